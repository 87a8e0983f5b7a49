"""The sliced wire: each receiving rank gets only the part of each tensor it keeps.

A tensor-parallel worker keeps a slice of most tensors (rows of a column-parallel weight, columns
of a row-parallel one), and its model's loader shows which (``Region``: one range along one
dimension, or the whole tensor). Once every receiving rank has published its regions for a layout,
a push of that layout no longer broadcasts every tensor to every rank: each sender sends each
receiver the box where its own part (the whole tensor, or its piece along the split dimension)
meets what that receiver keeps — point to point, so the senders' links work in parallel and every
receiver takes in only its share of the bytes.

Both sides derive the same ordered list of transfers from the layout and the published regions
(``slice_schedule``), so nothing about the schedule travels with a push.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from .weights import DTYPE_ITEMSIZE, Bucket, ParamMeta

# (start, stop) along each dimension of the whole tensor
Box = tuple[tuple[int, int], ...]


@dataclass(frozen=True)
class Region:
    """What a receiving rank keeps of a tensor: ``start:stop`` along ``dim``."""

    dim: int
    start: int
    stop: int


# One entry per tensor of a layout (in its order): the region a receiving rank keeps, or None for
# the whole tensor.
Needs = Sequence[Region | None]


@dataclass(frozen=True)
class Transfer:
    """One point-to-point message: ``box`` of tensor ``index`` from ``sender`` (its index among the
    trainer's sending ranks) to group rank ``receiver``."""

    index: int
    sender: int
    receiver: int
    box: Box


def whole_box(shape: Sequence[int]) -> Box:
    return tuple((0, n) for n in shape)


def part_box(meta: ParamMeta, sender: int) -> Box | None:
    """The box ``sender`` holds of the tensor (the whole tensor, or its piece), or None."""
    if not meta.pieces:
        return whole_box(meta.shape) if meta.sender == sender else None
    assert meta.split_dim is not None
    for piece in meta.pieces:
        if piece.sender == sender:
            return _narrowed(whole_box(meta.shape), meta.split_dim, piece.start, piece.stop)
    return None


def need_box(meta: ParamMeta, region: Region | None) -> Box:
    box = whole_box(meta.shape)
    return box if region is None else _narrowed(box, region.dim, region.start, region.stop)


def _narrowed(box: Box, dim: int, start: int, stop: int) -> Box:
    return (*box[:dim], (start, stop), *box[dim + 1 :])


def intersect(a: Box, b: Box) -> Box | None:
    out = tuple((max(x0, y0), min(x1, y1)) for (x0, x1), (y0, y1) in zip(a, b, strict=True))
    return out if all(lo < hi for lo, hi in out) else None


def relative(box: Box, within: Box) -> Box:
    """``box`` in the coordinates of ``within`` (which contains it)."""
    return tuple((lo - w0, hi - w0) for (lo, hi), (w0, _) in zip(box, within, strict=True))


def box_numel(box: Box) -> int:
    n = 1
    for lo, hi in box:
        n *= hi - lo
    return n


def transfer_bytes(metadata: Sequence[ParamMeta], t: Transfer) -> int:
    """The bytes of one transfer on the wire (the tensor's pushed dtype)."""
    return box_numel(t.box) * DTYPE_ITEMSIZE[metadata[t.index].dtype]


def slice_schedule(
    metadata: Sequence[ParamMeta], plan: Sequence[Bucket], needs: Mapping[int, Needs]
) -> list[list[Transfer]]:
    """Every transfer of a sliced push, per bucket of ``plan``, in the order both sides post them:
    by tensor, then the tensor's parts (``wire_parts`` order), then receiving rank. ``needs``:
    each receiving rank's regions (one entry per tensor of ``metadata``)."""
    for rank, regions in needs.items():
        check_needs(metadata, regions, rank)
    out: list[list[Transfer]] = []
    for bucket in plan:
        transfers: list[Transfer] = []
        for slot in bucket.slots:
            meta = metadata[slot.index]
            for sender, _, _ in meta.wire_parts():
                held = part_box(meta, sender)
                assert held is not None
                for rank in sorted(needs):
                    box = intersect(held, need_box(meta, needs[rank][slot.index]))
                    if box is not None:
                        transfers.append(Transfer(slot.index, sender, rank, box))
        out.append(transfers)
    return out


def check_needs(metadata: Sequence[ParamMeta], regions: Needs, rank: int) -> None:
    if len(regions) != len(metadata):
        raise ValueError(
            f"rank {rank} published regions for {len(regions)} tensors; the layout has {len(metadata)}"
        )
    for meta, region in zip(metadata, regions, strict=True):
        if region is None:
            continue
        if (
            not 0 <= region.dim < len(meta.shape)
            or not 0 <= region.start < region.stop <= meta.shape[region.dim]
        ):
            raise ValueError(
                f"rank {rank} keeps {region} of {meta.name!r}, which has shape {tuple(meta.shape)}: "
                "not a range inside it"
            )


def needs_to_json(regions: Needs) -> str:
    return json.dumps(
        [None if r is None else [r.dim, r.start, r.stop] for r in regions], separators=(",", ":")
    )


def needs_from_json(raw: str | bytes) -> list[Region | None]:
    return [None if r is None else Region(int(r[0]), int(r[1]), int(r[2])) for r in json.loads(raw)]


def needs_key(layout: str, rank: int) -> str:
    """Where receiving rank ``rank`` publishes its regions for ``layout`` in the group's store."""
    return f"slices/{layout}/{rank}"
