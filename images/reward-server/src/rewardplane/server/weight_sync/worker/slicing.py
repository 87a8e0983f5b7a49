"""The receiving side of sliced pushes (``protocol.slices``): after a push of a layout went through
the model's loader, this worker knows what it keeps of every tensor and where (the copy plan), and
publishes that in the group's store; the trainer then sends it only those bytes, straight into its
parameters, on the next pushes of that layout."""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from rewardplane.protocol import Bucket, ParamMeta
from rewardplane.protocol.slices import Region, Transfer, needs_key, needs_to_json, slice_schedule
from rewardplane.server.weight_sync.worker.staging import StagingPart
from rewardplane.transport.comm import Communicator
from rewardplane.transport.sliced import receive_slices
from rewardplane.transport.transfer import Received

log = logging.getLogger(__name__)


@dataclass
class _Kept:
    regions: list[Region | None]  # what this worker keeps of each tensor of the layout
    views: list[torch.Tensor]  # the parameter view each lands in
    schedule: list[list[Transfer]]  # this worker's transfers of a sliced push, per bucket


class SlicingPart(StagingPart):
    """Publishing what this worker keeps of a layout, and receiving a sliced push of it."""

    # layout id -> what was published of it, in the group ``_rp_slices_comm``
    _rp_slices: dict[str, _Kept] | None = None
    _rp_slices_comm: Communicator | None = None  # the group they were published in

    def _rp_slice_of(self, name: str) -> tuple[Region | None, torch.Tensor] | None:
        """What this worker keeps of ``name`` and where; None where only the loader can load it."""
        plan = self._rp_copy_plan
        return None if plan is None else plan.slice_of(name)

    def _rp_publish_slices(
        self, comm: Communicator, layout_key: str, metas: list[ParamMeta], plan: list[Bucket]
    ) -> None:
        """After a streamed push of ``layout_key`` loaded every tensor: publish what this worker
        keeps of each, where every tensor has one place in the parameters. Not while host copies of
        whole tensors are kept (persistence needs every byte on the replica's first worker)."""
        if self._rp_slices_comm is not comm:
            self._rp_slices, self._rp_slices_comm = {}, comm
        slices = self._rp_slices
        assert slices is not None
        if layout_key in slices or self._rp_keeps():
            return
        kept = [self._rp_slice_of(m.name) for m in metas]
        if any(k is None for k in kept):
            return
        regions = [k[0] for k in kept if k is not None]
        views = [k[1] for k in kept if k is not None]
        try:
            comm.store.set(needs_key(layout_key, comm.rank), needs_to_json(regions))
        except Exception as exc:  # the trainer's store is gone: its next group starts afresh
            log.debug("could not publish this worker's slices of layout %s: %s", layout_key, exc)
            return
        schedule = slice_schedule(metas, plan, {comm.rank: regions})
        slices[layout_key] = _Kept(regions, views, schedule)

    def _rp_forget_places(self) -> None:
        """The parameters moved or were discarded: the published places are void. The keys go
        first, so the trainer broadcasts (and this worker learns the places again) next time."""
        super()._rp_forget_places()
        comm, slices = self._rp_slices_comm, self._rp_slices
        self._rp_slices, self._rp_slices_comm = None, None
        if comm is None or not slices:
            return
        for layout_key in slices:
            try:
                comm.store.delete_key(needs_key(layout_key, comm.rank))
            except Exception:  # the store is gone with its group: nothing to take back
                break

    def _rp_sliced_problem(self, comm: Communicator, layout_key: str) -> str | None:
        if self._rp_slices_comm is comm and self._rp_slices and layout_key in self._rp_slices:
            return None
        return (
            f"this worker no longer keeps the places of layout {layout_key} (its weights were reloaded); "
            "push again: the next push sends whole tensors"
        )

    def _rp_receive_sliced(
        self,
        comm: Communicator,
        layout_key: str,
        metas: list[ParamMeta],
        got: Received,
    ) -> None:
        """Receive this worker's slices of every tensor into its parameters. Raises
        ``CommunicatorError`` like ``receive_buckets``."""
        assert self._rp_slices is not None
        kept = self._rp_slices[layout_key]
        receive_slices(
            comm, metas, kept.schedule, comm.rank, comm.first_sender, kept.regions, kept.views, out=got
        )
