"""Pushes between processes on this host, as the tests and benchmarks start them: the trainer's
pusher, and the operator's restore of a fresh replica from a peer."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from rewardplane.testing.servers import free_port

if TYPE_CHECKING:
    from rewardplane.operator.replicas import Replicas
    from rewardplane.sdk.push.pusher import WeightPusher


def loopback_pusher(
    urls: Sequence[str], token: str, *, group_port: int | None = None, **options: Any
) -> WeightPusher:
    """A ``WeightPusher`` to the servers at ``urls`` whose trainer listens on the loopback address.

    ``group_port``: the trainer's rendezvous port, a free one unless given (the ranks of one trainer
    group agree on theirs). ``options``: the pusher's other keywords (device, bucket size,
    timeouts). The pusher module is imported on call: it imports torch."""
    from rewardplane.sdk.push.pusher import WeightPusher

    return WeightPusher(
        list(urls),
        group_port=free_port() if group_port is None else group_port,
        token=token,
        trainer_host="127.0.0.1",
        **options,
    )


def loopback_peer_restore(
    replicas: Replicas,
    token: str,
    source_url: str,
    receiver_url: str,
    *,
    version: int,
    timeout_s: float,
    group_id: str,
) -> None:
    """The operator's peer restore (``restore_from_peer``) of ``version`` from the replica at
    ``source_url`` into one fresh replica of one worker at ``receiver_url``, both on this host: the
    source hosts the rendezvous on a free loopback port."""
    from rewardplane.operator.replicas import Receiver, restore_from_peer

    restore_from_peer(
        replicas,
        token,
        source_url=source_url,
        source_host="127.0.0.1",
        port=free_port(),
        receivers=[Receiver("fresh", receiver_url, 1)],
        version=version,
        timeout_s=timeout_s,
        group_id=group_id,
    )
