"""The push channel between a replica's control plane and its workers (real Unix sockets): each
worker joins with its rank, messages go both ways as bytes, a stranger without the key is not
taken, a worker that never joins is named, and closing either end ends the other's wait."""

from __future__ import annotations

import threading
from multiprocessing.connection import Client

import pytest

from rewardplane.server.weight_sync.push_channel import ChannelClosed, ChannelHub, WorkerChannel


def join(hub: ChannelHub, ranks: list[int]) -> dict[int, WorkerChannel]:
    workers: dict[int, WorkerChannel] = {}

    def connect(rank: int) -> None:
        workers[rank] = WorkerChannel(hub.address, hub.authkey, rank)

    threads = [threading.Thread(target=connect, args=(r,)) for r in ranks]
    for t in threads:
        t.start()
    hub.accept(ranks, timeout_s=10)
    for t in threads:
        t.join(10)
    return workers


def test_messages_reach_the_worker_of_each_rank_and_come_back() -> None:
    hub = ChannelHub()
    workers = join(hub, [4, 5])
    try:
        hub.send(5, b"go-5")
        hub.send(4, b"go-4")
        assert workers[4].recv(5) == b"go-4"
        assert workers[5].recv(5) == b"go-5"
        workers[5].send(b"loaded-5")
        assert hub.recv(5, 5) == b"loaded-5"
        with pytest.raises(TimeoutError):
            hub.recv(4, 0.05)  # rank 4 sent nothing
    finally:
        hub.close()


def test_a_connection_without_the_key_is_not_taken() -> None:
    hub = ChannelHub()
    stranger_failed = threading.Event()

    def stranger() -> None:
        try:
            Client(hub.address, family="AF_UNIX", authkey=b"not the key").send_bytes(b"1")
        except Exception:
            stranger_failed.set()

    t = threading.Thread(target=stranger)
    t.start()
    workers = join(hub, [1])  # the real worker of rank 1 is still taken after the stranger
    t.join(10)
    try:
        assert stranger_failed.is_set()
        hub.send(1, b"go")
        assert workers[1].recv(5) == b"go"
    finally:
        hub.close()


def test_a_worker_that_never_joins_is_named() -> None:
    hub = ChannelHub()
    with pytest.raises(TimeoutError, match=r"ranks \[3\]"):
        hub.accept([3], timeout_s=0.2)
    hub.close()


def test_closing_the_hub_ends_a_waiting_worker_and_a_stop_flag_ends_its_wait() -> None:
    hub = ChannelHub()
    worker = join(hub, [0])[0]
    stop = threading.Event()
    stop.set()
    assert worker.recv(None, stop) is None  # a stop flag: no message, no error
    hub.close()
    with pytest.raises(ChannelClosed):
        worker.recv(5)
    with pytest.raises(ChannelClosed):
        worker.send(b"loaded")


def test_a_worker_that_dies_ends_the_hubs_wait() -> None:
    hub = ChannelHub()
    worker = join(hub, [2])[2]
    worker.close()
    with pytest.raises(ChannelClosed):
        hub.recv(2, 5)
    hub.close()


def test_a_polling_wait_takes_a_message_within_or_after_its_spin_and_sees_a_close() -> None:
    """Waits inside a push poll before they block: a message sent during the poll or after it is
    taken, with the timeout still bounding the wait; a closed channel ends it either way."""
    hub = ChannelHub()
    workers = join(hub, [0])
    try:
        late = threading.Timer(0.05, hub.send, args=(0, b"after the spin"))
        late.start()
        assert workers[0].recv(5, spin_s=0.01) == b"after the spin"
        soon = threading.Timer(0.005, hub.send, args=(0, b"during the spin"))
        soon.start()
        assert workers[0].recv(5, spin_s=1.0) == b"during the spin"
        with pytest.raises(TimeoutError):
            workers[0].recv(0.05, spin_s=0.01)
    finally:
        hub.close()
    with pytest.raises(ChannelClosed):
        workers[0].recv(5, spin_s=0.01)
