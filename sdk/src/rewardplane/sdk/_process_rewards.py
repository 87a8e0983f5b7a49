"""Process reward models on the RL side: a rollout as a PRM solution, the PRM's answer written into
the rollout's steps, and dense per-token rewards for frameworks that take them. Pure logic, no I/O.

A rollout's steps are the solution's steps: the first step's observation is the prompt, each action
one reasoning step (a later observation, such as a tool's output, opens the step that answers it).
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence

from rewardplane.protocol import ScoringResult

from ._exceptions import RewardClientError
from ._rollout import Rollout


def rollout_solution(rollout: Rollout) -> tuple[str, list[str]]:
    """The prompt and the steps a PRM scores for ``rollout``, one step per ``Step``."""
    steps = [
        f"{s.prev_obs}\n{s.action}" if i > 0 and s.prev_obs else s.action for i, s in enumerate(rollout.steps)
    ]
    return (rollout.steps[0].prev_obs if rollout.steps else ""), steps


def write_process_scores(
    rollouts: Sequence[Rollout], results: Sequence[ScoringResult], score_key: str
) -> None:
    """Each step's PRM score into ``step.info[score_key]`` (where the step credit mode reads it) and
    the aggregate into ``rollout.meta[score_key]``; nothing is written unless every result fits."""
    for r, res in zip(rollouts, results, strict=True):
        if res.steps is None or len(res.steps) != len(r.steps):
            got = "no step scores" if res.steps is None else f"{len(res.steps)} step scores"
            raise RewardClientError(
                f"rollout {r.id!r} has {len(r.steps)} steps but the reward server answered {got}: is it a "
                "process reward model (GET /model_info kind: process)? A blank step is no step there: "
                "give every step a non-blank action"
            )
    for r, res in zip(rollouts, results, strict=True):
        assert res.steps is not None  # checked above
        for step, scored in zip(r.steps, res.steps, strict=True):
            step.info[score_key] = scored.score
        r.meta[score_key] = res.score


def token_rewards(
    step_scores: Sequence[float], step_ends: Sequence[int], token_ends: Sequence[int]
) -> list[float]:
    """Dense per-token rewards: each step's score on the token that completes the step, 0 elsewhere.

    ``step_ends``: where each step ends in the text (characters, a span's end); ``token_ends``: where
    each of the policy's tokens ends in the same text (a tokenizer's ``offset_mapping`` ends). Two
    steps ending in one token add up there, so the tokens' rewards sum to the steps'.
    """
    out = [0.0] * len(token_ends)
    if not token_ends:
        return out
    for score, end in zip(step_scores, step_ends, strict=True):
        k = min(bisect.bisect_left(token_ends, end), len(token_ends) - 1)
        out[k] += float(score)
    return out
