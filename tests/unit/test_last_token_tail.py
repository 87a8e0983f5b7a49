"""When a vLLM reward model may finish its final decoder layer on the pooled rows only: with LAST
pooling and nothing that reads or captures the other rows; anything else names why every row runs."""

from __future__ import annotations

from dataclasses import replace

import pytest

from rewardplane.protocol import settings
from rewardplane.server.engines.last_token_tail import EngineFacts, why_every_row

SERVED = EngineFacts(  # what the reward server runs by default: LAST pooling, piecewise graphs
    pooling="LAST",
    lora=False,
    pipeline_parallel=1,
    micro_batching=False,
    full_cuda_graphs=False,
    sequence_parallel=False,
    breakable_cuda_graph=False,
    v2_model_runner=False,
    layers=24,
)


def test_the_served_configuration_runs_the_pooled_rows_only() -> None:
    assert why_every_row(SERVED) is None
    assert why_every_row(replace(SERVED, layers=1)) is None  # the trunk then holds no whole layer


@pytest.mark.parametrize(
    ("change", "named"),
    [
        ({"pooling": "MEAN"}, "pooling is MEAN, not LAST"),
        ({"pooling": "CLS"}, "pooling is CLS, not LAST"),
        ({"pooling": None}, "pooling is not set"),
        ({"lora": True}, "LoRA is enabled"),
        ({"pipeline_parallel": 2}, "pipeline parallel size is 2"),
        ({"micro_batching": True}, "micro-batching"),
        ({"full_cuda_graphs": True}, "full CUDA graphs"),
        ({"sequence_parallel": True}, "sequence parallelism"),
        ({"breakable_cuda_graph": True}, "VLLM_USE_BREAKABLE_CUDAGRAPH=1"),
        ({"v2_model_runner": True}, "VLLM_USE_V2_MODEL_RUNNER=1"),
        ({"layers": 0}, "no decoder layer"),
    ],
)
def test_each_condition_that_needs_every_row_is_named(change: dict[str, object], named: str) -> None:
    why = why_every_row(replace(SERVED, **change))  # type: ignore[arg-type]
    assert why is not None and named in why


def test_the_first_failing_condition_is_the_one_named() -> None:
    why = why_every_row(replace(SERVED, pooling="MEAN", lora=True))
    assert why is not None and why.startswith("pooling is MEAN")


def test_setting_is_on_by_default_and_turns_off_with_0() -> None:
    name = settings.LAST_TOKEN_ONLY.name
    assert settings.LAST_TOKEN_ONLY.get({}) is True
    assert settings.LAST_TOKEN_ONLY.get({name: "0"}) is False
    with pytest.raises(settings.SettingError, match=name):
        settings.LAST_TOKEN_ONLY.get({name: "maybe"})
