"""Verification: checksums of the live parameters, as the engine holds them."""

from __future__ import annotations

from typing import Any

import torch

from rewardplane.server.weight_sync.worker.base import WorkerBase
from rewardplane.transport.checksums import digests


class ChecksumPart(WorkerBase):
    def rp_param_checksums(self) -> dict[str, Any]:
        """SHA-256 of every live parameter's bytes, under the engine's own parameter names (vLLM's
        are fused and sharded: ``qkv_proj``, ``gate_up_proj``), with dtype and shape. Costs a device →
        host copy of the weights: a diagnostic, not for the hot path."""
        with torch.no_grad():
            return {"rank": self.rp_local_rank(), "checksums": digests(self.rp_model().named_parameters())}
