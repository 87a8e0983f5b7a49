"""The engine interface both the transformers and the vLLM engines implement."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

from rewardplane.protocol import PoolingType

from .locking import WeightsGuard


@dataclass(frozen=True)
class EngineInfo:
    served_model_name: str
    engine: str
    num_labels: int
    dtype: str
    head_dtype: str
    max_model_len: int
    vocab_size: int
    pooling_types: tuple[PoolingType, ...]
    id2label: dict[int, str] = field(default_factory=dict)
    world_size: int = 1


class RewardEngine(Protocol):
    info: EngineInfo
    guard: WeightsGuard
    tokenizer: Any

    async def start(self) -> None: ...

    async def stop(self) -> None: ...

    async def score(self, prompts: list[list[int]], pooling: PoolingType) -> tuple[list[list[float]], int]:
        """Raw head outputs (one row of ``num_labels`` per prompt) and the weights version that made
        them. All rows of one call come from one version."""
        ...

    def weight_sync_service(self, metrics: Any) -> Any:
        """The engine's ``control_plane.WeightSyncService`` (worker calls + parameter manifest)."""
        ...
