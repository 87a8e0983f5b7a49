"""Moving flat buckets over a ``Communicator``, on both sides of a push.

A bucket travels as one group of broadcasts, one per tensor (the per-tensor wire,
``protocol.weights``): the trainer sends from its parameters without packing, and a server
receives each tensor where ``place`` says (its own parameter, when the tensor lands there
unchanged) or into a bucket buffer, for its loader.

On CUDA a server loads bucket k on a side stream while bucket k+1 arrives, with two bucket
buffers, so copies hide behind the link. A buffer's reuse waits on the GPU for its last load, and
the CPU runs up to ``RECEIVE_LOOKAHEAD`` buckets ahead (a bounded wait per bucket), so a slow
``load`` call (vLLM's loader is Python) does not stall the link or, with several replicas in one
group, every other replica. A bounded ``synchronize`` at the end catches a dead peer. On CPU
(gloo) it runs bucket by bucket.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import time
import weakref
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

import torch

from rewardplane.protocol import Bucket, ParamMeta, plan_buckets

from .buckets import as_bytes, piece_bytes, piece_view, torch_dtype, unpack_bucket
from .comm import Communicator, TensorCommunicator

log = logging.getLogger(__name__)

Loader = Callable[[list[tuple[str, torch.Tensor]]], None]
# Where a server would receive one announced tensor in place (e.g. the slice of a fused parameter
# it is loaded into), or None: into the bucket buffer. Used only where it fits exactly.
Placer = Callable[[ParamMeta], "torch.Tensor | None"]


# How many buckets a server's CPU may enqueue ahead of the GPU's loads (the two buffers are
# guarded on the GPU): enough to ride out a slow Python ``load`` call. 2 (wait on the CPU for each
# buffer's previous load) measures the same within run-to-run noise on 4x H100.
RECEIVE_LOOKAHEAD = 4


@functools.cache
def _streams(device: torch.device) -> tuple[torch.cuda.Stream, torch.cuda.Stream]:
    """(transfer stream, copy stream) of a device, made once: pushes on one device never overlap,
    and creating streams on every push sat on its critical path."""
    return torch.cuda.Stream(device), torch.cuda.Stream(device)


def send_buckets(
    comm: TensorCommunicator,
    metadata: Sequence[ParamMeta],
    tensors: Mapping[str, torch.Tensor],
    bucket_bytes: int,
    src: int,
    plan: list[Bucket] | None = None,
    before_first: Callable[[], bool] | None = None,
    sender: int = 0,
) -> int:
    """Broadcast ``tensors`` (ordered as ``metadata``) from rank ``src``, each bucket one group of
    broadcasts straight from the tensors (a tensor not on the device is copied first, on the
    transfer stream); returns bytes sent.

    Several sending ranks: ``src`` is the first one's rank and this rank is sender ``sender``; it
    sends what ``metadata`` gives it (``tensors[name]`` is its piece of a split tensor) and takes
    part in the other senders' broadcasts with scratch buffers (at most two buckets' worth).

    The receivers must have accepted the push (the announce) before: on CUDA everything is enqueued
    and waited for here, bounded by the group's timeout. ``plan``: ``plan_buckets(metadata,
    bucket_bytes)`` when the caller has it already. ``before_first``: called before any byte is
    sent (the receivers' agreement); False → nothing is sent and 0 is returned.
    """
    plan = plan if plan is not None else plan_buckets(list(metadata), bucket_bytes)
    device = comm.device
    scratch: list[torch.Tensor | None] = [None, None]

    def sources(k: int, bucket: Bucket) -> tuple[list[torch.Tensor], list[int]]:
        out: list[torch.Tensor] = []
        roots: list[int] = []
        foreign: list[tuple[int, int]] = []  # (position in out, bytes) sent by another rank
        for slot in bucket.slots:
            meta = metadata[slot.index]
            for owner, _, nbytes in meta.wire_parts():
                roots.append(src + owner)
                if owner != sender:
                    foreign.append((len(out), nbytes))
                    out.append(_EMPTY)
                    continue
                t = tensors[meta.name]
                out.append(as_bytes(t if t.device == device else t.to(device, non_blocking=True)))
        if foreign:  # another rank's bytes pass through here: into scratch, reused every other bucket
            need = sum(n for _, n in foreign)
            buf = scratch[k % 2]
            if buf is None or buf.numel() < need:
                buf = scratch[k % 2] = torch.empty(need, dtype=torch.uint8, device=device)
            at = 0
            for pos, n in foreign:
                out[pos] = buf[at : at + n]
                at += n
        return out, roots

    if device.type != "cuda":
        if before_first is not None and not before_first():
            return 0
        for k, bucket in enumerate(plan):
            comm.broadcast_group(*sources(k, bucket))
        return sum(b.nbytes for b in plan)
    caller = torch.cuda.current_stream(device)
    main, _ = _streams(device)  # a wedged transfer must not block the caller's stream
    main.wait_stream(caller)  # the parameters were produced on the caller's stream
    if before_first is not None and not before_first():
        return 0
    sent: list[torch.cuda.Event] = []
    with torch.cuda.stream(main):
        for k, bucket in enumerate(plan):
            if k >= 2:
                # two buckets in flight (a progress bar follows the link), and a dead peer is
                # noticed here, within the timeout; the scratch buffer of bucket k-2 is free again
                comm.wait_event(sent[k - 2])
            comm.broadcast_group(*sources(k, bucket))
            done = torch.cuda.Event()
            done.record(main)
            sent.append(done)
        comm.synchronize()
    caller.wait_stream(main)  # the caller may overwrite the parameters once this returns
    return sum(b.nbytes for b in plan)


_EMPTY = torch.empty(0, dtype=torch.uint8)


@dataclass
class Received:
    bytes: int = 0
    in_place_bytes: int = 0  # of ``bytes``, received straight where ``place`` said
    error: str | None = None
    applied_any: bool = False
    staged: list[tuple[Bucket, torch.Tensor]] = field(default_factory=list)
    # time.monotonic() when the first receive's call began (its targets resolved) and returned
    posting_at: float | None = None
    posted_at: float | None = None
    # ... and when every bucket's receive was enqueued (the final wait for the GPU follows)
    enqueued_at: float | None = None
    # loading with ``place``: bytes that went through the loader instead, by why (``why_not_in_place``),
    # and the first tensor of each kind with its detail
    through_loader: dict[str, int] = field(default_factory=dict)
    through_loader_example: dict[str, str] = field(default_factory=dict)


def _same(buf: torch.Tensor) -> torch.Tensor:
    return buf


def receive_buckets(
    comm: Communicator,
    metadata: Sequence[ParamMeta],
    bucket_bytes: int,
    src: int,
    load: Loader | None,
    out: Received | None = None,
    plan: list[Bucket] | None = None,
    place: Placer | None = None,
) -> Received:
    """Receive every bucket; ``load`` each as it arrives, or stage them all when ``load`` is None.

    ``src``: the rank of the trainer's first sending rank (a split tensor's pieces come from
    ``src + piece.sender``). A failing ``load`` does not stop the receive (the trainer's broadcast must not hang); its
    error is returned. Communication failures raise ``CommunicatorError``; pass ``out`` to see,
    after such a failure, whether weights may already have been written (``applied_any``).
    ``place`` (loading only): where to receive a tensor in place, skipping ``load``.
    """
    metas = list(metadata)
    receiver = _BucketReceiver(
        comm,
        metas,
        src,
        load,
        out if out is not None else Received(),
        place if load is not None else None,  # staging never writes in place
    )
    plan = plan if plan is not None else plan_buckets(metas, bucket_bytes)
    if load is None or comm.device.type != "cuda":
        got = _receive_in_turn(receiver, plan)
    else:
        got = _receive_pipelined(receiver, plan)
    _say_once_what_went_through_the_loader(comm, plan, got)
    return got


# per group, how many pushes of each layout (by its plan's id) were received: the first of a layout
# goes through the loader by design (the copy plan learns where each name lands from it)
_PUSHES: weakref.WeakKeyDictionary[Communicator, dict[int, int]] = weakref.WeakKeyDictionary()


def _say_once_what_went_through_the_loader(comm: Communicator, plan: list[Bucket], got: Received) -> None:
    """One log line per group and layout where its second push, which could land in place, did
    not, wholly: a push through the loader costs CPU time per tensor, every time."""
    seen = _PUSHES.setdefault(comm, {})
    n = seen[id(plan)] = seen.get(id(plan), 0) + 1
    if n != 2 or not got.through_loader or got.error is not None:
        return
    log.info(
        "%d of %d bytes of this push went through the loader, not straight into the parameters: %s",
        sum(got.through_loader.values()),
        got.bytes,
        "; ".join(
            f"{kind} ({nbytes} bytes, e.g. {got.through_loader_example[kind]})"
            for kind, nbytes in got.through_loader.items()
        ),
    )


def why_not_in_place(
    meta: ParamMeta, target: torch.Tensor | None, device: torch.device
) -> tuple[str, str] | None:
    """Why a pushed tensor cannot be received straight into ``target`` (its parameter view), as
    (kind, detail), or None where it can: only an exact fit is, since a cast or a reshape is the
    loader's and a wrong buffer corrupts."""
    if target is None:
        return "no place", "no parameter view is known for it (not learned yet, or the loader transforms it)"
    pushed = torch_dtype(meta.dtype)
    if target.dtype != pushed:
        return "dtype", f"served as {target.dtype}, pushed as {pushed}"
    if tuple(target.shape) != tuple(meta.shape):
        return "shape", f"served as {tuple(target.shape)}, pushed as {tuple(meta.shape)}"
    if not target.is_contiguous():
        return "layout", f"its parameter view is strided {tuple(target.stride())}"
    if target.device != device:
        return "device", f"served on {target.device}, received on {device}"
    return None


@dataclass
class _Landed:
    """A bucket received wholly in place, as worked out the last time: reused while ``place``
    returns the same objects for its tensors (a copy plan keeps its parameter views), so a repeat
    push does no per-tensor checks, and the transport sees the same targets list."""

    bucket: Bucket
    places: list[torch.Tensor | None]
    targets: list[torch.Tensor]
    roots: list[int]
    rest: Bucket  # nothing left for the loader
    in_place_bytes: int


# Buckets worked out per group, by the bucket object's id (checked: the entry holds the bucket).
KEPT_BUCKETS = 1024
_LANDED: weakref.WeakKeyDictionary[Communicator, dict[int, _Landed]] = weakref.WeakKeyDictionary()


@dataclass
class _BucketReceiver:
    """One receive's copy: where each bucket's bytes land (in place, in the bucket buffer, or
    received contiguous and copied into a strided piece), and loading what landed in the buffer."""

    comm: Communicator
    metas: list[ParamMeta]
    src: int
    load: Loader | None
    out: Received
    place: Placer | None

    def _landing(self, meta: ParamMeta, nbytes: int, target: torch.Tensor | None) -> torch.Tensor | None:
        """The bytes of ``target`` (where ``place`` puts the tensor) if it can be received there in
        place, else None (the bucket buffer; why is counted in ``out.through_loader``)."""
        if self.place is None:
            return None
        why = why_not_in_place(meta, target, self.comm.device)
        if why is not None:
            kind, detail = why
            self.out.through_loader[kind] = self.out.through_loader.get(kind, 0) + nbytes
            self.out.through_loader_example.setdefault(kind, f"{meta.name}: {detail}")
            return None
        assert target is not None  # no reason: a target that fits
        self.out.in_place_bytes += nbytes
        return target.view(-1).view(torch.uint8)

    def post(self, bucket: Bucket, buffer: Callable[[], torch.Tensor]) -> Bucket:
        """Post the bucket's receive (on the current stream); returns what of it lands in the
        bucket buffer (``buffer()``, asked for only when something does)."""
        device, out = self.comm.device, self.out
        places = [self.place(self.metas[s.index]) for s in bucket.slots] if self.place is not None else None
        landed = _LANDED.setdefault(self.comm, {}).get(id(bucket)) if places is not None else None
        if (
            landed is not None
            and landed.bucket is bucket
            and places is not None
            and all(a is b for a, b in zip(places, landed.places, strict=True))
        ):  # the same places as last time: the same targets, in place (a transport may key on the list)
            out.in_place_bytes += landed.in_place_bytes
            out.applied_any = True
            self._broadcast(landed.targets, landed.roots, [], bucket.nbytes)
            return landed.rest
        in_place_before = out.in_place_bytes
        targets: list[torch.Tensor] = []
        roots: list[int] = []
        scattered: list[tuple[torch.Tensor, torch.Tensor]] = []  # (piece received, its place)
        left = []
        for i, slot in enumerate(bucket.slots):
            meta = self.metas[slot.index]
            whole = self._landing(meta, slot.nbytes, places[i] if places is not None else None)
            if whole is None:
                whole = buffer()[slot.offset : slot.offset + slot.nbytes]
                left.append(slot)
            for owner, piece, nbytes in meta.wire_parts():
                roots.append(self.src + owner)
                if piece is None:
                    targets.append(whole)
                    continue
                contiguous = piece_bytes(whole, meta, piece)
                if (
                    contiguous is None
                ):  # e.g. a split along columns: received contiguous, then copied in place
                    contiguous = torch.empty(nbytes, dtype=torch.uint8, device=device)
                    typed = whole.view(torch_dtype(meta.dtype)).view(meta.shape)
                    scattered.append((contiguous, piece_view(typed, meta, piece)))
                targets.append(contiguous)
        rest = bucket
        if len(left) < len(bucket.slots):
            out.applied_any = True  # parameters are written as the bytes arrive
            rest = bucket.model_copy(update={"slots": tuple(left)})
        if places is not None and not left and not scattered:
            kept = _LANDED.setdefault(self.comm, {})
            if len(kept) >= KEPT_BUCKETS:
                kept.clear()
            kept[id(bucket)] = _Landed(
                bucket, places, targets, roots, rest, out.in_place_bytes - in_place_before
            )
        self._broadcast(targets, roots, scattered, bucket.nbytes)
        return rest

    def _broadcast(
        self,
        targets: list[torch.Tensor],
        roots: list[int],
        scattered: list[tuple[torch.Tensor, torch.Tensor]],
        nbytes: int,
    ) -> None:
        out = self.out
        if out.posting_at is None:
            out.posting_at = time.monotonic()
        self.comm.broadcast_group(targets, roots)
        for received, dst in scattered:  # stream-ordered after the receive (gloo: it is done)
            dst.copy_(received.view(dst.dtype).view(dst.shape))
        out.bytes += nbytes
        if out.posted_at is None:
            out.posted_at = time.monotonic()

    def apply(self, bucket: Bucket, buf: torch.Tensor) -> None:
        """Load what landed in the bucket buffer; a failure is kept, and the receive goes on."""
        if self.out.error is not None or self.load is None:
            return
        self.out.applied_any = True
        try:
            self.load(list(unpack_bucket(bucket, self.metas, buf)))
        except Exception as exc:  # keep receiving; the caller reports it in the status reduction
            self.out.error = f"loading parameters failed: {type(exc).__name__}: {exc}"


def _receive_in_turn(rx: _BucketReceiver, plan: list[Bucket]) -> Received:
    """Staging (every bucket kept in ``out.staged``), or loading on CPU: one bucket after the other."""
    device = rx.comm.device
    # staging on CUDA runs on the transfer stream: scoring kernels (an atomic update keeps
    # serving) must never queue behind a receive that waits for the trainer
    side = torch.cuda.stream(_streams(device)[0]) if device.type == "cuda" else contextlib.nullcontext()
    with side:
        reuse: torch.Tensor | None = None
        for bucket in plan:
            if rx.load is None or reuse is None or reuse.numel() < bucket.nbytes:
                reuse = torch.empty(bucket.nbytes, dtype=torch.uint8, device=device)
            buf = reuse[: bucket.nbytes]
            rest = rx.post(bucket, functools.partial(_same, buf))
            if rx.load is None:
                rx.out.staged.append((bucket, buf))
            elif rest.slots:
                rx.apply(rest, buf)
        rx.out.enqueued_at = time.monotonic()
        rx.comm.synchronize()
    return rx.out


def _receive_pipelined(rx: _BucketReceiver, plan: list[Bucket]) -> Received:
    """Loading on CUDA: bucket k+1 arrives on the transfer stream while bucket k loads on the load
    stream, through two buffers; the CPU waits (bounded, ``comm.wait_event``) when it runs more
    than ``RECEIVE_LOOKAHEAD`` buckets ahead, so a dead trainer is noticed within one bucket."""
    device, comm = rx.comm.device, rx.comm
    caller = torch.cuda.current_stream(device)
    main, load_stream = _streams(device)  # a wedged transfer must not block the stream scoring uses
    main.wait_stream(caller)
    load_stream.wait_stream(caller)
    buffers = _BucketBuffers(max(b.nbytes for b in plan), min(2, len(plan)), device)
    loaded: list[torch.cuda.Event | None] = [None] * buffers.count
    history: list[torch.cuda.Event] = []
    for k, bucket in enumerate(plan):
        i = k % buffers.count
        if k >= RECEIVE_LOOKAHEAD:
            # the CPU stays a few buckets ahead, no more: each bucket is bounded by the timeout
            # (a dead trainer is noticed within it), not only the whole transfer
            comm.wait_event(history[k - RECEIVE_LOOKAHEAD])
        with torch.cuda.stream(main):
            reused = loaded[i]
            if reused is not None:
                main.wait_event(reused)  # the buffer's previous bucket is loaded: on the GPU, not here
            rest = rx.post(bucket, functools.partial(buffers.get, i, bucket.nbytes))
            arrived = torch.cuda.Event()
            arrived.record(main)
        if rest.slots:
            with torch.cuda.stream(load_stream):
                load_stream.wait_event(arrived)
                rx.apply(rest, buffers.get(i, bucket.nbytes))  # enqueues the copies out of it on this stream
                done = torch.cuda.Event()
                done.record(load_stream)
        else:  # everything landed in place: nothing to load, the buffer is free once it arrived
            done = arrived
        loaded[i] = done
        history.append(done)
    rx.out.enqueued_at = time.monotonic()
    with torch.cuda.stream(main):
        main.wait_stream(load_stream)
        comm.synchronize()  # bounded: a dead trainer is noticed here, and the group aborted
    caller.wait_stream(main)
    return rx.out


class _BucketBuffers:
    """``count`` bucket buffers of ``largest`` bytes, made when first needed: with the per-tensor
    wire, once every tensor is received in place, none is (a fresh 1 GiB allocation can cost a
    cudaMalloc on the critical path)."""

    def __init__(self, largest: int, count: int, device: torch.device) -> None:
        self.largest, self.count, self.device = largest, count, device
        self._made: list[torch.Tensor | None] = [None] * count

    def get(self, i: int, nbytes: int) -> torch.Tensor:
        made = self._made[i]
        if made is None:
            made = self._made[i] = torch.empty(self.largest, dtype=torch.uint8, device=self.device)
        return made[:nbytes]
