"""Weight pushes over NCCL on CUDA tensors: a transformers-engine server on GPU 0, the trainer on
GPU 1 (two processes cannot share one GPU in an NCCL group). Skipped without two GPUs."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
import torch

from rewardplane.protocol import RewardModelTrainingMode as Mode
from rewardplane.protocol.naming import select_head
from rewardplane.testing.gpus import visible_gpus
from rewardplane.testing.pushers import loopback_pusher
from rewardplane.testing.servers import free_port, start_server
from tests.fixtures.models import TEXTS
from tests.fixtures.trainer import load_model, perturbed, run_dying_trainer

if not torch.cuda.is_available() or torch.cuda.device_count() < 2:
    pytest.skip("needs two CUDA GPUs (server on GPU 0, trainer on GPU 1)", allow_module_level=True)

TOKEN = "secret"
TRAINER = torch.device("cuda", 1)
# bf16 backbone on both sides, fp32 head on the server: agreement within bf16 noise
ATOL = 2e-2


@pytest.fixture(scope="module")
def gpu_server(tiny_model_dir, tmp_path_factory):
    h = start_server(
        tiny_model_dir,
        tmp_path_factory.mktemp("gpu-srv"),
        token=TOKEN,
        device="cuda",
        dtype="bfloat16",
        env_extra={"CUDA_VISIBLE_DEVICES": visible_gpus(0)},
    )
    yield h
    h.stop()


def served(h):
    body = httpx.post(f"{h.url}/score", json={"input": TEXTS, "normalize": False}, timeout=60).json()
    return torch.tensor([d["score"] for d in body["data"]]), body["version"]


def test_server_scores_the_checkpoint_like_the_trainer(gpu_server, tiny_model_dir):
    got, version = served(gpu_server)
    assert version == 0
    torch.testing.assert_close(
        got, trainer_scores(load_model(tiny_model_dir), tiny_model_dir), atol=ATOL, rtol=ATOL
    )


@torch.inference_mode()
def trainer_scores(model, model_dir):
    """The trainer's scores computed the way the server batches them (one right-padded batch, bf16
    backbone, fp32 head), so only the transfer can make them differ."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    m = model.to(TRAINER)
    m.model.to(torch.bfloat16)
    m.score.to(torch.float32)
    enc = tok(TEXTS, return_tensors="pt", padding=True, padding_side="right").to(TRAINER)
    hidden = m.model(**enc).last_hidden_state
    last = enc["attention_mask"].sum(1) - 1
    return m.score(hidden[torch.arange(len(TEXTS), device=TRAINER), last].float())[:, 0].cpu()


def push(h, params, version, mode, **kw):
    sync = loopback_pusher([h.url], TOKEN, device=TRAINER, connect_timeout_s=60, **kw)
    try:
        assert sync.open().comm.backend == "nccl"
        sync.push(params, version=version, training_mode=mode)
    finally:
        sync.close()


def test_round_trip_all_modes_over_nccl(gpu_server, tiny_model_dir):
    from peft import LoraConfig, get_peft_model

    from rewardplane.sdk.lora import merge_for_sync

    head = perturbed(tiny_model_dir, seed=21, head_only=True).to(TRAINER)
    push(gpu_server, select_head(head.state_dict()), 1, Mode.HEAD_ONLY)
    got, version = served(gpu_server)
    assert version == 1
    torch.testing.assert_close(got, trainer_scores(head, tiny_model_dir), atol=ATOL, rtol=ATOL)

    peft_model = get_peft_model(
        load_model(tiny_model_dir),
        LoraConfig(r=4, target_modules=["q_proj", "v_proj"], modules_to_save=["score"]),
    )
    with torch.no_grad():
        for p in peft_model.parameters():
            if p.requires_grad:
                p.add_(torch.randn_like(p) * 0.3)
    merged, _ = merge_for_sync(peft_model.to(TRAINER))
    push(gpu_server, merged.state_dict(), 2, Mode.LORA)
    got, version = served(gpu_server)
    assert version == 2
    torch.testing.assert_close(got, trainer_scores(merged, tiny_model_dir), atol=ATOL, rtol=ATOL)

    # a small perturbation keeps the tiny model well conditioned, so bf16 noise stays small
    full = perturbed(tiny_model_dir, seed=22, scale=0.01).to(TRAINER, torch.bfloat16)
    push(
        gpu_server, full.state_dict(), 3, Mode.FULL, bucket_bytes=1 << 16
    )  # many buckets: the pipelined path
    got, version = served(gpu_server)
    assert version == 3 and httpx.get(f"{gpu_server.url}/runtime_version").json()["version"] == 3
    torch.testing.assert_close(got, trainer_scores(full, tiny_model_dir), atol=ATOL, rtol=ATOL)


def test_trainer_dies_mid_broadcast_over_nccl(gpu_server, tiny_model_dir):
    v0 = httpx.get(f"{gpu_server.url}/runtime_version").json()["version"]
    proc = run_dying_trainer(
        gpu_server.url, free_port(), tiny_model_dir, version=v0 + 1, atomic=False, device="cuda:1"
    )
    assert proc.returncode == 17, proc.stdout + proc.stderr
    deadline = time.monotonic() + 60
    state = {}
    while time.monotonic() < deadline:
        state = httpx.get(f"{gpu_server.url}/runtime_version").json()
        if state["state"] != "updating":
            break
        time.sleep(0.2)
    assert gpu_server.process.poll() is None, "the server died with the trainer"
    if state.get("state") == "updating":  # stuck: show where (the server dumps its stacks on SIGUSR1)
        gpu_server.process.send_signal(signal.SIGUSR1)
        time.sleep(2)
        print(gpu_server.log()[-12000:])
    assert state["version"] == v0 and state["state"] in ("broken", "serving"), state
    full = perturbed(tiny_model_dir, seed=23, scale=0.01).to(TRAINER, torch.bfloat16)
    push(gpu_server, full.state_dict(), v0 + 2, Mode.FULL)
    got, version = served(gpu_server)
    assert version == v0 + 2
    torch.testing.assert_close(got, trainer_scores(full, tiny_model_dir), atol=ATOL, rtol=ATOL)


# NCCL's socket transport, the path between hosts without RDMA: with peer-to-peer, shared memory
# and InfiniBand off on both sides, this host's two GPUs connect the way two hosts without RDMA
# would. Set alike on the trainer and the server (NCCL reads them when a process first uses it).
SOCKETS_ONLY = {
    "NCCL_P2P_DISABLE": "1",
    "NCCL_SHM_DISABLE": "1",
    "NCCL_IB_DISABLE": "1",
    "NCCL_DEBUG": "INFO",
    "NCCL_DEBUG_SUBSYS": "INIT,NET",
}
SOCKET_TRAINER = r"""
import sys, torch
from rewardplane.sdk.push.pusher import WeightPusher
from tests.fixtures.trainer import perturbed
url, port, model_dir, seed = sys.argv[1], int(sys.argv[2]), sys.argv[3], int(sys.argv[4])
device = torch.device("cuda", 0)  # CUDA_VISIBLE_DEVICES=1: the host's second GPU
model = perturbed(model_dir, seed=seed, scale=0.01).to(device, torch.bfloat16)
sync = WeightPusher([url], group_port=port, token="secret", trainer_host="127.0.0.1", device=device,
                        connect_timeout_s=60, bucket_bytes=1 << 16)
try:
    assert sync.open().comm.backend == "nccl"
    sync.push(model.state_dict(), version=1)
finally:
    sync.close()
print("pushed", flush=True)
"""


def test_a_push_over_nccl_sockets_lands_like_one_over_nvlink(tiny_model_dir, tmp_path):
    server = start_server(
        tiny_model_dir,
        tmp_path,
        token=TOKEN,
        device="cuda",
        dtype="bfloat16",
        env_extra={"CUDA_VISIBLE_DEVICES": visible_gpus(0), **SOCKETS_ONLY},
    )
    try:
        trainer = subprocess.run(
            [sys.executable, "-c", SOCKET_TRAINER, server.url, str(free_port()), str(tiny_model_dir), "31"],
            env={**os.environ, "CUDA_VISIBLE_DEVICES": visible_gpus(1), **SOCKETS_ONLY},
            cwd=Path(__file__).resolve().parents[2],  # the repository root: the script imports tests.fixtures
            capture_output=True,
            text=True,
            timeout=300,
        )
        logs = trainer.stdout + trainer.stderr + server.log()
        assert trainer.returncode == 0 and "pushed" in trainer.stdout, logs[-8000:]
        # every connection NCCL made, on either side, went over its socket transport
        connections = [ln for ln in logs.splitlines() if "Channel" in ln and " via " in ln]
        assert connections, "NCCL logged no connections (NCCL_DEBUG=INFO):\n" + logs[-8000:]
        assert all("via NET/Socket" in ln for ln in connections), connections[:8]
        got, version = served(server)
        assert version == 1
        expected = trainer_scores(
            perturbed(tiny_model_dir, seed=31, scale=0.01).to(torch.bfloat16), tiny_model_dir
        )
        torch.testing.assert_close(got, expected, atol=ATOL, rtol=ATOL)
    finally:
        server.stop()
