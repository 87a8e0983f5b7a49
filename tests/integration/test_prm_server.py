"""A process reward model served by the transformers engine (real server processes on CPU): step
scores equal the model's own token classification, every request shape, and the errors a user
meets, each saying what to change."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from rewardplane.protocol.steps import good_log_odds, probability
from rewardplane.testing.servers import ServerHandle, start_servers
from rewardplane.tinymodel import PRM_STEP_TAG as TAG
from rewardplane.tinymodel import build_tiny_process_reward_model, build_tiny_reward_model
from tests.fixtures.models import PRM_QUESTION as QUESTION
from tests.fixtures.models import PRM_SOLUTION, load_process_reward_model, step_log_odds

MAX_LEN = 128
STEPS = [PRM_SOLUTION, ["The answer is 6."]]


@pytest.fixture(scope="module")
def prm_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_process_reward_model(
        tmp_path_factory.mktemp("tiny-prm"), seed=2, max_position_embeddings=MAX_LEN
    )


@pytest.fixture(scope="module")
def servers(prm_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, ServerHandle]]:
    """A PRM without a default aggregation, one with ``min``, and a sequence reward model."""
    seq_dir = build_tiny_reward_model(tmp_path_factory.mktemp("tiny-rm"), seed=0)
    log_dir = tmp_path_factory.mktemp("prm-logs")
    prm = {"model_kind": "process", "step_tag": TAG}
    handles = start_servers(
        prm_dir,
        log_dir,
        prm,
        {**prm, "step_aggregation": "min"},
        startup_timeout_s=240,
    )
    handles += start_servers(seq_dir, log_dir, {}, startup_timeout_s=240)
    try:
        yield dict(zip(("prm", "prm_min", "sequence"), handles, strict=True))
    finally:
        for h in handles:
            h.stop()


def post(url: str, path: str, body: dict[str, object], status: int = 200) -> dict[str, object]:
    r = httpx.post(url + path, json=body, timeout=60)
    assert r.status_code == status, r.text
    return dict(r.json())


def test_step_scores_equal_the_models_token_classification(
    servers: dict[str, ServerHandle], prm_dir: Path
) -> None:
    body = post(servers["prm"].url, "/score", {"steps": STEPS, "prompts": [QUESTION] * 2, "normalize": False})
    data = sorted(body["data"], key=lambda d: d["index"])  # type: ignore[arg-type, index]
    for steps, item in zip(STEPS, data, strict=True):
        ref = step_log_odds(load_process_reward_model(prm_dir), prm_dir, QUESTION, steps)
        got = [s["score"] for s in item["steps"]]
        assert got == pytest.approx(ref, abs=1e-4)
        assert item["score"] == pytest.approx(got, abs=1e-9)  # no aggregation: the step scores
        assert [tuple(s["span"]) for s in item["steps"]][:1] == [(0, len(steps[0]))]
        assert item["steps"][-1]["tokens"][1] == item["num_tokens"]  # the last tag ends the sequence
    assert len({s["score"] for s in data[0]["steps"]}) == 3  # the steps are told apart


def test_text_with_separators_scores_like_the_list(servers: dict[str, ServerHandle]) -> None:
    url = servers["prm"].url
    text = "\n\n".join(STEPS[0]) + "\n\n"  # a trailing separator makes no empty step
    as_text = post(url, "/score", {"input": [text], "aggregation": "mean"})["data"][0]
    as_list = post(url, "/score", {"steps": [STEPS[0]], "aggregation": "mean"})["data"][0]
    assert as_text == as_list
    for step, s in zip(STEPS[0], as_text["steps"], strict=True):  # type: ignore[index]
        a, b = s["span"]
        assert text[a:b] == step
    probs = [s["score"] for s in as_text["steps"]]  # type: ignore[index]
    assert as_text["score"] == pytest.approx(sum(probs) / 3)  # type: ignore[index]


def test_aggregations_and_raw_scores(servers: dict[str, ServerHandle]) -> None:
    url = servers["prm_min"].url
    info = httpx.get(url + "/model_info").json()
    assert (info["kind"], info["process"]["step_tag"], info["process"]["aggregation"]) == (
        "process",
        TAG,
        "min",
    )
    probs = [s["score"] for s in post(url, "/score", {"steps": [STEPS[0]]})["data"][0]["steps"]]  # type: ignore[index]
    expect = {"min": min(probs), "last": probs[-1], "product": probs[0] * probs[1] * probs[2]}
    for how, value in expect.items():
        got = post(url, "/score", {"steps": [STEPS[0]], "aggregation": how})["data"][0]["score"]  # type: ignore[index]
        assert got == pytest.approx(value)
    raw = post(url, "/score", {"steps": [STEPS[0]], "normalize": False})["data"][0]  # type: ignore[index]
    assert probability(raw["score"]) == pytest.approx(min(probs))  # the server's min, as log-odds
    assert [probability(s["score"]) for s in raw["steps"]] == pytest.approx(probs)


def test_incremental_request_scores_only_the_new_steps(servers: dict[str, ServerHandle]) -> None:
    url = servers["prm"].url
    full = post(url, "/score", {"steps": [STEPS[0]], "prompts": [QUESTION]})["data"][0]["steps"]  # type: ignore[index]
    last = post(url, "/score", {"steps": [STEPS[0]], "prompts": [QUESTION], "first_step": 2})["data"][0][
        "steps"
    ]  # type: ignore[index]
    assert last == full[2:]  # type: ignore[index]
    err = post(url, "/score", {"steps": [STEPS[1]], "first_step": 1}, status=400)
    assert "first_step 1 but solution 0 has 1 steps" in str(err["error"])


def test_vllm_pooling_shape_and_openrlhf(servers: dict[str, ServerHandle]) -> None:
    url = servers["prm_min"].url
    text = QUESTION + "".join(s + TAG for s in STEPS[0])
    rows = post(url, "/pooling", {"input": text})["data"][0]["data"]  # type: ignore[index]
    ours = post(url, "/score", {"steps": [STEPS[0]], "prompts": [QUESTION], "normalize": False})["data"][0]  # type: ignore[index]
    assert [good_log_odds(r, 1) for r in rows] == pytest.approx([s["score"] for s in ours["steps"]], abs=1e-5)
    # OpenRLHF sends prompt + response as the query; with the prompt beside it only the response has steps
    reward = post(url, "/get_reward", {"query": [QUESTION + "\n\n".join(STEPS[0])], "prompts": [QUESTION]})
    assert reward["rewards"] == pytest.approx([ours["score"]], abs=1e-5)


def test_clear_errors(servers: dict[str, ServerHandle]) -> None:
    prm, seq = servers["prm"].url, servers["sequence"].url
    err = post(prm, "/get_reward", {"query": ["a\n\nb"]}, status=400)
    assert "--step-aggregation" in str(err["error"]) and "POST /score" in str(err["error"])
    err = post(prm, "/classify", {"input": "a"}, status=400)
    assert "process reward model" in str(err["error"])
    err = post(seq, "/score", {"steps": [["a", "b"]]}, status=400)
    assert "sequence reward model" in str(err["error"]) and "--model-kind process" in str(err["error"])
    err = post(prm, "/score", {"steps": [["one more step of the solution"] * 40]}, status=400)
    assert "step tags; the limit is 128 (--max-model-len)" in str(err["error"])
    err = post(prm, "/score", {"steps": [[f"a{TAG}b"]]}, status=400)
    assert "contains the step tag" in str(err["error"])


def test_a_tokenizer_without_the_step_tag_stops_the_start(tmp_path: Path) -> None:
    seq_dir = build_tiny_reward_model(tmp_path / "rm", seed=0)
    cmd = [sys.executable, "-m", "rewardplane.server", "--model", str(seq_dir), "--device", "cpu"]
    done = subprocess.run(
        [*cmd, "--model-kind", "process", "--step-tag", "<extra_0>"],
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert done.returncode != 0
    assert "has no token '<extra_0>'" in done.stderr and "--step-tag" in done.stderr
    done = subprocess.run([*cmd, "--step-aggregation", "min"], capture_output=True, text=True, timeout=240)
    assert done.returncode == 2 and "add --model-kind process" in done.stderr


def test_scorer_writes_every_steps_score_from_one_call(servers: dict[str, ServerHandle]) -> None:
    import asyncio

    from rewardplane.sdk import AsyncRewardClient, RewardModelCreditAssigner, RewardModelScorer, Rollout, Step

    url = servers["prm_min"].url
    rollouts = [
        Rollout(id=f"r{k}", steps=[Step(i, QUESTION if i == 0 else "", a) for i, a in enumerate(steps)])
        for k, steps in enumerate(STEPS)
    ]

    async def run() -> None:
        async with AsyncRewardClient([url]) as client:
            await RewardModelScorer(client, "prm", score_level="process").score(rollouts)

    asyncio.run(run())
    # the scorer asks for raw scores (a PRM's log-odds), as every SDK scoring call does by default
    expect = post(url, "/score", {"steps": STEPS, "prompts": [QUESTION] * 2, "normalize": False})["data"]
    for r, e in zip(rollouts, expect, strict=True):  # type: ignore[call-overload]
        assert [s.info["prm"] for s in r.steps] == pytest.approx([s["score"] for s in e["steps"]])
        assert r.meta["prm"] == pytest.approx(e["score"])
    weights = RewardModelCreditAssigner(mode="replace", rm_score_key="prm", score_level="step").compute(
        rollouts
    )
    assert weights[("r0", 1)] == pytest.approx(expect[0]["steps"][1]["score"])  # type: ignore[index]


def test_integrations_request_shapes(servers: dict[str, ServerHandle], prm_dir: Path) -> None:
    import asyncio
    from types import SimpleNamespace

    import torch
    from transformers import AutoTokenizer

    from rewardplane.sdk import RewardClient
    from rewardplane.sdk.integrations import (
        TRLRewardFunction,
        VerlProcessRewardManager,
        verl_compute_process_score,
    )

    url = servers["prm"].url
    completion = "\n\n".join(STEPS[0])
    ours = post(url, "/score", {"steps": [STEPS[0]], "prompts": [QUESTION], "aggregation": "min"})["data"][0]
    # TRL: the aggregate as GRPO's one scalar per completion
    trl = TRLRewardFunction(endpoints=[url], process=True, aggregation="min", normalize=True)
    assert trl(prompts=[QUESTION], completions=[completion]) == pytest.approx([ours["score"]])  # type: ignore[index]
    with pytest.raises(ValueError, match="aggregation='min'"):
        TRLRewardFunction(endpoints=[url], process=True)(prompts=[QUESTION], completions=[completion])
    # verl's custom_reward_function: the aggregate, the step scores beside it
    got = asyncio.run(
        verl_compute_process_score("math", completion, "5", {"prompt": QUESTION}, url=url, aggregation="min")
    )
    assert got["score"] == pytest.approx(ours["score"])  # type: ignore[index]
    assert got["step_ends"] == [s["span"][1] for s in ours["steps"]]  # type: ignore[index]
    # verl's reward manager: dense per-token rewards, each step's score where the step ends
    tok = AutoTokenizer.from_pretrained(prm_dir)
    prompt_ids = tok(QUESTION)["input_ids"]
    resp_ids = tok(completion)["input_ids"]
    pad = 4
    prompts = torch.tensor([[tok.pad_token_id] * pad + prompt_ids])  # verl left-pads prompts
    responses = torch.tensor([resp_ids + [tok.pad_token_id] * pad])  # and right-pads responses
    mask = torch.tensor([[0] * pad + [1] * len(prompt_ids) + [1] * len(resp_ids) + [0] * pad])
    data = SimpleNamespace(batch={"prompts": prompts, "responses": responses, "attention_mask": mask})
    with RewardClient([url]) as client:
        manager = VerlProcessRewardManager(tok, client=client, aggregation="min")
        out = manager(data, return_dict=True)
    dense = out["reward_tensor"][0]
    nonzero = dense.nonzero().flatten().tolist()
    assert len(nonzero) == 3 and nonzero[-1] == len(resp_ids) - 1
    assert dense.sum().item() == pytest.approx(sum(s["score"] for s in ours["steps"]), abs=1e-5)  # type: ignore[index]
    assert out["reward_extra_info"]["prm_score"] == pytest.approx([ours["score"]])  # type: ignore[index]
