"""How a worker joins the trainer's group: the one place its communicator is built, from the
join's arguments. A transport (``backend``) other than torch.distributed's NCCL and gloo is
added here."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import torch

from rewardplane.transport.comm import Communicator, create_store, group_store
from rewardplane.transport.group import open_group

T = TypeVar("T")


@dataclass(frozen=True)
class GroupJoin:
    """A join of the trainer's group, as the control plane asked for it (``/init_communicator``)."""

    host: str  # the trainer's rendezvous (its TCPStore)
    port: int
    world_size: int
    rank_offset: int  # this replica's first rank; a worker's rank adds its own local rank
    backend: str
    timeout_s: float
    group_id: str
    senders: int = 1  # the trainer's sending ranks, the group's last ones


def open_communicator(
    join: GroupJoin, rank: int, device: torch.device, before_forming: Callable[[Any], T]
) -> tuple[Communicator, T]:
    """Reach the trainer's rendezvous, call ``before_forming`` with the group's namespace of its
    store (what this worker publishes there before the group forms: a trainer that joined it finds
    every worker's places), then form the group as ``rank``. Returns the communicator and what
    ``before_forming`` returned. Raises ``CommunicatorError`` naming what to check."""
    store = create_store(
        join.host, join.port, is_master=False, world_size=join.world_size, timeout_s=join.timeout_s
    )
    published = before_forming(group_store(store, join.group_id))
    # NCCL or gloo, or the same-host transport where the trainer shares this worker's GPU or host
    comm = open_group(
        store,
        rank=rank,
        world_size=join.world_size,
        device=device,
        backend=join.backend,  # type: ignore[arg-type]
        timeout_s=join.timeout_s,
        group_id=join.group_id,
        senders=join.senders,
    )
    return comm, published
