"""What a source offers: the files of a model, each with what is known about it before the
download (size, checksums), and a way to stream its bytes."""

from __future__ import annotations

import hashlib
import posixpath
from collections.abc import Iterator
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import Protocol

from rewardplane.modelfetch.errors import PermanentFetchError

CHUNK = 1 << 20


@dataclass(frozen=True)
class RemoteFile:
    path: str
    """Where the file goes, relative to the model directory (POSIX, no '..')."""
    size: int | None = None
    sha256: str | None = None
    """Expected content sha256 (the hub's LFS files); None: recorded, not checked."""
    git_blob: str | None = None
    """Expected git blob id (the hub's small files, which carry no sha256)."""
    ref: str = ""
    """Where the source finds it: an object key, a URL."""


@dataclass
class Listing:
    files: list[RemoteFile]
    revision: str | None = None
    """What the source resolved the revision to (the hub's commit), for the manifest."""
    archive: bool = False
    """One file that is an archive, to unpack into the model directory."""
    extra: dict[str, str] = field(default_factory=dict)

    @property
    def total_bytes(self) -> int | None:
        sizes = [f.size for f in self.files]
        return None if any(s is None for s in sizes) else sum(s for s in sizes if s is not None)


class Source(Protocol):
    """One downloadable source (s3, https, hub)."""

    def list_files(self) -> Listing: ...

    def open(self, file: RemoteFile) -> AbstractContextManager[tuple[int | None, Iterator[bytes]]]:
        """The file's length (if the server says) and its bytes in chunks; raises FetchError."""
        ...


def safe_relative(name: str, what: str) -> str:
    """``name`` as a path inside the model directory, or PermanentFetchError if it would leave it
    (absolute, '..', empty): a source must not write outside the cache entry."""
    norm = posixpath.normpath(name.replace("\\", "/")) if name else ""
    if not name or name.startswith("/") or norm in (".", "") or norm == ".." or norm.startswith("../"):
        raise PermanentFetchError(
            f"{what}: refusing the file name {name!r}, which would leave the model directory"
        )
    if "\x00" in norm:
        raise PermanentFetchError(f"{what}: refusing the file name {name!r} (a NUL byte)")
    return norm


def git_blob_hasher(size: int) -> hashlib._Hash:
    """sha1 over git's blob header and then the content: the id the hub lists for non-LFS files."""
    h = hashlib.sha1()
    h.update(f"blob {size}\0".encode())
    return h
