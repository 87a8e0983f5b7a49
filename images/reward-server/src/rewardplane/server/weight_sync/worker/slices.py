"""The receiving side of sliced pushes (``protocol.slices``): after a push of a layout went through
the model's loader (streamed, or an atomic push applied under the lock), this worker knows what it
keeps of every tensor and where (the copy plan), and publishes that in the group's store; the
trainer then sends it only those bytes on the next pushes of that layout: into its parameters as
they arrive (streamed), or into tensors shaped like its slices, copied into the parameters when the
control plane swaps under the scoring lock (atomic)."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import torch

from rewardplane.protocol import Bucket, ParamMeta, remember_layout
from rewardplane.protocol.slices import (
    Region,
    Transfer,
    needs_key,
    needs_to_json,
    slice_schedule,
    transfer_bytes,
)
from rewardplane.server.weight_sync.staging import GIB, SMALLER_FRACTION
from rewardplane.server.weight_sync.worker.persistence import Persistence
from rewardplane.server.weight_sync.worker.staging import Staging
from rewardplane.server.weight_sync.worker.state import WorkerState
from rewardplane.transport.comm import Communicator
from rewardplane.transport.slices import IN_FLIGHT, receive_slices
from rewardplane.transport.transfer import Received

log = logging.getLogger(__name__)


@dataclass
class _Kept:
    regions: list[Region | None]  # what this worker keeps of each tensor of the layout
    views: list[torch.Tensor]  # the parameter view each lands in
    schedule: list[list[Transfer]]  # this worker's transfers of a sliced push, per bucket
    bucket_bytes: int  # the most this worker receives of one bucket (the wire stages up to that)


@dataclass
class _Places:
    """What this worker keeps of a layout and where, whatever group it is in: published again
    into each group it joins, until its parameters move."""

    regions: list[Region | None]
    views: list[torch.Tensor]
    metas: list[ParamMeta]
    plan: list[Bucket]


@dataclass
class _StagedSlices:
    """An atomic sliced push received: each parameter view with what goes into it at the swap."""

    pairs: list[tuple[torch.Tensor, torch.Tensor]]
    metas: list[ParamMeta]  # the layout's tensors, in the pairs' order
    regions: list[Region | None]  # what of each the pair holds
    void: str | None = None  # why it can no longer be applied (the parameters moved)


class Slices:
    """Publishing what this worker keeps of a layout, and receiving a sliced push of it."""

    def __init__(self, state: WorkerState, persistence: Persistence, staging: Staging) -> None:
        self.state = state
        self.persistence = persistence
        self.staging = staging
        # layout id -> what was published of it, in the group ``slices_comm``
        self.slices: dict[str, _Kept] | None = None
        self.slices_comm: Communicator | None = None  # the group they were published in
        # layout id -> this worker's places of it (any group): a group formed later gets them at its join
        self.places: dict[str, _Places] | None = None
        self.staged_slices: _StagedSlices | None = None  # an atomic sliced push, until the swap
        # an atomic push staged whole (group, layout, its metadata and buckets): once it is applied
        # through the loader, this worker publishes its slices of that layout
        self.staged_layout: tuple[Communicator, str, list[ParamMeta], list[Bucket]] | None = None

    def publish(
        self, comm: Communicator, layout_key: str, metas: list[ParamMeta], plan: list[Bucket]
    ) -> None:
        """After a streamed push of ``layout_key`` loaded every tensor: publish what this worker
        keeps of each, where every tensor has one place in the parameters."""
        if self.slices_comm is not comm:
            self.slices, self.slices_comm = {}, comm
        slices = self.slices
        assert slices is not None
        if layout_key in slices:
            return
        kept = [self.state.host.slice_of(m.name) for m in metas]
        if any(k is None for k in kept):
            return
        places = _Places(
            [k[0] for k in kept if k is not None], [k[1] for k in kept if k is not None], metas, plan
        )
        if self.places is None:
            self.places = {}
        remember_layout(self.places, layout_key, places)  # bounded, like the layouts themselves
        published = _publish(comm.store, comm.rank, layout_key, places)
        if published is not None:
            slices[layout_key] = published

    def publish_places(self, store: Any, rank: int) -> dict[str, _Kept]:
        """Joining a group as ``rank``: publish the places of every layout this worker learned in
        an earlier group into the new group's store, before the group forms (so a trainer that
        joined it finds them: pushes through the operator form a group per push). Returns what was
        published, to record once the group is formed (``joined``)."""
        if not self.places:
            return {}
        out: dict[str, _Kept] = {}
        for layout_key, places in self.places.items():
            published = _publish(store, rank, layout_key, places)
            if published is None:
                break
            out[layout_key] = published
        return out

    def joined(self, comm: Communicator, published: dict[str, _Kept]) -> None:
        self.slices, self.slices_comm = dict(published), comm

    def forget_places(self) -> None:
        """The parameters moved or were discarded: the published places are void. The keys go
        first, so the trainer broadcasts (and this worker learns the places again) next time."""
        self.state.host.forget_places()
        if self.staged_slices is not None:
            self.staged_slices.void = (
                "this worker's weights were reloaded after the atomic push was received; push again"
            )
        comm, slices = self.slices_comm, self.slices
        self.slices, self.slices_comm, self.places = None, None, None
        if comm is None or not slices:
            return
        for layout_key in slices:
            try:
                comm.store.delete_key(needs_key(layout_key, comm.rank))
            except Exception:  # the store is gone with its group: nothing to take back
                break

    def problem(self, comm: Communicator, layout_key: str) -> str | None:
        """Why a sliced push of ``layout_key`` in ``comm`` cannot land here, or None."""
        if self.slices_comm is comm and self.slices and layout_key in self.slices:
            return None
        return (
            f"this worker no longer keeps the places of layout {layout_key} (its weights were reloaded); "
            "push again: the next push sends whole tensors"
        )

    def staging_problem(self, layout_key: str, atomic: bool) -> str | None:
        """Why this worker cannot stage a sliced push of a published layout, or None: the wire
        stages up to ``IN_FLIGHT`` buckets of this worker's share while they are copied into
        place, and an atomic push also all of its slices until the swap."""
        assert self.slices is not None
        kept = self.slices[layout_key]
        wire = IN_FLIGHT * kept.bucket_bytes
        whole = sum(v.numel() * v.element_size() for v in kept.views) if atomic else 0
        needed = wire + whole
        where = self.staging.where()
        what = (
            f"a sliced push stages up to {IN_FLIGHT} buckets of this worker's slices ({wire / GIB:.2f} GiB)"
        )
        if atomic:
            what += f" and, atomic, all of them until the swap ({whole / GIB:.2f} GiB)"
        return self.staging.problem(
            needed,
            what=f"{what} on {where}",
            advice="lower the push's bucket_bytes, push without slicing (REWARDPLANE_PUSH_SLICING=never "
            f"on the trainer){', push it streamed' if atomic else ''}, or {SMALLER_FRACTION}",
        )

    def receive(
        self,
        comm: Communicator,
        layout_key: str,
        metas: list[ParamMeta],
        got: Received,
        stage: bool = False,
    ) -> None:
        """Receive this worker's slices of every tensor: into its parameters, or (``stage``: an
        atomic push) into tensors of their shapes, applied by ``apply_staged``. Raises
        ``CommunicatorError`` like ``receive_buckets``."""
        assert self.slices is not None
        kept = self.slices[layout_key]
        if not stage:
            receive_slices(
                comm, metas, kept.schedule, comm.rank, comm.first_sender, kept.regions, kept.views, out=got
            )
            if got.error is None:
                self.persistence.keep_received(metas, kept.regions, kept.views)
            return
        targets = [torch.empty_like(v) for v in kept.views]
        # nothing reaches a parameter before the swap: not in place, nothing applied
        staged = receive_slices(
            comm, metas, kept.schedule, comm.rank, comm.first_sender, kept.regions, targets
        )
        got.bytes += staged.bytes
        self.staged_slices = _StagedSlices(list(zip(kept.views, targets, strict=True)), metas, kept.regions)

    def apply_staged(self, metadata: list[dict[str, Any]]) -> None:
        staged, self.staged_slices = self.staged_slices, None
        if staged is not None:  # copied into the parameters they were received for
            if staged.void is not None:
                raise RuntimeError(staged.void)
            for view, received in staged.pairs:
                view.copy_(received)
            self.persistence.start_keeping()
            self.persistence.keep_received(staged.metas, staged.regions, [r for _, r in staged.pairs])
            return
        layout, self.staged_layout = self.staged_layout, None
        self.staging.apply(metadata)
        if layout is not None:  # the loader placed every tensor: the next pushes can be sliced
            self.publish(*layout)

    def drop_staged(self) -> None:
        self.staged_slices, self.staged_layout = None, None
        self.staging.drop()


def _publish(store: Any, rank: int, layout_key: str, places: _Places) -> _Kept | None:
    """``places`` in ``store`` as receiving rank ``rank``'s needs; what that rank receives of a
    sliced push of the layout. None when the store is gone (its group's next push broadcasts)."""
    try:
        store.set(needs_key(layout_key, rank), needs_to_json(places.regions))
    except Exception as exc:  # the trainer's store is gone: its next group starts afresh
        log.debug("could not publish this worker's slices of layout %s: %s", layout_key, exc)
        return None
    schedule = slice_schedule(places.metas, places.plan, {rank: places.regions})
    most = max((sum(transfer_bytes(places.metas, t) for t in bucket) for bucket in schedule), default=0)
    return _Kept(places.regions, places.views, schedule, most)
