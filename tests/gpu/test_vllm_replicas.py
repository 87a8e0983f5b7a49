"""Two vLLM replicas on two GPUs, updated by one NCCL broadcast from a trainer on a third GPU.

Replicas: the 1-label tiny model on GPU 0 and GPU 1 (``CUDA_VISIBLE_DEVICES`` per server);
trainer: this process on ``cuda:2``. One process group holds both replicas' workers and the
trainer (world size 3), so every byte leaves the trainer once.
"""

from __future__ import annotations

import httpx
import pytest

from tests.gpu.vllm_support import (
    Trainer,
    check_after_push,
    fill_prefix_cache,
    push_a_new_head,
    push_a_training_step,
)

pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.timeout(1800), pytest.mark.gpus(3)]


# the replicas and trainers fixtures (tests/gpu/conftest.py) place the servers and trainer here
PLACEMENTS = [{"gpu": 0}, {"gpu": 1}]
TRAINER_GPU = 2


def test_one_broadcast_updates_both_replicas(trainers: list[Trainer]) -> None:
    t0 = trainers[0]
    before = [fill_prefix_cache(t.url) for t in trainers]
    assert push_a_training_step(t0, 1, seed=11) == 1
    # both replicas' workers and the trainer are one group: the trainer sent each bucket once
    assert t0.sync.open().comm.world_size == 3
    for t, b in zip(trainers, before, strict=True):
        check_after_push(t, 1, b, f"full push, replica {t.url}")


def test_head_only_push_reaches_both_replicas(trainers: list[Trainer]) -> None:
    t0 = trainers[0]
    before = [fill_prefix_cache(t.url) for t in trainers]
    assert push_a_new_head(t0, 2) == 2
    for t, b in zip(trainers, before, strict=True):
        check_after_push(t, 2, b, f"head_only push, replica {t.url}")
    versions = [httpx.get(f"{t.url}/runtime_version", timeout=30).json()["version"] for t in trainers]
    assert versions == [2, 2]
