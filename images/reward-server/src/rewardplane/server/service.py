"""The scoring path every route shares: the model-name check, the request limits, the engine call
and its metrics. Routes turn their own request shapes into token ids and call ``run``."""

from __future__ import annotations

from rewardplane.protocol import PoolingType

from .engine import EngineInfo, RewardEngine
from .errors import BadRequest
from .inputs import Limits, apply_length_limit, check_items
from .metrics import ServerMetrics
from .model_names import ModelNames


class ScoringService:
    def __init__(
        self, engine: RewardEngine, limits: Limits, metrics: ServerMetrics, names: ModelNames
    ) -> None:
        self.engine = engine
        self.limits = limits
        self.metrics = metrics
        self.names = names

    @property
    def info(self) -> EngineInfo:
        return self.engine.info

    def check_model(self, name: str | None) -> None:
        problem = self.names.problem(name)
        if problem is not None:
            raise BadRequest(problem)

    async def run(
        self, prompts: list[list[int]], pooling: PoolingType, truncate: bool
    ) -> tuple[list[list[float]], int, list[list[int]]]:
        """Raw head rows, the weights version that made all of them, and the prompts as scored."""
        check_items(len(prompts), self.limits)
        prompts = apply_length_limit(prompts, self.limits, truncate=truncate)
        rows, version = await self.engine.score(prompts, pooling)
        self.metrics.items.inc(len(prompts))
        self.metrics.tokens.inc(sum(len(p) for p in prompts))
        return rows, version, prompts
