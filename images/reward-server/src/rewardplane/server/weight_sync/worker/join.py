"""Joining the trainer's group without blocking the worker: the rendezvous runs on a thread of its
own, the control plane polls it, and an attempt it gives up on (timed out or cancelled) is
abandoned here.

The rendezvous (TCPStore connect, process-group creation) is bounded by the join's ``timeout_s``
in torch's C++ code, but it overruns it (twice over for a store nobody serves) and a peer that
accepts the connection and never answers can hold it longer still; nothing can interrupt it. So a
join never waits on that thread: ``rp_join_start`` returns at once (a vLLM worker keeps serving its
engine), ``rp_join_poll`` reports, and ``rp_join_abandon`` forgets the attempt. A thread of an
abandoned attempt that forms its group after all closes it instead of installing it (the
``_rp_comm`` setter below), so it can never replace the group of a later join."""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any

from rewardplane.server.weight_sync.worker.receive import ReceivePart
from rewardplane.transport.comm import Communicator

# On a join's thread: the attempt it works for (unset on every other thread).
_join_thread = threading.local()


@dataclass
class _Attempt:
    id: str
    done: bool = False
    rank: int | None = None
    error: str | None = None
    abandoned: bool = False


class JoinPart(ReceivePart):
    """``rp_join_start`` / ``rp_join_poll`` / ``rp_join_abandon``: one join attempt at a time."""

    _rp_attempt: _Attempt | None = None
    _rp_join_lock = threading.Lock()  # one lock for every worker of the process: joins are rare
    _rp_comm_held: Communicator | None = None

    @property
    def _rp_comm(self) -> Communicator | None:
        return self._rp_comm_held

    @_rp_comm.setter
    def _rp_comm(self, comm: Communicator | None) -> None:
        attempt_id = getattr(_join_thread, "attempt", None)
        with self._rp_join_lock:
            current = self._rp_attempt
            stale = attempt_id is not None and (
                current is None or current.id != attempt_id or current.abandoned
            )
            if not stale:
                self._rp_comm_held = comm
                return
        if comm is not None:  # an abandoned join formed its group late: nobody will use it
            comm.close()

    def rp_join_start(
        self,
        attempt_id: str,
        host: str,
        port: int,
        world_size: int,
        rank_offset: int,
        backend: str,
        timeout_s: float,
        group_id: str,
        senders: int = 1,
    ) -> None:
        """Start joining on a daemon thread and return; an earlier attempt still running is abandoned."""
        attempt = _Attempt(attempt_id)
        self.rp_close_communicator()  # here, not on the thread: a late thread must not close a newer group
        with self._rp_join_lock:
            if self._rp_attempt is not None:
                self._rp_attempt.abandoned = True
            self._rp_attempt = attempt

        def run() -> None:
            _join_thread.attempt = attempt_id
            try:
                attempt.rank = self.rp_init_communicator(
                    host, port, world_size, rank_offset, backend, timeout_s, group_id, senders
                )
            except Exception as exc:
                attempt.error = str(exc)
            finally:
                attempt.done = True

        threading.Thread(target=run, name=f"rp-join-{group_id}", daemon=True).start()

    def rp_join_poll(self, attempt_id: str) -> dict[str, Any]:
        """``done`` with ``rank`` or ``error``; an unknown or abandoned attempt is done and failed."""
        attempt = self._rp_attempt
        if attempt is None or attempt.id != attempt_id or attempt.abandoned:
            return {"done": True, "rank": None, "error": f"join {attempt_id} was abandoned"}
        return {"done": attempt.done, "rank": attempt.rank, "error": attempt.error}

    def rp_join_abandon(self, attempt_id: str) -> bool:
        """Forget the attempt (given up on by the control plane): a group it formed is left, and one
        it forms later is closed at once. True if it was still running."""
        with self._rp_join_lock:
            attempt = self._rp_attempt
            if attempt is None or attempt.id != attempt_id:
                return False
            attempt.abandoned = True
            running = not attempt.done
        if not running and attempt.error is None:
            self.rp_close_communicator()  # formed here, but not everywhere in time: leave it
        return running
