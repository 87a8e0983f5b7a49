"""Moving flat buckets over a ``Communicator``, on both sides of a push.

On CUDA the transfer is pipelined with two bucket buffers: the trainer packs bucket k+1 on a side
stream while bucket k is on the wire, and a server loads bucket k on a side stream while bucket
k+1 arrives, so copies hide behind the link. Nothing waits on the CPU until the end, where one
bounded ``synchronize`` catches a dead peer. On CPU (gloo) it runs bucket by bucket.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

import torch

from .buckets import pack_bucket, unpack_bucket
from .comm import Communicator
from .protocol import Bucket, ParamMeta, plan_buckets

Loader = Callable[[list[tuple[str, torch.Tensor]]], None]


def send_buckets(
    comm: Communicator, metadata: Sequence[ParamMeta], tensors: Mapping[str, torch.Tensor], bucket_bytes: int,
    src: int, before_wait: Callable[[], None] | None = None,
    failed: Callable[[], BaseException | None] | None = None,
) -> int:
    """Broadcast ``tensors`` (ordered as ``metadata``) from rank ``src``; returns bytes sent.

    ``before_wait`` runs after everything is enqueued and before the bounded wait for completion
    (e.g. to confirm that the servers accepted the announce sent concurrently); if it raises, the
    group is aborted, since the enqueued transfer can then never complete. ``failed`` is polled
    while waiting for buckets in flight (CUDA), so a refused announce surfaces at once rather than
    after the transfer's timeout.
    """
    plan = plan_buckets(list(metadata), bucket_bytes)
    device = comm.device
    if device.type != "cuda":
        buf: torch.Tensor | None = None
        if before_wait is not None:
            before_wait()  # CPU broadcasts block: the announce must be accepted before them
        for bucket in plan:
            buf = pack_bucket(bucket, metadata, tensors, device, out=buf)
            comm.broadcast(buf[: bucket.nbytes], src)
        return sum(b.nbytes for b in plan)
    caller = torch.cuda.current_stream(device)
    main = torch.cuda.Stream(device)  # a wedged transfer must not block the caller's stream
    pack_stream = torch.cuda.Stream(device)
    main.wait_stream(caller)
    pack_stream.wait_stream(caller)  # the parameters were produced on the caller's stream
    largest = max(b.nbytes for b in plan)
    bufs = [torch.empty(largest, dtype=torch.uint8, device=device) for _ in range(min(2, len(plan)))]
    free: list[torch.cuda.Event | None] = [None] * len(bufs)
    with torch.cuda.stream(main):
        for k, bucket in enumerate(plan):
            i = k % len(bufs)
            if free[i] is not None:
                # at most two buckets in flight, and a dead peer is noticed here, within the timeout
                comm.wait_event(free[i], abort_if=failed)
            with torch.cuda.stream(pack_stream):
                pack_bucket(bucket, metadata, tensors, device, out=bufs[i])
                packed = torch.cuda.Event()
                packed.record(pack_stream)
            main.wait_event(packed)
            comm.broadcast(bufs[i][: bucket.nbytes], src)
            done = torch.cuda.Event()
            done.record(main)
            free[i] = done
        if before_wait is not None:
            try:
                before_wait()
            except BaseException:
                comm.abort()
                raise
        comm.synchronize()
    return sum(b.nbytes for b in plan)


@dataclass
class Received:
    bytes: int = 0
    error: str | None = None
    applied_any: bool = False
    staged: list[tuple[Bucket, torch.Tensor]] = field(default_factory=list)
    posted_at: float | None = None  # time.monotonic() when the first receive was posted


def receive_buckets(
    comm: Communicator, metadata: Sequence[ParamMeta], bucket_bytes: int, src: int, load: Loader | None,
    out: Received | None = None, plan: list[Bucket] | None = None,
) -> Received:
    """Receive every bucket; ``load`` each as it arrives, or stage them all when ``load`` is None.

    A failing ``load`` does not stop the receive (the trainer's broadcast must not hang); its
    error is returned. Communication failures raise ``CommunicatorError``; pass ``out`` to see,
    after such a failure, whether weights may already have been written (``applied_any``).
    """
    metas = list(metadata)
    plan = plan if plan is not None else plan_buckets(metas, bucket_bytes)
    device = comm.device
    out = out if out is not None else Received()

    def apply(bucket: Bucket, buf: torch.Tensor) -> None:
        if out.error is not None or load is None:
            return
        out.applied_any = True
        try:
            load(list(unpack_bucket(bucket, metas, buf)))
        except Exception as exc:  # keep receiving; the caller reports it in the status reduction
            out.error = f"loading parameters failed: {type(exc).__name__}: {exc}"

    if load is None or device.type != "cuda":
        reuse: torch.Tensor | None = None
        for bucket in plan:
            if load is None or reuse is None or reuse.numel() < bucket.nbytes:
                reuse = torch.empty(bucket.nbytes, dtype=torch.uint8, device=device)
            buf = reuse[: bucket.nbytes]
            out.posted_at = out.posted_at or time.monotonic()
            comm.broadcast(buf, src)
            out.bytes += bucket.nbytes
            if load is None:
                out.staged.append((bucket, buf))
            else:
                apply(bucket, buf)
        comm.synchronize()
        return out

    caller = torch.cuda.current_stream(device)
    main = torch.cuda.Stream(device)  # a wedged transfer must not block the stream scoring uses
    load_stream = torch.cuda.Stream(device)
    main.wait_stream(caller)
    largest = max(b.nbytes for b in plan)
    bufs = [torch.empty(largest, dtype=torch.uint8, device=device) for _ in range(min(2, len(plan)))]
    loaded: list[torch.cuda.Event | None] = [None] * len(bufs)
    with torch.cuda.stream(main):
        for k, bucket in enumerate(plan):
            i = k % len(bufs)
            if loaded[i] is not None:
                # at most two buckets in flight, and a dead trainer is noticed here, within the timeout
                comm.wait_event(loaded[i])
            buf = bufs[i][: bucket.nbytes]
            comm.broadcast(buf, src)
            out.posted_at = out.posted_at or time.monotonic()
            out.bytes += bucket.nbytes
            arrived = torch.cuda.Event()
            arrived.record(main)
            with torch.cuda.stream(load_stream):
                load_stream.wait_event(arrived)
                apply(bucket, buf)
                done = torch.cuda.Event()
                done.record(load_stream)
            loaded[i] = done
        main.wait_stream(load_stream)
        comm.synchronize()
    caller.wait_stream(main)
    return out
