"""Receiving a push announced over HTTP: joining the trainer's group, and receiving its buckets
(loaded as they arrive, or staged for an atomic swap)."""

from __future__ import annotations

import logging
import time
from typing import Any

from rewardplane.protocol import Bucket, ParamMeta, plan_buckets, remember_layout
from rewardplane.server.weight_sync.worker.slicing import SlicingPart
from rewardplane.transport.comm import create_store, group_store
from rewardplane.transport.group import open_group
from rewardplane.transport.transfer import Received, receive_buckets

log = logging.getLogger(__name__)


class ReceivePart(SlicingPart):
    """The group and the receive of a push announced over HTTP."""

    def rp_init_communicator(
        self,
        host: str,
        port: int,
        world_size: int,
        rank_offset: int,
        backend: str,
        timeout_s: float,
        group_id: str,
        senders: int = 1,
    ) -> int:
        self.rp_close_communicator()
        rank = rank_offset + self.rp_local_rank()
        store = create_store(host, port, is_master=False, world_size=world_size, timeout_s=timeout_s)
        # before the group forms: a trainer that joined it finds every worker's places
        published = self._rp_publish_places(group_store(store, group_id), rank)
        # NCCL or gloo, or the same-host transport where the trainer shares this worker's GPU or host
        self._rp_comm = open_group(
            store,
            rank=rank,
            world_size=world_size,
            device=self.rp_device(),
            backend=backend,  # type: ignore[arg-type]
            timeout_s=timeout_s,
            group_id=group_id,
            senders=senders,
        )
        self._rp_joined_with_places(self._rp_comm, published)
        return rank

    def rp_receive(
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
        layout = self._rp_layout(metadata, bucket_bytes, layout_key)
        if layout is None:
            return {
                "ok": False,
                "partial": False,
                "bytes": 0,
                "unknown_layout": True,
                "error": f"layout {layout_key} is not cached in this worker; send its metadata",
            }
        metas, plan = layout
        comm = self._rp_comm
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
            times = {"worker_in": entered, "worker_posted": got.posted_at, "worker_out": time.monotonic()}
            return {
                "ok": ok,
                "partial": partial,
                "bytes": got.bytes,
                "in_place_bytes": got.in_place_bytes,
                "error": error,
                "times": times,
                "sliced": sliced,
            }

        self._rp_kept = {} if self._rp_keeps() else None
        try:
            if agree_slicing:
                problem = self._rp_sliced_problem(comm, layout_key) or self._rp_sliced_staging_problem(
                    layout_key, atomic=not apply
                )
                if problem is not None:
                    log.debug("this worker asks for a broadcast push of layout %s: %s", layout_key, problem)
                sliced = comm.max_flag(1 if problem else 0) == 0
            if sliced:
                self._rp_receive_sliced(comm, layout_key, metas, got, stage=not apply)
            else:
                receive_buckets(
                    comm,
                    metas,
                    bucket_bytes,
                    src,
                    self._rp_load_kept if apply else None,
                    out=got,
                    plan=plan,
                    place=self.rp_place,
                )
            if comm.max_flag(1 if got.error else 0) != 0 and got.error is None:
                got.error = "another rank failed to load its part of the update"
        except Exception as exc:  # communication failed: the trainer died or timed out
            self.rp_close_communicator()
            return outcome(False, apply and got.applied_any, str(exc))
        if got.error is not None:
            return outcome(False, got.applied_any, got.error)
        self._rp_staged = None if apply else got.staged
        self._rp_staged_layout = None if apply or sliced else (comm, layout_key, metas, plan)
        if apply and not sliced:
            self._rp_publish_slices(comm, layout_key, metas, plan)
        return outcome(True, False, None)

    def _rp_layout(
        self,
        metadata: list[dict[str, Any]] | None,
        bucket_bytes: int,
        layout_key: str,
    ) -> tuple[list[ParamMeta], list[Bucket]] | None:
        """Parsed metadata and bucket plan, cached by the layout's id (the control plane's, which
        covers the bucket size): a trainer pushes the same layout again and again, and re-parsing
        hundreds of entries sits on every push's critical path. None: not cached, no metadata.

        Eviction is ``protocol.remember_layout``'s (first in, first out): ``control_plane`` mirrors
        it to know which layouts it can name by id alone, so every worker of a replica decides alike."""
        cache = self._rp_layouts
        if cache is None:
            cache = self._rp_layouts = {}
        hit = cache.get(layout_key)
        if hit is None:
            if metadata is None:
                return None
            metas = [ParamMeta(**m) for m in metadata]
            hit = (metas, plan_buckets(metas, bucket_bytes))
            remember_layout(cache, layout_key, hit)
        return hit

    def rp_close_communicator(self) -> None:
        self._rp_stop_listening()
        if self._rp_comm is not None:
            self._rp_comm.close()
            self._rp_comm = None
