"""The SDK's own rollout types, so a training loop needs no host RL framework.

A ``Rollout`` is one episode (for a language model: a prompt and its completion, or a multi-turn
conversation); each ``Step`` is one action of the policy with the observation it answered. The
field names follow the common ``Rollout(id, steps, meta)`` / ``Step(index, prev_obs, action,
reward, info)`` shape, so rollouts from such frameworks convert field by field.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

RolloutStepKey = tuple[str, int]
"""``(rollout.id, step.index)``: the key of one step's credit weight."""


@dataclass
class Step:
    """One policy action: the observation it answered (``prev_obs``), the action, its env reward.

    ``info`` holds per-step extras; step-level reward-model scores are written there.
    """

    index: int
    prev_obs: str
    action: str
    reward: float = 0.0
    info: dict[str, Any] = field(default_factory=dict)


@dataclass
class Rollout:
    """One episode: its steps in order and free-form ``meta`` (sequence-level scores go there)."""

    id: str
    steps: list[Step]
    meta: dict[str, Any] = field(default_factory=dict)

    def total_reward(self) -> float:
        """The rollout's return: the sum of its steps' env rewards (undiscounted)."""
        return float(sum(s.reward for s in self.steps))

    def key(self, step: Step) -> RolloutStepKey:
        return (self.id, step.index)
