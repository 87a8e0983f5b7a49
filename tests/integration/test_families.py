"""Every served decoder family on the transformers engine (real server processes on CPU): a tiny
random ``<Family>ForSequenceClassification`` per family (``rewardplane.tinymodel.FAMILIES``) is
served with the model's own raw scores, and a full push over gloo makes every live parameter the
trainer's, bit for bit (``/param_checksums``) — q/k norms, Gemma 2's four norms per layer, the
experts' fused 3-D tensors and their router included; head-only and LoRA-merged pushes follow
the trainer too."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from rewardplane.protocol import Endpoints, ParamChecksumsResponse
from rewardplane.protocol import RewardModelTrainingMode as Mode
from rewardplane.testing.servers import ServerHandle, launch_server, wait_healthy
from rewardplane.tinymodel import FAMILIES, TINY_SLIDING_WINDOW, build_tiny_reward_model
from rewardplane.transport.checksums import digests
from tests.fixtures.models import TEXTS as SHORT_TEXTS
from tests.fixtures.models import reference_logits
from tests.fixtures.trainer import logits, perturbed
from tests.integration.test_weight_sync import TOKEN, sync_for

HIDDEN = 64
# one text well past the sliding window of Gemma 2 and Mistral, so the window is exercised
LONG = " ".join(["The reward model reads every step of the answer before it gives a score."] * 4)
TEXTS = [*SHORT_TEXTS, LONG]
TOL = 1e-5


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("families")
    return {
        family: build_tiny_reward_model(root / family, family=family, head_std=HIDDEN**-0.5, seed=i)
        for i, family in enumerate(FAMILIES)
    }


@pytest.fixture(scope="module")
def servers(
    models: dict[str, Path], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[dict[str, ServerHandle]]:
    """One server per family, all started side by side (each start is mostly importing torch)."""
    log_dir = tmp_path_factory.mktemp("family-logs")
    handles = {f: launch_server(path, log_dir, token=TOKEN) for f, path in models.items()}
    try:
        yield {f: wait_healthy(h, 300) for f, h in handles.items()}
    finally:
        for h in handles.values():
            h.stop()


def served(url: str) -> list[float]:
    r = httpx.post(url + "/score", json={"input": TEXTS, "normalize": False}, timeout=60)
    assert r.status_code == 200, r.text
    return [d["score"] for d in sorted(r.json()["data"], key=lambda d: d["index"])]


def one_label(rows: list[list[float]]) -> list[float]:
    return [score for (score,) in rows]


def checksums(url: str) -> dict[str, tuple[object, ...]]:
    r = httpx.get(url + Endpoints.PARAM_CHECKSUMS, headers={"Authorization": f"Bearer {TOKEN}"}, timeout=60)
    assert r.status_code == 200, r.text
    return {
        n: tuple(c) for n, c in ParamChecksumsResponse.model_validate(r.json()).workers[0].checksums.items()
    }


def test_the_long_text_crosses_the_sliding_window(models: dict[str, Path]) -> None:
    from transformers import AutoTokenizer

    assert len(AutoTokenizer.from_pretrained(models["mistral"])(LONG)["input_ids"]) > 2 * TINY_SLIDING_WINDOW


@pytest.mark.parametrize("family", list(FAMILIES))
def test_scores_equal_transformers_and_a_full_push_lands_bit_for_bit(
    family: str, models: dict[str, Path], servers: dict[str, ServerHandle]
) -> None:
    server, model_dir = servers[family], models[family]
    assert served(server.url) == pytest.approx(one_label(reference_logits(model_dir, TEXTS)), abs=TOL)
    model = perturbed(model_dir, seed=11)
    sync = sync_for(server, bucket_bytes=1 << 16)  # several buckets
    try:
        assert sync.push(model.state_dict(), version=1, training_mode=Mode.FULL) == 1
    finally:
        sync.close()
    want = digests(model.named_parameters())
    got = checksums(server.url)
    assert set(got) == set(want)
    assert [n for n in want if got[n] != tuple(want[n])] == []
    assert served(server.url) == pytest.approx(one_label(logits(model, model_dir, TEXTS)), abs=TOL)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_head_only_and_lora_merged_pushes_follow_the_trainer(
    family: str, models: dict[str, Path], servers: dict[str, ServerHandle]
) -> None:
    """Head-only moves the score head alone; a LoRA on the attention's q/v (the targets every
    family has, MoE included) merged before the push serves what the adapted model computes."""
    import torch
    from peft import LoraConfig, get_peft_model

    from rewardplane.protocol.naming import select_head
    from rewardplane.sdk.lora import merge_sync_reinit

    server, model_dir = servers[family], models[family]
    model = perturbed(model_dir, seed=12)
    sync = sync_for(server)
    try:
        sync.push(model.state_dict(), version=2, training_mode=Mode.FULL)
        before = checksums(server.url)
        with torch.no_grad():
            model.score.weight.add_(torch.randn_like(model.score.weight) * HIDDEN**-0.5)
        sync.push(select_head(model.state_dict()), version=3, training_mode=Mode.HEAD_ONLY)
        after = checksums(server.url)
        assert [n for n in after if after[n] != before[n]] == ["score.weight"]
        assert served(server.url) == pytest.approx(one_label(logits(model, model_dir, TEXTS)), abs=TOL)
        peft_model = get_peft_model(
            model,
            LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], modules_to_save=["score"]),
        )
        with torch.no_grad():
            for name, p in peft_model.named_parameters():
                if "lora_B" in name:
                    p.normal_(0.0, 0.05)
        want = one_label(logits(peft_model, model_dir, TEXTS))
        merge_sync_reinit(peft_model, lambda sd: sync.push(sd, version=4, training_mode=Mode.LORA))
        assert served(server.url) == pytest.approx(want, abs=TOL)
    finally:
        sync.close()
