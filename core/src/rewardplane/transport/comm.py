"""The data plane: torch.distributed process groups made from a TCPStore, without the global
default group (the trainer may use torch.distributed for its own DDP).

NCCL on CUDA tensors, gloo on CPU — chosen automatically. The trainer hosts the store and takes
the last rank; server workers take ranks from their rank offset.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from collections.abc import Sequence
from datetime import timedelta
from typing import Any, Literal, Protocol

import torch
import torch.distributed as dist

log = logging.getLogger(__name__)

# "ipc": the same-host transport (``same_host``), which ``group.open_group`` builds
Backend = Literal["auto", "nccl", "gloo", "ipc"]
# How long a wait for the GPU polls without sleeping (seconds): a push's waits are short, and a
# sleep costs at least ~60 us (the kernel's timer slack) plus a wake-up on a host whose idle CPUs
# wake slowly. 2 ms covers the short waits inside a push (docs/weight-sync.md, "Where a push's
# time goes").
SPIN_S = 2e-3


class TensorCommunicator(Protocol):
    """What a weight transfer needs of a process group (``Communicator`` is the real one; the SDK
    wraps it, e.g. to drive a progress bar)."""

    device: torch.device

    def broadcast(self, tensor: torch.Tensor, src: int) -> None: ...

    def broadcast_group(self, tensors: Sequence[torch.Tensor], src: int | Sequence[int]) -> None: ...

    def wait_event(self, done: torch.cuda.Event) -> None: ...

    def synchronize(self) -> None: ...

    def max_flag(self, value: int) -> int: ...

    def close(self) -> None: ...


class CommunicatorError(RuntimeError):
    pass


def group_store(store: dist.Store, group_id: str) -> dist.Store:
    """Group ``group_id``'s namespace in the trainer's store (``Communicator.store``): reachable
    before the group forms, for what its ranks publish ahead of it."""
    return dist.PrefixStore(f"rewardplane/{group_id}/", store)


def resolve_backend(backend: Backend, device: torch.device) -> Literal["nccl", "gloo"]:
    if backend == "auto":
        return "nccl" if device.type == "cuda" else "gloo"
    if backend == "ipc":
        raise CommunicatorError(
            "backend ipc is the same-host transport: form the group with group.open_group"
        )
    if backend == "nccl" and device.type != "cuda":
        raise CommunicatorError("backend nccl needs a CUDA device; use backend gloo (or auto) on CPU")
    return backend


def first_line(exc: BaseException) -> str:
    """An error's message without the C++ frames torch appends to c10d's ("Exception raised
    from ...", "frame #0: ..."): what went wrong, on one line."""
    text = str(exc).split("\nException raised from", 1)[0]
    return " ".join(text.split()) or type(exc).__name__


def _wait_reachable(host: str, port: int, timeout_s: float) -> None:
    """Connect to the rendezvous until it accepts or ``timeout_s`` passes. Only then does c10d try:
    its client logs each failed attempt, with about 20 lines of C++ frames, straight to stderr."""
    deadline = time.monotonic() + timeout_s
    while True:
        left = deadline - time.monotonic()
        try:
            socket.create_connection((host, port), timeout=max(0.05, min(1.0, left))).close()
            return
        except OSError as exc:
            if time.monotonic() >= deadline:
                raise TimeoutError(f"nothing accepted a connection there ({exc})") from exc
            time.sleep(min(0.1, max(0.0, deadline - time.monotonic())))


def create_store(
    host: str, port: int, *, is_master: bool, world_size: int | None, timeout_s: float
) -> dist.TCPStore:
    """A TCPStore; ``world_size`` None when the host does not know yet how many will join."""
    try:
        if not is_master:
            _wait_reachable(host, port, timeout_s)
        return dist.TCPStore(
            host,
            port,
            world_size=world_size,
            is_master=is_master,
            timeout=timedelta(seconds=timeout_s),  # also the bound of every later wait on the store
            wait_for_workers=False,
        )
    except Exception as exc:  # the C++ errors say little; say what to check
        log.debug("the store at %s:%d failed", host, port, exc_info=True)
        role = "host the rendezvous on" if is_master else "reach the trainer's rendezvous at"
        raise CommunicatorError(
            f"could not {role} {host}:{port} within {timeout_s:.0f}s ({first_line(exc)}); check that the "
            "address is reachable from every server, the port is free on the trainer, and no firewall blocks it"
        ) from exc


class Communicator:
    """One process group for weight pushes: broadcast of flat buckets, a status reduction, close."""

    def __init__(
        self,
        store: dist.Store,
        *,
        rank: int,
        world_size: int,
        device: torch.device,
        backend: Backend = "auto",
        timeout_s: float = 120.0,
        group_id: str = "default",
        senders: int = 1,
    ) -> None:
        prefixed = self._join(store, rank, world_size, device, timeout_s, group_id, senders)
        device = self.device
        self.backend: str = resolve_backend(backend, device)
        if self.backend == "nccl":
            # On a collective timeout, abort the communicators but keep the process: a reward
            # server must survive a trainer that died mid-push (the default tears it down).
            os.environ.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "2")
            torch.cuda.set_device(device)
            opts = dist.ProcessGroupNCCL.Options()
            # Our own bounded waits (wait_event/synchronize) fire first and abort cleanly; the
            # watchdog is the backstop.
            opts._timeout = self.timeout * 2 + timedelta(seconds=10)
            # Any: torch's stubs declare no collectives on the backend classes we call them on.
            self.pg: Any = dist.ProcessGroupNCCL(prefixed, rank, world_size, opts)
        else:
            self.pg = dist.ProcessGroupGloo(prefixed, rank, world_size, self.timeout)

    def _join(
        self,
        store: dist.Store,
        rank: int,
        world_size: int,
        device: torch.device,
        timeout_s: float,
        group_id: str,
        senders: int,
    ) -> dist.Store:
        """What every transport's group holds: ranks, device, timeout, the group's namespace in the
        store (returned), the flag state."""
        if not 1 <= senders < world_size:
            raise CommunicatorError(f"{senders} sending rank(s) do not fit a group of {world_size}")
        self.rank = rank
        self.world_size = world_size
        # the trainer's sending ranks are the last ones: sender i is rank first_sender + i
        self.senders = senders
        self.first_sender = world_size - senders
        if device.type == "cuda" and device.index is None:  # NCCL (and CUDA IPC) need a concrete device
            device = torch.device("cuda", torch.cuda.current_device())
        self.device = device
        self.timeout = timedelta(seconds=timeout_s)
        # the group's namespace in the store: pushes started from the data plane signal through it
        self.store = group_store(store, group_id)
        self._closed = False
        # the status reductions' flag (device), its pinned read-back and their stream: made once
        self._flag: tuple[torch.Tensor, torch.Tensor, torch.cuda.Stream] | None = None
        # time.monotonic() the last reduction's call began and returned (enqueued): a push's timeline
        self.flag_calling: float | None = None
        self.flag_enqueued: float | None = None
        return self.store

    def _wait(self, work: dist.Work, what: str) -> None:
        try:
            ok = work.wait(self.timeout)
        except Exception as exc:
            self.abort()
            raise CommunicatorError(
                f"{what} failed on rank {self.rank}/{self.world_size} ({exc}); a peer probably died or "
                f"timed out after {self.timeout.total_seconds():.0f}s"
            ) from exc
        if ok is False:
            self.abort()
            raise CommunicatorError(
                f"{what} timed out after {self.timeout.total_seconds():.0f}s on rank {self.rank}"
            )

    def broadcast(self, tensor: torch.Tensor, src: int) -> None:
        """Broadcast ``tensor`` from rank ``src``.

        NCCL: enqueued, ordered on the current CUDA stream; the CPU does not wait, so packing and
        loading of neighbouring buckets overlap with the transfer. Call ``synchronize`` (bounded)
        before trusting the result on the CPU. gloo: returns when done (bounded by the timeout).
        """
        opts = dist.BroadcastOptions()
        opts.rootRank = src
        opts.rootTensor = 0
        work = self.pg.broadcast([tensor], opts)
        if self.backend == "nccl":
            work.wait()  # stream-ordered only: no CPU block
        else:
            self._wait(work, "broadcast")

    def broadcast_group(self, tensors: Sequence[torch.Tensor], src: int | Sequence[int]) -> None:
        """Broadcast several tensors as one NCCL group (one launch; the peers must post the same
        sizes in the same order, into buffers of their choice), each from rank ``src`` (one rank
        for all, or one per tensor: several trainer ranks send their own parts). gloo: one
        broadcast after the other. Ordering and waiting as ``broadcast``."""
        roots = [src] * len(tensors) if isinstance(src, int) else list(src)
        if len(roots) != len(tensors):
            raise ValueError(f"{len(tensors)} tensors but {len(roots)} source ranks")
        if self.backend != "nccl":
            for tensor, root in zip(tensors, roots, strict=True):
                self.broadcast(tensor, root)
            return
        self.pg._start_coalescing()  # the backend's own: no device argument
        try:
            for tensor, root in zip(tensors, roots, strict=True):
                opts = dist.BroadcastOptions()
                opts.rootRank = root
                opts.rootTensor = 0
                self.pg.broadcast([tensor], opts)
        except BaseException:
            # half a group must never be launched: the peers would pair it with other buffers
            self.abort()
            raise
        self.pg._end_coalescing().wait()  # stream-ordered only: no CPU block

    def exchange(
        self, sends: Sequence[tuple[torch.Tensor, int]], recvs: Sequence[tuple[torch.Tensor, int]]
    ) -> None:
        """Point-to-point messages as one group: each ``(tensor, peer rank)`` of ``sends`` goes to
        its peer, each of ``recvs`` is filled from its peer. Messages between two ranks pair in the
        order they are posted. NCCL: one launch over the group's communicator, stream-ordered (no
        CPU block). gloo: returns when every message is done (bounded by the timeout)."""
        if self.backend != "nccl":
            works = [self.pg.send([t], peer, 0) for t, peer in sends]
            works += [self.pg.recv([t], peer, 0) for t, peer in recvs]
            for work in works:
                self._wait(work, "point-to-point transfer")
            return
        if not sends and not recvs:
            return
        self.pg._start_coalescing()
        try:
            for t, peer in sends:
                self.pg.send([t], peer, 0)
            for t, peer in recvs:
                self.pg.recv([t], peer, 0)
        except BaseException:
            self.abort()  # half a group must never be launched
            raise
        self.pg._end_coalescing().wait()  # stream-ordered only: no CPU block

    def synchronize(self) -> None:
        """Wait (bounded) until the work enqueued on the current stream is done; abort on timeout,
        so a dead peer cannot leave a collective hanging on the GPU."""
        if self.backend != "nccl":
            return
        done = torch.cuda.Event()
        done.record(torch.cuda.current_stream(self.device))
        self.wait_event(done)

    def wait_event(self, done: torch.cuda.Event) -> None:
        """Bounded CPU wait for a CUDA event; aborts the group on timeout."""
        start = time.monotonic()
        deadline = start + self.timeout.total_seconds()
        delay = 1e-5
        while not done.query():
            now = time.monotonic()
            if now > deadline:
                self.abort()
                raise CommunicatorError(
                    f"transfer did not finish within {self.timeout.total_seconds():.0f}s on rank {self.rank}; "
                    "a peer probably died. The group was aborted; form a new one for the next push"
                )
            if now - start < SPIN_S:
                time.sleep(0)  # these waits sit on every push's critical path: only yield the GIL
                continue
            time.sleep(delay)
            # then poll finely (a 1 ms poll cost ~1 ms per wait), coarsely once the wait is long
            delay = min(delay * 2, 5e-5 if now - start < 0.05 else 1e-3)

    def max_flag(self, value: int) -> int:
        """All ranks learn the largest value: a cheap way to agree that every rank succeeded.

        NCCL: on a stream of its own, into a flag kept on the device and read back through pinned
        memory, so it never queues behind work on the default stream (an atomic push's reductions
        run while the engine scores) and costs no pageable copy or blocking ``item()``."""
        opts = dist.AllreduceOptions()
        opts.reduceOp = dist.ReduceOp.MAX  # type: ignore[assignment]  # stubs: the enum member, not the op
        if self.backend != "nccl":
            t = torch.tensor([value], dtype=torch.int32)
            self.flag_calling = time.monotonic()
            work = self.pg.allreduce([t], opts)
            self.flag_enqueued = time.monotonic()
            self._wait(work, "status reduction")
            return int(t.item())
        flag, host, stream = self._flag_buffers()
        with torch.cuda.stream(stream):
            flag.fill_(value)
            self.flag_calling = time.monotonic()
            self.pg.allreduce([flag], opts).wait()  # stream-ordered only
            self.flag_enqueued = time.monotonic()
            host.copy_(flag, non_blocking=True)
            done = torch.cuda.Event()
            done.record(stream)
        self.wait_event(done)
        return int(host[0])

    def _flag_buffers(self) -> tuple[torch.Tensor, torch.Tensor, torch.cuda.Stream]:
        if self._flag is None:
            self._flag = (
                torch.zeros(1, dtype=torch.int32, device=self.device),
                torch.zeros(1, dtype=torch.int32, pin_memory=True),
                torch.cuda.Stream(self.device),
            )
        return self._flag

    def barrier(self) -> None:
        self.max_flag(0)

    def _release(self) -> Any:
        """The process group, no longer reachable from this communicator. A gloo group closes its
        connections only when its last reference goes (its abort and shutdown leave them open, so
        a peer blocked in a collective would wait for its timeout); the caller drops this one."""
        pg, self.pg = self.pg, _Released(self.backend)
        return pg

    def abort(self) -> None:
        """Tear the group down so nothing stays blocked on a dead peer. Never a graceful shutdown
        here: that waits for the pending (hung) collectives."""
        if self._closed:
            return
        self._closed = True
        if self.backend == "gloo":
            _drop_gloo(self._release(), "abort")
            return

        def abort() -> None:
            try:
                self.pg.abort()
            except Exception:  # the NCCL watchdog aborts the communicators after its timeout anyway
                log.warning("aborting the process group failed", exc_info=True)

        # ncclCommAbort can itself block on a wedged peer: never let it hold the caller forever.
        t = threading.Thread(target=abort, name="pg-abort", daemon=True)
        t.start()
        t.join(timeout=10)

    def close(self) -> None:
        if self.backend == "nccl":
            # A graceful NCCL shutdown waits for the peers to shut down too (a reward server's close
            # hung until the trainer closed its side). Nothing is in flight at close: abort is local.
            self.abort()
            return
        if not self._closed:
            self._closed = True
            _drop_gloo(self._release(), "shutdown")


def _drop_gloo(pg: Any, how: str) -> None:
    """End a gloo group: ``how`` (abort or shutdown), then its last reference goes, which closes
    its connections, so a peer blocked on this rank fails at once ("Connection closed by peer").
    That takes milliseconds; the teardown waits only for a collective of this rank still in flight
    (none, where the collectives' own thread aborts or closes), so it runs on a thread the caller
    waits for within a bound. Waited for, not left running: a process that exits while a group is
    being torn down is ended by the C++ runtime (std::terminate)."""
    group = [pg]
    del pg

    def drop() -> None:
        g = group.pop()
        try:
            getattr(g, how)()
        except Exception:
            log.debug("gloo group %s failed", how, exc_info=True)
        del g

    t = threading.Thread(target=drop, name=f"gloo-{how}", daemon=True)
    t.start()
    t.join(timeout=10)
    if t.is_alive():
        log.warning("a gloo group's teardown still waits for a collective of this rank after 10 s")


class _Released:
    """Where a closed communicator's process group was: any use names the cause."""

    def __init__(self, backend: str) -> None:
        self._backend = backend

    def __getattr__(self, name: str) -> Any:
        raise CommunicatorError(
            f"this {self._backend} group was closed or aborted; join a new group for the next push"
        )


def default_device() -> torch.device:
    if torch.cuda.is_available():
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", torch.cuda.current_device())))
    return torch.device("cpu")
