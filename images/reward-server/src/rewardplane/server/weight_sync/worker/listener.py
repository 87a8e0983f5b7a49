"""Pushes started from the data plane: a thread of the worker waits for the control plane's go on
the push channel, then joins the ready reduction, receives, reports and joins the commit reduction."""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

import torch

from rewardplane.protocol import PushGo, PushLoaded, PushVerdict
from rewardplane.server.weight_sync.push_channel import COMING, SPIN_S, ChannelClosed, WorkerChannel
from rewardplane.server.weight_sync.worker.receive import Receiver
from rewardplane.server.weight_sync.worker.state import WorkerState
from rewardplane.transport.comm import Communicator
from rewardplane.transport.transfer import Received, receive_buckets

log = logging.getLogger(__name__)


class DataPushListener:
    """The listener thread and one data-plane push at a time."""

    def __init__(self, state: WorkerState, receiver: Receiver) -> None:
        self.state = state
        self.receiver = receiver
        self.slices = receiver.slices
        self.persistence = receiver.persistence
        self.staging = receiver.slices.staging
        self._thread: threading.Thread | None = None
        self._outcome: tuple[int, PushLoaded] | None = None  # the last push's seq and what was reported

    def listen(self, address: str, authkey: bytes) -> bool:
        """Wait, on a thread of this worker, for pushes the control plane lets through (its
        ``PushGo`` over the push channel at ``address``, ``push_channel``); False without a
        communicator. Between pushes the thread is blocked on a socket: no GPU work is pending and
        the GIL is free, so scoring runs as without it."""
        state = self.state
        comm = state.comm
        if comm is None:
            return False
        state.stop_listening()
        stop = threading.Event()
        thread = threading.Thread(
            target=self._loop,
            args=(comm, address, authkey, stop),
            name="rp-push-listener",
            daemon=True,
        )
        self._thread, state.listen_stop = thread, stop
        thread.start()
        return True

    def _loop(self, comm: Communicator, address: str, authkey: bytes, stop: threading.Event) -> None:
        if comm.device.type == "cuda":
            torch.cuda.set_device(comm.device)  # the device is per thread
        try:
            channel = WorkerChannel(address, authkey, comm.rank)
        except Exception as exc:  # the control plane gave up on us: pushes go over HTTP
            log.warning("could not join the push channel (%s); pushes go over HTTP", exc)
            return
        try:
            while True:
                raw = channel.recv(None, stop)
                while raw == COMING:  # a header arrived: the go follows once the push is admitted
                    raw = channel.recv(None, stop, spin_s=SPIN_S)
                if raw is None:
                    return
                go = PushGo.model_validate_json(raw)
                if self.state.comm is not comm or not self._push(comm, channel, go):
                    return
        except ChannelClosed as exc:
            log.info("stopped waiting for pushes: %s", exc)
        except Exception:
            log.exception("the push listener failed; pushes go over HTTP until the group is formed again")
        finally:
            channel.close()

    def _push(self, comm: Communicator, channel: WorkerChannel, go: PushGo) -> bool:
        """One push: the ready reduction, the transfer, the report, the commit reduction. Returns
        whether to wait for the next one (False once the group is unusable)."""
        entered = time.monotonic()
        state, slices = self.state, self.slices
        layout = None if go.error else self.receiver.layout(None, go.bucket_bytes, go.layout_id)
        refusal = go.error or (None if layout else f"layout {go.layout_id} is not cached in this worker")
        if refusal is None and go.sliced:  # the places it was published for still valid, and room to stage
            refusal = slices.problem(comm, go.layout_id) or slices.staging_problem(
                go.layout_id, atomic=not go.apply
            )
        elif refusal is None and layout is not None and not go.apply:  # atomic: is there room to stage it?
            refusal = self.staging.problem(sum(b.nbytes for b in layout[1]))
        got = Received()

        agreed: float | None = None
        ready_posting: float | None = None  # this worker's side of the ready reduction: called,
        ready_posted: float | None = None  # and enqueued

        def report(ok: bool, *, refused: bool = False, error: str | None = None) -> None:
            times = {"worker_in": entered, "worker_out": time.monotonic()}
            if ready_posting is not None and ready_posted is not None:
                times["worker_ready_posting"] = ready_posting
                times["worker_ready_posted"] = ready_posted
            if agreed is not None:
                times["worker_agreed"] = agreed
            if got.posting_at is not None and got.posted_at is not None:
                times["worker_posting"] = got.posting_at
                times["worker_posted"] = got.posted_at
            if got.enqueued_at is not None:
                times["worker_enqueued"] = got.enqueued_at
            partial = got.applied_any and not ok
            msg = PushLoaded(
                ok=ok,
                partial=partial,
                refused=refused,
                bytes=got.bytes,
                in_place_bytes=got.in_place_bytes,
                error=error,
                times=times,
            )
            self._outcome = (go.seq, msg)
            channel.send(msg.model_dump_json().encode())

        try:
            agreement = comm.max_flag(1 if refusal else 0)
        except Exception as exc:  # communication failed: the trainer died or timed out
            if state.comm is comm:
                self.receiver.close()
            report(False, error=str(exc))
            return False
        ready_posting, ready_posted = comm.flag_calling, comm.flag_enqueued
        if agreement != 0:  # every rank agrees before a byte moves
            report(False, refused=True, error=refusal or "another replica refused the push")
            return True
        agreed = time.monotonic()  # the ready reduction is done: every rank accepted
        assert layout is not None
        metas, plan = layout
        self.persistence.start_keeping(go.apply)
        load = self.persistence.load_kept if go.apply else None
        try:
            if go.sliced:
                slices.receive(comm, go.layout_id, metas, got, stage=not go.apply)
            else:
                receive_buckets(
                    comm,
                    metas,
                    go.bucket_bytes,
                    comm.first_sender,
                    load,
                    out=got,
                    plan=plan,
                    place=state.place,
                )
        except Exception as exc:  # communication failed: the trainer died or timed out
            if state.comm is comm:
                self.receiver.close()
            report(False, error=str(exc))
            return False
        if got.error is not None:
            report(False, error=got.error)
        else:
            # before the report: the control plane may apply what was staged as soon as it has it
            state.staged = None if go.apply else got.staged
            slices.staged_layout = None if go.apply or go.sliced else (comm, go.layout_id, metas, plan)
            report(True)
            if go.apply and not go.sliced:
                slices.publish(comm, go.layout_id, metas, plan)
        # the control plane commits (or not) and says so; the trainer learns it in one reduction
        try:
            raw = channel.recv(comm.timeout.total_seconds(), spin_s=SPIN_S)
        except (TimeoutError, ChannelClosed):  # no verdict: the trainer learns of a failure at once
            raw = None
        committed = raw is not None and PushVerdict.model_validate_json(raw).committed
        # False when some replica failed: the trainer forms a new group
        return comm.max_flag(0 if committed else 1) == 0

    def outcome(self, seq: int, timeout_s: float) -> dict[str, Any]:
        """What the listener reported for push ``seq`` (for the control plane when the store is gone);
        waits for it, bounded. Unknown → a failure that may have overwritten weights."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            outcome = self._outcome
            if outcome is not None and outcome[0] == seq:
                return outcome[1].model_dump()
            if self._thread is None or not self._thread.is_alive():
                break
            time.sleep(0.01)
        return PushLoaded(
            ok=False, partial=True, error=f"push {seq}: the worker reported no outcome"
        ).model_dump()
