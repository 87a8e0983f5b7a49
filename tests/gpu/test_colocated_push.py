"""Colocated pushes on one GPU: the trainer (this process, cuda:0) pushes into a vLLM reward server
on the same GPU over the same-host transport (CUDA IPC), which ``backend="auto"`` picks because
NCCL cannot put two ranks on one GPU.

Full, LoRA-merged and head-only pushes land bit for bit (``/param_checksums``) and score like the
trainer; NCCL asked for on one GPU is refused before anything moves, naming the same-GPU
transport; and the colocated cycle (sleep → train → wake → push → score → sleep, one
``with pusher.awake(2, reload=False)`` block) serves the pushed weights after a level-2 sleep
without reading the checkpoint, with the GPU memory read by nvidia-smi at every step.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import httpx
import pytest

from rewardplane.testing.gpus import gpu_memory_used_mib
from tests.gpu.vllm_support import (
    TEXTS,
    TOKEN,
    Trainer,
    as_served,
    assert_close,
    assert_same_parameters,
    check_after_push,
    direct_sync,
    fill_prefix_cache,
    load_trainer_model,
    lora_config,
    perturb,
    push_a_new_head,
    push_a_training_step,
    record_result,
    reference_scores,
    served,
    server_checksums,
    start_vllm_server,
    stop,
    train_lora,
    vllm_llama_checksums,
    wait_ready,
)

pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.timeout(1500), pytest.mark.gpus(1)]

# the server's share of the GPU; the trainer (this process) lives in the rest
GPU_MEMORY_UTILIZATION = 0.3
AUTH = {"Authorization": f"Bearer {TOKEN}"}
RESULT = "colocated_push.json"


def _pusher(url: str, device: Any, backend: str = "auto") -> Any:
    return direct_sync([url], device, backend=backend)


@pytest.fixture(scope="module")
def server(tiny_seqcls_1label: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    handle = wait_ready(
        start_vllm_server(
            tiny_seqcls_1label,
            tmp_path_factory.mktemp("colocated"),
            gpu=0,
            gpu_memory_utilization=GPU_MEMORY_UTILIZATION,
            enable_sleep_mode=True,
        )
    )
    try:
        yield handle.url
    finally:
        stop(handle)


@pytest.fixture(scope="module")
def trainer(server: str, tiny_seqcls_1label: Path) -> Iterator[Trainer]:
    import torch
    from transformers import AutoTokenizer

    device = torch.device("cuda", 0)  # the server's GPU
    sync = _pusher(server, device)
    try:
        model = load_trainer_model(tiny_seqcls_1label, device)
        yield Trainer(model, AutoTokenizer.from_pretrained(tiny_seqcls_1label), sync, device, server)
    finally:
        sync.close()


def _transport(t: Trainer) -> str:
    return str(getattr(t.sync.open().comm, "backend", "?"))


def _exact(t: Trainer, version: int, what: str) -> None:
    got_version, got = server_checksums(t.url)
    assert got_version == version
    assert_same_parameters(got, vllm_llama_checksums(t.model.state_dict()), what)


def test_nccl_on_one_gpu_is_refused_naming_the_same_gpu_transport(server: str) -> None:
    import torch

    from rewardplane.protocol import RewardModelTrainingMode as Mode
    from rewardplane.sdk import WeightSyncError

    version = httpx.get(f"{server}/runtime_version", timeout=30).json()["version"]
    sync = _pusher(server, torch.device("cuda", 0), backend="nccl")
    try:
        with pytest.raises((WeightSyncError, RuntimeError)) as err:
            sync.push(
                {"score.weight": torch.zeros(1, 4, device="cuda")}, version=99, training_mode=Mode.HEAD_ONLY
            )
        assert "one GPU" in str(err.value) and "ipc" in str(err.value), str(err.value)
    finally:
        sync.close()
    assert httpx.get(f"{server}/runtime_version", timeout=30).json()["version"] == version  # nothing moved


def test_full_push_over_cuda_ipc_bit_for_bit(trainer: Trainer) -> None:
    from rewardplane.protocol import RewardModelTrainingMode as Mode

    before = fill_prefix_cache(trainer.url)
    assert push_a_training_step(trainer, 1, seed=4) == 1
    assert _transport(trainer) == "ipc"
    check_after_push(trainer, 1, before, "full over CUDA IPC")
    _exact(trainer, 1, "full over CUDA IPC")
    # the second push of the same parameters reads them in place (exported once, cached)
    perturb(trainer.model, 0.05)
    before = fill_prefix_cache(trainer.url)
    assert trainer.sync.push(trainer.model.state_dict(), version=2, training_mode=Mode.FULL) == 2
    check_after_push(trainer, 2, before, "second full over CUDA IPC")
    _exact(trainer, 2, "second full over CUDA IPC")


def test_head_only_push_over_cuda_ipc_bit_for_bit(trainer: Trainer) -> None:
    before = fill_prefix_cache(trainer.url)
    assert push_a_new_head(trainer, 3) == 3
    check_after_push(trainer, 3, before, "head_only over CUDA IPC")
    _exact(trainer, 3, "head_only over CUDA IPC")


def test_lora_merged_push_over_cuda_ipc_bit_for_bit(trainer: Trainer) -> None:
    """Merged weights are new tensors on every push: they go through the staging ring."""
    from peft import get_peft_model

    from rewardplane.protocol import RewardModelTrainingMode as Mode
    from rewardplane.sdk.lora import merge_sync_reinit

    config = lora_config()
    for version, seed in ((4, 3), (5, 5)):  # twice: the second merge's storages are new again
        peft_model = get_peft_model(trainer.model, config)
        before = fill_prefix_cache(trainer.url)
        train_lora(peft_model, seed)

        def push(sd: Mapping[str, Any], version: int = version) -> None:
            trainer.sync.push(sd, version=version, training_mode=Mode.LORA)

        peft_model = merge_sync_reinit(peft_model, push)
        trainer.model = peft_model.merge_and_unload()  # fresh adapters have B = 0: the same function
        check_after_push(trainer, version, before, f"lora (merged) v{version} over CUDA IPC")
        _exact(trainer, version, f"lora (merged) v{version} over CUDA IPC")


def test_successive_full_pushes_with_a_bf16_head_bit_for_bit_each_time(trainer: Trainer) -> None:
    """A trainer holding its head in bf16 (``from_pretrained(dtype=bfloat16)`` as a whole), as the
    benchmark's does: vLLM keeps the head in fp32, so the head is received into the bucket buffer
    and widened by the copy plan while the backbone lands in place. Three full pushes in a row,
    every parameter (head included) changed in place before each: each served version holds the
    trainer's bytes (the head widened, exactly) and scores like the trainer."""
    import torch

    from rewardplane.protocol import RewardModelTrainingMode as Mode

    trainer.model.score.to(torch.bfloat16)  # a new storage and a new layout (its dtype)
    try:
        for version, seed in ((6, 11), (7, 12), (8, 13)):
            perturb(trainer.model, 0.05, seed=seed)
            before = fill_prefix_cache(trainer.url)
            assert (
                trainer.sync.push(trainer.model.state_dict(), version=version, training_mode=Mode.FULL)
                == version
            )
            assert _transport(trainer) == "ipc"
            check_after_push(trainer, version, before, f"full v{version}, bf16 head, over CUDA IPC")
            got_version, got = server_checksums(trainer.url)
            assert got_version == version
            want, widened = as_served(trainer.model.state_dict(), got[0])
            assert widened == ["score.weight"], widened  # vLLM's fp32 head: the one tensor cast
            assert_same_parameters(got, vllm_llama_checksums(want), f"full v{version}, bf16 head")
    finally:
        trainer.model.score.to(torch.float32)  # as the module's other tests hold it


def _control(url: str, path: str, body: dict[str, Any] | None = None) -> dict[str, Any]:
    r = httpx.post(url + path, json=body, headers=AUTH, timeout=600)
    assert r.status_code == 200, f"{path} answered {r.status_code}: {r.text[:2000]}"
    return r.json()


def test_colocated_cycle_level_2_push_without_the_checkpoint(trainer: Trainer) -> None:
    """Sleep (level 2) → train → wake without reloading → full push → score → sleep, twice, with
    the GPU's memory (nvidia-smi) after every step. The server reads no checkpoint: scoring after
    the wake and before the push answers 503, and the push makes it serve the trainer's weights."""
    import torch

    from rewardplane.protocol import RewardModelTrainingMode as Mode

    url = trainer.url
    steps: list[dict[str, Any]] = []

    def step(name: str, started: float) -> None:
        torch.cuda.synchronize(0)
        steps.append(
            {"step": name, "s": round(time.perf_counter() - started, 4), "used_mib": gpu_memory_used_mib(0)}
        )
        print(json.dumps(steps[-1]), flush=True)

    step("start", time.perf_counter())
    _control(url, "/sleep", {"level": 2})
    for cycle, version in enumerate((10, 11)):
        t0 = time.perf_counter()
        perturb(trainer.model, 0.05)  # a training step's worth of change, in place (the trainer's own memory)
        step(f"{cycle}: train", t0)
        t0 = time.perf_counter()
        with trainer.sync.awake(2, reload=False) as awake:
            woke = next(iter(awake.woken.values()))
            assert woke.state == "awake" and woke.weights == "broken" and "reload" in (woke.detail or ""), (
                woke
            )
            step(f"{cycle}: wake", t0)
            refused = httpx.post(f"{url}/score", json={"input": ["x"], "normalize": False}, timeout=60)
            assert refused.status_code == 503, refused.text  # the discarded weights never serve
            t0 = time.perf_counter()
            assert (
                trainer.sync.push(trainer.model.state_dict(), version=version, training_mode=Mode.FULL)
                == version
            )
            step(f"{cycle}: push", t0)
            assert _transport(trainer) == "ipc"
            t0 = time.perf_counter()
            got, served_version = served(url)
            step(f"{cycle}: score", t0)
            assert served_version == version
            ref = reference_scores(trainer.model, trainer.tokenizer, TEXTS, trainer.device)
            assert_close(got, ref, f"cycle {cycle}: served vs trainer")
            _exact(trainer, version, f"cycle {cycle}: full push after a level-2 sleep")
            t0 = time.perf_counter()
        step(f"{cycle}: sleep", t0)
        health = httpx.get(f"{url}/health", timeout=10).json()
        assert (health["state"], health["sleep_level"]) == ("sleeping", 2)
    record_result(RESULT, "cycle_steps", steps)
    awake_used = [s["used_mib"] for s in steps if s["step"].endswith("score")]
    asleep_used = [s["used_mib"] for s in steps if s["step"].endswith("sleep")]
    if None not in awake_used + asleep_used:
        # vLLM's weights and KV cache leave the GPU while it sleeps
        assert max(asleep_used) < min(awake_used), steps
