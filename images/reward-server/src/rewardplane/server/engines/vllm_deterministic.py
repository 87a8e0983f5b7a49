"""Which matmul vLLM's linear layers run in batch-invariant mode (``--deterministic``).

With ``VLLM_BATCH_INVARIANT=1``, vLLM 0.24 sends every unquantized linear layer through its Triton
persistent matmul (``linear_batch_invariant``), on every GPU. That matmul is what makes the mode
cost 18-22% of scoring throughput on H200 (``benchmarks/batch_invariant_kernels.py``). Yet on
compute capability 9.0 and later vLLM itself trusts cuBLASLt with every other matmul of the model:
its batch-invariant mode cuts cuBLASLt's workspace to one byte, so no kernel can split the K
dimension, and without split-K each output row is reduced in the same order whatever else is in the
batch. On those GPUs the reward server routes the linear layers back to cuBLASLt (vLLM's ordinary
``dispatch_unquantized_gemm``), under the same workspace limit. On older GPUs (Ampere), where vLLM
does not trust cuBLASLt, or with ``REWARDPLANE_DETERMINISTIC_GEMM=triton``, vLLM's path stays.
``tests/gpu/test_vllm_batch_invariant.py`` checks the result bit for bit on the GPU.

``linear_gemm`` is the decision (pure); ``route_linear_layers`` applies it in a vLLM worker process,
before the model is built and compiled (vLLM imports the worker extension at worker start).

Run eagerly (``--enforce-eager``, or RMSNorm as a custom op), vLLM 0.24's batch-invariant RMSNorm
with a residual is not batch-invariant: it calls the fused add-and-norm CUDA kernel, whose thread
block is 1024 wide for launches of fewer than 256 tokens and 256 wide above, so each row's sum of
squares is reduced in another order when the step's token count crosses 256 (vllm#48391).
``residual_norm_rows_exact`` adds the residual first and normalises with vLLM's Triton norm kernel,
whose block does not depend on the token count. Compiled (the default), the norms are inductor
code and never reach either kernel.

cuBLASLt without split-K is row-invariant for the model's large GEMMs, not for a handful of rows: it
picks other kernels for a few rows, with their own reduction order (on H200 a prompt alone in its
step scored 1 fp32 ulp away from the same prompt in larger steps, once the final decoder layer ran
on the pooled rows only, one row per prompt). ``any_row_count`` puts such layers on vLLM's Triton
matmul, whose tiles do not depend on the row count; the work there is a few rows per step.
"""

from __future__ import annotations

import functools
import logging
from typing import Any, Literal

from rewardplane.protocol import settings

# under vLLM's logger: in its worker processes only vLLM's loggers have a handler
log = logging.getLogger("vllm.rewardplane.deterministic")

LinearGemm = Literal["default", "cublas", "triton"]
CUBLAS_MIN_MAJOR = 9  # Hopper: vLLM's batch-invariant mode relies on cuBLASLt from here on


def linear_gemm(batch_invariant: bool, choice: str, capability_major: int | None) -> LinearGemm:
    """The matmul of the linear layers: ``default`` (vLLM's usual, not batch-invariant), ``cublas``
    (cuBLASLt without split-K) or ``triton`` (vLLM's batch-invariant Triton matmul)."""
    if not batch_invariant:
        return "default"
    if choice == "triton" or capability_major is None or capability_major < CUBLAS_MIN_MAJOR:
        return "triton"
    return "cublas"


def route_linear_layers() -> LinearGemm:
    """Apply ``linear_gemm`` in this vLLM worker process; returns what the linear layers run."""
    import vllm.envs as envs
    from vllm.platforms import current_platform

    if not envs.VLLM_BATCH_INVARIANT:  # the setting is read (and checked) in this mode only
        return "default"
    # NVML, not torch.cuda: initialising CUDA here would open a context on the wrong device of a
    # tensor-parallel worker, before vLLM picks its device
    cap = current_platform.get_device_capability() if current_platform.is_cuda() else None
    gemm = linear_gemm(True, settings.DETERMINISTIC_GEMM.get(), cap.major if cap else None)
    if gemm == "cublas":
        _linear_layers_on_cublas()
    log.info("batch-invariant mode: linear layers on %s (%s)", gemm, settings.DETERMINISTIC_GEMM.name)
    return gemm


def _linear_layers_on_cublas() -> None:
    from vllm.model_executor.layers import linear
    from vllm.model_executor.layers.utils import dispatch_unquantized_gemm

    method = linear.UnquantizedLinearMethod
    if getattr(method.apply, "_rewardplane_cublas", False):
        return

    def apply(self: Any, layer: Any, x: Any, bias: Any = None) -> Any:
        return dispatch_unquantized_gemm()(layer, x, layer.weight, bias)

    apply._rewardplane_cublas = True  # type: ignore[attr-defined]
    method.apply = apply


def residual_norm_rows_exact() -> bool:
    """In batch-invariant mode, make RMSNorm with a residual exact for any token count where it runs
    as vLLM's custom op (eager); returns whether it was patched (in this mode: always)."""
    import vllm.envs as envs

    if not envs.VLLM_BATCH_INVARIANT:
        return False
    from vllm.model_executor.layers import layernorm

    stock = layernorm.rms_norm_batch_invariant
    if getattr(stock, "_rewardplane_rows_exact", False):
        return True

    def rms_norm(input: Any, weight: Any, eps: float = 1e-6, residual: Any = None) -> Any:
        if residual is None:
            return stock(input, weight, eps)  # vLLM's Triton kernel: one fixed block per row
        added = input + residual  # as the fused kernel: the sum in the activations' dtype
        return stock(added, weight, eps), added

    rms_norm._rewardplane_rows_exact = True  # type: ignore[attr-defined]
    layernorm.rms_norm_batch_invariant = rms_norm
    log.info("batch-invariant mode: RMSNorm with a residual on vLLM's Triton norm kernel when eager")
    return True


def any_row_count(*layers: Any) -> int:
    """In batch-invariant mode, run these linear layers (eager ones that see a few rows per step: the
    pooled rows) on vLLM's Triton matmul, exact for any row count. Returns how many were switched;
    quantized layers keep their own method. A no-op outside batch-invariant mode."""
    import vllm.envs as envs
    from vllm.model_executor.layers.linear import UnquantizedLinearMethod

    if not envs.VLLM_BATCH_INVARIANT:
        return 0
    switched = 0
    for layer in layers:
        if type(layer.quant_method) is UnquantizedLinearMethod:
            layer.quant_method = _any_row_count_method()()
            switched += 1
    return switched


@functools.cache
def _any_row_count_method() -> type:
    from vllm.model_executor.layers.batch_invariant import linear_batch_invariant
    from vllm.model_executor.layers.linear import UnquantizedLinearMethod

    class AnyRowCountLinearMethod(UnquantizedLinearMethod):
        """Weights as vLLM's unquantized layers; the product on the row-count-exact Triton matmul."""

        def apply(self, layer: Any, x: Any, bias: Any = None) -> Any:
            return linear_batch_invariant(x, layer.weight, bias)

    return AnyRowCountLinearMethod
