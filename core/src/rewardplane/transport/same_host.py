"""The same-host transport: a ``Communicator`` whose bytes move through memory both processes
map (CUDA IPC on one GPU, shared memory on CPU) instead of NCCL or gloo, for a trainer whose reward
server runs on its own GPUs (or host). The signalling goes through the group's TCPStore.

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
"""

from __future__ import annotations

import json
import logging
import mmap
import os
import tempfile
import time
import uuid
import warnings
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from .buckets import as_bytes
from .comm import SPIN_S, Communicator, CommunicatorError
from .placement import POD_FIELD_HINT, Place

log = logging.getLogger(__name__)

SHM_DIR = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()
# How often a long wait looks whether the peer it waits for still runs (seconds).
LIVENESS_S = 0.05


@dataclass
class _Export:
    """A sender's storage shared with the receivers: the handle they open it by."""

    key: str  # short: it travels with every tensor read from here
    storage: weakref.ref[torch.UntypedStorage]
    source: tuple[Any, ...]  # what a receiver needs to open it (``_open``): sent the first time only
    sent: bool = False

    def entry(self, offset: int, nbytes: int) -> tuple[str, tuple[Any, ...], int, int]:
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
class _Pending:
    seq: int
    roots: list[int]
    done: torch.cuda.Event | None = None


@dataclass
class _Side:
    """What one process holds of a group: the sender's exports and ring, the receiver's opens."""

    exports: dict[int, _Export] = field(default_factory=dict)  # by storage data_ptr
    # storages of the previous push and of this one, by weak reference: one alive in both is stable
    known: dict[int, weakref.ref[torch.UntypedStorage]] = field(default_factory=dict)
    seen: dict[int, weakref.ref[torch.UntypedStorage]] = field(default_factory=dict)
    ring: list[_Slot | None] = field(default_factory=lambda: [None, None])
    opened: dict[str, torch.Tensor] = field(default_factory=dict)  # by key, flat uint8
    views: dict[tuple[str, int, int], torch.Tensor] = field(default_factory=dict)  # (key, offset, bytes)
    released: list[str] = field(default_factory=list)  # sender: keys the receivers are to close


def _create_for_readers(path: str, nbytes: int) -> torch.Tensor:
    """A new shared file for the trainer to write: torch creates it 0600, and the receivers (a
    server may run as another user) need to read it."""
    buf = torch.from_file(path, shared=True, size=nbytes, dtype=torch.uint8)
    os.chmod(path, 0o644)
    return buf


def _map_for_reading(path: str, nbytes: int) -> torch.Tensor:
    """The trainer's file mapped shared and read-only: a receiver needs no write permission on it,
    and sees every bucket the trainer writes into it later."""
    with open(path, "rb") as f:
        mapped = mmap.mmap(f.fileno(), nbytes, prot=mmap.PROT_READ)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # "not writable": this side only copies out
        return torch.frombuffer(mapped, dtype=torch.uint8, count=nbytes)  # keeps `mapped` alive


class SameHostCommunicator(Communicator):
    """A push group whose ranks share one host (see the module's docstring). It keeps
    ``Communicator``'s interface: ``broadcast``, ``broadcast_group``, ``max_flag``, ``synchronize``,
    ``wait_event``, ``close``; point-to-point ``exchange`` is not offered (sliced pushes broadcast)."""

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
        self._places = list(places)
        me = places[rank]
        # peers whose pid this process can look at (one pid namespace)
        self._pids = {r: p.pid for r, p in enumerate(places) if r != rank and p.pid_ns == me.pid_ns}
        self._seq = 0  # broadcasts so far: every rank makes the same calls in the same order
        self._flags = 0
        self._moved = False  # a broadcast since the last end of a push
        self._pending: list[_Pending] = []  # receiver: copies not acknowledged yet
        self._unacked: list[int] = []  # sender: broadcasts whose acknowledgements are due
        self._side = _Side()
        self._token = uuid.uuid4().hex[:8]
        self._keys = 0  # exports made: each gets a key of its own

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
            except dist.DistNetworkError as exc:
                self.abort()
                raise CommunicatorError(
                    f"{what} failed on rank {self.rank}: the trainer's store is gone ({exc}); the trainer "
                    "probably died. The group was aborted; form a new one for the next push"
                ) from exc
            self._acknowledge(block=False)
            now = time.monotonic()
            if now > deadline:
                self.abort()
                raise CommunicatorError(
                    f"{what} timed out after {self.timeout.total_seconds():.0f}s on rank {self.rank}; a peer "
                    "probably died. The group was aborted; form a new one for the next push"
                )
            if now - looked > LIVENESS_S:
                looked = now
                gone = [r for r in watch if not _alive(self._pids.get(r))]
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

    def _count(self, key: str, want: int) -> Callable[[], bool]:
        return lambda: int(self.store.add(key, 0)) >= want

    def _has(self, key: str) -> Callable[[], bool]:
        return lambda: bool(self.store.check([key]))

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
        if self.rank >= self.first_sender:
            if self.rank in senders:
                mine = [t for t, r in zip(tensors, roots, strict=True) if r == self.rank]
                self._publish(seq, mine)
                self._unacked.append(seq)
                if self.device.type != "cuda":
                    self._await_acks()
            return
        self._receive(seq, tensors, roots, senders)

    def _publish(self, seq: int, tensors: Sequence[torch.Tensor]) -> None:
        entries: list[tuple[str, tuple[Any, ...], int, int]] = []
        staged: list[tuple[int, torch.Tensor]] = []  # (position, tensor) copied into the ring
        for pos, typed in enumerate(tensors):
            t = _flat_bytes(typed)
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
            slot = self._slot(seq, sum(_aligned(t.numel()) for _, t in staged))
            at = 0
            for pos, t in staged:
                slot.buf[at : at + t.numel()].copy_(t, non_blocking=True)
                entries[pos] = slot.export.entry(at, t.numel())
                at += _aligned(t.numel())
        if self.device.type == "cuda":
            # the receivers read this memory from another process: what wrote it (the trainer's
            # step, the ring copies) must be done first
            done = torch.cuda.Event()
            done.record(torch.cuda.current_stream(self.device))
            self.wait_event(done)
        self.store.set(f"d/{seq}/{self.rank}", _encode(entries))

    def _direct(self, t: torch.Tensor) -> _Export | None:
        """The export to read ``t`` from where it is, or None: through the ring (its storage is new
        since the previous push, so it may be gone by the next)."""
        storage = t.untyped_storage()
        ptr = storage.data_ptr()
        side = self._side
        export = side.exports.get(ptr)
        if export is not None and export.storage() is storage:
            return export
        before = side.known.get(ptr)
        if before is None or before() is not storage:
            side.seen[ptr] = weakref.ref(storage)
            return None
        export = self._export(storage)
        side.exports[ptr] = export
        return export

    def _export(self, storage: torch.UntypedStorage) -> _Export:
        if storage.device.type == "cuda":
            source: tuple[Any, ...] = ("cuda", *storage._share_cuda_())
        else:
            raise AssertionError("CPU storages are staged, never exported")
        return _Export(key=self._new_key(), storage=weakref.ref(storage), source=source)

    def _new_key(self) -> str:
        self._keys += 1
        return f"{self.rank}.{self._keys}"

    def _slot(self, seq: int, nbytes: int) -> _Slot:
        """The staging buffer for broadcast ``seq``: the one two broadcasts back, once its
        receivers acknowledged it; made (or grown) when too small."""
        i = seq % 2
        side = self._side
        slot = side.ring[i]
        if slot is not None and slot.busy_seq >= 0:
            self._await_acks(upto=slot.busy_seq)
        if slot is None or slot.buf.numel() < nbytes:
            if slot is not None:
                self._drop_slot(i)
            slot = side.ring[i] = self._new_slot(nbytes)
        slot.busy_seq = seq
        return slot

    def _new_slot(self, nbytes: int) -> _Slot:
        if self.device.type == "cuda":
            buf = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
            return _Slot(buf=buf, export=self._export(buf.untyped_storage()))
        path = os.path.join(SHM_DIR, f"rewardplane-{self.group_id}-{self._token}-{uuid.uuid4().hex[:8]}")
        buf = _create_for_readers(path, nbytes)
        source = ("shm", path, nbytes)
        export = _Export(key=self._new_key(), storage=weakref.ref(buf.untyped_storage()), source=source)
        return _Slot(buf=buf, export=export, path=path)

    def _drop_slot(self, i: int) -> None:
        slot = self._side.ring[i]
        self._side.ring[i] = None
        if slot is None:
            return
        self._side.released.append(slot.export.key)
        if slot.path is not None:
            _unlink(slot.path)

    def _await_acks(self, upto: int | None = None) -> None:
        """Sender: wait (bounded) until every receiver acknowledged the broadcasts up to ``upto``
        (all outstanding ones by default)."""
        receivers = list(range(self.first_sender))
        while self._unacked and (upto is None or self._unacked[0] <= upto):
            seq = self._unacked[0]
            key = f"a/{seq}/{self.rank}"
            self._poll(self._count(key, len(receivers)), "waiting for the receivers' copies", receivers)
            self._unacked.pop(0)
            self.store.delete_key(key)
            self.store.delete_key(f"d/{seq}/{self.rank}")
            for slot in self._side.ring:  # a CPU buffer's file goes once every receiver mapped it
                if slot is not None and slot.path is not None and slot.busy_seq <= seq:
                    _unlink(slot.path)
                    slot.path = None

    def _receive(
        self, seq: int, tensors: Sequence[torch.Tensor], roots: list[int], senders: list[int]
    ) -> None:
        for root in senders:
            key = f"d/{seq}/{root}"
            self._poll(self._has(key), "waiting for the trainer's tensors", [root])
            entries = _decode(self.store.get(key))
            targets = [t for t, r in zip(tensors, roots, strict=True) if r == root]
            if len(entries) != len(targets):
                raise CommunicatorError(
                    f"rank {root} sent {len(entries)} tensors where rank {self.rank} expected {len(targets)}: "
                    "the two sides disagree on the layout"
                )
            views = self._side.views
            for target, (key_, source, offset, nbytes) in zip(targets, entries, strict=True):
                dst = (
                    target
                    if target.dtype is torch.uint8 and target.dim() == 1
                    else target.view(-1).view(torch.uint8)
                )
                if dst.numel() != nbytes:
                    raise CommunicatorError(
                        f"rank {root} sent {nbytes} bytes for a {dst.numel()}-byte tensor: the two sides "
                        "disagree on the layout"
                    )
                if not nbytes:
                    continue
                src = views.get((key_, offset, nbytes))
                if src is None:  # made once per tensor of a layout, not on every push
                    src = views[(key_, offset, nbytes)] = self._open(key_, source, root)[
                        offset : offset + nbytes
                    ]
                dst.copy_(src, non_blocking=True)
        pending = _Pending(seq, senders)
        if self.device.type == "cuda":
            pending.done = torch.cuda.Event()
            pending.done.record(torch.cuda.current_stream(self.device))
            self._pending.append(pending)
            self._acknowledge(block=False)
        else:
            self._ack(pending)

    def _open(self, key: str, source: tuple[Any, ...], root: int) -> torch.Tensor:
        side = self._side
        opened = side.opened.get(key)
        if opened is not None:
            return opened
        if not source:
            raise CommunicatorError(
                f"rank {root} read from memory {key} that rank {self.rank} never opened: the two sides "
                "disagree on what is shared; form a new group"
            )
        try:
            if source[0] == "cuda":
                # the sender's device index is in its own numbering (CUDA_VISIBLE_DEVICES may differ)
                storage = torch.UntypedStorage._new_shared_cuda(self._local_index(root), *source[2:])
                opened = torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)
            else:
                _, path, nbytes = source
                if not os.path.isfile(path):  # never create it: it must be the trainer's
                    raise FileNotFoundError(f"{path} does not exist here")
                opened = _map_for_reading(path, nbytes)
        except Exception as exc:
            raise CommunicatorError(
                f"rank {self.rank} could not open the trainer's memory ({type(exc).__name__}: {exc}); "
                f"{POD_FIELD_HINT}"
            ) from exc
        side.opened[key] = opened
        return opened

    def _local_index(self, root: int) -> int:
        gpu = self._places[root].gpu
        if gpu == self._places[self.rank].gpu:
            return int(self.device.index or 0)
        for i in range(torch.cuda.device_count()):
            if str(torch.cuda.get_device_properties(i).uuid) == gpu:
                return i
        raise CommunicatorError(
            f"rank {root}'s GPU {gpu} is not visible to rank {self.rank} (CUDA_VISIBLE_DEVICES): a receiver "
            "opens the trainer's memory on the trainer's GPU"
        )

    def _ack(self, pending: _Pending) -> None:
        for root in pending.roots:
            self.store.add(f"a/{pending.seq}/{root}", 1)

    def _acknowledge(self, block: bool) -> None:
        """Receiver: acknowledge every broadcast whose copies finished (``block``: all, waiting
        for the GPU within the timeout)."""
        while self._pending:
            done = self._pending[0].done
            if done is not None and not done.query():
                if not block:
                    return
                self.wait_event(done)
            self._ack(self._pending.pop(0))

    # ---- the rest of the interface ------------------------------------------------------------

    def synchronize(self) -> None:
        """Receiver: its copies are done and acknowledged; sender: every receiver's are."""
        self._check_open()
        self._acknowledge(block=True)
        self._await_acks()

    def max_flag(self, value: int) -> int:
        """The largest ``value`` of every rank, through the store. It also ends a push: what the
        push did not use is dropped on both sides."""
        self._check_open()
        self.synchronize()
        if self._moved:
            self._end_push()
        n, self._flags = self._flags, self._flags + 1
        self.flag_calling = time.monotonic()
        released, self._side.released = self._side.released, []
        # what the receivers are to close rides on this sender's flag: no extra round trip
        self.store.set(f"f/{n}/{self.rank}", f"{value}|{json.dumps(released)}" if released else str(value))
        self.flag_enqueued = time.monotonic()
        keys = [f"f/{n}/{r}" for r in range(self.world_size)]
        others = [r for r in range(self.world_size) if r != self.rank]
        self._poll(lambda: bool(self.store.check(keys)), "status reduction", others)
        try:
            raw = [bytes(v).decode() for v in self.store.multi_get(keys)]
        except dist.DistNetworkError as exc:
            self.abort()
            raise CommunicatorError(
                f"status reduction failed on rank {self.rank}: the trainer's store is gone ({exc})"
            ) from exc
        values = []
        for v in raw:
            flag, _, closing = v.partition("|")
            values.append(int(flag))
            if closing and self.rank < self.first_sender:
                closed = set(json.loads(closing))
                for key in closed:
                    self._side.opened.pop(key, None)  # closes the handle (or unmaps the file)
                self._side.views = {k: v for k, v in self._side.views.items() if k[0] not in closed}
        if n >= 2:  # every rank read round n-2 before it wrote round n-1, which this one read
            self.store.delete_key(f"f/{n - 2}/{self.rank}")
        return max(values)

    def _end_push(self) -> None:
        """Sender: exports of storages the trainer freed are released (the receivers close them
        at this reduction; until then the driver keeps their memory), and the storages staged in
        this push that are still alive at the next are read in place from then on."""
        self._moved = False
        side = self._side
        if self.rank < self.first_sender:
            return
        for ptr in [p for p, e in side.exports.items() if e.storage() is None]:
            side.released.append(side.exports.pop(ptr).key)
        side.known, side.seen = {p: r for p, r in side.seen.items() if r() is not None}, {}
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
        for i in range(len(self._side.ring)):
            self._drop_slot(i)
        self._side = _Side()
        self._pending.clear()
        self._unacked.clear()
        return None


def _encode(entries: list[tuple[str, tuple[Any, ...], int, int]]) -> str:
    """JSON (the store is reachable from the network: nothing executable), handles as hex."""

    def plain(v: Any) -> Any:
        return {"hex": v.hex()} if isinstance(v, bytes) else v

    return json.dumps([[key, [plain(v) for v in source], off, n] for key, source, off, n in entries])


def _decode(raw: bytes) -> list[tuple[str, tuple[Any, ...], int, int]]:
    def typed(v: Any) -> Any:
        return bytes.fromhex(v["hex"]) if isinstance(v, dict) else v

    return [(key, tuple(typed(v) for v in source), off, n) for key, source, off, n in json.loads(raw)]


def _flat_bytes(t: torch.Tensor) -> torch.Tensor:
    """``t``'s bytes, flat. The wire hands flat bytes already, which need no new view (a push's CPU
    time is per tensor, and here it is not hidden behind a link); contiguous ones only: an export is
    read as bytes [offset, offset + numel) of its storage, which a strided view's bytes are not."""
    return t if t.dtype is torch.uint8 and t.dim() == 1 and t.is_contiguous() else as_bytes(t)


def _aligned(n: int) -> int:
    return (n + 255) // 256 * 256


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def _alive(pid: int | None) -> bool:
    """False only when ``pid`` surely exited (gone, or a zombie not reaped yet)."""
    if pid is None:
        return True
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False
    except OSError:
        return True
