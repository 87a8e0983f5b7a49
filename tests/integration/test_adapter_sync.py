"""Adapter-only weight sync into real servers over gloo (CPU): the server applies the pushed LoRA
A/B tensors as an adapter, scores equal the trainer's PEFT model, base weights stay bit for bit."""

from __future__ import annotations

import warnings

import httpx
import pytest
import torch

from rewardplane.protocol import Endpoints, ParamChecksumsResponse, WeightSyncMode
from rewardplane.protocol import RewardModelTrainingMode as Mode
from rewardplane.sdk import LoraSync
from rewardplane.sdk._exceptions import WeightSyncError
from rewardplane.sdk.lora import adapter_payload
from rewardplane.sdk.retry import RewardServerError
from rewardplane.testing.servers import free_port
from tests.fixtures.models import TEXTS
from tests.fixtures.trainer import load_model, logits
from tests.integration.test_weight_sync import TOKEN, close, served, sync_for

MAX_RANK = 8


def peft_model(model_dir, *, seed: int, r: int = 4, head: bool = True):
    """A LoRA reward model as after some training: non-zero adapters (and a changed head)."""
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(
        load_model(model_dir),
        LoraConfig(
            r=r,
            lora_alpha=2 * r,
            target_modules=["q_proj", "v_proj", "down_proj"],
            modules_to_save=["score"] if head else None,
            task_type="SEQ_CLS",
        ),
    )
    train(model, seed)
    return model.eval()


def train(model, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            if p.requires_grad:
                p.add_(torch.randn(p.shape, generator=g) * 0.3)


def checksums(server) -> dict[str, tuple]:
    r = httpx.get(
        server.url + Endpoints.PARAM_CHECKSUMS, headers={"Authorization": f"Bearer {TOKEN}"}, timeout=60
    )
    assert r.status_code == 200, r.text
    return {
        n: tuple(c) for n, c in ParamChecksumsResponse.model_validate(r.json()).workers[0].checksums.items()
    }


@pytest.fixture
def lora_server(server_factory, tiny_model_dir):
    return server_factory(tiny_model_dir, token=TOKEN, enable_lora=True, max_lora_rank=MAX_RANK)


def test_adapter_push_serves_the_peft_model_over_untouched_base_weights(lora_server, tiny_model_dir):
    info = httpx.get(lora_server.url + Endpoints.MODEL_INFO, timeout=10).json()
    assert info["max_lora_rank"] == MAX_RANK
    before = checksums(lora_server)
    model = peft_model(tiny_model_dir, seed=1)
    sync = sync_for(lora_server)
    try:
        handle = LoraSync(sync, mode="auto")
        assert handle.mode is WeightSyncMode.ADAPTER  # the server serves adapters: auto picks them
        with warnings.catch_warnings():
            warnings.filterwarnings("error", message=".*falling back")  # no fallback
            assert handle.sync(model, version=1) is model  # nothing merged: keep training this model
        scores, version = served(lora_server)
        assert version == 1
        assert close(scores, logits(model, tiny_model_dir, TEXTS), tol=1e-5)
        # where the push's time went, step by step (the benchmark reports these)
        last = httpx.get(
            lora_server.url + "/get_num_background_tasks", headers={"Authorization": f"Bearer {TOKEN}"}
        ).json()["last_update"]
        assert (last["version"], last["mode"], last["ok"]) == (1, "adapter", True)
        steps = [
            "returned",
            "locked",
            "adapter_unpacked",
            "adapter_added",
            "adapter_plain_loaded",
            "committed",
        ]
        ms = last["after_announce_ms"]
        assert [ms[k] for k in steps] == sorted(ms[k] for k in steps), ms
        after = checksums(lora_server)
        changed = sorted(n for n in before if after[n] != before[n])
        assert changed == ["score.weight"]  # the head came through modules_to_save; the base did not move
        assert set(after) == set(before)  # no adapter parameter shows up as a served weight

        # a second version replaces the first adapter (never stacked, never a stale one)
        train(model, seed=2)
        handle.sync(model, version=2)
        assert close(served(lora_server)[0], logits(model, tiny_model_dir, TEXTS), tol=1e-5)
        assert {n: c for n, c in checksums(lora_server).items() if n != "score.weight"} == {
            n: c for n, c in before.items() if n != "score.weight"
        }

        # a peer restored from this replica would get the base alone: refused, with what to do
        r = httpx.post(
            lora_server.url + Endpoints.SEND_WEIGHTS,
            json={"port": free_port(), "world_size": 2, "version": 2},
            headers={"Authorization": f"Bearer {TOKEN}"},
            timeout=30,
        )
        assert r.status_code == 409 and "adapters are not sent to peers" in r.text, r.text

        # a full push carries the whole model: the adapter goes, the server serves exactly the base pushed
        base = load_model(tiny_model_dir)
        sync.push(base.state_dict(), version=3, training_mode=Mode.FULL)
        assert close(served(lora_server)[0], logits(base, tiny_model_dir, TEXTS), tol=1e-5)
    finally:
        sync.close()


def test_adapter_push_is_refused_before_anything_moves_when_it_does_not_fit(lora_server, tiny_model_dir):
    sync = sync_for(lora_server)
    try:
        too_big = peft_model(tiny_model_dir, seed=3, r=2 * MAX_RANK, head=False)
        tensors, adapter = adapter_payload(too_big)
        with pytest.raises(RewardServerError, match="max-lora-rank"):
            sync.push(tensors, version=1, training_mode=Mode.ADAPTER, adapter=adapter)
        # refused before any byte moved: the group is intact and the next push goes through
        ok = peft_model(tiny_model_dir, seed=4)
        LoraSync(sync, mode="adapter", fallback_to_full=False).sync(ok, version=1)
        assert close(served(lora_server)[0], logits(ok, tiny_model_dir, TEXTS), tol=1e-5)
    finally:
        sync.close()


def test_without_lora_on_the_server_adapter_sync_falls_back_to_full_for_good(server_factory, tiny_model_dir):
    server = server_factory(tiny_model_dir, token=TOKEN)  # LoRA not enabled
    sync = sync_for(server)
    try:
        assert LoraSync(sync, mode="auto").mode is WeightSyncMode.FULL
        strict = LoraSync(sync, mode="adapter", fallback_to_full=False)
        with pytest.raises(WeightSyncError, match=r"spec\.lora\.enabled.*mode='full'"):
            strict.sync(peft_model(tiny_model_dir, seed=5), version=1)
        assert served(server)[1] == 0  # nothing was applied

        handle = LoraSync(sync, mode="adapter", fallback_to_full=True)
        model = peft_model(tiny_model_dir, seed=6)
        expected = logits(model, tiny_model_dir, TEXTS)
        with pytest.warns(UserWarning, match="falling back to full"):
            fresh = handle.sync(model, version=1)
        assert handle.mode is WeightSyncMode.FULL and "does not serve LoRA adapters" in (
            handle.fallback_reason or ""
        )
        assert close(served(server)[0], expected)
        # permanent for this handle: the next push is merged straight away, without another warning
        train(fresh, seed=7)
        expected = logits(fresh, tiny_model_dir, TEXTS)
        with warnings.catch_warnings():
            warnings.filterwarnings("error", message=".*falling back")
            handle.sync(fresh, version=2)
        assert close(served(server)[0], expected)
    finally:
        sync.close()
