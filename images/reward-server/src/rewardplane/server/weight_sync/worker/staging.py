"""Atomic pushes: whether the whole update fits to be staged, and loading (or dropping) what was
staged once the control plane swaps under the scoring lock."""

from __future__ import annotations

from typing import Any

import torch

from rewardplane.protocol import ParamMeta
from rewardplane.server.weight_sync.staging import staging_limit_from_env, staging_problem
from rewardplane.server.weight_sync.worker.persistence import PersistencePart
from rewardplane.transport.buckets import unpack_bucket


class StagingPart(PersistencePart):
    """Staged updates of this worker."""

    def rp_apply_staged(self, metadata: list[dict[str, Any]]) -> None:
        metas = [ParamMeta(**m) for m in metadata]  # staged updates are not on the fast path
        staged, self._rp_staged = self._rp_staged or [], None
        self._rp_kept = {} if self._rp_keeps() else None
        for bucket, buf in staged:
            self._rp_load_kept(list(unpack_bucket(bucket, metas, buf)))

    def rp_drop_staged(self) -> None:
        self._rp_staged = None

    def rp_staging_problem(
        self, nbytes: int, what: str | None = None, advice: str | None = None
    ) -> str | None:
        """Why this worker cannot stage ``nbytes`` (for an atomic push, or ``what`` says), or None
        (``staging.py``)."""
        device = self.rp_device()
        free = self.rp_cuda_free_bytes()
        cached = 0
        if device.type == "cuda":
            cached = int(torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device))
        return staging_problem(
            nbytes,
            where=self.rp_where(),
            free=free,
            cached=cached,
            limit=staging_limit_from_env(),
            what=what,
            advice=advice,
        )

    def rp_where(self) -> str:
        device = self.rp_device()
        return f"GPU {device.index}" if device.type == "cuda" else "this server's host memory"

    def rp_cuda_free_bytes(self) -> int | None:
        """Free memory of this worker's GPU (``cudaMemGetInfo``); None off CUDA."""
        device = self.rp_device()
        if device.type != "cuda":
            return None
        return int(torch.cuda.mem_get_info(device)[0])
