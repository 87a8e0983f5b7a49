"""A trainer that gives up on a push aborts its group: over a real gloo group (two ranks, one
process), a peer blocked in a broadcast from it fails at once, long before the group's timeout,
and the aborted communicator names what happened if it is used again."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from rewardplane.testing.servers import free_port
from rewardplane.transport.comm import Communicator, CommunicatorError, create_store

GROUP_TIMEOUT_S = 60.0


def _pair() -> tuple[Communicator, Communicator]:
    port = free_port()
    comms: dict[int, Communicator] = {}

    def rank(r: int) -> None:
        store = create_store("127.0.0.1", port, is_master=r == 1, world_size=2, timeout_s=30)
        comms[r] = Communicator(
            store, rank=r, world_size=2, device=torch.device("cpu"), backend="gloo", timeout_s=GROUP_TIMEOUT_S
        )

    threads = [threading.Thread(target=rank, args=(r,)) for r in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert set(comms) == {0, 1}, "the group did not form"
    return comms[0], comms[1]


def test_a_peer_waiting_on_an_aborted_trainer_fails_at_once() -> None:
    replica, trainer = _pair()
    failed: list[BaseException] = []
    took: list[float] = []

    def receive() -> None:
        start = time.monotonic()
        try:
            replica.broadcast(torch.zeros(8), src=1)  # the trainer (rank 1) never sends
        except BaseException as exc:
            failed.append(exc)
        took.append(time.monotonic() - start)

    waiting = threading.Thread(target=receive)
    waiting.start()
    time.sleep(0.5)  # the replica is in its broadcast
    trainer.abort()
    waiting.join(GROUP_TIMEOUT_S + 10)
    assert failed, "the broadcast returned although the trainer sent nothing"
    # the group's timeout is 60 s: a peer that only noticed at its timeout would take that long
    assert took[0] < GROUP_TIMEOUT_S / 4, f"the peer noticed the abort after {took[0]:.1f}s"
    with pytest.raises(CommunicatorError, match="closed or aborted"):
        trainer.broadcast(torch.zeros(8), src=1)
    replica.abort()
