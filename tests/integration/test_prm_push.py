"""Pushes into a process reward model over real gloo groups (CPU, transformers engine): every
training mode, with the same guarantees as a sequence model's — the step scores follow the
trainer's model, and head-only moves the token-classification head alone."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest
import torch

from rewardplane.protocol import Endpoints, ParamChecksumsResponse
from rewardplane.protocol import RewardModelTrainingMode as Mode
from rewardplane.protocol.naming import WeightValidationError, select_head
from rewardplane.sdk import LoraSync
from rewardplane.sdk.lora import merge_sync_reinit
from rewardplane.tinymodel import PRM_STEP_TAG as TAG
from rewardplane.tinymodel import build_tiny_process_reward_model
from tests.fixtures.models import PRM_QUESTION as QUESTION
from tests.fixtures.models import PRM_SOLUTION, load_process_reward_model, step_log_odds
from tests.integration.test_weight_sync import TOKEN, sync_for

SOLUTIONS = [PRM_SOLUTION, ["The answer is 6.", "Done."]]
TOL = 1e-4
PRM = {"token": TOKEN, "model_kind": "process", "step_tag": TAG}


@pytest.fixture(scope="module")
def prm_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_process_reward_model(tmp_path_factory.mktemp("prm-push"), seed=3)


def served(url: str) -> tuple[list[float], int]:
    body = httpx.post(
        url + "/score", json={"steps": SOLUTIONS, "prompts": [QUESTION] * 2, "normalize": False}, timeout=60
    ).json()
    return [s["score"] for d in body["data"] for s in d["steps"]], body["version"]


def expected(model: torch.nn.Module, prm_dir: Path) -> list[float]:
    """The trainer's model's step log-odds on the texts with the tags written in."""
    return [x for steps in SOLUTIONS for x in step_log_odds(model, prm_dir, QUESTION, steps)]


def noise(model: torch.nn.Module, seed: int, *, only: str | None = None, scale: float = 0.05) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.requires_grad and (only is None or name.startswith(only)):
                p.add_(torch.randn(p.shape, generator=g) * (0.3 if name.startswith("score.") else scale))


def checksums(url: str) -> dict[str, tuple[int, ...]]:
    r = httpx.get(url + Endpoints.PARAM_CHECKSUMS, headers={"Authorization": f"Bearer {TOKEN}"}, timeout=60)
    body = ParamChecksumsResponse.model_validate(r.json())
    return {n: tuple(c) for n, c in body.workers[0].checksums.items()}


def test_full_head_only_lora_merged_and_delta_pushes(server_factory, prm_dir: Path) -> None:  # type: ignore[no-untyped-def]
    server = server_factory(prm_dir, **PRM)
    sync = sync_for(server, bucket_bytes=1 << 16)
    try:
        # full
        model = load_process_reward_model(prm_dir)
        noise(model, 1)
        assert sync.push(model.state_dict(), version=1, training_mode=Mode.FULL) == 1
        got, version = served(server.url)
        assert version == 1 and got == pytest.approx(expected(model, prm_dir), abs=TOL)
        # head-only: the two-layer token-classification head, and nothing else moves
        before = checksums(server.url)
        noise(model, 2, only="score.")
        head = select_head(model.state_dict())
        assert sorted(head) == ["score.0.bias", "score.0.weight", "score.2.bias", "score.2.weight"]
        with pytest.raises(WeightValidationError, match="backbone"):
            sync.push(model.state_dict(), version=2, training_mode=Mode.HEAD_ONLY)
        sync.push(head, version=2, training_mode=Mode.HEAD_ONLY)
        after = checksums(server.url)
        assert sorted(n for n in after if after[n] != before[n]) == sorted(head)
        assert served(server.url)[0] == pytest.approx(expected(model, prm_dir), abs=TOL)
        # LoRA, merged before the push; the fresh adapters compute what the server serves
        from peft import LoraConfig, get_peft_model

        peft_model = get_peft_model(
            model,
            LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], modules_to_save=["score"]),
        )
        noise(peft_model, 3, scale=0.3)
        want = expected(peft_model, prm_dir)
        fresh = merge_sync_reinit(peft_model, lambda sd: sync.push(sd, version=3, training_mode=Mode.LORA))
        assert served(server.url)[0] == pytest.approx(want, abs=TOL)
        assert expected(fresh, prm_dir) == pytest.approx(want, abs=TOL)
        # delta: only what changed moves, and the server holds the trainer's model
        model = load_process_reward_model(prm_dir)
        noise(model, 4)
        sync.push(model.state_dict(), version=4)
        with torch.no_grad():
            dict(model.named_parameters())["model.layers.1.mlp.up_proj.weight"].add_(0.01)
        sync.push(model.state_dict(), version=5, delta=True)
        assert served(server.url) == (pytest.approx(expected(model, prm_dir), abs=TOL), 5)
    finally:
        sync.close()


def test_adapter_push_into_a_prm(server_factory, prm_dir: Path) -> None:  # type: ignore[no-untyped-def]
    from peft import LoraConfig, get_peft_model

    server = server_factory(prm_dir, enable_lora=True, max_lora_rank=8, **PRM)
    base = checksums(server.url)
    model = get_peft_model(
        load_process_reward_model(prm_dir),
        LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], modules_to_save=["score"]),
    )
    noise(model, 5, scale=0.3)
    sync = sync_for(server)
    try:
        LoraSync(sync, mode="adapter", fallback_to_full=False).sync(model, version=1)
        got, version = served(server.url)
        assert version == 1 and got == pytest.approx(expected(model.eval(), prm_dir), abs=1e-4)
        after = checksums(server.url)
        assert sorted(n for n in after if after[n] != base[n]) == [
            "score.0.bias",
            "score.0.weight",
            "score.2.bias",
            "score.2.weight",
        ]  # the head came through modules_to_save; the base weights did not move
    finally:
        sync.close()
