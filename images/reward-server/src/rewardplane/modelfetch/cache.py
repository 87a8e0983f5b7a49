"""The node cache: one directory (a hostPath) shared by every replica on the node.

    DIR/KEY.lock           flock'ed while a fetcher checks or fills KEY (never deleted: a lock
                           file removed while another process waits on it would split the lock)
    DIR/KEY/model/         the model, what the server gets as --model
    DIR/KEY/manifest.json  source, revision, files with size and sha256, total bytes, fetched-at
    DIR/KEY/last-used      its mtime orders the least-recently-used eviction
    DIR/.partial-KEY-PID/  a download in progress, renamed to DIR/KEY when complete

Partial and half-deleted directories of a key are only made by the holder of the key's lock, so
whoever holds that lock may remove any it finds: a process id says nothing across the PID
namespaces of the node's pods."""

from __future__ import annotations

import errno
import fcntl
import hashlib
import json
import os
import shutil
import sys
import time
from collections.abc import Collection, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from rewardplane.modelfetch.errors import PermanentFetchError, TransientFetchError
from rewardplane.modelfetch.files import CHUNK
from rewardplane.modelfetch.progress import Progress

MANIFEST = "manifest.json"
MODEL = "model"
LAST_USED = "last-used"
PARTIAL = ".partial-"
DELETING = ".deleting-"
LOCK_POLL_S = 0.5


@dataclass
class Manifest:
    source: str
    revision: str | None
    files: list[dict[str, Any]]
    """``{"path", "size", "sha256"}`` each, paths relative to ``model/``."""
    total_bytes: int
    fetched_at: str
    resolved_revision: str | None = None
    """What the source resolved the revision to (the hub's commit sha)."""
    endpoint: str | None = None

    def dumps(self) -> str:
        return json.dumps(asdict(self), indent=1, sort_keys=True) + "\n"

    @classmethod
    def load(cls, path: Path) -> Manifest:
        data = json.loads(path.read_text())
        return cls(
            **{k: data[k] for k in ("source", "revision", "files", "total_bytes", "fetched_at")},
            resolved_revision=data.get("resolved_revision"),
            endpoint=data.get("endpoint"),
        )


@dataclass(frozen=True)
class EntryInfo:
    key: str
    size: int
    last_used: float


def choose_evictions(entries: list[EntryInfo], keep: Collection[str], limit: int) -> list[str]:
    """The least recently used entries (not in ``keep``) to remove, oldest first, until the total
    is at most ``limit`` bytes (0: no limit). Entries in ``keep`` count toward the total but stay,
    even when they alone are over the limit."""
    if limit <= 0:
        return []
    total = sum(e.size for e in entries)
    chosen = []
    for e in sorted((e for e in entries if e.key not in keep), key=lambda e: (e.last_used, e.key)):
        if total <= limit:
            break
        chosen.append(e.key)
        total -= e.size
    return chosen


def sha256_file(path: Path, progress: Progress | None = None) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(CHUNK):
            h.update(chunk)
            if progress is not None:
                progress.add(len(chunk))
    return h.hexdigest()


def tree_size(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file() and not p.is_symlink())


def make_world_readable(root: Path) -> None:
    """Folders 0755, files 0644: the server runs as another user and mounts the cache read-only."""
    for dirpath, _dirnames, filenames in os.walk(root):
        os.chmod(dirpath, 0o755)
        for name in filenames:
            os.chmod(os.path.join(dirpath, name), 0o644)


class NodeCache:
    def __init__(self, root: Path) -> None:
        self.root = root

    def entry(self, key: str) -> Path:
        return self.root / key

    def model_dir(self, key: str) -> Path:
        return self.root / key / MODEL

    def ensure_root(self) -> None:
        try:
            self.root.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise PermanentFetchError(f"cannot create the cache directory {self.root}: {e}") from e
        if not os.access(self.root, os.W_OK | os.X_OK):
            raise PermanentFetchError(
                f"the cache directory {self.root} is not writable by uid {os.getuid()}: check the node cache's hostPath"
            )

    @contextmanager
    def locked(self, key: str, timeout_s: float, progress: Progress) -> Iterator[None]:
        """Hold ``DIR/KEY.lock`` (exclusive); while another fetcher holds it, phase "waiting"."""
        fd = os.open(self.root / f"{key}.lock", os.O_RDWR | os.O_CREAT, 0o644)
        try:
            deadline = time.monotonic() + timeout_s
            waiting = False
            while True:
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    break
                except OSError as e:
                    if e.errno not in (errno.EAGAIN, errno.EACCES):
                        raise
                if not waiting:
                    waiting = True
                    progress.phase("waiting")
                if time.monotonic() > deadline:
                    raise TransientFetchError(
                        f"another fetch of {key} on this node has held {self.root / key}.lock for over "
                        f"{timeout_s:.0f} s; retrying"
                    )
                time.sleep(LOCK_POLL_S)
            yield
        finally:
            os.close(fd)  # releases the lock

    def try_lock(self, key: str) -> int | None:
        """The lock's fd if it was free (the caller closes it), None if another process holds it."""
        fd = os.open(self.root / f"{key}.lock", os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return fd
        except OSError:
            os.close(fd)
            return None

    def valid_manifest(self, key: str, verify: str, progress: Progress) -> Manifest | None:
        """The entry's manifest if the entry is complete and its files match (sizes, and with
        ``verify == "sha256"`` their content); otherwise says why, deletes the entry, None."""
        entry = self.entry(key)
        if not entry.exists():
            return None
        reason = self._mismatch(key, verify, progress)
        if reason is None:
            return Manifest.load(entry / MANIFEST)
        print(f"cached model {entry} is not usable ({reason}); downloading it again", file=sys.stderr)
        self.delete(key)
        return None

    def _mismatch(self, key: str, verify: str, progress: Progress) -> str | None:
        entry = self.entry(key)
        try:
            manifest = Manifest.load(entry / MANIFEST)
        except FileNotFoundError:
            return "no manifest: an incomplete entry"
        except (ValueError, KeyError, TypeError) as e:
            return f"unreadable manifest: {e}"
        model = entry / MODEL
        if verify == "sha256":
            progress.phase("verifying", bytes_total=manifest.total_bytes, files_total=len(manifest.files))
        for f in manifest.files:
            path = model / str(f["path"])
            try:
                size = path.stat().st_size
            except FileNotFoundError:
                return f"{f['path']} is missing"
            if size != f["size"]:
                return f"{f['path']} has {size} bytes, the manifest says {f['size']}"
            if verify == "sha256":
                digest = sha256_file(path, progress)
                if digest != f["sha256"]:
                    return f"{f['path']} has sha256 {digest}, the manifest says {f['sha256']}"
                progress.add(0, files=1)
        return None

    def touch(self, key: str) -> None:
        (self.entry(key) / LAST_USED).touch()
        os.chmod(self.entry(key) / LAST_USED, 0o644)

    def partial_dir(self, key: str) -> Path:
        return self.root / f"{PARTIAL}{key}-{os.getpid()}"

    def delete(self, key: str) -> None:
        """Remove an entry (caller holds its lock): renamed first, so that no half-deleted entry
        is ever at DIR/KEY."""
        doomed = self.root / f"{DELETING}{key}-{os.getpid()}"
        try:
            os.rename(self.entry(key), doomed)
        except FileNotFoundError:
            return
        shutil.rmtree(doomed, ignore_errors=True)

    def remove_leftovers(self, key: str) -> None:
        """Partial and half-deleted directories of ``key`` (caller holds its lock) and of every key
        whose lock is free: what fetchers that died left behind."""
        by_key: dict[str, list[Path]] = {}
        for p in self.root.iterdir():
            for prefix in (PARTIAL, DELETING):
                if p.name.startswith(prefix) and p.is_dir():
                    owner = p.name[len(prefix) :].rsplit("-", 1)[0]
                    by_key.setdefault(owner, []).append(p)
        for owner, paths in by_key.items():
            fd = None if owner == key else self.try_lock(owner)
            if owner != key and fd is None:
                continue  # a live fetch of that key
            try:
                for p in paths:
                    if p != self.partial_dir(key):
                        shutil.rmtree(p, ignore_errors=True)
            finally:
                if fd is not None:
                    os.close(fd)

    def entries(self) -> list[EntryInfo]:
        """Complete entries (with a manifest), their size and when they were last used."""
        found = []
        for p in self.root.iterdir():
            if p.name.startswith(".") or not p.is_dir() or not (p / MANIFEST).is_file():
                continue
            used = p / LAST_USED
            last_used = used.stat().st_mtime if used.exists() else (p / MANIFEST).stat().st_mtime
            found.append(EntryInfo(p.name, tree_size(p), last_used))
        return found

    def evict(self, keep: str, limit: int) -> list[str]:
        """Remove least recently used entries other than ``keep`` until the cache holds at most
        ``limit`` bytes; an entry being fetched or checked (its lock held) is skipped."""
        if limit <= 0:
            return []
        entries = self.entries()
        evicted: list[str] = []
        skipped: set[str] = set()
        while True:
            # entries whose lock is held (skipped) count toward the total but cannot go
            remaining = [e for e in entries if e.key not in evicted]
            choice = choose_evictions(remaining, {keep, *skipped}, limit)
            if not choice:
                break
            key = choice[0]
            fd = self.try_lock(key)
            if fd is None:
                skipped.add(key)
                continue
            try:
                self.delete(key)
            finally:
                os.close(fd)
            evicted.append(key)
            print(f"evicted {key} from the node cache (least recently used)", file=sys.stderr)
        total = sum(e.size for e in entries if e.key not in evicted)
        if total > limit:
            print(
                f"the node cache holds {total} bytes, over its limit of {limit}: the rest is in use or is this model",
                file=sys.stderr,
            )
        return evicted
