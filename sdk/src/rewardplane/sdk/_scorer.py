"""Scoring rollouts with a reward model: ``RewardModelScorer`` writes scores into the rollouts,
where a credit assigner reads them.

The scorer is the only part of the training-side flow that does I/O: it sends the texts of the
rollouts to the reward servers in batches, in order, and writes the scores only once every batch
has come back, so a failed batch leaves no rollout half scored.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Sequence
from typing import Any, Literal, Protocol

from rewardplane.protocol import Score, ScoringResult

from ._credit import ScoreLevel
from ._exceptions import RewardClientError
from ._process_rewards import rollout_solution, write_process_scores
from ._rollout import Rollout, Step

ScorerLevel = ScoreLevel | Literal["process"]


class AsyncScoringClient(Protocol):
    """What the scorer and the reward loop need from a client: ``score_batch`` in input order
    (``AsyncRewardClient`` and ``GenerativeJudge`` have it)."""

    async def score_batch(self, inputs: Sequence[str], *, normalize: bool = False) -> list[Score]: ...


class AsyncStepScoringClient(Protocol):
    """What process-level scoring needs: ``score_steps`` (``AsyncRewardClient`` has it)."""

    async def score_steps(
        self,
        solutions: Sequence[str | Sequence[str]],
        *,
        prompts: Sequence[str] | None = ...,
        normalize: bool = ...,
    ) -> list[ScoringResult]: ...


def check_async_client(client: object, who: str) -> None:
    """Refuse, at construction, a client whose ``score_batch`` cannot be awaited."""
    method = getattr(client, "score_batch", None)
    if not callable(method) or not inspect.iscoroutinefunction(method):
        raise TypeError(
            f"{who} needs an async scoring client, but {type(client).__name__}.score_batch is "
            f"{'missing' if method is None else 'not async'}; pass an AsyncRewardClient "
            "(a RewardClient is the blocking one)"
        )


def rollout_text(rollout: Rollout) -> str:
    """The default sequence-level text: the first observation (the prompt) followed by every
    action and later observation, one per line — ``prompt + completion`` for single-turn rollouts.
    """
    parts: list[str] = []
    for i, step in enumerate(rollout.steps):
        if i == 0 or step.prev_obs:
            parts.append(step.prev_obs)
        parts.append(step.action)
    return "\n".join(parts)


def step_text(rollout: Rollout, step: Step) -> str:
    """The default step-level text: the observation the step answered and its action."""
    return f"{step.prev_obs}\n{step.action}"


def chat_template_text(
    tokenizer: Any, *, user_role: str = "user", assistant_role: str = "assistant"
) -> Callable[[Rollout], str]:
    """A ``text_fn`` that renders a rollout with the reward model's chat template: each step's
    ``prev_obs`` as a user turn and its ``action`` as an assistant turn, through
    ``tokenizer.apply_chat_template(messages, tokenize=False)`` (a transformers tokenizer)."""

    def render(rollout: Rollout) -> str:
        messages: list[dict[str, str]] = []
        for step in rollout.steps:
            if step.prev_obs:
                messages.append({"role": user_role, "content": step.prev_obs})
            messages.append({"role": assistant_role, "content": step.action})
        return str(tokenizer.apply_chat_template(messages, tokenize=False))

    return render


def write_scores(
    rollouts: Sequence[Rollout], scores: Sequence[Any], score_key: str, score_level: ScoreLevel
) -> None:
    """Scores in the order of the rollouts (of their steps at step level) into ``meta[score_key]``
    (``step.info[score_key]``): where a credit assigner reads them."""
    it = iter(scores)
    if score_level == "step":
        for r in rollouts:
            for s in r.steps:
                s.info[score_key] = next(it)
    else:
        for r in rollouts:
            r.meta[score_key] = next(it)


class RewardModelScorer:
    """Scores rollouts through a reward-model client and stores the scores in them.

    Args:
        client: an async scoring client (``AsyncRewardClient``, or anything with
            ``async score_batch(inputs, normalize=...)``).
        score_key: sequence level writes ``rollout.meta[score_key]``; step level writes
            ``step.info[score_key]`` for every step.
        score_level: ``sequence`` (one text per rollout, :func:`rollout_text`), ``step`` (one
            text per step, :func:`step_text`) or ``process``: a process reward model scores each
            rollout in one pass, its steps as the solution's steps (``_process_rewards``), writing
            every ``step.info[score_key]`` and the aggregate into ``rollout.meta[score_key]``.
        batch_size: texts per ``score_batch`` call; batches are sent one after another, in order.
        text_fn: the text of a rollout at sequence level (default :func:`rollout_text`; e.g.
            :func:`chat_template_text`).
        step_text_fn: the text of a step at step level (default :func:`step_text`).
        normalize: passed to the server (True applies the head's activation; False returns the
            raw head output).

    Scores are floats, or lists for multi-label heads (the credit assigner then needs a
    reduction). A scoring error propagates and no rollout is modified.
    """

    def __init__(
        self,
        client: AsyncScoringClient,
        score_key: str = "rm_score",
        score_level: ScorerLevel = "sequence",
        batch_size: int = 64,
        *,
        text_fn: Callable[[Rollout], str] = rollout_text,
        step_text_fn: Callable[[Rollout, Step], str] = step_text,
        normalize: bool = False,
    ) -> None:
        if score_level not in ("sequence", "step", "process"):
            raise ValueError(f"score_level must be 'sequence', 'step' or 'process', got {score_level!r}")
        if score_level == "process" and not callable(getattr(client, "score_steps", None)):
            raise TypeError(
                f"score_level='process' needs a client with score_steps (an AsyncRewardClient); "
                f"{type(client).__name__} has none"
            )
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        check_async_client(client, "RewardModelScorer")
        self.client = client
        self.score_key = score_key
        self.score_level: ScorerLevel = score_level
        self.batch_size = batch_size
        self.text_fn = text_fn
        self.step_text_fn = step_text_fn
        self.normalize = normalize

    def texts(self, rollouts: Sequence[Rollout]) -> list[str]:
        """The texts that :meth:`score` sends, in order (one per rollout, or per step)."""
        if self.score_level == "step":
            return [self.step_text_fn(r, s) for r in rollouts for s in r.steps]
        return [self.text_fn(r) for r in rollouts]

    async def score(self, rollouts: Sequence[Rollout]) -> None:
        """Score ``rollouts`` and write the scores into them (all or nothing)."""
        if self.score_level == "process":
            await self._score_process(rollouts)
            return
        texts = self.texts(rollouts)
        scores: list[Score] = []
        for start in range(0, len(texts), self.batch_size):
            batch = texts[start : start + self.batch_size]
            got = await self.client.score_batch(batch, normalize=self.normalize)
            if len(got) != len(batch):
                raise RewardClientError(
                    f"the scoring client returned {len(got)} scores for a batch of {len(batch)} texts; "
                    "nothing was written"
                )
            scores.extend(got)
        write_scores(rollouts, scores, self.score_key, "step" if self.score_level == "step" else "sequence")

    async def _score_process(self, rollouts: Sequence[Rollout]) -> None:
        client: AsyncStepScoringClient = self.client  # type: ignore[assignment]  # checked in __init__
        results: list[ScoringResult] = []
        for start in range(0, len(rollouts), self.batch_size):
            batch = [rollout_solution(r) for r in rollouts[start : start + self.batch_size]]
            results += await client.score_steps(
                [steps for _, steps in batch], prompts=[p for p, _ in batch], normalize=self.normalize
            )
        write_process_scores(rollouts, results, self.score_key)
