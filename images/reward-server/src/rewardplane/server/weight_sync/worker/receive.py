"""Receiving a push announced over HTTP: joining the trainer's group, and receiving its buckets
(loaded as they arrive, or staged for an atomic swap)."""

from __future__ import annotations

import logging
import time
from typing import Any

from rewardplane.protocol import Bucket, ParamMeta, plan_buckets, remember_layout
from rewardplane.server.weight_sync.worker.group import GroupJoin, open_communicator
from rewardplane.server.weight_sync.worker.persistence import Persistence
from rewardplane.server.weight_sync.worker.slices import Slices
from rewardplane.server.weight_sync.worker.state import WorkerState
from rewardplane.transport.transfer import Received, receive_buckets

log = logging.getLogger(__name__)


class Receiver:
    """The group and the receive of a push announced over HTTP."""

    def __init__(self, state: WorkerState, persistence: Persistence, slices: Slices) -> None:
        self.state = state
        self.persistence = persistence
        self.slices = slices
        # Parsed layouts by key; made per worker, never shared.
        self._layouts: dict[str, tuple[list[ParamMeta], list[Bucket]]] = {}

    def join(self, join: GroupJoin) -> int:
        """Leave any group, join ``join``'s; this worker's rank in it."""
        self.close()
        state = self.state
        rank = join.rank_offset + state.host.local_rank()
        comm, published = open_communicator(
            join, rank, state.host.device(), lambda store: self.slices.publish_places(store, rank)
        )
        state.comm = comm
        self.slices.joined(comm, published)
        return rank

    def receive(
        self,
        metadata: list[dict[str, Any]] | None,
        bucket_bytes: int,
        apply: bool,
        layout_key: str,
        agree_slicing: bool = False,
    ) -> dict[str, Any]:
        """Receive every bucket. ``apply``: load each as it arrives (streamed); else stage them all.
        ``agree_slicing``: first agree with every rank whether the push is sliced (this worker
        agrees when it published its places of the layout in this group and has room to stage
        its share); sliced, it receives only its slices.

        ``metadata`` may be None for a layout this worker received before (``layout_key``); if it
        does not hold it, it answers ``unknown_layout`` at once, before posting any receive, and the
        control plane calls again with the metadata.

        A rank whose load fails keeps receiving (so the trainer's broadcast is not left hanging),
        then reports failure in the final status reduction that every rank and the trainer join.
        """
        entered = time.monotonic()
        layout = self.layout(metadata, bucket_bytes, layout_key)
        if layout is None:
            return {
                "ok": False,
                "partial": False,
                "bytes": 0,
                "unknown_layout": True,
                "error": f"layout {layout_key} is not cached in this worker; send its metadata",
            }
        metas, plan = layout
        state, slices = self.state, self.slices
        comm = state.comm
        if comm is None:
            return {
                "ok": False,
                "partial": False,
                "bytes": 0,
                "error": "no communicator: call /init_communicator first",
            }
        src = comm.first_sender
        got = Received()

        sliced = False

        def outcome(ok: bool, partial: bool, error: str | None) -> dict[str, Any]:
            # monotonic stamps (one clock for every process of the host) for the update's timeline
            times = {
                "worker_in": entered,
                "worker_posted": got.posted_at,
                "worker_enqueued": got.enqueued_at,
                "worker_out": time.monotonic(),
            }
            return {
                "ok": ok,
                "partial": partial,
                "bytes": got.bytes,
                "in_place_bytes": got.in_place_bytes,
                "error": error,
                "times": times,
                "sliced": sliced,
            }

        self.persistence.start_keeping()
        try:
            if agree_slicing:
                problem = slices.problem(comm, layout_key) or slices.staging_problem(
                    layout_key, atomic=not apply
                )
                if problem is not None:
                    log.debug("this worker asks for a broadcast push of layout %s: %s", layout_key, problem)
                sliced = comm.max_flag(1 if problem else 0) == 0
            if sliced:
                slices.receive(comm, layout_key, metas, got, stage=not apply)
            else:
                receive_buckets(
                    comm,
                    metas,
                    bucket_bytes,
                    src,
                    self.persistence.load_kept if apply else None,
                    out=got,
                    plan=plan,
                    place=state.place,
                )
            if comm.max_flag(1 if got.error else 0) != 0 and got.error is None:
                got.error = "another rank failed to load its part of the update"
        except Exception as exc:  # communication failed: the trainer died or timed out
            self.close()
            return outcome(False, apply and got.applied_any, str(exc))
        if got.error is not None:
            return outcome(False, got.applied_any, got.error)
        state.staged = None if apply else got.staged
        slices.staged_layout = None if apply or sliced else (comm, layout_key, metas, plan)
        if apply and not sliced:
            slices.publish(comm, layout_key, metas, plan)
        return outcome(True, False, None)

    def layout(
        self,
        metadata: list[dict[str, Any]] | None,
        bucket_bytes: int,
        layout_key: str,
    ) -> tuple[list[ParamMeta], list[Bucket]] | None:
        """Parsed metadata and bucket plan, cached by the layout's id (the control plane's, which
        covers the bucket size): a trainer pushes the same layout again and again, and re-parsing
        hundreds of entries sits on every push's critical path. None: not cached, no metadata.

        Eviction is ``protocol.remember_layout``'s (first in, first out): the control plane mirrors
        it to know which layouts it can name by id alone, so every worker of a replica decides alike."""
        hit = self._layouts.get(layout_key)
        if hit is None:
            if metadata is None:
                return None
            metas = [ParamMeta(**m) for m in metadata]
            hit = (metas, plan_buckets(metas, bucket_bytes))
            remember_layout(self._layouts, layout_key, hit)
        return hit

    def close(self) -> None:
        """Leave the group (and stop waiting for pushes from it)."""
        state = self.state
        state.stop_listening()
        if state.comm is not None:
            state.comm.close()
            state.comm = None
