"""The receiving side of the same-host transport: read where the trainer's tensors are, open that
memory once, copy each tensor straight into its target, and acknowledge the copies.

A trainer pushes the same layout again and again, and its message for a bucket is then the same
bytes every time: the source views a message names are made once and kept by the message's bytes,
so a repeat push costs one read of shared memory and one ``copy_`` per tensor. On a GPU, a bucket received
twice into the same targets (the same list: ``transfer`` keeps a bucket's targets while its places
stay the same) is captured as a CUDA graph of its copies and replayed from then on: one launch
instead of one per tensor, where enqueueing the copies, not the GPU, bounds a push. Kept views and
graphs go when any memory they read from is closed.
"""

from __future__ import annotations

import logging
import os
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from rewardplane.protocol import settings

from .comm import CommunicatorError
from .placement import POD_FIELD_HINT, Place
from .same_host_board import SignalBoard
from .same_host_memory import decode, map_for_reading, message_key

# (until this is true, what the wait is for, the ranks whose exit ends it at once): the group's bounded wait
Wait = Callable[[Callable[[], bool], str, Sequence[int]], None]
log = logging.getLogger(__name__)

# Source views (and graphs) kept for this many distinct messages at most (a layout has one per bucket).
KEPT_MESSAGES = 4096


@dataclass
class _Copies:
    """A bucket's copies from one sender as last received: the targets list they went into, and
    the CUDA graph replaying them once they were received into it twice."""

    tensors: Sequence[torch.Tensor]
    graph: torch.cuda.CUDAGraph | None = None


@dataclass
class _Pending:
    roots: list[int]  # whose broadcast it copied
    done: torch.cuda.Event | None = None  # CUDA: when the copies are done


class SameHostReceiver:
    """One receiving rank's side of a same-host group."""

    def __init__(
        self,
        store: dist.Store,
        *,
        rank: int,
        device: torch.device,
        places: Sequence[Place],
        wait: Wait,
        wait_event: Callable[[torch.cuda.Event], None],
        board: SignalBoard,
    ) -> None:
        self.store, self.rank, self.device = store, rank, device
        self._board = board  # the senders' messages are read, and this rank's acknowledgements written, there
        self._places = list(places)
        self._wait, self._wait_event = wait, wait_event
        self.opened: dict[str, torch.Tensor] = {}  # the trainer's memory, by key, flat uint8
        self._sources: dict[tuple[int, bytes], list[torch.Tensor | None]] = {}  # (root, message) -> views
        self._pending: list[_Pending] = []  # copies not acknowledged yet
        self._copies: dict[tuple[int, bytes], _Copies] = {}  # (root, message) -> as last received
        self._graphs = device.type == "cuda" and settings.SAME_GPU_GRAPHS.get()
        self._capture_stream: torch.cuda.Stream | None = None

    def receive(
        self, seq: int, tensors: Sequence[torch.Tensor], roots: list[int], senders: list[int]
    ) -> None:
        """Copy broadcast ``seq``'s tensors into ``tensors`` (CUDA: enqueued on the current stream)."""
        for root in senders:
            body = self._message(seq, root)
            last = self._copies.get((root, body))
            if last is not None and last.tensors is tensors and last.graph is not None:
                last.graph.replay()  # checked when it was captured: the same sources into the same targets
                continue
            pairs = self._pairs(root, body, [t for t, r in zip(tensors, roots, strict=True) if r == root])
            if last is not None and last.tensors is tensors and self._graphs:
                last.graph = self._capture(pairs)  # the second time alike: replayed from now on
                if last.graph is not None:
                    last.graph.replay()
                    continue
            elif self._graphs:
                if len(self._copies) >= KEPT_MESSAGES:
                    self._copies.clear()
                self._copies[(root, body)] = _Copies(tensors)
            for dst, src in pairs:
                dst.copy_(src, non_blocking=True)
        pending = _Pending(senders)
        if self.device.type == "cuda":
            pending.done = torch.cuda.Event()
            pending.done.record(torch.cuda.current_stream(self.device))
            self._pending.append(pending)
            self.acknowledge(block=False)
        else:
            self._pending.append(pending)
            self.acknowledge(block=True)

    def _pairs(
        self, root: int, body: bytes, targets: list[torch.Tensor]
    ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """(destination bytes, source bytes) for each tensor of ``root``'s message that has bytes;
        a target whose size is not the message's is refused before any copy."""
        sources = self._sources_of(root, body)
        if len(sources) != len(targets):
            raise CommunicatorError(
                f"rank {root} sent {len(sources)} tensors where rank {self.rank} expected {len(targets)}: "
                "the two sides disagree on the layout"
            )
        pairs = []
        for target, src in zip(targets, sources, strict=True):
            dst = (
                target
                if target.dtype is torch.uint8 and target.dim() == 1
                else target.view(-1).view(torch.uint8)
            )
            nbytes = 0 if src is None else src.numel()
            if dst.numel() != nbytes:
                raise CommunicatorError(
                    f"rank {root} sent {nbytes} bytes for a {dst.numel()}-byte tensor: the two sides "
                    "disagree on the layout"
                )
            if src is not None:
                pairs.append((dst, src))
        return pairs

    def _capture(self, pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.cuda.CUDAGraph | None:
        """The copies as a CUDA graph (not run yet), or None where capturing failed (they are then
        copied one by one). Captured on a stream of its own, thread-local: the engine's threads
        go on using the GPU meanwhile."""
        if self._capture_stream is None:
            self._capture_stream = torch.cuda.Stream(self.device)
        graph = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.stream(self._capture_stream):
                graph.capture_begin(capture_error_mode="thread_local")
                try:
                    for dst, src in pairs:
                        dst.copy_(src, non_blocking=True)
                finally:
                    graph.capture_end()
        except Exception:  # e.g. a driver that cannot capture copies out of IPC memory
            log.warning(
                "could not capture a same-GPU bucket's copies as a CUDA graph; copying them one by one",
                exc_info=True,
            )
            self._graphs = False
            return None
        if all(c.graph is None for c in self._copies.values()):  # the first: say so once
            log.info("same-GPU pushes: replaying each bucket's copies as one CUDA graph from now on")
        return graph

    def _message(self, seq: int, root: int) -> bytes:
        """The body of ``root``'s message for broadcast ``seq``, once it is there (bounded)."""
        got: list[bytes] = []

        def ready() -> bool:
            posted, body = self._board.message(root, seq)
            if not posted:
                return False
            if body is None:  # too long for its slot: in the store, written before it was posted
                raw, prefix = bytes(self.store.get(message_key(seq, root))), f"{seq}|".encode()
                if not raw.startswith(prefix):
                    raise CommunicatorError(
                        f"rank {root}'s message for broadcast {seq} is not in the store: form a new group"
                    )
                body = raw[len(prefix) :]
            got.append(body)
            return True

        self._wait(ready, "waiting for the trainer's tensors", [root])
        return got[0]

    def _sources_of(self, root: int, body: bytes) -> list[torch.Tensor | None]:
        kept = self._sources.get((root, body))
        if kept is not None:
            return kept
        sources: list[torch.Tensor | None] = []
        for key, source, offset, nbytes in decode(body):
            sources.append(self._open(key, source, root)[offset : offset + nbytes] if nbytes else None)
        if len(self._sources) >= KEPT_MESSAGES:
            self._sources.clear()
        self._sources[(root, body)] = sources
        return sources

    def _open(self, key: str, source: tuple, root: int) -> torch.Tensor:
        opened = self.opened.get(key)
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
                opened = map_for_reading(path, nbytes)
        except Exception as exc:
            raise CommunicatorError(
                f"rank {self.rank} could not open the trainer's memory ({type(exc).__name__}: {exc}); "
                f"{POD_FIELD_HINT}"
            ) from exc
        self.opened[key] = opened
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

    def acknowledge(self, block: bool) -> None:
        """Acknowledge every broadcast whose copies finished, one increment per sender (``block``:
        all of them, waiting for the GPU within the timeout)."""
        done: Counter[int] = Counter()
        while self._pending:
            event = self._pending[0].done
            if event is not None and not event.query():
                if not block:
                    break
                self._wait_event(event)
            done.update(self._pending.pop(0).roots)
        for root, n in done.items():
            self._board.add_acks(root, n)

    def close(self, keys: Sequence[str]) -> None:
        """The trainer released this memory: close it (its handle, or the mapped file)."""
        for key in keys:
            self.opened.pop(key, None)
        self._sources.clear()  # kept views and graphs would hold (or read) the closed memory
        self._copies.clear()

    def release(self) -> None:
        self.opened.clear()
        self._sources.clear()
        self._copies.clear()
        self._pending.clear()
