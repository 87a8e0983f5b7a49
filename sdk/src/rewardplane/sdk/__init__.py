"""rewardplane's trainer-side SDK: score rollouts, push weights, follow the cluster.

Everything public is importable from here (``from rewardplane.sdk import AsyncRewardClient``);
the modules behind it are private unless documented (``docs/sdk.md``).

- Scoring: :class:`AsyncRewardClient` and :class:`RewardClient` (blocking), over one base.
- Pushing: :class:`WeightPusher` (direct mode) and :class:`RewardModelHandle` (through the
  operator; ``handle.client()`` is a :class:`RewardClient` over its ready replicas);
  :class:`LoraSync` for LoRA models (sync mode ``full``, ``adapter`` or ``auto``).
- Training loops: :class:`Rollout`/:class:`Step`, :class:`RewardModelScorer`,
  :class:`GenerativeJudge` (an LLM judge on a server of task ``generate``),
  :class:`RewardModelCreditAssigner` and its presets, :class:`RewardLoop`.
- Errors: one tree under :class:`RewardplaneError`.

Scoring needs only pydantic and httpx; pushes need torch (extra ``train``): the push classes are
imported on first use, so ``import rewardplane.sdk`` stays light.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from rewardplane.protocol import (
    AdapterConfig,
    RewardModelTrainingMode,
    ScoringRequest,
    ScoringResponse,
    SleepResponse,
    WeightSyncMode,
    resolve_sync_mode,
)
from rewardplane.protocol.naming import normalize_params, select_head

from ._awake import AwakeReplicas
from ._client_base import BaseRewardClient
from ._credit import (
    CreditAssigner,
    GroupNormalizedAssigner,
    RewardModelCreditAssigner,
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
from .async_client import AsyncRewardClient
from .client import RewardClient
from .cluster import PushResult, ReplicaEndpoint, RewardModelHandle
from .retry import RetryPolicy

if TYPE_CHECKING:
    from .lora import LoraSync
    from .push.plan.layout import TensorPiece
    from .push.pusher import WeightPusher
    from .push.wire.http import Rank0OnlyPublisher

# What docs/sdk.md documents, by its table's areas (tests/unit/test_sdk_surface.py keeps the two alike).
__all__ = [
    # scoring
    "AsyncRewardClient",
    "BaseRewardClient",
    "RetryPolicy",
    "RewardClient",
    "ScoringRequest",
    "ScoringResponse",
    # pushing
    "AdapterConfig",
    "LoraSync",
    "PushResult",
    "Rank0OnlyPublisher",
    "ReplicaEndpoint",
    "RewardModelHandle",
    "RewardModelTrainingMode",
    "TensorPiece",
    "WeightPusher",
    "WeightSyncMode",
    "normalize_params",
    "resolve_sync_mode",
    "select_head",
    # LLM judges
    "GenerativeJudge",
    "JudgeStats",
    "parse_score",
    # RL
    "CreditAssigner",
    "GroupNormalizedAssigner",
    "RewardModelCreditAssigner",
    "RewardModelScorer",
    "RewardRL",
    "Rollout",
    "RolloutStepKey",
    "Step",
    "chat_template_text",
    "combine",
    "make_reward_rl",
    "make_rm_grpo_assigner",
    "make_rm_scalerl_assigner",
    "rollout_text",
    "step_text",
    # reward loop
    "RewardLoop",
    "RewardResult",
    "RewardSample",
    "sample_text",
    # sleep and wake
    "AwakeReplicas",
    "SleepResponse",
    # errors
    "ClientClosedError",
    "ClusterError",
    "CreditAssignmentError",
    "JudgeParseError",
    "RewardClientError",
    "RewardFunctionError",
    "RewardServerError",
    "RewardServerUnavailable",
    "RewardplaneError",
    "RewardplaneTimeout",
    "WeightSyncError",
    "WeightSyncFailed",
    "WeightValidationError",
]

# Names whose modules import torch: loaded on first access (PEP 562).
_LAZY = {
    "WeightPusher": ".push.pusher",
    "Rank0OnlyPublisher": ".push.wire.http",
    "LoraSync": ".lora",
    "TensorPiece": ".push.plan.layout",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name], __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
