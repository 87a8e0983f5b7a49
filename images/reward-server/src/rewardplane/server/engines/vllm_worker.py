"""What vLLM's worker processes import (``worker_extension_cls``): the weight-sync extension, and,
before the model is built, the batch-invariant linear layers' matmul (``vllm_deterministic``)."""

from __future__ import annotations

from rewardplane.server.engines.vllm_deterministic import route_linear_layers
from rewardplane.server.weight_sync.worker_extension import RewardWeightSyncExtension

LINEAR_GEMM = route_linear_layers()

__all__ = ["LINEAR_GEMM", "RewardWeightSyncExtension"]
