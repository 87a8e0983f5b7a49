"""rewardplane's trainer-side SDK: score rollouts, push weights, follow the cluster.

Everything public is importable from here (``from rewardplane.sdk import AsyncRewardClient``);
the modules behind it are private unless documented (``docs/sdk.md``).

- Scoring: :class:`AsyncRewardClient` and :class:`RewardClient` (blocking), over one base.
- Pushing: :class:`WeightPusher` (direct mode) and :class:`RewardModelHandle` (through the
  operator); :class:`LoraSync` for LoRA models (sync mode ``full``, ``adapter`` or ``auto``).
- Training loops: :class:`Rollout`/:class:`Step`, :class:`RewardModelScorer`,
  :class:`GenerativeJudge` (an LLM judge on a server of task ``generate``),
  :class:`RewardModelCreditAssigner` and its presets, :class:`RewardLoop`.
- Errors: one tree under :class:`RewardplaneError`.
- Seed-compatible names: :class:`VLLMRewardClient` (scoring and pushing in one object),
  :class:`RewardModelClient`, :func:`create_reward_publisher`.

Scoring needs only pydantic and httpx; pushes need torch (extra ``train``): the push classes are
imported on first use, so ``import rewardplane.sdk`` stays light.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from rewardplane.protocol import (
    AdapterConfig,
    PoolingType,
    RewardModelTrainingMode,
    ScoringRequest,
    ScoringResponse,
    SleepResponse,
    WeightSyncMode,
    derive_ports,
    replica_group_port,
    resolve_sync_mode,
)
from rewardplane.protocol.auth import resolve_token
from rewardplane.protocol.naming import normalize_params, select_head

from ._awake import AwakeReplicas
from ._client import AsyncRewardClient, BaseRewardClient, RewardClient
from ._credit import (
    CreditAssigner,
    GroupNormalizedAssigner,
    RewardModelCreditAssigner,
    RMGroupOptions,
    combine,
    make_rm_grpo_assigner,
    make_rm_scalerl_assigner,
)
from ._exceptions import (
    ClientClosedError,
    ClusterError,
    CreditAssignmentError,
    JudgeParseError,
    RewardClientError,
    RewardFunctionError,
    RewardplaneError,
    RewardplaneTimeout,
    RewardServerError,
    RewardServerUnavailable,
    WeightSyncError,
    WeightSyncFailed,
    WeightValidationError,
)
from ._judge import GenerativeJudge, JudgeStats
from ._judge_parsing import parse_score
from ._presets import RewardRL, make_reward_rl
from ._reward_loop import RewardLoop, RewardResult, RewardSample, sample_text
from ._rollout import Rollout, RolloutStepKey, Step
from ._scorer import RewardModelScorer, chat_template_text, rollout_text, step_text
from .chunking import contiguous_chunks, reassemble
from .client import VLLMRewardClient
from .cluster import PushResult, ReplicaEndpoint, RewardModelHandle
from .retry import RetryPolicy
from .reward_client_protocol import RewardModelClient

if TYPE_CHECKING:
    from .direct_sync import WeightPusher
    from .lora import LoraSync
    from .publisher import Rank0OnlyPublisher, RewardModelPublisher

__all__ = [
    "AdapterConfig",
    "AsyncRewardClient",
    "AwakeReplicas",
    "BaseRewardClient",
    "ClientClosedError",
    "ClusterError",
    "LoraSync",
    "CreditAssigner",
    "CreditAssignmentError",
    "GroupNormalizedAssigner",
    "PoolingType",
    "PushResult",
    "Rank0OnlyPublisher",
    "ReplicaEndpoint",
    "RetryPolicy",
    "RewardClient",
    "RewardClientError",
    "RewardFunctionError",
    "RewardLoop",
    "RewardModelClient",
    "RMGroupOptions",
    "RewardModelCreditAssigner",
    "RewardModelHandle",
    "RewardModelPublisher",
    "RewardModelScorer",
    "GenerativeJudge",
    "JudgeStats",
    "JudgeParseError",
    "parse_score",
    "RewardModelTrainingMode",
    "RewardRL",
    "RewardResult",
    "RewardSample",
    "RewardServerError",
    "RewardServerUnavailable",
    "RewardplaneError",
    "RewardplaneTimeout",
    "Rollout",
    "RolloutStepKey",
    "ScoringRequest",
    "ScoringResponse",
    "SleepResponse",
    "Step",
    "VLLMRewardClient",
    "WeightPusher",
    "WeightSyncError",
    "WeightSyncFailed",
    "WeightSyncMode",
    "WeightValidationError",
    "chat_template_text",
    "combine",
    "contiguous_chunks",
    "create_reward_publisher",
    "derive_ports",
    "make_reward_rl",
    "make_rm_grpo_assigner",
    "make_rm_scalerl_assigner",
    "normalize_params",
    "reassemble",
    "replica_group_port",
    "resolve_sync_mode",
    "resolve_token",
    "rollout_text",
    "sample_text",
    "select_head",
    "step_text",
]

# Names whose modules import torch: loaded on first access (PEP 562).
_LAZY = {
    "WeightPusher": ".direct_sync",
    "RewardModelPublisher": ".publisher",
    "Rank0OnlyPublisher": ".publisher",
    "LoraSync": ".lora",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name], __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def create_reward_publisher(
    client: VLLMRewardClient, head_name_patterns: list[str] | None = None, rank0_only: bool = False
) -> RewardModelPublisher | Rank0OnlyPublisher:
    """A publisher over the client's servers (the seed's factory). ``rank0_only`` for
    multi-process learners: only rank 0 joins the communicator and pushes, fenced by barriers."""
    from .publisher import Rank0OnlyPublisher

    def make() -> RewardModelPublisher:
        publisher = client.create_reward_publisher()
        if head_name_patterns:
            publisher.head_name_patterns = tuple(head_name_patterns)
        return publisher

    return Rank0OnlyPublisher(make) if rank0_only else make()
