"""Persisting pushed weights, so a restarted replica can be restored without the trainer.

After every successful update the server saves what was pushed (safetensors: the union of every
parameter pushed so far, latest value per name) and the version into ``--weights-dir``.
``POST /restore_weights {"version": N}`` loads that state and commits version N; the operator calls
it when a replica restarted onto base weights.

Cost: each update copies the pushed parameters to host memory under the update lock (a device →
host copy of the pushed bytes; scoring waits for it) and writes them to disk in a background thread
(disk I/O of the union of pushed parameters, e.g. the whole model for full pushes: ~2 bytes/param
in bf16). A head_only push after a full one rewrites the union (read + write). Disk space: one copy
of the union per replica.

Both engines do it the same way, in the worker extension: vLLM's workers hold fused and sharded
parameters, so the copies are taken while the update is loaded, under the HF names that were pushed
(the replica's first worker keeps them: every tensor-parallel worker receives every full tensor), and
a restore goes through the engine's own ``load_weights`` in every worker, one parameter at a time on
the device — so neither costs GPU memory beyond one parameter, within vLLM's memory fraction.
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


PERSIST_WAIT_S = 3600.0  # bound on one background write (the union of a large model, on a slow disk)


async def prepare_workers(service: Any) -> None:
    """Tell the workers where to persist (once; the vLLM engine's workers exist only after start).
    Before a receive, so the first worker keeps host copies of what it loads."""
    store: WeightsStore | None = getattr(service, "persistence", None)
    if store is None or getattr(service, "_persistence_ready", False):
        return
    await service.call("rp_persist_to", str(store.dir), store.base)
    service._persistence_ready = True


def model_params(engine: Any) -> dict[str, torch.Tensor] | None:
    model = getattr(engine, "model", None)
    if not isinstance(model, torch.nn.Module):
        return None
    return dict(model.named_parameters())


async def persist_after_commit(service: Any, names: list[str], version: int) -> None:
    """The hook after ``guard.commit(version)``: the workers hold host copies (HF names, full
    tensors) of what this update loaded; the replica's first worker merges them into the saved union
    in a background thread. A tracked task waits for that write, so ``/get_num_background_tasks``
    counts it (bounded by ``PERSIST_WAIT_S``)."""
    if getattr(service, "persistence", None) is None:
        return
    writes = await service.call("rp_persist", version)
    if not any(writes):
        log.warning("version %d: no worker kept the pushed weights; it is not persisted", version)
        return

    async def wait_written() -> None:
        deadline = asyncio.get_running_loop().time() + PERSIST_WAIT_S
        while any(await service.call("rp_persist_pending")):
            if asyncio.get_running_loop().time() > deadline:
                log.error(
                    "persisting version %d took over %.0fs; still running in the workers",
                    version,
                    PERSIST_WAIT_S,
                )
                return
            await asyncio.sleep(0.05)

    task = asyncio.ensure_future(wait_written())
    service.tasks.add(task)
    task.add_done_callback(service.tasks.discard)


async def restore(service: Any, version: int, timeout_s: float) -> int:
    """Load the persisted state for ``version`` in every worker (through the engine's own loader, one
    parameter at a time on the device) and commit it; returns the parameters restored."""
    store: WeightsStore | None = getattr(service, "persistence", None)
    if store is None:
        raise Conflict(
            "this server persists no weights: start it with --weights-dir (RewardModel "
            "spec.weightSync.persistDir) to make restores possible"
        )
    if service._busy():
        raise Conflict("a weight update is in progress; restore after it finishes")
    saved = store.saved_version()
    if saved is None:
        raise Conflict(
            f"no persisted weights in {store.dir}: nothing was pushed to this replica's directory yet; "
            "push the weights again"
        )
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
    await prepare_workers(service)
    guard = service.engine.guard
    async with guard.updating(timeout_s=timeout_s):
        try:
            counts = await service.call("rp_restore", version)
        except LookupError as exc:  # the store changed between the check and the load
            raise Conflict(f"{exc}; push version {version} again") from exc
        except Exception as exc:  # some parameters may be loaded: never serve a mix
            guard.mark_broken(f"restoring version {version} failed part-way: {exc}")
            raise
        await service._reset_cache()
        guard.commit(version)
    service.metrics.weights_version.set(guard.version)
    count = max(counts, default=0)
    log.info("restored persisted weights version %d (%d parameters)", version, count)
    return int(count)


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
