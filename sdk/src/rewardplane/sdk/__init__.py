"""rewardplane's trainer-side SDK: score rollouts, push weights, follow the cluster.

Scoring needs only pydantic and httpx; weight pushes need torch (extra ``train``).
"""

from rewardplane.protocol import (
    PoolingType,
    RewardModelTrainingMode,
    ScoringRequest,
    ScoringResponse,
    derive_ports,
    replica_group_port,
)
from rewardplane.protocol.auth import resolve_token
from rewardplane.protocol.naming import normalize_params, select_head
from rewardplane.sdk.chunking import contiguous_chunks, reassemble
from rewardplane.sdk.client import VLLMRewardClient
from rewardplane.sdk.cluster import PushResult, RewardModelHandle, WeightSyncFailed
from rewardplane.sdk.retry import RetryPolicy, RewardClientError, RewardServerError, RewardServerUnavailable
from rewardplane.sdk.reward_client_protocol import RewardModelClient

__all__ = [
    "PoolingType",
    "PushResult",
    "RetryPolicy",
    "RewardClientError",
    "RewardModelClient",
    "RewardModelHandle",
    "RewardModelTrainingMode",
    "RewardServerError",
    "RewardServerUnavailable",
    "ScoringRequest",
    "ScoringResponse",
    "VLLMRewardClient",
    "WeightSyncFailed",
    "contiguous_chunks",
    "create_reward_publisher",
    "derive_ports",
    "normalize_params",
    "reassemble",
    "replica_group_port",
    "resolve_token",
    "select_head",
]


def create_reward_publisher(
    client: VLLMRewardClient, head_name_patterns: list[str] | None = None, rank0_only: bool = False
):  # -> RewardModelPublisher | Rank0OnlyPublisher
    """A publisher over the client's servers. ``rank0_only`` for multi-process
    learners: only rank 0 joins the communicator and pushes, fenced by barriers."""
    from rewardplane.sdk.publisher import Rank0OnlyPublisher

    def make():  # noqa: ANN202 - RewardModelPublisher, imported lazily (torch)
        publisher = client.create_reward_publisher()
        if head_name_patterns:
            publisher.head_name_patterns = tuple(head_name_patterns)
        return publisher

    return Rank0OnlyPublisher(make) if rank0_only else make()
