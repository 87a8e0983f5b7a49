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


def _messages(
    transfers: Sequence[Transfer], mine: Callable[[Transfer], bool], peer: Callable[[Transfer], int]
) -> dict[int, list[Transfer]]:
    """This rank's transfers of one bucket, grouped by peer in schedule order (both sides derive
    the same order: a message's boxes are packed back to back in it)."""
    out: dict[int, list[Transfer]] = {}
    for t in transfers:
        if mine(t):
            out.setdefault(peer(t), []).append(t)
    return out


def _nbytes(metadata: Sequence[ParamMeta], t: Transfer) -> int:
    return box_numel(t.box) * torch_dtype(metadata[t.index].dtype).itemsize


class _Staging:
    """Two flat byte buffers, one per bucket in flight, grown when a bucket needs more."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.bufs: list[torch.Tensor | None] = [None, None]

    def get(self, k: int, nbytes: int) -> torch.Tensor:
        buf = self.bufs[k % 2]
        if buf is None or buf.numel() < nbytes:
            buf = self.bufs[k % 2] = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
        return buf[:nbytes]


def send_packed(
    comm: PeerCommunicator,
    metadata: Sequence[ParamMeta],
    tensors: dict[str, torch.Tensor],
    schedule: Sequence[Sequence[Transfer]],
    sender: int = 0,
) -> int:
    """``send_slices`` with one message per receiver and bucket: this rank's boxes for a receiver
    are packed back to back (a copy on the copy stream, overlapping the previous bucket's send).
    Returns the bytes sent."""
    device = comm.device
    staging = _Staging(device)
    total = 0

    def pack(k: int) -> list[tuple[torch.Tensor, int]]:
        nonlocal total
        messages = _messages(schedule[k], lambda t: t.sender == sender, lambda t: t.receiver)
        sizes = {r: sum(_nbytes(metadata, t) for t in ts) for r, ts in messages.items()}
        flat = staging.get(k, sum(sizes.values()))
        sends: list[tuple[torch.Tensor, int]] = []
        at = 0
        for receiver, transfers in messages.items():
            start = at
            for t in transfers:
                meta = metadata[t.index]
                held = part_box(meta, sender)
                assert held is not None
                local = tensors[meta.name]
                if local.device != device:
                    local = local.to(device, non_blocking=True)
                src = box_view(local, relative(t.box, held))
                n = _nbytes(metadata, t)
                flat[at : at + n].view(src.dtype).view(src.shape).copy_(src)
                at += n
            sends.append((flat[start:at], receiver))
        total += at
        return sends

    if device.type != "cuda":
        for k in range(len(schedule)):
            comm.exchange(pack(k), [])
        return total
    caller = torch.cuda.current_stream(device)
    main, copy = _streams(device)
    main.wait_stream(caller)
    copy.wait_stream(caller)  # the parameters were produced on the caller's stream
    sent: list[torch.cuda.Event] = []
    for k in range(len(schedule)):
        if k >= 2:
            comm.wait_event(sent[k - 2])  # two buckets in flight; bucket k-2's staging is free
        with torch.cuda.stream(copy):
            sends = pack(k)
            packed = torch.cuda.Event()
            packed.record(copy)
        with torch.cuda.stream(main):
            main.wait_event(packed)
            comm.exchange(sends, [])
            done = torch.cuda.Event()
            done.record(main)
            sent.append(done)
    with torch.cuda.stream(main):
        comm.synchronize()
    caller.wait_stream(main)
    return total


def receive_packed(
    comm: PeerCommunicator,
    metadata: Sequence[ParamMeta],
    schedule: Sequence[Sequence[Transfer]],
    rank: int,
    src: int,
    needs: Needs,
    targets: Sequence[torch.Tensor],
    out: Received | None = None,
) -> Received:
    """``receive_slices`` with one message per sender and bucket (``send_packed``): received into a
    staging buffer, then copied into ``targets`` on the copy stream while the next bucket arrives."""
    out = out if out is not None else Received()
    device = comm.device
    staging = _Staging(device)

    def post(k: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Post bucket k's receives; returns (received bytes, their place) to copy once it arrived."""
        messages = _messages(schedule[k], lambda t: t.receiver == rank, lambda t: t.sender)
        flat = staging.get(k, sum(_nbytes(metadata, t) for ts in messages.values() for t in ts))
        recvs: list[tuple[torch.Tensor, int]] = []
        places: list[tuple[torch.Tensor, torch.Tensor]] = []
        at = 0
        for sender, transfers in messages.items():
            start = at
            for t in transfers:
                meta = metadata[t.index]
                dst = box_view(targets[t.index], relative(t.box, need_box(meta, needs[t.index])))
                n = _nbytes(metadata, t)
                places.append((flat[at : at + n].view(torch_dtype(meta.dtype)).view(dst.shape), dst))
                at += n
            recvs.append((flat[start:at], src + sender))
        out.bytes += at
        if recvs:
            out.applied_any = True
        comm.exchange([], recvs)
        return places

    def unpack(places: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        for received, dst in places:
            dst.copy_(received)

    if device.type != "cuda":
        for k in range(len(schedule)):
            unpack(post(k))
        return out
    caller = torch.cuda.current_stream(device)
    main, copy = _streams(device)
    main.wait_stream(caller)
    copy.wait_stream(caller)
    unpacked: list[torch.cuda.Event] = []
    for k in range(len(schedule)):
        if k >= 2:
            comm.wait_event(unpacked[k - 2])  # bucket k-2's staging is copied out: free again
        with torch.cuda.stream(main):
            places = post(k)
            arrived = torch.cuda.Event()
            arrived.record(main)
        with torch.cuda.stream(copy):
            copy.wait_event(arrived)
            unpack(places)
            done = torch.cuda.Event()
            done.record(copy)
            unpacked.append(done)
    with torch.cuda.stream(main):
        main.wait_stream(copy)
        comm.synchronize()
    caller.wait_stream(main)
    return out
