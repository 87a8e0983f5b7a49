"""The vLLM engine on real GPUs: raw scores equal transformers, and NCCL weight pushes land.

Layout (needs >= 2 GPUs for the pushes): the 1-label vLLM server runs on GPU 0 as a subprocess
(``python -m rewardplane.server --engine vllm``, ``CUDA_VISIBLE_DEVICES=0``); the 3-label server
on GPU 1 (GPU 0 too where there is only one); the trainer is this test process on ``cuda:1``.
Each vLLM start costs about two minutes, so the servers are module-scoped and start in parallel;
the scoring tests run before the pushes (file order), which change the 1-label server's weights.

Env knobs: ``RP_VLLM_SERVER_ARGS`` (extra server flags, e.g. ``--enforce-eager`` for a faster
start), ``RP_VLLM_STARTUP_S`` (start timeout, default 600), ``RP_GPU_TESTS_LARGE=1`` (also run
a full push into a ~0.4B model).
"""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import httpx
import pytest

from rewardplane.testing.servers import ServerHandle
from tests.gpu.vllm_support import (
    TEXTS,
    TOKEN,
    Trainer,
    assert_close,
    assert_same_parameters,
    check_after_push,
    device_count,
    direct_sync,
    fill_prefix_cache,
    load_trainer_model,
    lora_config,
    new_head,
    perturb,
    post,
    push_a_training_step,
    reference_scores,
    served,
    server_checksums,
    start_vllm_server,
    stop,
    train_lora,
    vllm_llama_checksums,
    wait_ready,
)

pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.timeout(1800)]

# ---- engine arguments (no server start) ------------------------------------------------------


def test_engine_args_defaults_and_user_overrides(tiny_seqcls_1label: Path) -> None:
    """Whole prompts per step and offline-sized batches unless the user says otherwise; flags the
    server owns are refused, not silently overridden."""
    from rewardplane.server.config import ServerConfig
    from rewardplane.server.engines.vllm_engine import build_engine_args

    cfg = ServerConfig(model=str(tiny_seqcls_1label), engine="vllm")
    args = build_engine_args(cfg, 1024)
    assert args.enable_chunked_prefill is False
    assert args.max_num_batched_tokens >= 8192 and args.max_num_seqs >= 256
    assert args.hf_overrides == {"head_dtype": "float32"}
    assert args.worker_extension_cls.endswith("RewardWeightSyncExtension")

    user = ServerConfig(
        model=str(tiny_seqcls_1label),
        engine="vllm",
        extra_engine_args=["--enable-chunked-prefill", "--max-num-batched-tokens", "4096", "--enforce-eager"],
    )
    args = build_engine_args(user, 1024)
    assert (args.enable_chunked_prefill, args.max_num_batched_tokens, args.enforce_eager) == (
        True,
        4096,
        True,
    )

    owned = ServerConfig(
        model=str(tiny_seqcls_1label), engine="vllm", extra_engine_args=["--dtype", "float16"]
    )
    with pytest.raises(ValueError, match="--dtype"):
        build_engine_args(owned, 1024)


# ---- fixtures --------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def vllm_servers(
    tiny_seqcls_1label: Path,
    tiny_seqcls_3labels: Path,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[dict[int, ServerHandle]]:
    log_dir = tmp_path_factory.mktemp("vllm-logs")
    two = device_count() >= 2
    handles: dict[int, ServerHandle] = {}
    try:
        handles[1] = start_vllm_server(tiny_seqcls_1label, log_dir, gpu=0)
        if two:  # both start at once, one per GPU (two vLLM starts on one GPU disturb its memory profiling)
            handles[3] = start_vllm_server(tiny_seqcls_3labels, log_dir, gpu=1)
        wait_ready(handles[1])
        if not two:
            handles[3] = start_vllm_server(tiny_seqcls_3labels, log_dir, gpu=0)
        wait_ready(handles[3])
        yield handles
    finally:
        for h in handles.values():
            stop(h)


@pytest.fixture(scope="module")
def model_dirs(tiny_seqcls_1label: Path, tiny_seqcls_3labels: Path) -> dict[int, Path]:
    return {1: tiny_seqcls_1label, 3: tiny_seqcls_3labels}


@pytest.fixture(scope="module")
def ref_device() -> Any:
    import torch

    return torch.device("cuda", device_count() - 1)


# ---- scoring ---------------------------------------------------------------------------------


@pytest.mark.parametrize("labels", [1, 3])
def test_model_info_reports_vllm_and_fp32_head(vllm_servers: dict[int, ServerHandle], labels: int) -> None:
    info = httpx.get(f"{vllm_servers[labels].url}/model_info", timeout=30).json()
    assert info["engine"] == "vllm"
    assert info["num_labels"] == labels
    assert info["head_dtype"] == "float32"
    assert info["dtype"] == "bfloat16"
    assert httpx.get(f"{vllm_servers[labels].url}/get_world_size", timeout=30).json()["world_size"] == 1


@pytest.mark.parametrize("endpoint", ["/score", "/classify", "/pooling"])
@pytest.mark.parametrize("labels", [1, 3])
def test_raw_scores_equal_transformers(
    vllm_servers: dict[int, ServerHandle],
    model_dirs: dict[int, Path],
    ref_device: Any,
    labels: int,
    endpoint: str,
) -> None:
    import torch
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dirs[labels])
    model = AutoModelForSequenceClassification.from_pretrained(model_dirs[labels], dtype=torch.bfloat16)
    ref = reference_scores(model, tok, TEXTS, ref_device)
    got, version = served(vllm_servers[labels].url, TEXTS, endpoint)
    assert version == 0
    assert all(len(row) == labels for row in got)
    assert_close(got, ref, f"{endpoint} with {labels} label(s)")


def test_token_id_input_and_activation(
    vllm_servers: dict[int, ServerHandle], model_dirs: dict[int, Path]
) -> None:
    from transformers import AutoTokenizer

    url = vllm_servers[3].url
    tok = AutoTokenizer.from_pretrained(model_dirs[3])
    ids = [tok(t, add_special_tokens=True)["input_ids"] for t in TEXTS[:4]]
    by_text, _ = served(url, TEXTS[:4], "/pooling")
    by_ids = [d["data"] for d in post(url, "/pooling", {"input": ids})["data"]]
    assert_close(by_ids, by_text, "token-id input vs text input")
    probs = [d["probs"] for d in post(url, "/classify", {"input": TEXTS[:4], "use_activation": True})["data"]]
    for p, raw in zip(probs, by_text, strict=True):
        e = [math.exp(x - max(raw)) for x in raw]
        assert all(abs(a - b / sum(e)) < 1e-4 for a, b in zip(p, e, strict=True))


def test_concurrent_requests_all_answered(vllm_servers: dict[int, ServerHandle]) -> None:
    import asyncio

    async def run() -> list[int]:
        async with httpx.AsyncClient(timeout=120) as client:
            rs = await asyncio.gather(
                *(
                    client.post(
                        f"{vllm_servers[1].url}/score",
                        json={"input": TEXTS[i % 16 :] or TEXTS, "normalize": False},
                    )
                    for i in range(64)
                )
            )
        return [r.status_code for r in rs]

    assert set(asyncio.run(run())) == {200}


# ---- weight pushes over NCCL (trainer on cuda:1) ----------------------------------------------


@pytest.fixture(scope="module")
def trainer(vllm_servers: dict[int, ServerHandle], model_dirs: dict[int, Path]) -> Iterator[Trainer]:
    import torch
    from transformers import AutoTokenizer

    if device_count() < 2:
        pytest.skip("weight pushes over NCCL need 2 GPUs (server on GPU 0, trainer on GPU 1)")
    device = torch.device("cuda", 1)
    url = vllm_servers[1].url
    sync = direct_sync([url], device)
    t = Trainer(
        load_trainer_model(model_dirs[1], device),
        AutoTokenizer.from_pretrained(model_dirs[1]),
        sync,
        device,
        url,
    )
    try:
        yield t
    finally:
        sync.close()


@pytest.mark.gpus(2)
def test_push_head_only_fp32_head(trainer: Trainer) -> None:
    import torch

    from rewardplane.protocol import RewardModelTrainingMode as Mode
    from rewardplane.protocol.naming import select_head

    before = fill_prefix_cache(trainer.url)
    new_head(trainer.model)
    params = select_head(trainer.model.state_dict())
    assert params["score.weight"].dtype == torch.float32
    assert trainer.sync.push(params, version=1, training_mode=Mode.HEAD_ONLY) == 1
    check_after_push(trainer, 1, before, "head_only")


@pytest.mark.gpus(2)
def test_push_lora_merged(trainer: Trainer) -> None:
    from peft import get_peft_model

    from rewardplane.protocol import RewardModelTrainingMode as Mode
    from rewardplane.sdk.lora import merge_sync_reinit

    before = fill_prefix_cache(trainer.url)
    peft_model = get_peft_model(trainer.model, lora_config())
    train_lora(peft_model, seed=3)

    def push(sd: Mapping[str, Any]) -> None:
        trainer.sync.push(sd, version=2, training_mode=Mode.LORA)

    fresh = merge_sync_reinit(peft_model, push)
    trainer.model = fresh.merge_and_unload()  # fresh adapters have B = 0: the same function
    check_after_push(trainer, 2, before, "lora (merged)")
    # bit for bit: every live parameter of the worker against the trainer's merged weights
    version, got = server_checksums(trainer.url)
    assert version == 2
    assert_same_parameters(got, vllm_llama_checksums(trainer.model.state_dict()), "lora (merged)")


@pytest.mark.gpus(2)
def test_push_full(trainer: Trainer) -> None:
    before = fill_prefix_cache(trainer.url)
    assert push_a_training_step(trainer, 3, seed=4) == 3
    check_after_push(trainer, 3, before, "full")
    version, got = server_checksums(trainer.url)
    assert version == 3
    assert_same_parameters(got, vllm_llama_checksums(trainer.model.state_dict()), "full")


@pytest.mark.gpus(3)
def test_pushed_server_equals_a_server_loaded_from_disk(trainer: Trainer, tmp_path: Path) -> None:
    """The server that got version 3 by a push against one that loads the same weights from disk
    (vLLM's own loader): the same bytes in every parameter, and scores within the run-to-run noise
    of the disk server (the same texts scored alone and in one batch)."""
    trainer.model.save_pretrained(tmp_path / "v3")
    trainer.tokenizer.save_pretrained(tmp_path / "v3")
    disk = wait_ready(start_vllm_server(tmp_path / "v3", tmp_path, gpu=2))
    try:
        assert server_checksums(disk.url)[1] == server_checksums(trainer.url)[1]
        batched, _ = served(disk.url)
        alone = [served(disk.url, [t])[0][0] for t in TEXTS]
        noise = max(abs(a[0] - b[0]) for a, b in zip(batched, alone, strict=True))
        pushed, version = served(trainer.url)
        assert version == 3
        diff = max(abs(a[0] - b[0]) for a, b in zip(pushed, batched, strict=True))
        print(f"push vs disk: max abs diff {diff:.6f}; disk run to run (alone vs batched): {noise:.6f}")
        assert diff <= noise + 1e-6, (
            f"push vs disk differ by {diff}, more than the disk server's noise {noise}"
        )
    finally:
        stop(disk)


@pytest.mark.gpus(2)
def test_bad_metadata_rejected_before_any_byte(trainer: Trainer) -> None:
    import torch

    from rewardplane.protocol import RewardModelTrainingMode as Mode

    bad = {k: v for k, v in trainer.model.state_dict().items()}
    bad["model.norm.weight"] = torch.ones(7, device=trainer.device, dtype=torch.bfloat16)
    with pytest.raises(Exception, match="model.norm.weight"):
        trainer.sync.push(bad, version=4, training_mode=Mode.FULL)
    assert httpx.get(f"{trainer.url}/runtime_version", timeout=30).json()["version"] == 3
    got, _ = served(trainer.url)
    assert_close(
        got,
        reference_scores(trainer.model, trainer.tokenizer, TEXTS, trainer.device),
        "after a rejected push",
    )


@pytest.mark.gpus(2)
def test_later_pushes_start_from_the_data_plane(trainer: Trainer) -> None:
    """A layout pushed before starts its next push from the data plane (a header in the group's
    store; the worker's listener thread receives): exact weights, fresh prefix cache, the version
    served as soon as the push returns (confirmed in the commit reduction)."""
    import torch

    from rewardplane.protocol import RewardModelTrainingMode as Mode

    auth = {"Authorization": f"Bearer {TOKEN}"}
    served_version = httpx.get(f"{trainer.url}/runtime_version", timeout=30).json()["version"]
    for step, version in enumerate((served_version + 1, served_version + 2)):
        before = fill_prefix_cache(trainer.url)
        torch.manual_seed(10 + step)
        perturb(trainer.model, 0.1)
        assert (
            trainer.sync.push(trainer.model.state_dict(), version=version, training_mode=Mode.FULL) == version
        )
        assert httpx.get(f"{trainer.url}/runtime_version", timeout=30).json()["version"] == version
        check_after_push(trainer, version, before, f"full, push {step + 1}")
    last = httpx.get(f"{trainer.url}/get_num_background_tasks", headers=auth, timeout=30).json()[
        "last_update"
    ]
    assert (last["via"], last["version"], last["ok"]) == ("data_plane", served_version + 2, True), last
    got_version, got = server_checksums(trainer.url)
    assert got_version == served_version + 2
    assert_same_parameters(got, vllm_llama_checksums(trainer.model.state_dict()), "full (data plane)")


@pytest.mark.gpus(2)
def test_atomic_pushes_stage_beside_the_memory_fraction(trainer: Trainer) -> None:
    """Atomic pushes into vLLM: the update is staged outside the engine's memory fraction while the
    old weights serve, then swapped in. Scoring in a thread throughout: every answer equals the
    trainer's scores for the version it names (never a mix). Where the device has no room for the
    staged copy (here this process takes GPU 0's free memory, as a 7B model at
    --gpu-memory-utilization 0.9 on an 80 GB card leaves ~8 GB for a 13 GB copy), the push is
    refused before any byte moves with the way out; the old weights keep serving and the same
    group takes the next, streamed, push."""
    import threading

    import torch

    from rewardplane.sdk.retry import RewardServerError

    publisher = trainer.sync.open()
    version = httpx.get(f"{trainer.url}/runtime_version", timeout=30).json()["version"]
    refs = {version: reference_scores(trainer.model, trainer.tokenizer, TEXTS, trainer.device)}
    answers: list[tuple[list[list[float]], int]] = []
    stop = threading.Event()

    def score() -> None:
        while not stop.is_set():
            answers.append(served(trainer.url))

    scorer = threading.Thread(target=score, daemon=True)
    publisher.options = dataclasses.replace(publisher.options, atomic=True)
    try:
        scorer.start()
        for step in (1, 2):
            torch.manual_seed(20 + step)
            perturb(trainer.model, 0.05)
            refs[version + step] = reference_scores(trainer.model, trainer.tokenizer, TEXTS, trainer.device)
            assert trainer.sync.push(trainer.model.state_dict(), version=version + step) == version + step
        stop.set()
        scorer.join(60)
        assert answers and {v for _, v in answers} <= set(refs), {v for _, v in answers}
        for got, v in answers:
            assert_close(got, refs[v], f"atomic: an answer naming version {v}")
        last = httpx.get(
            f"{trainer.url}/get_num_background_tasks",
            headers={"Authorization": f"Bearer {TOKEN}"},
            timeout=30,
        ).json()["last_update"]
        assert last["ok"] and last["in_place_bytes"] == 0, last  # staged, then swapped under the lock
        served_now = version + 2
        assert_close(served(trainer.url)[0], refs[served_now], "atomic: after the swap")

        perturb(trainer.model, 0.05)
        free = torch.cuda.mem_get_info(0)[0]
        hog = torch.empty(max(0, free - (64 << 20)), dtype=torch.uint8, device="cuda:0")
        try:
            with pytest.raises(RewardServerError) as info:
                trainer.sync.push(trainer.model.state_dict(), version=served_now + 1)
        finally:
            del hog
            torch.cuda.empty_cache()
        assert "GiB are free" in info.value.message and "atomic=False" in info.value.message, (
            info.value.message
        )
    finally:
        stop.set()
        publisher.options = dataclasses.replace(publisher.options, atomic=False)
    state = httpx.get(f"{trainer.url}/runtime_version", timeout=30).json()
    assert (state["version"], state["state"]) == (served_now, "serving"), state
    assert_close(served(trainer.url)[0], refs[served_now], "atomic: after the refusal")
    assert trainer.sync.push(trainer.model.state_dict(), version=served_now + 1) == served_now + 1
    assert_close(
        served(trainer.url)[0],
        reference_scores(trainer.model, trainer.tokenizer, TEXTS, trainer.device),
        "streamed, after the refusal",
    )


# ---- optional: a ~0.4B model (RP_GPU_TESTS_LARGE=1) ---------------------------------------------


@pytest.mark.gpus(2)
@pytest.mark.skipif(
    os.environ.get("RP_GPU_TESTS_LARGE") != "1", reason="set RP_GPU_TESTS_LARGE=1 (one more vLLM start)"
)
def test_full_push_0_4b(seqcls_0_4b: Path, tmp_path: Path) -> None:
    import torch
    from transformers import AutoTokenizer

    from rewardplane.testing.pushers import loopback_pusher

    handle = wait_ready(start_vllm_server(seqcls_0_4b, tmp_path, gpu=0, gpu_memory_utilization=0.4))
    device = torch.device("cuda", 1)
    sync = loopback_pusher([handle.url], TOKEN, device=device, timeout_s=300, connect_timeout_s=120)
    try:
        t = Trainer(
            load_trainer_model(seqcls_0_4b, device),
            AutoTokenizer.from_pretrained(seqcls_0_4b),
            sync,
            device,
            handle.url,
        )
        assert_close(
            served(handle.url)[0], reference_scores(t.model, t.tokenizer, TEXTS, device), "0.4B at start"
        )
        before = fill_prefix_cache(handle.url)
        assert push_a_training_step(t, 1, seed=5) == 1
        check_after_push(t, 1, before, "0.4B full")
    finally:
        sync.close()
        stop(handle)
