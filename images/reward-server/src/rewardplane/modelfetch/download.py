"""Streams a source's files to disk, a few at a time, hashing as the bytes arrive, and checks each
file against what the source promised (size, sha256, git blob id)."""

from __future__ import annotations

import hashlib
import threading
from concurrent.futures import FIRST_EXCEPTION, ThreadPoolExecutor, wait
from dataclasses import dataclass
from pathlib import Path

from rewardplane.modelfetch.errors import TransientFetchError
from rewardplane.modelfetch.files import RemoteFile, Source, git_blob_hasher
from rewardplane.modelfetch.progress import Progress
from rewardplane.modelfetch.retry import retrying

WORKERS = 4


@dataclass(frozen=True)
class Downloaded:
    path: str
    size: int
    sha256: str


class _Cancelled(Exception):
    """Another file failed: stop this one at its next chunk."""


def download_all(
    source: Source, files: list[RemoteFile], dest_dir: Path, progress: Progress, workers: int = WORKERS
) -> list[Downloaded]:
    """Every file into ``dest_dir/<file.path>``; the first failure stops the rest and is raised."""
    cancel = threading.Event()
    with ThreadPoolExecutor(max_workers=max(1, min(workers, len(files)))) as pool:
        futures = [pool.submit(_download_one, source, f, dest_dir / f.path, progress, cancel) for f in files]
        wait(futures, return_when=FIRST_EXCEPTION)
        if any(f.done() and f.exception() is not None for f in futures):
            cancel.set()
            for f in futures:
                f.cancel()
            wait(futures)
            errors = [e for f in futures if not f.cancelled() and (e := f.exception()) is not None]
            # the first real failure, not a _Cancelled of a file stopped because of it
            raise ([e for e in errors if not isinstance(e, _Cancelled)] or errors)[0]
    return [f.result() for f in futures]


def _download_one(
    source: Source, file: RemoteFile, dest: Path, progress: Progress, cancel: threading.Event
) -> Downloaded:
    dest.parent.mkdir(parents=True, exist_ok=True)
    result = retrying(file.path, lambda: _attempt(source, file, dest, progress, cancel))
    progress.add(0, files=1)
    return result


def _attempt(
    source: Source, file: RemoteFile, dest: Path, progress: Progress, cancel: threading.Event
) -> Downloaded:
    written = 0
    sha = hashlib.sha256()
    blob = git_blob_hasher(file.size) if file.git_blob and file.size is not None else None
    try:
        with source.open(file) as (length, chunks), open(dest, "wb") as out:
            if length is not None and progress.state.bytes_total is None and len_known_alone(file):
                progress.set_total(length)
            for chunk in chunks:
                if cancel.is_set():
                    raise _Cancelled(file.path)
                out.write(chunk)
                sha.update(chunk)
                if blob is not None:
                    blob.update(chunk)
                written += len(chunk)
                progress.add(len(chunk))
        if file.size is not None and written != file.size:
            raise TransientFetchError(f"{file.path}: got {written} bytes, the source lists {file.size}")
        digest = sha.hexdigest()
        if file.sha256 and digest != file.sha256:
            raise TransientFetchError(f"{file.path}: sha256 {digest} differs from the source's {file.sha256}")
        if blob is not None and blob.hexdigest() != file.git_blob:
            raise TransientFetchError(
                f"{file.path}: git blob id {blob.hexdigest()} differs from the source's {file.git_blob}"
            )
        return Downloaded(file.path, written, digest)
    except BaseException:
        progress.add(-written)  # the retry counts these bytes again
        raise


def len_known_alone(file: RemoteFile) -> bool:
    """A file the listing gave no size for (a single https download): the response's length is the
    total the progress shows."""
    return file.size is None
