"""Persisting pushed weights, so a restarted replica can be restored without the trainer.

After every successful update the server saves what was pushed (safetensors: the union of every
parameter pushed so far, latest value per name) and the version into ``--weights-dir``.
``POST /restore_weights {"version": N}`` loads that state and commits version N; the operator calls
it when a replica restarted onto base weights.

Cost: each update copies the pushed parameters to host memory under the update lock (a device →
host copy of the pushed bytes; scoring waits for it) and writes them to disk in a background thread
(disk I/O of the union of pushed parameters, e.g. the whole model for full pushes: ~2 bytes/param
in bf16). A head_only push after a full one rewrites the union (read + write). Disk space: one copy
of the union per replica. The snapshot is the worker extension's ``rp_snapshot`` (through the
engine's ``WeightSyncPort``; the control plane calls it): the transformers engine has it; vLLM
workers hold fused/sharded parameters, so they answer None and nothing is persisted there (yet).
"""

from __future__ import annotations

import json
import logging
import os
import threading
from collections.abc import Mapping
from pathlib import Path

import torch

log = logging.getLogger(__name__)

WEIGHTS_FILE = "pushed.safetensors"
VERSION_FILE = "version.json"


class WeightsStore:
    """The persisted union of pushed parameters in one directory (atomic file replacement)."""

    def __init__(self, directory: Path) -> None:
        self.dir = Path(directory)
        self.dir.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()

    def saved_version(self) -> int | None:
        try:
            return int(json.loads((self.dir / VERSION_FILE).read_text())["version"])
        except (OSError, ValueError, KeyError):
            return None

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
            tmp_version.write_text(json.dumps({"version": version, "parameters": len(union)}))
            os.replace(tmp_version, self.dir / VERSION_FILE)

    def load(self) -> tuple[int, dict[str, torch.Tensor]] | None:
        from safetensors.torch import load_file

        with self._lock:
            version = self.saved_version()
            path = self.dir / WEIGHTS_FILE
            if version is None or not path.exists():
                return None
            return version, load_file(str(path))
