"""Atomic pushes: whether the whole update fits to be staged, and loading (or dropping) what was
staged once the control plane swaps under the scoring lock."""

from __future__ import annotations

from typing import Any

import torch

from rewardplane.protocol import ParamMeta
from rewardplane.server.weight_sync.staging import staging_limit_from_env, staging_problem
from rewardplane.server.weight_sync.worker.persistence import Persistence
from rewardplane.server.weight_sync.worker.state import WorkerState
from rewardplane.transport.buckets import unpack_bucket


class Staging:
    """Staged updates of this worker (``state.staged``), and the room to stage one."""

    def __init__(self, state: WorkerState, persistence: Persistence) -> None:
        self.state = state
        self.persistence = persistence

    def apply(self, metadata: list[dict[str, Any]]) -> None:
        metas = [ParamMeta(**m) for m in metadata]  # staged updates are not on the fast path
        staged, self.state.staged = self.state.staged or [], None
        self.persistence.start_keeping()
        for bucket, buf in staged:
            self.persistence.load_kept(list(unpack_bucket(bucket, metas, buf)))

    def drop(self) -> None:
        self.state.staged = None

    def problem(self, nbytes: int, what: str | None = None, advice: str | None = None) -> str | None:
        """Why this worker cannot stage ``nbytes`` (for an atomic push, or ``what`` says), or None
        (``staging.py``)."""
        device = self.state.host.device()
        free = self.cuda_free_bytes()
        cached = 0
        if device.type == "cuda":
            cached = int(torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device))
        return staging_problem(
            nbytes,
            where=self.where(),
            free=free,
            cached=cached,
            limit=staging_limit_from_env(),
            what=what,
            advice=advice,
        )

    def where(self) -> str:
        device = self.state.host.device()
        return f"GPU {device.index}" if device.type == "cuda" else "this server's host memory"

    def cuda_free_bytes(self) -> int | None:
        """Free memory of this worker's GPU (``cudaMemGetInfo``); None off CUDA."""
        device = self.state.host.device()
        if device.type != "cuda":
            return None
        return int(torch.cuda.mem_get_info(device)[0])
