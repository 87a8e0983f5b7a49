"""Moving a sliced push (``protocol.slices``) over a ``Communicator``: per bucket of the layout,
one point-to-point message from each sender to each receiving rank, holding every box (a sender's
part of a tensor meeting what that rank keeps of it) the pair has in the bucket, back to back in
schedule order.

One message per pair rather than one per box: on 4x H200 the 7B shape's 710 boxes as separate
messages took two senders 0.76 of one sender's broadcast, packed 0.59 (``benchmarks/sliced_wire.py``).
A sender packs its boxes into a staging buffer and a receiver copies them out of one into its
parameters (a slice of columns, a cast), both on the copy stream while the neighbouring bucket is on
the link; a message of one box that is contiguous on its side skips the copy. The transfers run on
the transfer stream, ``IN_FLIGHT`` buckets at once, bounded by the group's timeout like the
broadcast wire (``transfer``). Staging costs each side ``IN_FLIGHT`` buffers of the bytes it moves
per bucket.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Protocol, TypeVar

import torch

from rewardplane.protocol import ParamMeta
from rewardplane.protocol.slices import Box, Needs, Transfer, need_box, part_box, relative, transfer_bytes

from .buckets import as_bytes, torch_dtype
from .transfer import Received, _streams

# Buckets staged at once on each side: one is packed (or copied out) while the other travels. A
# third measured 2% faster (within run-to-run noise) for another bucket of staging memory.
IN_FLIGHT = 2

Staged = TypeVar("Staged")
Moved = TypeVar("Moved")


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


def _messages(
    transfers: Sequence[Transfer], mine: Callable[[Transfer], bool], peer: Callable[[Transfer], int]
) -> dict[int, list[Transfer]]:
    """This rank's transfers of one bucket, by peer, in schedule order: both sides derive the same
    messages, boxes back to back."""
    out: dict[int, list[Transfer]] = {}
    for t in transfers:
        if mine(t):
            out.setdefault(peer(t), []).append(t)
    return out


class _Staging:
    """One flat byte buffer per bucket in flight, made when first needed and grown when a bucket
    needs more (a message that skips the copy takes none)."""

    def __init__(self, device: torch.device, in_flight: int) -> None:
        self.device = device
        self.bufs: list[torch.Tensor | None] = [None] * in_flight

    def get(self, k: int, nbytes: int) -> torch.Tensor:
        i = k % len(self.bufs)
        buf = self.bufs[i]
        if buf is None or buf.numel() < nbytes:
            buf = self.bufs[i] = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
        return buf[:nbytes]


def _pipeline(
    comm: PeerCommunicator,
    buckets: int,
    in_flight: int,
    before: Callable[[int], Staged] | None,
    on_link: Callable[[int, Staged | None], Moved],
    after: Callable[[int, Moved], None] | None,
) -> None:
    """Per bucket k: ``before(k)`` on the copy stream, then ``on_link(k, ...)`` on the transfer
    stream once it is done, then ``after(k, ...)`` on the copy stream once that arrived. The CPU
    runs at most ``in_flight`` buckets ahead (bounded waits: a dead peer is noticed within the
    timeout; bucket k-in_flight's staging is free again); the caller's stream is ordered around.
    A side without ``before`` or ``after`` never makes one stream wait for the other: bucket k's
    transfer must not queue behind bucket k-1's copies."""
    device = comm.device
    if device.type != "cuda":
        for k in range(buckets):
            moved = on_link(k, before(k) if before is not None else None)
            if after is not None:
                after(k, moved)
        return
    caller = torch.cuda.current_stream(device)
    main, copy = _streams(device)
    main.wait_stream(caller)
    copy.wait_stream(caller)  # the parameters were produced (or are read) on the caller's stream
    finished: list[torch.cuda.Event] = []
    for k in range(buckets):
        if k >= in_flight:
            comm.wait_event(finished[k - in_flight])
        staged: Staged | None = None
        if before is not None:
            with torch.cuda.stream(copy):
                staged = before(k)
                ready = torch.cuda.Event()
                ready.record(copy)
            main.wait_event(ready)
        with torch.cuda.stream(main):
            moved = on_link(k, staged)
            done = torch.cuda.Event()
            done.record(main)
        if after is not None:
            with torch.cuda.stream(copy):
                copy.wait_event(done)
                after(k, moved)
                done = torch.cuda.Event()
                done.record(copy)
        finished.append(done)
    with torch.cuda.stream(main):
        main.wait_stream(copy)
        comm.synchronize()  # bounded: a dead peer is noticed here, and the group aborted
    caller.wait_stream(main)


def send_slices(
    comm: PeerCommunicator,
    metadata: Sequence[ParamMeta],
    tensors: dict[str, torch.Tensor],
    schedule: Sequence[Sequence[Transfer]],
    sender: int = 0,
    in_flight: int = IN_FLIGHT,
) -> int:
    """Send this rank's transfers of ``schedule`` (``tensors[name]``: its part of each tensor it
    sends; each transfer names its receiver's group rank), one message per receiver and bucket.
    Returns the bytes sent."""
    device = comm.device
    staging = _Staging(device, in_flight)
    total = 0

    def source(t: Transfer) -> torch.Tensor:
        meta = metadata[t.index]
        held = part_box(meta, sender)
        assert held is not None
        local = tensors[meta.name]
        if local.device != device:
            local = local.to(device, non_blocking=True)
        return box_view(local, relative(t.box, held))

    def pack(k: int) -> list[tuple[torch.Tensor, int]]:
        nonlocal total
        messages = _messages(schedule[k], lambda t: t.sender == sender, lambda t: t.receiver)
        sources = {r: [source(t) for t in ts] for r, ts in messages.items()}
        direct = {r for r, srcs in sources.items() if len(srcs) == 1 and srcs[0].is_contiguous()}
        staged = sum(transfer_bytes(metadata, t) for r, ts in messages.items() if r not in direct for t in ts)
        flat = staging.get(k, staged) if staged else None
        sends: list[tuple[torch.Tensor, int]] = []
        at = 0
        for receiver, srcs in sources.items():
            if receiver in direct:
                sends.append((as_bytes(srcs[0]), receiver))
                total += sends[-1][0].numel()
                continue
            assert flat is not None
            start = at
            for src in srcs:
                n = src.numel() * src.element_size()
                flat[at : at + n].view(src.dtype).view(src.shape).copy_(src)
                at += n
            sends.append((flat[start:at], receiver))
        total += at
        return sends

    def send(k: int, sends: list[tuple[torch.Tensor, int]] | None) -> None:
        assert sends is not None
        comm.exchange(sends, [])

    _pipeline(comm, len(schedule), in_flight, pack, send, None)
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
    in_flight: int = IN_FLIGHT,
) -> Received:
    """Receive this rank's transfers of ``schedule`` into ``targets`` (tensor i's slice this rank
    keeps, shaped as ``needs[i]`` says), one message per sender and bucket: straight into the
    parameter where a message is one box contiguous there in the pushed dtype, else into staging
    and copied into place while the next bucket arrives."""
    out = out if out is not None else Received()
    device = comm.device
    staging = _Staging(device, in_flight)

    def post(k: int, _: None) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Post bucket k's receives; returns (received bytes, their place) to copy once arrived."""
        messages = _messages(schedule[k], lambda t: t.receiver == rank, lambda t: t.sender)
        places = {
            s: [
                box_view(targets[t.index], relative(t.box, need_box(metadata[t.index], needs[t.index])))
                for t in ts
            ]
            for s, ts in messages.items()
        }
        direct = {
            s
            for s, dsts in places.items()
            if len(dsts) == 1
            and dsts[0].is_contiguous()
            and dsts[0].dtype == torch_dtype(metadata[messages[s][0].index].dtype)
            and dsts[0].device == device
        }
        staged = sum(transfer_bytes(metadata, t) for s, ts in messages.items() if s not in direct for t in ts)
        flat = staging.get(k, staged) if staged else None
        recvs: list[tuple[torch.Tensor, int]] = []
        copies: list[tuple[torch.Tensor, torch.Tensor]] = []
        at = 0
        for sender, ts in messages.items():
            if sender in direct:
                recvs.append((places[sender][0].view(-1).view(torch.uint8), src + sender))
                out.in_place_bytes += transfer_bytes(metadata, ts[0])
                out.bytes += transfer_bytes(metadata, ts[0])
                continue
            assert flat is not None
            start = at
            for t, dst in zip(ts, places[sender], strict=True):
                n = transfer_bytes(metadata, t)
                copies.append(
                    (flat[at : at + n].view(torch_dtype(metadata[t.index].dtype)).view(dst.shape), dst)
                )
                at += n
            recvs.append((flat[start:at], src + sender))
        out.bytes += at
        if recvs:
            out.applied_any = True  # parameters are written as the bytes arrive
        comm.exchange([], recvs)
        return copies

    def unpack(k: int, copies: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        for received, dst in copies:
            dst.copy_(received)

    _pipeline(comm, len(schedule), in_flight, None, post, unpack)
    return out
