"""Small messages through a group's TCPStore: how a push started from the data plane begins and
ends (``protocol.PushKeys``; docs/weight-sync.md). The store is the trainer's rendezvous, which
every server reaches already; a blocked wait on it holds no GPU resource and no GIL."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from datetime import timedelta

import torch.distributed as dist
from pydantic import BaseModel

from .comm import create_store

# A wait between pushes is cut into slices this long (a stop is noticed at the latest then; each
# slice that times out makes torch log a warning, so not shorter).
IDLE_SLICE_S = 30.0


class StoreClosed(RuntimeError):
    """The store's host (the trainer) is gone: nothing more can arrive."""


def group_store(host: str, port: int, group_id: str, timeout_s: float) -> dist.Store:
    """A client of the trainer's store, in the group's namespace (the one ``Communicator`` uses)."""
    client = create_store(host, port, is_master=False, world_size=None, timeout_s=timeout_s)
    return dist.PrefixStore(f"rewardplane/{group_id}/", client)


def wait_slices(
    timeout_s: float | None, stop: threading.Event | None, slice_s: float, what: str
) -> Iterator[float]:
    """How long each attempt of a stoppable, bounded wait may block: slices of at most ``slice_s``
    until ``stop`` is set (the caller then gives up quietly). Raises ``TimeoutError`` ("``what``
    within ...") once ``timeout_s`` has passed (None: no bound)."""
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    while stop is None or not stop.is_set():
        left = slice_s if deadline is None else min(slice_s, deadline - time.monotonic())
        if left <= 0:
            raise TimeoutError(f"{what} within {timeout_s:g}s")
        yield left


def wait_value(
    store: dist.Store, key: str, timeout_s: float | None, stop: threading.Event | None = None
) -> bytes | None:
    """The value of ``key`` once it is set. None: ``stop`` was set. Raises ``TimeoutError`` after
    ``timeout_s`` (None: wait until stopped), ``StoreClosed`` when the store's host is gone."""
    for left in wait_slices(timeout_s, stop, IDLE_SLICE_S, f"nothing arrived under {key!r}"):
        try:
            store.wait([key], timedelta(seconds=left))
        except dist.DistNetworkError as exc:
            raise StoreClosed(f"the trainer's store is gone ({exc})") from exc
        except dist.DistStoreError:
            continue  # this slice timed out
        try:
            return bytes(store.get(key))
        except dist.DistNetworkError as exc:
            raise StoreClosed(f"the trainer's store is gone ({exc})") from exc
    return None


def put(store: dist.Store, key: str, message: BaseModel | str) -> None:
    """Write one message (a protocol model as JSON). Raises ``StoreClosed`` when the host is gone."""
    value = message if isinstance(message, str) else message.model_dump_json()
    try:
        store.set(key, value)
    except dist.DistError as exc:
        raise StoreClosed(f"the trainer's store is gone ({exc})") from exc
