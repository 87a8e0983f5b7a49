"""The trainer's side of sliced pushes (``protocol.slices``): reading what every receiving rank
published that it keeps of a layout, and deciding whether a push of it is sliced.

Sliced where it moves less (``REWARDPLANE_PUSH_SLICING``, default ``auto``): when the receiving
ranks together keep at most ``SLICED_SHARE`` of what a broadcast would deliver to them
(tensor-parallel replicas). Replicas that keep whole tensors get
broadcasts, which cross each sender's link once however many replicas there are; point-to-point
messages would cross it once per replica.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal, cast

import torch.distributed as dist

from rewardplane.protocol import Bucket, ParamMeta, settings
from rewardplane.protocol.slices import Transfer, box_numel, needs_from_json, needs_key, slice_schedule
from rewardplane.transport.buckets import torch_dtype
from rewardplane.transport.comm import Communicator

Slicing = Literal["auto", "always", "never"]
SLICED_SHARE = 0.75


def slicing_of(comm: Communicator, default: Slicing | None = None) -> Slicing | None:
    """The slicing a group allows: none over the same-host transport (it broadcasts only; each
    receiver copies what it needs straight from the trainer's memory)."""
    return "never" if comm.backend == "ipc" else default


class SliceBook:
    """Per layout: the schedule of a sliced push, or None (broadcast); made once every receiving
    rank published. A sliced layout's places are checked in the store on every push (a worker whose
    weights were reloaded takes them back)."""

    def __init__(self, store: dist.Store, receivers: int, slicing: Slicing | None = None) -> None:
        self.store = store
        self.receivers = receivers
        self.slicing = cast(Slicing, slicing or settings.PUSH_SLICING.get())
        self._schedules: dict[str, list[list[Transfer]] | None] = {}

    def schedule(
        self, layout: str, metadata: Sequence[ParamMeta], plan: Sequence[Bucket]
    ) -> list[list[Transfer]] | None:
        """The schedule to push ``layout`` by, or None to broadcast it."""
        if self.slicing == "never":
            return None
        if layout in self._schedules and self._schedules[layout] is None:
            return None  # decided: broadcast (no store round trip on its pushes' path)
        keys = [needs_key(layout, r) for r in range(self.receivers)]
        try:
            published = bool(self.store.check(keys))
        except dist.DistError:
            published = False
        if not published:
            self._schedules.pop(layout, None)
            return None
        if layout not in self._schedules:
            needs = {r: needs_from_json(self.store.get(k)) for r, k in enumerate(keys)}
            schedule = slice_schedule(metadata, plan, needs)
            whole = sum(m.nbytes for m in metadata) * self.receivers
            moved = sum(
                box_numel(t.box) * torch_dtype(metadata[t.index].dtype).itemsize for b in schedule for t in b
            )
            worth = self.slicing == "always" or moved <= SLICED_SHARE * whole
            self._schedules[layout] = schedule if worth else None
        return self._schedules[layout]


def agree_on_slices(
    comm: Communicator, layout: str, metadata: Sequence[ParamMeta], plan: Sequence[Bucket], *, decides: bool
) -> list[list[Transfer]] | None:
    """A push through the operator (a group formed for it; the workers published the places they
    know into its store as they joined): every trainer rank and every worker agree in one
    reduction whether it is sliced; the schedule, or None to broadcast. ``decides``: this rank
    applies ``REWARDPLANE_PUSH_SLICING`` (rank 0); the others agree to whatever the published
    places allow. A worker that no longer holds its places, or lacks room to stage its share,
    makes it a broadcast."""
    book = SliceBook(comm.store, comm.first_sender, slicing_of(comm, None if decides else "always"))
    schedule = book.schedule(layout, metadata, plan)
    return schedule if comm.max_flag(0 if schedule is not None else 1) == 0 else None
