"""Joining the trainer's group without blocking the worker: the rendezvous runs on a thread of its
own, the control plane polls it, and an attempt it gives up on (timed out or cancelled) is
abandoned here.

The rendezvous (TCPStore connect, process-group creation) is bounded by the join's ``timeout_s``
in torch's C++ code, but it overruns it (twice over for a store nobody serves) and a peer that
accepts the connection and never answers can hold it longer still; nothing can interrupt it. So a
join never waits on that thread: ``start`` returns at once (a vLLM worker keeps serving its
engine), ``poll`` reports, and ``abandon`` forgets the attempt. A thread of an abandoned attempt
that forms its group after all closes it instead of installing it (``WorkerState.comm``)."""

from __future__ import annotations

import threading
from typing import Any

from rewardplane.server.weight_sync.worker.group import GroupJoin
from rewardplane.server.weight_sync.worker.receive import Receiver
from rewardplane.server.weight_sync.worker.state import JOIN_LOCK, JoinAttempt, WorkerState, join_thread


class Joins:
    """One join attempt at a time."""

    def __init__(self, state: WorkerState, receiver: Receiver) -> None:
        self.state = state
        self.receiver = receiver

    def start(self, attempt_id: str, join: GroupJoin) -> None:
        """Start joining on a daemon thread and return; an earlier attempt still running is abandoned."""
        attempt = JoinAttempt(attempt_id)
        state = self.state
        self.receiver.close()  # here, not on the thread: a late thread must not close a newer group
        with JOIN_LOCK:
            if state.attempt is not None:
                state.attempt.abandoned = True
            state.attempt = attempt

        def run() -> None:
            join_thread.attempt = attempt_id
            try:
                attempt.rank = self.receiver.join(join)
            except Exception as exc:
                attempt.error = str(exc)
            finally:
                attempt.done = True

        threading.Thread(target=run, name=f"rp-join-{join.group_id}", daemon=True).start()

    def poll(self, attempt_id: str) -> dict[str, Any]:
        """``done`` with ``rank`` or ``error``; an unknown or abandoned attempt is done and failed."""
        attempt = self.state.attempt
        if attempt is None or attempt.id != attempt_id or attempt.abandoned:
            return {"done": True, "rank": None, "error": f"join {attempt_id} was abandoned"}
        return {"done": attempt.done, "rank": attempt.rank, "error": attempt.error}

    def abandon(self, attempt_id: str) -> bool:
        """Forget the attempt (given up on by the control plane): a group it formed is left, and one
        it forms later is closed at once. True if it was still running."""
        with JOIN_LOCK:
            attempt = self.state.attempt
            if attempt is None or attempt.id != attempt_id:
                return False
            attempt.abandoned = True
            running = not attempt.done
        if not running and attempt.error is None:
            self.receiver.close()  # formed here, but not everywhere in time: leave it
        return running
