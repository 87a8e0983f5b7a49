"""The GPU checks' comparison of a trainer's tensors with ``/param_checksums``
(``tests/gpu/vllm_support.as_served``): vLLM holds a pooling model's head in fp32, so a trainer's
bf16 head is compared widened, exactly as the loader casts it; nothing else is cast."""

from __future__ import annotations

import torch

from rewardplane.transport.checksums import digests
from tests.gpu.vllm_support import as_served, vllm_llama_checksums


def _trainer() -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    return {
        "model.norm.weight": torch.randn(8, dtype=torch.bfloat16),
        "score.weight": torch.randn(1, 8, dtype=torch.bfloat16),
    }


def test_a_bf16_head_matches_the_served_fp32_head_once_widened() -> None:
    state = _trainer()
    served = digests(
        [("model.norm.weight", state["model.norm.weight"]), ("score.weight", state["score.weight"].float())]
    )
    assert vllm_llama_checksums(state)[0] != served  # the bf16 bytes never equal the fp32 ones
    want, widened = as_served(state, served)
    assert widened == ["score.weight"]
    assert vllm_llama_checksums(want)[0] == served


def test_a_wrong_head_still_differs_after_widening() -> None:
    state = _trainer()
    wrong = state["score.weight"].float() + 1e-3  # what a stale or corrupted head would hold
    served = digests([("model.norm.weight", state["model.norm.weight"]), ("score.weight", wrong)])
    want, _ = as_served(state, served)
    assert vllm_llama_checksums(want)[0]["score.weight"] != served["score.weight"]


def test_only_widening_of_floats_is_applied() -> None:
    state = {"a": torch.randn(4, dtype=torch.float32), "b": torch.randn(4, dtype=torch.float16)}
    served = digests([("a", state["a"].bfloat16()), ("b", state["b"].bfloat16())])  # narrower, same width
    want, widened = as_served(state, served)
    assert widened == [] and want["a"].dtype == torch.float32 and want["b"].dtype == torch.float16
