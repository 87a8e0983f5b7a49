"""Unpacking an https source's archive (.tar, .tar.gz, .tgz, .zip) into the model directory, safely:
only regular files and folders, each inside the directory. Checked here member by member rather
than with tarfile's ``filter=``, which the image's Python (Debian's 3.11.2) lacks."""

from __future__ import annotations

import shutil
import stat
import tarfile
import zipfile
from pathlib import Path
from typing import IO

from rewardplane.modelfetch.errors import PermanentFetchError
from rewardplane.modelfetch.files import CHUNK, safe_relative


def archive_kind(name: str) -> str | None:
    """'tar' or 'zip' for an archive's file name, else None (a plain file)."""
    lower = name.lower()
    if lower.endswith((".tar", ".tar.gz", ".tgz")):
        return "tar"
    if lower.endswith(".zip"):
        return "zip"
    return None


def tar_member_path(member: tarfile.TarInfo, what: str) -> str | None:
    """Where a tar member goes (relative), None for a folder; PermanentFetchError for a link, a
    device, or a name that leaves the directory."""
    if member.issym() or member.islnk():
        raise PermanentFetchError(f"{what}: the archive holds a link ({member.name!r}); links are refused")
    if not (member.isfile() or member.isdir()):
        raise PermanentFetchError(
            f"{what}: the archive holds {member.name!r}, which is not a file or a folder"
        )
    path = safe_relative(member.name, what)
    return None if member.isdir() else path


def zip_member_path(info: zipfile.ZipInfo, what: str) -> str | None:
    """As :func:`tar_member_path`, for a zip member (links are marked in the Unix mode bits)."""
    mode = info.external_attr >> 16
    if stat.S_ISLNK(mode):
        raise PermanentFetchError(f"{what}: the archive holds a link ({info.filename!r}); links are refused")
    path = safe_relative(info.filename, what)
    return None if info.is_dir() else path


def unpack(archive: Path, kind: str, dest: Path, what: str) -> None:
    """Every member of ``archive`` under ``dest``; a bad archive is a PermanentFetchError."""
    dest.mkdir(parents=True, exist_ok=True)
    try:
        if kind == "tar":
            with tarfile.open(archive, "r:*") as tar:
                for member in tar:
                    rel = tar_member_path(member, what)
                    if rel is None:
                        (dest / safe_relative(member.name, what)).mkdir(parents=True, exist_ok=True)
                        continue
                    src = tar.extractfile(member)
                    if src is None:
                        raise PermanentFetchError(f"{what}: cannot read {member.name!r} in the archive")
                    _write(src, dest / rel, what)
        else:
            with zipfile.ZipFile(archive) as zf:
                for info in zf.infolist():
                    rel = zip_member_path(info, what)
                    if rel is None:
                        (dest / safe_relative(info.filename, what)).mkdir(parents=True, exist_ok=True)
                        continue
                    with zf.open(info) as src:
                        _write(src, dest / rel, what)
    except (tarfile.TarError, zipfile.BadZipFile, EOFError) as e:
        raise PermanentFetchError(
            f"{what}: not a readable {kind} archive ({e}); check the URL names the archive"
        ) from e
    hoist_single_folder(dest)


def _write(src: IO[bytes], target: Path, what: str) -> None:
    if target.exists():
        raise PermanentFetchError(f"{what}: the archive holds {target.name!r} twice")
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(target, "wb") as out:
        shutil.copyfileobj(src, out, CHUNK)


def hoist_single_folder(dest: Path) -> None:
    """An archive whose members all sit in one top-level folder (``rm-7b/config.json``, ...) gives
    that folder's content as the model directory, which is what the server's --model expects."""
    entries = list(dest.iterdir())
    if len(entries) != 1 or not entries[0].is_dir():
        return
    inner = entries[0]
    staging = dest.with_name(dest.name + ".hoist")
    inner.rename(staging)
    dest.rmdir()
    staging.rename(dest)
