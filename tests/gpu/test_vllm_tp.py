"""A tensor-parallel replica: ``--tensor-parallel-size 2`` on GPUs 0-1 next to a TP=1 replica on
GPU 2, both updated by one broadcast from a trainer on GPU 3.

World size 4: the TP=2 replica's workers are ranks 0-1 (rank offset 0), the TP=1 replica's worker
rank 2 (offset 2), the trainer rank 3 (the last). Every worker receives every full tensor; vLLM's
``load_weights`` keeps each rank's shard. Full, head-only and LoRA (merged) pushes; scores equal the
trainer's, and every shard equals the trainer's tensor split the way vLLM splits it.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import httpx
import pytest

from tests.gpu.vllm_support import (
    TOKEN,
    Trainer,
    assert_same_parameters,
    check_after_push,
    fill_prefix_cache,
    lora_config,
    push_a_new_head,
    push_a_training_step,
    server_checksums,
    train_lora,
    vllm_llama_checksums,
)

pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.timeout(1800), pytest.mark.gpus(4)]


# the replicas and trainers fixtures (tests/gpu/conftest.py) place the servers and trainer here
PLACEMENTS = [{"gpu": "0,1", "tensor_parallel_size": 2}, {"gpu": 2}]
TRAINER_GPU = 3


def _check(trainers: list[Trainer], version: int, before: list[float], what: str) -> None:
    for t, b in zip(trainers, before, strict=True):
        check_after_push(t, version, b, f"{what}, replica {t.url}")
    model = trainers[0].model
    for t, tp in zip(trainers, (2, 1), strict=True):
        got_version, got = server_checksums(t.url)
        assert got_version == version
        assert_same_parameters(got, vllm_llama_checksums(model.state_dict(), tp_size=tp), f"{what}, TP={tp}")


def test_world_size_and_rank_offsets(trainers: list[Trainer]) -> None:
    from rewardplane.sdk.push.wire.http import HTTPControlPlane

    sizes = [httpx.get(f"{t.url}/get_world_size", timeout=30).json()["world_size"] for t in trainers]
    assert sizes == [2, 1]
    control = HTTPControlPlane([t.url for t in trainers], token=TOKEN)
    assert control.rank_offsets() == [0, 2]
    assert control.total_world_size() == 4


def test_full_push_reaches_every_shard(trainers: list[Trainer]) -> None:
    t0 = trainers[0]
    before = [fill_prefix_cache(t.url) for t in trainers]
    assert push_a_training_step(t0, 1, seed=21) == 1
    assert t0.sync.open().comm.world_size == 4
    _check(trainers, 1, before, "full")


def test_head_only_push(trainers: list[Trainer]) -> None:
    t0 = trainers[0]
    before = [fill_prefix_cache(t.url) for t in trainers]
    assert push_a_new_head(t0, 2) == 2
    _check(trainers, 2, before, "head_only")


def test_lora_push(trainers: list[Trainer]) -> None:
    from peft import get_peft_model

    from rewardplane.protocol import RewardModelTrainingMode as Mode
    from rewardplane.sdk.lora import merge_sync_reinit

    t0 = trainers[0]
    before = [fill_prefix_cache(t.url) for t in trainers]
    peft_model = get_peft_model(t0.model, lora_config())
    train_lora(peft_model, seed=23)

    def push(sd: Mapping[str, Any]) -> None:
        t0.sync.push(sd, version=3, training_mode=Mode.LORA)

    merged = merge_sync_reinit(peft_model, push).merge_and_unload()
    for t in trainers:
        t.model = merged
    _check(trainers, 3, before, "lora (merged)")
