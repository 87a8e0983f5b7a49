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

This module is the store; ``control_plane.WeightSyncService`` drives it (``_persist``, ``restore``)
and ``routes.persistence_router`` serves ``POST /restore_weights``.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import threading
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

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

    def saved_names(self) -> set[str]:
        """The names of the saved parameters (read from the file's header; no tensor is loaded)."""
        from safetensors import safe_open

        with self._lock:
            path = self.dir / WEIGHTS_FILE
            if not path.exists():
                return set()
            with safe_open(str(path), framework="pt") as f:
                return set(f.keys())

    def load(self) -> tuple[int, dict[str, torch.Tensor]] | None:
        from safetensors.torch import load_file

        with self._lock:
            version = self.saved_version()
            path = self.dir / WEIGHTS_FILE
            if version is None or not path.exists():
                return None
            return version, load_file(str(path))


PERSIST_WAIT_S = 3600.0  # bound on one background write (the union of a large model, on a slow disk)
