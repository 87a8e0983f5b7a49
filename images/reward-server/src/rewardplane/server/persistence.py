"""Persisting pushed weights, so a restarted replica can be restored without the trainer.

After every successful update the server saves what was pushed (safetensors: the union of every
parameter pushed so far, latest value per name) and the version into ``--weights-dir``.
``POST /restore_weights {"version": N}`` loads that state and commits version N; the operator calls
it when a replica restarted onto base weights.

Cost: each update copies the pushed parameters to host memory under the update lock (a device →
host copy of the pushed bytes; scoring waits for it) and writes them to disk in a background thread
(disk I/O of the union of pushed parameters, e.g. the whole model for full pushes: ~2 bytes/param
in bf16). A head_only push after a full one rewrites the union (read + write). Disk space: one copy
of the union per replica. Engines: the transformers engine (``engine.model``); vLLM workers hold
fused/sharded parameters, so there it needs a worker-extension hook (not yet).
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import os
import threading
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from fastapi import FastAPI

from rewardplane.protocol import Endpoints, RestoreWeightsRequest, StatusResponse

from .errors import Conflict

log = logging.getLogger(__name__)

WEIGHTS_FILE = "pushed.safetensors"
VERSION_FILE = "version.json"


def base_fingerprint(manifest: Mapping[str, Any], params: Mapping[str, torch.Tensor] | None) -> str:
    """Identifies the base model a server loaded: every parameter's name, dtype and shape, plus a
    few values from each end of every parameter (cheap at any size, yet two checkpoints of one
    architecture differ). Saved weights carry it, and are never restored onto another base."""
    digest = hashlib.sha256()
    for name in sorted(manifest):
        meta = manifest[name]
        digest.update(f"{name}:{meta.dtype}:{tuple(meta.shape)};".encode())
        if params is not None and name in params:
            flat = params[name].detach().reshape(-1)
            sample = torch.cat([flat[:8], flat[-8:]]).to("cpu", torch.float64)
            digest.update(sample.numpy().tobytes())
    return digest.hexdigest()[:16]


class WeightsStore:
    """The persisted union of pushed parameters in one directory (atomic file replacement)."""

    def __init__(self, directory: Path, base: str = "") -> None:
        self.dir = Path(directory)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.base = base  # base_fingerprint of the model these weights were pushed onto
        self._lock = threading.Lock()

    def _saved(self) -> dict[str, Any]:
        try:
            saved = json.loads((self.dir / VERSION_FILE).read_text())
        except (OSError, ValueError):
            return {}
        return saved if isinstance(saved, dict) else {}

    def saved_version(self) -> int | None:
        try:
            return int(self._saved()["version"])
        except (KeyError, TypeError, ValueError):
            return None

    def saved_base(self) -> str | None:
        base = self._saved().get("base")
        return str(base) if base else None

    def save(self, version: int, tensors: Mapping[str, torch.Tensor]) -> None:
        """Merge ``tensors`` into the saved union and record ``version`` (latest value per name)."""
        from safetensors.torch import load_file, save_file

        with self._lock:
            path = self.dir / WEIGHTS_FILE
            union: dict[str, torch.Tensor] = {}
            if path.exists():
                union = load_file(str(path))
            union.update({n: t.contiguous() for n, t in tensors.items()})
            tmp = self.dir / (WEIGHTS_FILE + ".tmp")
            save_file(union, str(tmp), metadata={"version": str(version)})
            os.replace(tmp, path)  # the version file follows the weights, so it never names absent weights
            tmp_version = self.dir / (VERSION_FILE + ".tmp")
            tmp_version.write_text(
                json.dumps({"version": version, "parameters": len(union), "base": self.base})
            )
            os.replace(tmp_version, self.dir / VERSION_FILE)

    def load(self) -> tuple[int, dict[str, torch.Tensor]] | None:
        from safetensors.torch import load_file

        with self._lock:
            version = self.saved_version()
            path = self.dir / WEIGHTS_FILE
            if version is None or not path.exists():
                return None
            return version, load_file(str(path))


def model_params(engine: Any) -> dict[str, torch.Tensor] | None:
    model = getattr(engine, "model", None)
    if not isinstance(model, torch.nn.Module):
        return None
    return dict(model.named_parameters())


async def persist_after_commit(service: Any, names: list[str], version: int) -> None:
    """The hook after ``guard.commit(version)``: snapshot the pushed parameters (still under the update
    lock, so the snapshot is exactly this version), then write them off the event loop."""
    store: WeightsStore | None = getattr(service, "persistence", None)
    if store is None:
        return
    params = model_params(service.engine)
    if params is None:
        log.warning(
            "--weights-dir is set but engine %s cannot be snapshotted; pushed weights are not persisted",
            type(service.engine).__name__,
        )
        return
    with torch.no_grad():
        snapshot = {n: params[n].detach().to("cpu", copy=True) for n in names if n in params}

    def write() -> None:
        try:
            store.save(version, snapshot)
            log.info("persisted version %d (%d parameters) in %s", version, len(snapshot), store.dir)
        except Exception:
            log.exception("persisting version %d failed; a restart cannot be restored to it", version)

    task = asyncio.ensure_future(asyncio.to_thread(write))
    service.tasks.add(task)
    task.add_done_callback(service.tasks.discard)


async def restore(service: Any, version: int, timeout_s: float) -> int:
    """Load the persisted state for ``version`` and commit it; returns the parameters restored."""
    store: WeightsStore | None = getattr(service, "persistence", None)
    if store is None:
        raise Conflict(
            "this server persists no weights: start it with --weights-dir (RewardModel "
            "spec.weightSync.persistDir) to make restores possible"
        )
    if service._busy():
        raise Conflict("a weight update is in progress; restore after it finishes")
    loaded = await asyncio.to_thread(store.load)
    if loaded is None:
        raise Conflict(
            f"no persisted weights in {store.dir}: nothing was pushed to this replica's directory yet; "
            "push the weights again"
        )
    saved, tensors = loaded
    if store.saved_base() != store.base:
        raise Conflict(
            f"the weights saved in {store.dir} were pushed onto another base model (fingerprint "
            f"{store.saved_base() or 'missing'}, this server loaded {store.base}); they are not restored "
            "onto this one: push the weights again"
        )
    if saved != version:
        raise Conflict(
            f"the persisted weights are version {saved}, not {version}; push version {version} again"
        )
    guard = service.engine.guard
    async with guard.updating(timeout_s=timeout_s):
        await service.call("rp_load", list(tensors.items()))
        await service._reset_cache()
        guard.commit(version)
    service.metrics.weights_version.set(guard.version)
    log.info("restored persisted weights version %d (%d parameters)", version, len(tensors))
    return len(tensors)


def install_restore(app: FastAPI, service: Any, weights_dir: Path | None, auth: list[Any]) -> None:
    """Attach the store to the weight-sync service and add ``POST /restore_weights`` (token-protected)."""
    service.persistence = (
        WeightsStore(weights_dir, base_fingerprint(service.manifest, model_params(service.engine)))
        if weights_dir is not None
        else None
    )

    @app.post(Endpoints.RESTORE_WEIGHTS, response_model=StatusResponse, dependencies=auth)
    async def restore_weights(req: RestoreWeightsRequest) -> StatusResponse:
        count = await restore(service, req.version, req.timeout_s)
        return StatusResponse(detail={"version": req.version, "parameters": count})
