"""The local channel between a replica's control plane and its workers, for pushes started from
the data plane.

What crosses hosts (the trainer's header, the verdicts the trainer reads on a refusal) goes through
the trainer's store. The control plane and its workers share a pod, and the three signals between
them on every push's critical path (go, loaded, verdict) each cost a write and a wake-up plus read
through the trainer's store otherwise. Here they go over a Unix socket in the abstract namespace
(no file, no path-length limit), opened with a one-time key (``multiprocessing.connection``'s
challenge), carrying the protocol's JSON messages as bytes — nothing is unpickled.
"""

from __future__ import annotations

import secrets
import threading
import time
import uuid
from multiprocessing.connection import Client, Connection, Listener

from rewardplane.transport.signals import wait_slices

# What the control plane sends its workers the moment a trainer's header arrives, before it admits
# the push: they wake now and poll for the go (``SPIN_S``) instead of paying a wake-up after it.
COMING = b"coming"
# How often a blocked wait looks at its stop flag (seconds).
IDLE_SLICE_S = 1.0
# How long a wait inside a push polls before it blocks (seconds). A blocked thread's wake-up cost
# 0.2-0.4 ms per hop on the H100 hosts measured (docs/weight-sync.md), several times per push;
# polling holds no lock (``time.sleep(0)`` lets other threads run) and ends with the wait.
SPIN_S = 5e-3


class ChannelClosed(RuntimeError):
    """The other side closed the channel (stopped listening, or its process died)."""


def _recv(
    conn: Connection, timeout_s: float | None, stop: threading.Event | None = None, spin_s: float = 0.0
) -> bytes | None:
    """The next message; None when ``stop`` was set. Raises ``TimeoutError``, ``ChannelClosed``.
    ``spin_s``: poll that long first (a message expected within it), then block."""
    try:
        if spin_s > 0:
            end = time.monotonic() + spin_s
            while not conn.poll(0):
                if time.monotonic() > end:
                    break
                time.sleep(0)
            else:
                return conn.recv_bytes()
    except (EOFError, OSError) as exc:
        raise ChannelClosed(f"the push channel closed ({type(exc).__name__})") from exc
    for left in wait_slices(timeout_s, stop, IDLE_SLICE_S, "no message"):
        try:
            if conn.poll(left):
                return conn.recv_bytes()
        except (EOFError, OSError) as exc:
            raise ChannelClosed(f"the push channel closed ({type(exc).__name__})") from exc
    return None


def _send(conn: Connection, message: bytes) -> None:
    try:
        conn.send_bytes(message)
    except (EOFError, OSError) as exc:
        raise ChannelClosed(f"the push channel closed ({type(exc).__name__})") from exc


class ChannelHub:
    """The control plane's end: listens, then takes each worker's connection (tagged with its rank)."""

    def __init__(self) -> None:
        self.address = f"\0rewardplane-push-{uuid.uuid4().hex}"
        self.authkey = secrets.token_bytes(32)
        self._listener = Listener(self.address, family="AF_UNIX", authkey=self.authkey)
        self._conns: dict[int, Connection] = {}
        self._gave_up = threading.Event()

    def accept(self, ranks: list[int], timeout_s: float) -> None:
        """Take the connections of the workers of ``ranks`` (each connects from its listener
        thread), then stop listening. Raises ``TimeoutError`` naming the missing ranks."""

        def give_up() -> None:  # an accept cannot time out: wake it with a connection of our own
            self._gave_up.set()
            try:
                Client(self.address, family="AF_UNIX", authkey=self.authkey).close()
            except Exception:
                pass

        timer = threading.Timer(timeout_s, give_up)
        timer.daemon = True
        timer.start()
        try:
            while any(r not in self._conns for r in ranks):
                try:
                    conn = self._listener.accept()
                except Exception:  # a peer without the key: not one of ours
                    continue
                if self._gave_up.is_set():
                    conn.close()
                    missing = [r for r in ranks if r not in self._conns]
                    raise TimeoutError(
                        f"workers of ranks {missing} did not connect to the push channel within {timeout_s:g}s"
                    )
                try:
                    rank = int(_recv(conn, timeout_s) or b"")
                except (TimeoutError, ChannelClosed, ValueError):
                    conn.close()
                    continue
                self._conns[rank] = conn
        finally:
            timer.cancel()
            self._listener.close()

    def send(self, rank: int, message: bytes) -> None:
        _send(self._conns[rank], message)

    def recv(self, rank: int, timeout_s: float | None, spin_s: float = 0.0) -> bytes:
        got = _recv(self._conns[rank], timeout_s, spin_s=spin_s)
        assert got is not None  # no stop flag here
        return got

    def close(self) -> None:
        """The workers' waits end (``ChannelClosed``)."""
        self._listener.close()
        for conn in self._conns.values():
            conn.close()


class WorkerChannel:
    """A worker's end."""

    def __init__(self, address: str, authkey: bytes, rank: int) -> None:
        self._conn = Client(address, family="AF_UNIX", authkey=authkey)
        _send(self._conn, str(rank).encode())

    def send(self, message: bytes) -> None:
        _send(self._conn, message)

    def recv(
        self, timeout_s: float | None, stop: threading.Event | None = None, spin_s: float = 0.0
    ) -> bytes | None:
        return _recv(self._conn, timeout_s, stop, spin_s)

    def close(self) -> None:
        self._conn.close()
