"""Forming a push group: every rank publishes where it runs, all take the same decision of
transport (``placement.choose_transport``), then build it — NCCL or gloo (``Communicator``), or
the same-host transport (``SameHostCommunicator``)."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from .comm import Backend, Communicator, CommunicatorError, group_store
from .placement import Place, PlacementError, choose_transport, local_place
from .same_host import SameHostCommunicator


def exchange_places(
    store: dist.Store,
    rank: int,
    world_size: int,
    device: torch.device,
    timeout_s: float,
    asked: Backend = "auto",
) -> list[Place]:
    """Every rank's ``Place``, by rank (``store``: the group's namespace); bounded."""
    store.set(f"place/{rank}", local_place(device, asked).to_json())
    keys = [f"place/{r}" for r in range(world_size)]
    try:
        store.wait(keys, timedelta(seconds=timeout_s))
    except Exception as exc:
        missing = [k for k in keys if not store.check([k])]
        raise CommunicatorError(
            f"ranks {[int(k.split('/')[1]) for k in missing]} did not join the group within {timeout_s:.0f}s ({exc})"
        ) from exc
    return [Place.from_json(v) for v in store.multi_get(keys)]


def open_group(
    store: dist.Store,
    *,
    rank: int,
    world_size: int,
    device: torch.device,
    backend: Backend = "auto",
    timeout_s: float = 120.0,
    group_id: str = "default",
    senders: int = 1,
) -> Communicator:
    """Join group ``group_id`` as ``rank`` over the transport its ranks' places call for
    (``backend``: ``auto``, or one asked for: refused with a clear error where it cannot work)."""
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    places = exchange_places(group_store(store, group_id), rank, world_size, device, timeout_s, backend)
    try:
        transport = choose_transport(backend, places)
    except PlacementError as exc:
        raise CommunicatorError(str(exc)) from exc
    common: dict[str, Any] = {
        "rank": rank,
        "world_size": world_size,
        "device": device,
        "timeout_s": timeout_s,
        "group_id": group_id,
        "senders": senders,
    }
    if transport == "ipc":
        return SameHostCommunicator(store, places=places, **common)
    return Communicator(store, backend=transport, **common)
