"""Adapter-only sync into vLLM on real GPUs: a LoRA-enabled vLLM server (GPU 0) serves the pushed
A/B tensors as a LoRA adapter; the trainer (this process, ``cuda:1``) pushes them over NCCL.

Checks: scores equal the trainer's (PEFT) model; the base weights' bytes do not move; a second
adapter version replaces the first (scores follow, the prefix cache is not stale); a merged full
push afterwards drops the adapter and lands bit for bit in the LoRA-wrapped layers. The workers
build the adapter from the received tensors in memory: no adapter directory is written (vLLM's
directory loader is only the fallback where vLLM's internals differ).

    bash scripts/gpu-run.sh tests tests/gpu/test_vllm_adapter.py    # 2 GPUs, ~4 minutes
"""

from __future__ import annotations

import copy
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from rewardplane.protocol import Endpoints
from tests.gpu.vllm_support import (
    Trainer,
    assert_same_parameters,
    check_after_push,
    device_count,
    direct_sync,
    fill_prefix_cache,
    load_trainer_model,
    lora_config,
    server_checksums,
    start_vllm_server,
    stop,
    train_lora,
    vllm_llama_checksums,
    wait_ready,
)

pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.timeout(1800), pytest.mark.gpus(2)]

MAX_RANK = 16


def test_engine_args_enable_lora(tiny_seqcls_1label: Path) -> None:
    from rewardplane.server.config import ServerConfig
    from rewardplane.server.engines.vllm_engine import build_engine_args

    cfg = ServerConfig(model=str(tiny_seqcls_1label), engine="vllm", enable_lora=True, max_lora_rank=MAX_RANK)
    args = build_engine_args(cfg, 1024)
    assert (args.enable_lora, args.max_lora_rank, args.max_loras) == (True, MAX_RANK, 1)
    plain = build_engine_args(ServerConfig(model=str(tiny_seqcls_1label), engine="vllm"), 1024)
    assert not plain.enable_lora


@dataclass
class AdapterServer:
    trainer: Trainer
    adapter_dir: Path  # the server's --adapter-dir
    loads: str  # how its workers hand adapters to vLLM: "memory" (the directory only as a fallback)

    def written(self) -> list[str]:
        """The adapter directories the server's workers wrote (one per worker process and id)."""
        return sorted(p.name for p in self.adapter_dir.glob("*/*"))


@pytest.fixture(scope="module", params=["memory"])
def lora_server(
    request: pytest.FixtureRequest, tiny_seqcls_1label: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[AdapterServer]:
    import torch
    from transformers import AutoTokenizer

    if device_count() < 2:
        pytest.skip("adapter pushes over NCCL need 2 GPUs (server on GPU 0, trainer on GPU 1)")
    adapter_dir = tmp_path_factory.mktemp("adapters")
    env = {"REWARDPLANE_ADAPTER_DIR": str(adapter_dir)}
    handle = start_vllm_server(
        tiny_seqcls_1label,
        tmp_path_factory.mktemp("vllm-lora-logs"),
        gpu=0,
        enable_lora=True,
        max_lora_rank=MAX_RANK,
        env=env,
    )
    device = torch.device("cuda", 1)
    sync = None
    try:
        wait_ready(handle)
        sync = direct_sync([handle.url], device)
        trainer = Trainer(
            load_trainer_model(tiny_seqcls_1label, device),
            AutoTokenizer.from_pretrained(tiny_seqcls_1label),
            sync,
            device,
            handle.url,
        )
        yield AdapterServer(trainer, adapter_dir, request.param)
    finally:
        if sync is not None:
            sync.close()
        stop(handle)


def _merged(peft_model: Any) -> Any:
    """The function the adapter computes, as a plain model: the reference scores."""
    return copy.deepcopy(peft_model).merge_and_unload()


def test_adapter_push_scores_equal_trainer_base_untouched_and_replaced(lora_server: AdapterServer) -> None:
    from peft import get_peft_model

    from rewardplane.protocol import WeightSyncMode
    from rewardplane.sdk import LoraSync

    t = lora_server.trainer
    info = httpx.get(t.url + Endpoints.MODEL_INFO, timeout=30).json()
    assert info["max_lora_rank"] == MAX_RANK, info
    base_version, base = server_checksums(t.url)
    assert base_version == 0
    peft_model = get_peft_model(t.model, lora_config())
    train_lora(peft_model, seed=3)
    handle = LoraSync(t.sync, mode="auto", fallback_to_full=False)  # a failure must fail the test
    assert handle.mode is WeightSyncMode.ADAPTER

    before = fill_prefix_cache(t.url)
    assert handle.sync(peft_model, version=1) is peft_model
    check_after_push(
        Trainer(_merged(peft_model), t.tokenizer, t.sync, t.device, t.url), 1, before, "adapter v1"
    )
    written = lora_server.written()
    if lora_server.loads == "memory":
        assert written == [], f"an adapter built in memory wrote {written}"
    else:
        assert len(written) == 1, f"one adapter directory while it serves, found {written}"
    version, after = server_checksums(t.url)
    assert version == 1
    moved = sorted(n for n in base[0] if after[0][n] != base[0][n])
    assert moved == ["score.weight"], f"only the head (modules_to_save) may change, moved: {moved[:5]}"
    assert set(after[0]) == set(base[0])

    # version 2: a new adapter id replaces the first; scores follow it, the prefix cache is not stale
    before = fill_prefix_cache(t.url)
    train_lora(peft_model, seed=4)
    handle.sync(peft_model, version=2)
    check_after_push(
        Trainer(_merged(peft_model), t.tokenizer, t.sync, t.device, t.url), 2, before, "adapter v2"
    )
    if lora_server.loads == "directory":
        now = lora_server.written()
        assert len(now) == 1 and now != written, f"the first adapter's directory stays: {written} -> {now}"
    _, after = server_checksums(t.url)
    assert {n: c for n, c in after[0].items() if n != "score.weight"} == {
        n: c for n, c in base[0].items() if n != "score.weight"
    }

    # a merged full push (mode full) replaces the adapter: the base layers hold the merged weights
    # bit for bit, though vLLM wraps them for LoRA, and scores equal the merged model without the adapter
    before = fill_prefix_cache(t.url)
    train_lora(peft_model, seed=5)
    merged = _merged(peft_model)
    LoraSync(t.sync, mode="full").sync(peft_model, version=3)
    check_after_push(Trainer(merged, t.tokenizer, t.sync, t.device, t.url), 3, before, "merged after adapter")
    version, got = server_checksums(t.url)
    assert version == 3
    assert_same_parameters(
        got, vllm_llama_checksums(merged.state_dict()), "merged push into a LoRA-enabled server"
    )
