"""What vLLM's worker processes import (``worker_extension_cls``), before they build the model: the
weight-sync extension, the batch-invariant linear layers' matmul and residual RMSNorm
(``vllm_deterministic``) and the Llama classifier that finishes its final layer on the pooled rows
(``vllm_last_token``)."""

from __future__ import annotations

from rewardplane.protocol import settings
from rewardplane.protocol.families import POOLED_ROWS_ARCHS
from rewardplane.server.engines.vllm_deterministic import residual_norm_rows_exact, route_linear_layers
from rewardplane.server.weight_sync.worker_extension import RewardWeightSyncExtension

LAST_TOKEN_MODULE = "rewardplane.server.engines.vllm_last_token"


def register_last_token_model() -> bool:
    """Serve each architecture of ``POOLED_ROWS_ARCHS`` with ``LAST_TOKEN_MODULE``'s
    ``LastToken<architecture>`` unless turned off. By name: vLLM imports it when it builds the
    model, after the worker has picked its device."""
    if not settings.LAST_TOKEN_ONLY.get():
        return False
    from vllm import ModelRegistry

    for arch in sorted(POOLED_ROWS_ARCHS):
        ModelRegistry.register_model(arch, f"{LAST_TOKEN_MODULE}:LastToken{arch}")
    return True


LINEAR_GEMM = route_linear_layers()
RESIDUAL_NORM_EXACT = residual_norm_rows_exact()
LAST_TOKEN = register_last_token_model()

__all__ = ["LAST_TOKEN", "LINEAR_GEMM", "RESIDUAL_NORM_EXACT", "RewardWeightSyncExtension"]
