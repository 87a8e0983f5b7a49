"""Process reward models, the pure parts: splitting solutions into steps, inserting the step tags,
step scores and aggregates, the request's rules, and reading vLLM's step rows."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
from pydantic import ValidationError

from rewardplane.protocol import ScoringRequest, StepAggregation
from rewardplane.protocol.steps import (
    aggregate,
    good_log_odds,
    log_odds,
    probability,
    split_steps,
    step_spans,
)
from rewardplane.server.engines.step_tag import step_tag_id
from rewardplane.server.engines.vllm_steps import rows_at_tags
from rewardplane.server.errors import BadRequest
from rewardplane.server.http.steps import build_solution, check_length, solution_steps

TAG = "<extra_0>"


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Any:
    from transformers import AutoTokenizer

    from rewardplane.tinymodel import train_tokenizer

    tok = train_tokenizer()
    tok.add_special_tokens({"additional_special_tokens": [TAG]})
    out = Path(tmp_path_factory.mktemp("prm-tok"))
    tok.save_pretrained(out)
    return AutoTokenizer.from_pretrained(out)


def test_a_text_splits_at_the_separator_with_spans_into_the_text() -> None:
    text = "Add 2 and 3.\n\nThat is 5.\n\n\n\nSo 5.\n\n"
    steps = split_steps(text, "\n\n")
    assert [s for s, _ in steps] == ["Add 2 and 3.", "That is 5.", "So 5."]  # blank pieces are no steps
    assert [text[a:b] for _, (a, b) in steps] == ["Add 2 and 3.", "That is 5.", "So 5."]
    # a list of steps counts as the steps joined by the separator: the same spans for the same steps
    joined = "\n\n".join(["Add 2 and 3.", "That is 5."])
    assert step_spans(["Add 2 and 3.", "That is 5."], "\n\n") == [(0, 12), (14, 24)]
    assert [s for s, _ in split_steps(joined, "\n\n")] == ["Add 2 and 3.", "That is 5."]
    assert [span for _, span in split_steps(joined, "\n\n")] == [(0, 12), (14, 24)]


def test_raw_step_scores_are_the_log_odds_of_the_good_label() -> None:
    logits = [0.3, 1.7]
    p_good = math.exp(1.7) / (math.exp(0.3) + math.exp(1.7))
    assert probability(good_log_odds(logits, 1)) == pytest.approx(p_good)
    assert probability(good_log_odds(logits, 0)) == pytest.approx(1 - p_good)
    assert good_log_odds([0.8], 0) == 0.8  # one label: its logit, sigmoid is the probability
    assert log_odds(probability(-2.5)) == pytest.approx(-2.5)
    assert (log_odds(0.0), log_odds(1.0)) == (-math.inf, math.inf)


def test_aggregates() -> None:
    p = [0.9, 0.5, 0.8]
    assert aggregate(p, StepAggregation.MIN) == 0.5
    assert aggregate(p, StepAggregation.MEAN) == pytest.approx(2.2 / 3)
    assert aggregate(p, StepAggregation.LAST) == 0.8
    assert aggregate(p, StepAggregation.PRODUCT) == pytest.approx(0.36)
    with pytest.raises(ValueError, match="without steps"):
        aggregate([], StepAggregation.MIN)


def test_the_server_inserts_a_tag_after_each_step(tokenizer: Any) -> None:
    tag_id = step_tag_id(tokenizer, TAG, "m")
    prompt, steps = "Question: 2 + 3?\n", ["Add 2 and 3.", "That is 5."]
    sol = build_solution(tokenizer, prompt, steps, step_spans(steps, "\n\n"), tag_id=tag_id, tag=TAG, index=0)
    # the same ids as the text with the tags written in: the tag splits the tokenizer's text
    assert sol.ids == tokenizer(prompt + "".join(s + TAG for s in steps))["input_ids"]
    assert [sol.ids[t] for t in sol.tags] == [tag_id, tag_id]
    assert [i for i, t in enumerate(sol.ids) if t == tag_id] == sol.tags
    (a0, b0), (a1, b1) = sol.token_spans
    assert b0 - 1 == sol.tags[0] and a1 == b0 and b1 == len(sol.ids)
    assert (
        tokenizer.decode(sol.ids[a0 : b0 - 1]).strip() == steps[0]
    )  # the first step's tokens, not the prompt's
    assert tokenizer.decode(sol.ids[:a0]) == prompt


def test_a_step_containing_the_tag_or_none_at_all_is_refused(tokenizer: Any) -> None:
    tag_id = step_tag_id(tokenizer, TAG, "m")
    with pytest.raises(BadRequest, match="step 1 contains the step tag"):
        build_solution(tokenizer, "", ["a", f"b{TAG}c"], [(0, 1), (3, 12)], tag_id=tag_id, tag=TAG, index=0)
    with pytest.raises(BadRequest, match="solution 4 has no steps"):
        build_solution(tokenizer, "q", [], [], tag_id=tag_id, tag=TAG, index=4)
    assert solution_steps(["\n\n"], None, "\n\n") == [([], [])]


def test_a_solution_over_the_model_length_is_refused_not_cut(tokenizer: Any) -> None:
    tag_id = step_tag_id(tokenizer, TAG, "m")
    steps = ["one step of a long solution"] * 20
    sol = build_solution(tokenizer, "", steps, step_spans(steps, "\n\n"), tag_id=tag_id, tag=TAG, index=2)
    check_length(sol, len(sol.ids), 2)
    with pytest.raises(BadRequest, match=r"solution 2 has \d+ tokens with its 20 step tags; the limit is 50"):
        check_length(sol, 50, 2)


def test_a_tokenizer_without_the_step_tag_fails_the_start(tokenizer: Any) -> None:
    with pytest.raises(ValueError, match=r"has no token '<step>'.*--step-tag"):
        step_tag_id(tokenizer, "<step>", "/models/prm")


def test_request_rules() -> None:
    with pytest.raises(ValidationError, match="either as `input` texts"):
        ScoringRequest(input=["a"], steps=[["a"]])
    with pytest.raises(ValidationError, match="prompts has 2 items for 1 solutions"):
        ScoringRequest(steps=[["a"]], prompts=["q", "r"])
    with pytest.raises(ValidationError):
        ScoringRequest(steps=[["a"]], aggregation="median")
    # a sequence request's wire form has none of the process fields: older servers forbid unknown ones
    assert not {"steps", "prompts", "aggregation", "first_step"} & set(ScoringRequest(input=["a"]).wire())
    assert ScoringRequest(steps=[["a"]], first_step=1).wire()["first_step"] == 1


def test_vllm_step_rows_are_read_at_the_tags() -> None:
    ids = [5, 9, 7, 9, 8, 9]  # tag id 9 at 1, 3, 5
    # STEP pooling: one row per tag; a subset of the tags asked for
    assert rows_at_tags([[0.0], [1.0], [2.0]], ids, [3, 5], tag_id=9, selected=True) == [[1.0], [2.0]]
    with pytest.raises(RuntimeError, match="--prm-pooling token"):
        rows_at_tags([[0.0]] * 6, ids, [1, 3, 5], tag_id=9, selected=True)  # vLLM ignored STEP
    # token pooling: one row per computed token, the prompt's tail when a cached prefix was read
    every = [[float(i)] for i in range(6)]
    assert rows_at_tags(every, ids, [1, 3, 5], tag_id=9, selected=False) == [[1.0], [3.0], [5.0]]
    tail = every[4:]
    assert rows_at_tags(tail, ids, [5], tag_id=9, selected=False) == [[5.0]]
    assert rows_at_tags(tail, ids, [3, 5], tag_id=9, selected=False) is None  # step 2 was cached


def test_the_operators_prm_flags_are_the_servers() -> None:
    """What the operator renders for a PRM RewardModel parses into the server's process config."""
    from rewardplane.operator.planning import ClusterView, plan_reward_model
    from rewardplane.operator.render import server_args
    from rewardplane.server.config import parse_args
    from tests.unit.test_planning import NODES, cpu_rm

    model = {
        "source": "/models/prm",
        "kind": "process",
        "process": {"stepTag": TAG, "aggregation": "product"},
    }
    plan = plan_reward_model(cpu_rm(model=model), ClusterView(nodes=NODES))
    cfg = parse_args(server_args(plan, plan.replicas[0]))
    assert cfg.process is not None
    assert (cfg.process.step_tag, cfg.process.step_separator, cfg.process.good_label) == (TAG, "\n\n", 1)
    assert cfg.process.aggregation is StepAggregation.PRODUCT
