"""The trainer's end of a push to servers on this host, as the tests and benchmarks open one."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from rewardplane.testing.servers import free_port

if TYPE_CHECKING:
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
