"""``make_reward_rl``: the simplest RL-with-a-reward-model recipe, a scorer and a credit
assigner in one object.

``make_rm_grpo_assigner`` and ``make_rm_scalerl_assigner`` (pure, in ``_credit``) return credit
assigners; ``make_reward_rl`` adds the scoring step in front, since it is what a training loop
calls between generating rollouts and computing the loss.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from ._credit import CombineMode, Reduction, RewardModelCreditAssigner, ScoreLevel
from ._rollout import Rollout, RolloutStepKey
from ._scorer import AsyncScoringClient, RewardModelScorer


@dataclass
class RewardRL:
    """A scorer (None when the rollouts come scored) and the credit assigner that reads its
    scores. :meth:`compute` scores, then assigns."""

    scorer: RewardModelScorer | None
    credit_assigner: RewardModelCreditAssigner

    async def compute(self, rollouts: Sequence[Rollout]) -> dict[RolloutStepKey, float]:
        """Score the rollouts (writing the scores into them), then one weight per step."""
        if self.scorer is not None:
            await self.scorer.score(rollouts)
        return self.credit_assigner.compute(rollouts)


def make_reward_rl(
    client: AsyncScoringClient | None = None,
    mode: CombineMode = "replace",
    *,
    rm_coeff: float = 1.0,
    alpha: float = 0.5,
    rm_score_key: str = "rm_score",
    score_level: ScoreLevel = "sequence",
    batch_size: int = 64,
    normalize: bool = False,
    reduce: Reduction | None = None,
) -> RewardRL:
    """Plain (non-GRPO) RL on reward-model scores.

    Sets: a :class:`RewardModelScorer` over ``client`` writing ``rm_score_key`` at
    ``score_level`` (none when ``client`` is None), and a :class:`RewardModelCreditAssigner` in
    ``mode`` (``replace`` by default: the RM score is the reward) without normalisation — every
    step of a rollout gets the rollout's combined value (sequence level) or its own (step level).
    """
    scorer = (
        None
        if client is None
        else RewardModelScorer(client, rm_score_key, score_level, batch_size, normalize=normalize)
    )
    assigner = RewardModelCreditAssigner(mode, rm_coeff, alpha, rm_score_key, score_level, reduce=reduce)
    return RewardRL(scorer, assigner)
