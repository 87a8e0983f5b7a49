"""The RL side of process reward models, pure: rollouts as PRM solutions, step scores written into
the steps, the step credit mode, dense per-token rewards, and the request shapes the SDK sends."""

from __future__ import annotations

import pytest

from rewardplane.protocol import ScoringResult, StepScore
from rewardplane.sdk import RewardClient, RewardModelCreditAssigner, Rollout, Step
from rewardplane.sdk._exceptions import RewardClientError
from rewardplane.sdk._process_rewards import rollout_solution, token_rewards, write_process_scores


def rollout(rid: str, actions: list[str], env: float = 0.0) -> Rollout:
    steps = [Step(index=i, prev_obs="Q: 2+3?" if i == 0 else "", action=a) for i, a in enumerate(actions)]
    steps[-1].reward = env
    return Rollout(id=rid, steps=steps)


def result(scores: list[float], agg: float) -> ScoringResult:
    steps = [StepScore(index=i, score=s, span=(0, 1), tokens=(0, 1)) for i, s in enumerate(scores)]
    return ScoringResult(index=0, score=agg, steps=steps)


def test_a_rollouts_steps_are_the_solutions_steps() -> None:
    r = rollout("r", ["Add 2 and 3.", "That is 5."])
    r.steps[1].prev_obs = "tool: 5"
    assert rollout_solution(r) == ("Q: 2+3?", ["Add 2 and 3.", "tool: 5\nThat is 5."])


def test_step_credit_gives_each_step_its_prm_reward() -> None:
    rs = [rollout("a", ["s1", "s2", "s3"], env=1.0), rollout("b", ["t1"])]
    write_process_scores(rs, [result([0.9, 0.2, 0.7], 0.2), result([0.4], 0.4)], "prm")
    assert [s.info["prm"] for s in rs[0].steps] == [0.9, 0.2, 0.7] and rs[0].meta["prm"] == 0.2
    weights = RewardModelCreditAssigner(mode="replace", rm_score_key="prm", score_level="step").compute(rs)
    assert weights == {("a", 0): 0.9, ("a", 1): 0.2, ("a", 2): 0.7, ("b", 0): 0.4}
    bonus = RewardModelCreditAssigner(mode="bonus", rm_coeff=0.5, rm_score_key="prm", score_level="step")
    assert bonus.compute(rs)[("a", 2)] == pytest.approx(1.0 + 0.35)  # the env reward on its step
    # the aggregate is the sequence-level score (one scalar per rollout, GRPO-style)
    seq = RewardModelCreditAssigner(mode="replace", rm_score_key="prm").compute(rs)
    assert seq[("a", 0)] == seq[("a", 2)] == 0.2


def test_a_reply_that_does_not_fit_writes_nothing() -> None:
    rs = [rollout("a", ["s1", "s2"]), rollout("b", ["t1"])]
    with pytest.raises(
        RewardClientError, match="rollout 'b' has 1 steps but the reward server answered no step"
    ):
        write_process_scores(rs, [result([0.1, 0.2], 0.1), ScoringResult(index=1, score=0.3)], "prm")
    assert all("prm" not in s.info for r in rs for s in r.steps)


def test_dense_rewards_sit_on_the_token_that_completes_each_step() -> None:
    text = "Add 2 and 3.\n\nThat is 5."
    token_ends = [3, 5, 9, 12, 14, 18, 21, 24]  # e.g. a tokenizer's offset_mapping ends
    dense = token_rewards([0.9, 0.6], [12, 24], token_ends)
    assert dense == [0, 0, 0, 0.9, 0, 0, 0, 0.6]
    assert text[:12].endswith("3.") and sum(dense) == pytest.approx(1.5)
    assert token_rewards([0.5, 0.25], [2, 3], [4, 8]) == [0.75, 0.0]  # two steps in one token add up
    assert token_rewards([1.0], [99], [4, 8]) == [0.0, 1.0]  # past the end: the last token


def test_request_shapes() -> None:
    client = RewardClient(["http://a:1", "http://b:1"], max_items_per_request=2, min_chunk=1)
    try:
        req = client._steps_request([["s1", "s2"], ["t1"], ["u1"]], ["p1", "p2", "p3"], "min", False, 1)
        body = req.wire()
        assert (body["input"], body["steps"], body["aggregation"], body["first_step"]) == (
            [],
            [["s1", "s2"], ["t1"], ["u1"]],
            "min",
            1,
        )
        # split over the servers, each piece carries its own solutions and prompts
        pieces = [c.json for c in client._score_calls(req, None)]
        assert len(pieces) == 2 and sum((p["steps"] for p in pieces), []) == [["s1", "s2"], ["t1"], ["u1"]]
        assert sum((p["prompts"] for p in pieces), []) == ["p1", "p2", "p3"]
        assert all(len(p["steps"]) == len(p["prompts"]) for p in pieces)
        text = client._steps_request(["a\n\nb"], None, None, True, 0).wire()
        assert text["input"] == ["a\n\nb"] and "steps" not in text and "aggregation" not in text
        with pytest.raises(ValueError, match="every one as a list of steps"):
            client._steps_request(["a", ["b"]], None, None, True, 0)
    finally:
        client.close()
