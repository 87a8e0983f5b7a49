"""One fetch: find the model in the node cache (checked), or download it into a partial directory
and rename that into place; then evict least-recently-used entries over the size limit."""

from __future__ import annotations

import os
import re
import shutil
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import httpx

from rewardplane.modelfetch import http as https
from rewardplane.modelfetch.archives import archive_kind, unpack
from rewardplane.modelfetch.cache import (
    LAST_USED,
    MANIFEST,
    MODEL,
    Manifest,
    NodeCache,
    make_world_readable,
    sha256_file,
)
from rewardplane.modelfetch.download import download_all
from rewardplane.modelfetch.errors import PermanentFetchError
from rewardplane.modelfetch.files import Listing, Source
from rewardplane.modelfetch.progress import Progress
from rewardplane.modelfetch.retry import retrying
from rewardplane.protocol.model_sources import ModelSource, SourceKind

_KEY = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")


@dataclass(frozen=True)
class FetchRequest:
    source: ModelSource
    cache_dir: Path
    key: str
    endpoint: str | None = None
    max_cache_bytes: int = 0
    verify: str = "sha256"
    lock_timeout_s: float = 3600.0


def fetch(req: FetchRequest, progress: Progress, env: Mapping[str, str] = os.environ) -> Path:
    """The model directory (``DIR/KEY/model``); raises FetchError."""
    if not req.source.downloaded:
        raise PermanentFetchError(
            f"{req.source.uri}: a {req.source.kind.value} source is mounted, not downloaded; nothing to fetch"
        )
    if not _KEY.match(req.key) or req.key.endswith(".lock"):
        raise PermanentFetchError(
            f"--key {req.key!r}: use letters, digits, '.', '_' and '-' (it names a folder)"
        )
    cache = NodeCache(req.cache_dir)
    cache.ensure_root()
    with cache.locked(req.key, req.lock_timeout_s, progress):
        cache.remove_leftovers(req.key)
        manifest = cache.valid_manifest(req.key, req.verify, progress)
        if manifest is not None:
            cache.touch(req.key)
            _finished(progress, "cached", manifest)
            return cache.model_dir(req.key)
        partial = cache.partial_dir(req.key)
        try:
            manifest = _download(req, partial, progress, env)
            (partial / MANIFEST).write_text(manifest.dumps())
            (partial / LAST_USED).touch()
            make_world_readable(partial)
            os.rename(partial, cache.entry(req.key))
        except BaseException:
            shutil.rmtree(partial, ignore_errors=True)
            raise
        cache.evict(req.key, req.max_cache_bytes)
        _finished(progress, "done", manifest)
    return cache.model_dir(req.key)


def _finished(progress: Progress, phase: str, manifest: Manifest) -> None:
    n = len(manifest.files)
    progress.phase(
        phase, bytes_done=manifest.total_bytes, bytes_total=manifest.total_bytes, files_done=n, files_total=n
    )


def _download(req: FetchRequest, partial: Path, progress: Progress, env: Mapping[str, str]) -> Manifest:
    partial.mkdir(mode=0o755)
    model = partial / MODEL
    with https.client() as http:
        source = _source(req, env, http)
        progress.phase("listing")
        listing: Listing = retrying("listing the model's files", source.list_files)
        progress.phase("downloading", bytes_total=listing.total_bytes, files_total=len(listing.files))
        if listing.archive:
            staging = partial / "archive"
            download_all(source, listing.files, staging, progress)
            archive = listing.files[0].path
            unpack(staging / archive, archive_kind(archive) or "tar", model, req.source.uri)
            shutil.rmtree(staging)
            files: list[dict[str, Any]] = [
                {"path": p.relative_to(model).as_posix(), "size": p.stat().st_size, "sha256": sha256_file(p)}
                for p in sorted(model.rglob("*"))
                if p.is_file()
            ]
        else:
            got = download_all(source, listing.files, model, progress)
            files = [{"path": d.path, "size": d.size, "sha256": d.sha256} for d in got]
    return Manifest(
        source=req.source.uri,
        revision=req.source.revision,
        files=files,
        total_bytes=sum(int(f["size"]) for f in files),
        fetched_at=datetime.now(timezone.utc).isoformat(timespec="seconds"),
        resolved_revision=listing.revision,
        endpoint=req.endpoint,
    )


def _source(req: FetchRequest, env: Mapping[str, str], http: httpx.Client) -> Source:
    src = req.source
    if src.kind is SourceKind.S3:
        from rewardplane.modelfetch.s3 import S3Source, make_store

        return S3Source(src.location, src.path, req.endpoint, make_store(src.location, req.endpoint, env))
    if src.kind is SourceKind.HTTPS:
        return https.HttpsSource(src.location, env.get("AUTHORIZATION") or None, http)
    from rewardplane.modelfetch.hub import DEFAULT_ENDPOINT, HubSource

    endpoint = req.endpoint or env.get("HF_ENDPOINT") or DEFAULT_ENDPOINT
    return HubSource(src.location, src.revision, endpoint, env.get("HF_TOKEN") or None, http)
