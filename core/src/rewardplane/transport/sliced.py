"""Moving a sliced push (``protocol.slices``) over a ``Communicator``: each bucket of the layout is
one group of point-to-point messages, each the box where a sender's part of a tensor meets what a
receiving rank keeps of it.

A sender sends straight from its tensor where the box is contiguous there (a range of rows), else
from a contiguous copy. A receiver receives straight into its parameter's slice where that is
contiguous and of the pushed dtype, else into a scratch tensor copied there afterwards (a range of
columns; a cast). On CUDA both run on the transfer stream, two buckets in flight, bounded by the
group's timeout like the broadcast wire (``transfer``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Protocol

import torch

from rewardplane.protocol import ParamMeta
from rewardplane.protocol.slices import Box, Needs, Transfer, box_numel, need_box, part_box, relative

from .buckets import as_bytes, torch_dtype
from .transfer import Received, _streams


class PeerCommunicator(Protocol):
    device: torch.device

    def exchange(
        self, sends: Sequence[tuple[torch.Tensor, int]], recvs: Sequence[tuple[torch.Tensor, int]]
    ) -> None: ...

    def wait_event(self, done: torch.cuda.Event) -> None: ...

    def synchronize(self) -> None: ...


def box_view(t: torch.Tensor, box: Box) -> torch.Tensor:
    """The view of ``t`` (whose own box starts at 0 in every dimension) covering ``box``."""
    for dim, (lo, hi) in enumerate(box):
        if lo != 0 or hi != t.shape[dim]:
            t = t.narrow(dim, lo, hi - lo)
    return t


def _run(comm: PeerCommunicator, buckets: int, post: Callable[[int], None]) -> None:
    """``post(k)`` for every bucket; on CUDA on the transfer stream with two buckets in flight
    (bounded waits: a dead peer is noticed within the timeout), the caller's stream ordered around."""
    device = comm.device
    if device.type != "cuda":
        for k in range(buckets):
            post(k)
        return
    caller = torch.cuda.current_stream(device)
    main, _ = _streams(device)
    main.wait_stream(caller)
    sent: list[torch.cuda.Event] = []
    with torch.cuda.stream(main):
        for k in range(buckets):
            if k >= 2:
                comm.wait_event(sent[k - 2])
            post(k)
            done = torch.cuda.Event()
            done.record(main)
            sent.append(done)
        comm.synchronize()
    caller.wait_stream(main)


def send_slices(
    comm: PeerCommunicator,
    metadata: Sequence[ParamMeta],
    tensors: dict[str, torch.Tensor],
    schedule: Sequence[Sequence[Transfer]],
    sender: int = 0,
) -> int:
    """Send this rank's transfers of ``schedule`` (``tensors[name]``: its part of each tensor it
    sends; each transfer names its receiver's group rank). Returns the bytes sent."""
    device = comm.device
    total = 0

    def post(k: int) -> None:
        nonlocal total
        sends: list[tuple[torch.Tensor, int]] = []
        for t in schedule[k]:
            if t.sender != sender:
                continue
            meta = metadata[t.index]
            held = part_box(meta, sender)
            assert held is not None
            local = tensors[meta.name]
            if local.device != device:
                local = local.to(device, non_blocking=True)
            data = as_bytes(box_view(local, relative(t.box, held)))  # a copy only if not contiguous
            sends.append((data, t.receiver))
            total += data.numel()
        comm.exchange(sends, [])

    _run(comm, len(schedule), post)
    return total


def receive_slices(
    comm: PeerCommunicator,
    metadata: Sequence[ParamMeta],
    schedule: Sequence[Sequence[Transfer]],
    rank: int,
    src: int,
    needs: Needs,
    targets: Sequence[torch.Tensor],
    out: Received | None = None,
) -> Received:
    """Receive this rank's transfers of ``schedule`` straight into ``targets`` (tensor i's slice this
    rank keeps, shaped as ``needs[i]`` says). Parameters are written as the bytes arrive."""
    out = out if out is not None else Received()
    device = comm.device

    def post(k: int) -> None:
        recvs: list[tuple[torch.Tensor, int]] = []
        after: list[tuple[torch.Tensor, torch.Tensor]] = []  # (scratch received, its place)
        for t in schedule[k]:
            if t.receiver != rank:
                continue
            meta = metadata[t.index]
            dtype = torch_dtype(meta.dtype)
            dst = box_view(targets[t.index], relative(t.box, need_box(meta, needs[t.index])))
            nbytes = box_numel(t.box) * dtype.itemsize
            if dst.is_contiguous() and dst.dtype == dtype and dst.device == device:
                recvs.append((dst.view(-1).view(torch.uint8), src + t.sender))
                out.in_place_bytes += nbytes
            else:
                scratch = torch.empty(dst.shape, dtype=dtype, device=device)
                recvs.append((scratch.view(-1).view(torch.uint8), src + t.sender))
                after.append((scratch, dst))
            out.bytes += nbytes
        if recvs:
            out.applied_any = True
        comm.exchange([], recvs)
        for scratch, dst in after:  # stream-ordered after the receive (gloo: it is done)
            dst.copy_(scratch)

    _run(comm, len(schedule), post)
    return out
