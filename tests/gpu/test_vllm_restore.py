"""Saved weights and restore after a restart on the vLLM engine (``--weights-dir``).

The server on GPU 0 keeps host copies (HF names) of what it loads and persists their union; after a
kill and a restart on base weights, ``POST /restore_weights`` loads them through vLLM's own loader
within the server's memory fraction. Trainer: this process on ``cuda:1``.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import httpx
import pytest

from rewardplane.testing.pushers import loopback_peer_restore
from rewardplane.testing.servers import ServerHandle
from tests.gpu.vllm_support import (
    TEXTS,
    TOKEN,
    assert_close,
    direct_sync,
    load_trainer_model,
    new_head,
    perturb,
    reference_scores,
    served,
    server_checksums,
    start_vllm_server,
    stop,
    wait_ready,
)

pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.timeout(1800), pytest.mark.gpus(2)]

AUTH = {"Authorization": f"Bearer {TOKEN}"}
GPU_MEMORY_UTILIZATION = 0.3


def _persisted_version(weights: Path, timeout_s: float = 120) -> int | None:
    deadline = time.monotonic() + timeout_s
    path = weights / "version.json"
    while time.monotonic() < deadline:
        if path.exists() and json.loads(path.read_text()).get("version") == 2:
            return 2
        time.sleep(0.1)
    return json.loads(path.read_text()).get("version") if path.exists() else None


def _saving_server(model_dir: Path, log_dir: Path, weights: Path) -> ServerHandle:
    """A vLLM server on GPU 0 that saves what it loads into ``weights`` (``--weights-dir``), ready."""
    return wait_ready(
        start_vllm_server(
            model_dir, log_dir, gpu=0, gpu_memory_utilization=GPU_MEMORY_UTILIZATION, weights_dir=weights
        )
    )


def test_pushed_weights_survive_a_restart(tiny_seqcls_1label: Path, tmp_path: Path) -> None:
    import torch
    from transformers import AutoTokenizer

    from rewardplane.protocol import RewardModelTrainingMode as Mode
    from rewardplane.protocol.naming import select_head

    weights = tmp_path / "weights"
    device = torch.device("cuda", 1)
    model = load_trainer_model(tiny_seqcls_1label, device)
    tok = AutoTokenizer.from_pretrained(tiny_seqcls_1label)
    server = _saving_server(tiny_seqcls_1label, tmp_path, weights)
    try:
        sync = direct_sync([server.url], device)
        try:
            perturb(model, 0.1, seed=7)
            sync.push(model.state_dict(), version=1, training_mode=Mode.FULL)
            new_head(model)
            sync.push(select_head(model.state_dict()), version=2, training_mode=Mode.HEAD_ONLY)
        finally:
            sync.close()
        want = reference_scores(model, tok, TEXTS, device)
        assert_close(served(server.url)[0], want, "after the pushes")
        before = server_checksums(server.url)[1]
        assert _persisted_version(weights) == 2, "version 2 was not persisted within 120 s"
    finally:
        stop(server)

    restarted = _saving_server(tiny_seqcls_1label, tmp_path, weights)
    try:
        got, version = served(restarted.url)
        assert version == 0
        wrong = httpx.post(f"{restarted.url}/restore_weights", json={"version": 3}, headers=AUTH, timeout=60)
        assert wrong.status_code == 409 and "version 2, not 3" in wrong.json()["error"]
        ok = httpx.post(f"{restarted.url}/restore_weights", json={"version": 2}, headers=AUTH, timeout=300)
        assert ok.status_code == 200, ok.text
        got, version = served(restarted.url)
        assert version == 2
        assert_close(got, want, "restored after a restart")
        # bit for bit what the server held before it was killed (the union: v1's backbone, v2's head)
        assert server_checksums(restarted.url)[1] == before
        # the restore stayed inside the server's memory fraction (vLLM preallocates up to it)
        used = torch.cuda.mem_get_info(0)
        assert used[1] - used[0] <= (GPU_MEMORY_UTILIZATION + 0.05) * used[1], used
    finally:
        stop(restarted)


@pytest.mark.gpus(3)
def test_a_fresh_replica_gets_the_weights_from_a_vllm_peer(tiny_seqcls_1label: Path, tmp_path: Path) -> None:
    """Peer restore with vLLM on both ends: the source (GPU 0) got version 1 (full) and 2 (head)
    from the trainer (GPU 1); a fresh replica (GPU 2, no saved weights) gets version 2 from the
    source, the way the operator restores one: bit for bit the source's parameters, the trainer's
    scores, and the source keeps serving."""
    import torch
    from transformers import AutoTokenizer

    from rewardplane.operator.replicas import HttpReplicas, ReplicaError
    from rewardplane.protocol import RewardModelTrainingMode as Mode
    from rewardplane.protocol.naming import select_head

    device = torch.device("cuda", 1)
    model = load_trainer_model(tiny_seqcls_1label, device)
    tok = AutoTokenizer.from_pretrained(tiny_seqcls_1label)
    for side in ("source", "fresh"):
        (tmp_path / side).mkdir()  # each server's log
    source = start_vllm_server(tiny_seqcls_1label, tmp_path / "source", gpu=0)
    fresh = start_vllm_server(tiny_seqcls_1label, tmp_path / "fresh", gpu=2)
    replicas = HttpReplicas()
    try:
        wait_ready(source)
        wait_ready(fresh)

        def restore(version: int, group: str) -> None:
            loopback_peer_restore(
                replicas, TOKEN, source.url, fresh.url, version=version, timeout_s=120, group_id=group
            )

        sync = direct_sync([source.url], device)
        try:
            perturb(model, 0.1, seed=11)
            sync.push(select_head(model.state_dict()), version=1, training_mode=Mode.HEAD_ONLY)
            # only the head came by a push: the backbone is where vLLM's loader put it from disk
            with pytest.raises(ReplicaError, match="cannot send its weights to peers"):
                restore(1, "peer-gpu-refused")
            sync.push(model.state_dict(), version=2, training_mode=Mode.FULL)
        finally:
            sync.close()
        want = reference_scores(model, tok, TEXTS, device)
        assert_close(served(source.url)[0], want, "the source after the pushes")
        assert served(fresh.url)[1] == 0

        restore(2, "peer-gpu")
        deadline = time.monotonic() + 120
        while served(fresh.url)[1] != 2 and time.monotonic() < deadline:
            time.sleep(0.2)
        got, version = served(fresh.url)
        assert version == 2, f"--- source log\n{source.log()[-3000:]}\n--- fresh log\n{fresh.log()[-3000:]}"
        assert server_checksums(fresh.url)[1] == server_checksums(source.url)[1]
        assert_close(got, want, "the fresh replica after the peer restore")
        assert served(source.url)[1] == 2
        assert_close(served(source.url)[0], want, "the source after it sent")
    finally:
        replicas.close()
        stop(source)
        stop(fresh)
