"""The same-host transport: a ``Communicator`` whose bytes move through memory both processes
map (CUDA IPC on one GPU, shared memory on CPU) instead of NCCL or gloo, for a trainer whose reward
server runs on its own GPUs (or host). The signalling goes through shared memory that each rank
polls (``same_host_board``): the messages saying where each broadcast's tensors are, the status
reductions' flags and the copies' acknowledgements; the group's TCPStore carries only where each
rank's board is and what does not fit it.

A broadcast is one copy: the sender publishes where each tensor lives, and every receiver copies
it straight into its target (a parameter, or a bucket buffer for its loader). What the sender
publishes:

- **exported storages** (CUDA): a storage the trainer kept since the previous push (a parameter)
  is shared once (``_share_cuda_``) and its handle cached on both sides, checked on every push
  (the cached storage object must be the tensor's own: a weak reference); a receiver opens it once.
- **the staging ring**: a storage new since the previous push (e.g. a LoRA-merged weight made for
  this push), and every tensor on CPU, is copied into one of two staging buffers of the sender
  (on a GPU, device memory shared once; on CPU, a file in ``/dev/shm``), which the receivers open
  once and reuse.

At the end of each push (the status reduction after it) both sides drop what it did not use:
exports of storages the trainer freed, a staging buffer no longer needed. So neither side holds
more than the two staging buffers beyond the trainer's own tensors.

The sender's broadcasts return once every receiver acknowledged its copy (``synchronize`` on CUDA,
each broadcast on CPU); every wait is bounded by the group's timeout, and a peer process that is
gone is noticed at once (its pid, where both share a pid namespace; the trainer's store, which
every server reaches, otherwise).

The receiving side is ``same_host_receiver``; the store messages and the shared memory both sides
use are ``same_host_memory``'s.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import time
import uuid
import weakref
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from .comm import SPIN_S, Communicator, CommunicatorError
from .placement import Place
from .same_host_board import FLAG_VALUE_LIMIT, MESSAGE_BODY_LIMIT, SignalBoard
from .same_host_memory import (
    MESSAGE_RING,
    SHM_DIR,
    Entry,
    aligned,
    alive,
    create_for_readers,
    encode,
    flat_bytes,
    message_key,
    unlink,
)
from .same_host_receiver import SameHostReceiver

log = logging.getLogger(__name__)

__all__ = ["SHM_DIR", "SameHostCommunicator", "flat_bytes"]

# How often a long wait looks whether the peer it waits for still runs (seconds).
LIVENESS_S = 0.05


@dataclass
class _Export:
    """A sender's storage shared with the receivers: the handle they open it by."""

    key: str  # short: it travels with every tensor read from here
    storage: weakref.ref[torch.UntypedStorage]
    source: tuple[Any, ...]  # what a receiver needs to open it: sent the first time only
    sent: bool = False

    def entry(self, offset: int, nbytes: int) -> Entry:
        source, self.sent = (() if self.sent else self.source), True
        return self.key, source, offset, nbytes


@dataclass
class _Slot:
    """One of the sender's two staging buffers."""

    buf: torch.Tensor
    export: _Export
    path: str | None = None  # CPU: its file, unlinked once every receiver opened it
    busy_seq: int = -1  # the broadcast that last filled it: reused once that one is acknowledged


@dataclass
class _Exports:
    """What a sending rank shares: its exported storages and staging ring."""

    by_ptr: dict[int, _Export] = field(default_factory=dict)  # by storage data_ptr
    # storages of the previous push and of this one, by weak reference: one alive in both is stable
    known: dict[int, weakref.ref[torch.UntypedStorage]] = field(default_factory=dict)
    seen: dict[int, weakref.ref[torch.UntypedStorage]] = field(default_factory=dict)
    ring: list[_Slot | None] = field(default_factory=lambda: [None, None])
    released: list[str] = field(default_factory=list)  # keys the receivers are to close
    unacked: list[int] = field(default_factory=list)  # broadcasts published, not known copied by all
    acked: int = 0  # of this rank's broadcasts, how many every receiver copied


class SameHostCommunicator(Communicator):
    """A push group whose ranks share one host (see the module's docstring). It keeps
    ``Communicator``'s interface: ``broadcast``, ``broadcast_group``, ``max_flag``, ``synchronize``,
    ``wait_event``, ``close``; point-to-point ``exchange`` is not offered (sliced pushes broadcast).
    A receiving rank's copies are its ``SameHostReceiver``'s."""

    def __init__(
        self,
        store: dist.Store,
        *,
        rank: int,
        world_size: int,
        device: torch.device,
        places: Sequence[Place],
        timeout_s: float = 120.0,
        group_id: str = "default",
        senders: int = 1,
    ) -> None:
        self._join(store, rank, world_size, device, timeout_s, group_id, senders)
        self.backend = "ipc"
        self.group_id = group_id
        me = places[rank]
        # peers whose pid this process can look at (one pid namespace)
        self._pids = {r: p.pid for r, p in enumerate(places) if r != rank and p.pid_ns == me.pid_ns}
        self._seq = 0  # broadcasts so far: every rank makes the same calls in the same order
        self._flags = 0
        self._moved = False  # a broadcast since the last end of a push
        self._exports = _Exports()
        self._token = uuid.uuid4().hex[:8]
        self._keys = 0  # exports made: each gets a key of its own
        # flags and acknowledgements in shared memory; the store keeps only what does not fit a word
        self._board = SignalBoard(
            self.store,
            rank=rank,
            world_size=world_size,
            name=f"{group_id}-{self._token}",
            sender=rank >= self.first_sender,
        )
        self._noted: list[int] = []  # reductions whose flag this rank wrote to the store as a note
        self.receiver = SameHostReceiver(
            self.store,
            rank=rank,
            device=self.device,
            places=places,
            wait=self._poll,
            wait_event=self.wait_event,
            board=self._board,
        )

    # ---- waiting ------------------------------------------------------------------------------

    def _poll(self, ready: Callable[[], bool], what: str, watch: Sequence[int]) -> None:
        """Until ``ready()``; bounded by the timeout, and failing at once when a rank of ``watch``
        has exited or the store's host is gone. Acknowledges finished copies meanwhile."""
        start = time.monotonic()
        deadline = start + self.timeout.total_seconds()
        delay = 1e-5
        looked = start
        while True:
            try:
                if ready():
                    return
                self.receiver.acknowledge(block=False)
            except dist.DistNetworkError as exc:
                self.abort()
                raise CommunicatorError(
                    f"{what} failed on rank {self.rank}: the trainer's store is gone ({exc}); the trainer "
                    "probably died. The group was aborted; form a new one for the next push"
                ) from exc
            now = time.monotonic()
            if now > deadline:
                self.abort()
                raise CommunicatorError(
                    f"{what} timed out after {self.timeout.total_seconds():.0f}s on rank {self.rank}; a peer "
                    "probably died. The group was aborted; form a new one for the next push"
                )
            if now - looked > LIVENESS_S:
                looked = now
                gone = [r for r in watch if not alive(self._pids.get(r))]
                if gone:
                    self.abort()
                    raise CommunicatorError(
                        f"{what} failed on rank {self.rank}: rank(s) {gone} exited. The group was "
                        "aborted; form a new one for the next push"
                    )
            if now - start < SPIN_S:
                time.sleep(0)
                continue
            time.sleep(delay)
            delay = min(delay * 2, 5e-5 if now - start < 0.05 else 1e-3)

    # ---- broadcasts ---------------------------------------------------------------------------

    def broadcast(self, tensor: torch.Tensor, src: int) -> None:
        self.broadcast_group([tensor], src)

    def broadcast_group(self, tensors: Sequence[torch.Tensor], src: int | Sequence[int]) -> None:
        """Sender (a rank of ``src``): publish where its tensors are, return (CPU: once every
        receiver copied them; CUDA: ``synchronize`` waits). Receiver: copy each tensor from there
        into its tensor (CUDA: on the current stream). Other senders take no part."""
        self._check_open()
        roots = [src] * len(tensors) if isinstance(src, int) else list(src)
        if len(roots) != len(tensors):
            raise ValueError(f"{len(tensors)} tensors but {len(roots)} source ranks")
        seq, self._seq = self._seq, self._seq + 1
        self._moved = True
        senders = sorted(set(roots))
        if self.rank < self.first_sender:
            self.receiver.receive(seq, tensors, roots, senders)
        elif self.rank in senders:
            self._publish(seq, [t for t, r in zip(tensors, roots, strict=True) if r == self.rank])
            if self.device.type != "cuda":
                self._await_acks()

    def _publish(self, seq: int, tensors: Sequence[torch.Tensor]) -> None:
        entries: list[Entry] = []
        staged: list[tuple[int, torch.Tensor]] = []  # (position, tensor) copied into the ring
        for pos, typed in enumerate(tensors):
            t = flat_bytes(typed)
            if t.numel() == 0:
                entries.append(("", (), 0, 0))
                continue
            export = self._direct(t) if t.device.type == "cuda" else None
            if export is None:
                staged.append((pos, t))
                entries.append(("", (), 0, t.numel()))
                continue
            entries.append(export.entry(int(t.storage_offset()), t.numel()))
        if staged:
            slot = self._slot(seq, sum(aligned(t.numel()) for _, t in staged))
            at = 0
            for pos, t in staged:
                slot.buf[at : at + t.numel()].copy_(t, non_blocking=True)
                entries[pos] = slot.export.entry(at, t.numel())
                at += aligned(t.numel())
        if self.device.type == "cuda":
            # the receivers read this memory from another process: what wrote it (the trainer's
            # step, the ring copies) must be done first
            done = torch.cuda.Event()
            done.record(torch.cuda.current_stream(self.device))
            self.wait_event(done)
        unacked = self._exports.unacked
        if unacked and unacked[0] <= seq - MESSAGE_RING:  # its message key is still being read
            self._await_acks(upto=seq - MESSAGE_RING)
        body = encode(entries)
        if len(body) <= MESSAGE_BODY_LIMIT:
            self._board.post_message(seq, body)
        else:  # too long for a board slot (handles sent the first time of many tensors): the store's
            self.store.set(message_key(seq, self.rank), f"{seq}|{body.decode()}")
            self._board.post_message(seq, None)
        unacked.append(seq)

    def _direct(self, t: torch.Tensor) -> _Export | None:
        """The export to read ``t`` from where it is, or None: through the ring (its storage is new
        since the previous push, so it may be gone by the next)."""
        storage = t.untyped_storage()
        ptr = storage.data_ptr()
        ex = self._exports
        export = ex.by_ptr.get(ptr)
        if export is not None and export.storage() is storage:
            return export
        before = ex.known.get(ptr)
        if before is None or before() is not storage:
            ex.seen[ptr] = weakref.ref(storage)
            return None
        export = ex.by_ptr[ptr] = self._export(storage, ("cuda", *storage._share_cuda_()))
        return export

    def _export(self, storage: torch.UntypedStorage, source: tuple[Any, ...]) -> _Export:
        self._keys += 1
        return _Export(key=f"{self.rank}.{self._keys}", storage=weakref.ref(storage), source=source)

    def _slot(self, seq: int, nbytes: int) -> _Slot:
        """The staging buffer for broadcast ``seq``: the one two broadcasts back, once its
        receivers acknowledged it; made (or grown) when too small."""
        i = seq % 2
        ring = self._exports.ring
        slot = ring[i]
        if slot is not None and slot.busy_seq >= 0:
            self._await_acks(upto=slot.busy_seq)
        if slot is None or slot.buf.numel() < nbytes:
            if slot is not None:
                self._drop_slot(i)
            slot = ring[i] = self._new_slot(nbytes)
        slot.busy_seq = seq
        return slot

    def _new_slot(self, nbytes: int) -> _Slot:
        if self.device.type == "cuda":
            buf = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
            storage = buf.untyped_storage()
            return _Slot(buf=buf, export=self._export(storage, ("cuda", *storage._share_cuda_())))
        path = os.path.join(SHM_DIR, f"rewardplane-{self.group_id}-{self._token}-{uuid.uuid4().hex[:8]}")
        buf = create_for_readers(path, nbytes)
        return _Slot(buf=buf, export=self._export(buf.untyped_storage(), ("shm", path, nbytes)), path=path)

    def _drop_slot(self, i: int) -> None:
        slot = self._exports.ring[i]
        self._exports.ring[i] = None
        if slot is None:
            return
        self._exports.released.append(slot.export.key)
        if slot.path is not None:
            unlink(slot.path)

    def _await_acks(self, upto: int | None = None) -> None:
        """Sender: wait (bounded) until every receiver copied this rank's broadcasts up to ``upto``
        (all published ones by default): one read of each receiver's counter per look."""
        ex = self._exports
        count = len(ex.unacked) if upto is None else sum(1 for s in ex.unacked if s <= upto)
        if not count:
            return
        need = ex.acked + count
        receivers = list(range(self.first_sender))
        board, me = self._board, self.rank
        self._poll(
            lambda: all(board.acks(r, me) >= need for r in receivers),
            "waiting for the receivers' copies",
            receivers,
        )
        last = ex.unacked[count - 1]
        del ex.unacked[:count]
        ex.acked = need
        for slot in ex.ring:  # a CPU buffer's file goes once every receiver mapped it
            if slot is not None and slot.path is not None and slot.busy_seq <= last:
                unlink(slot.path)
                slot.path = None

    # ---- the rest of the interface ------------------------------------------------------------

    def synchronize(self) -> None:
        """Receiver: its copies are done and acknowledged; sender: every receiver's are."""
        self._check_open()
        self.receiver.acknowledge(block=True)
        self._await_acks()

    def max_flag(self, value: int) -> int:
        """The largest ``value`` of every rank, through the ranks' shared flags. It also ends a
        push: what the push did not use is dropped on both sides."""
        self._check_open()
        self.synchronize()
        if self._moved:
            self._end_push()
        n, self._flags = self._flags, self._flags + 1
        self.flag_calling = time.monotonic()
        released, self._exports.released = self._exports.released, []
        # what the receivers are to close (or a value too large for the word) is a note in the store
        note = bool(released) or not 0 <= value < FLAG_VALUE_LIMIT
        if note:
            with self._reduction_store() as store:
                store.set(f"f/{n}/{self.rank}", f"{value}|{json.dumps(released)}")
            self._noted.append(n)
        board = self._board
        board.write_flag(n, 0 if note else value, note)
        self.flag_enqueued = time.monotonic()
        others = [r for r in range(self.world_size) if r != self.rank]
        self._poll(lambda: all(board.flag(r, n) is not None for r in others), "status reduction", others)
        values = [value]
        for r in others:
            flag = board.flag(r, n)
            assert flag is not None  # written: the poll saw it, and a ring slot is reused two rounds on
            if not flag[1]:
                values.append(flag[0])
                continue
            with self._reduction_store() as store:
                got, _, closing = bytes(store.get(f"f/{n}/{r}")).decode().partition("|")
            values.append(int(got))
            if closing and self.rank < self.first_sender:
                self.receiver.close(json.loads(closing))
        if n == 1:  # every rank read round 0, so every rank mapped this rank's board
            board.unlink()
        while self._noted and self._noted[0] <= n - 2:  # every rank read round n-2 before writing n-1
            self.store.delete_key(f"f/{self._noted.pop(0)}/{self.rank}")
        return max(values)

    @contextlib.contextmanager
    def _reduction_store(self) -> Iterator[dist.Store]:
        """The store, for a reduction's notes: a store that is gone aborts the group, saying so."""
        try:
            yield self.store
        except dist.DistNetworkError as exc:
            self.abort()
            raise CommunicatorError(
                f"status reduction failed on rank {self.rank}: the trainer's store is gone ({exc})"
            ) from exc

    def _end_push(self) -> None:
        """Sender: exports of storages the trainer freed are released (the receivers close them
        at this reduction; until then the driver keeps their memory), and the storages staged in
        this push that are still alive at the next are read in place from then on."""
        self._moved = False
        ex = self._exports
        if self.rank < self.first_sender:
            return
        for ptr in [p for p, e in ex.by_ptr.items() if e.storage() is None]:
            ex.released.append(ex.by_ptr.pop(ptr).key)
        ex.known, ex.seen = {p: r for p, r in ex.seen.items() if r() is not None}, {}
        if self.device.type == "cuda":
            torch.cuda.ipc_collect()  # storages freed by the trainer that the receivers released

    def exchange(
        self, sends: Sequence[tuple[torch.Tensor, int]], recvs: Sequence[tuple[torch.Tensor, int]]
    ) -> None:
        raise CommunicatorError(
            "the same-host transport broadcasts only; sliced (point-to-point) pushes need backend nccl or gloo"
        )

    def _check_open(self) -> None:
        if self._closed:
            raise CommunicatorError(
                "this same-host group was closed or aborted; join a new group for the next push"
            )

    def abort(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._release()

    def close(self) -> None:
        self.abort()

    def _release(self) -> Any:
        for i in range(len(self._exports.ring)):
            self._drop_slot(i)
        self._exports = _Exports()
        self.receiver.release()
        self._board.close()
        return None
