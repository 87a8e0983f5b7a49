"""The ``RewardModelClient`` protocol: what a trainer needs from a reward model.

Kept free of httpx and torch so code that only type-checks against the protocol (a custom
backend, a test double) imports nothing heavy.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from rewardplane.protocol import RewardModelTrainingMode, Score, ScoringRequest, ScoringResponse

if TYPE_CHECKING:  # torch is only needed by implementations that push weights
    import torch


@runtime_checkable
class RewardModelClient(Protocol):
    """A reward model backend: scoring, weight pushes and version checks."""

    async def score(self, request: ScoringRequest) -> tuple[ScoringResponse, dict[str, Any]]:
        """Score ``request.inputs``; returns the scores and transport metadata (``info``)."""
        ...

    async def score_batch(self, inputs: Sequence[str], *, normalize: bool = True) -> list[Score]:
        """Scores of ``inputs`` in order (floats, or vectors for multi-label heads)."""
        ...

    def sync_weights(
        self,
        params: Mapping[str, torch.Tensor],
        *,
        timeout_s: float = 600.0,
        version: int | None = None,
        training_mode: RewardModelTrainingMode = RewardModelTrainingMode.FULL,
    ) -> str:
        """Push updated reward-model parameters; returns the new weights version as a string."""
        ...

    async def get_model_version(self) -> int:
        """Weights version currently served (for staleness checks)."""
        ...
