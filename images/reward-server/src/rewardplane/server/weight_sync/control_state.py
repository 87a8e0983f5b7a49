"""The control plane's state and what every way of updating shares: the validated layouts, the
running update, the timeline and metrics of a finished one, dropping a served adapter, and handing
committed weights to persistence."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import OrderedDict
from collections.abc import Awaitable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from rewardplane.protocol import (
    JOIN_GRACE_S,
    ParamMeta,
    PushHeader,
    RewardModelTrainingMode,
    delta_refusal,
)
from rewardplane.server.engines.engine import ServedAdapter, WeightSyncPort
from rewardplane.server.locking import WeightsGuard
from rewardplane.server.metrics import ServerMetrics
from rewardplane.server.weight_sync.data_push import PushListener
from rewardplane.server.weight_sync.persistence import PERSIST_WAIT_S, WeightsStore, base_fingerprint
from rewardplane.server.weight_sync.worker_calls import WorkerCalls, WorkerReceived

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Layout:
    """One validated push layout: what the workers are told to receive."""

    id: str
    bucket_bytes: int
    names: list[str]
    metadata: list[dict[str, Any]]  # ParamMeta as JSON, for the worker calls
    nbytes: int  # what one push of it moves (and an atomic push stages)
    adapter: bool = False  # validated as an adapter push (LoRA tensors), not against the manifest alone


@dataclass
class DataPush:
    """One push started from the data plane, from its admission to its commit."""

    header: PushHeader
    arrived: float  # time.monotonic() when the header was seen
    layout: Layout | None = None
    error: str | None = None  # refused before any byte moved
    code: str = "ok"
    lock: contextlib.AbstractAsyncContextManager[None] | None = None  # the exclusive lock, held (streamed)
    reset: asyncio.Task[None] | None = None  # the cache reset, sent alongside the receive
    stamps: dict[str, float] = field(default_factory=dict)

    @property
    def apply(self) -> bool:
        return not self.header.atomic


@dataclass
class PendingJoin:
    """The one join of a trainer's group this server is waiting on."""

    host: str
    port: int
    group_id: str
    started: float  # time.monotonic()
    timeout_s: float
    attempt: str  # names this attempt to the workers (rp_join_*)
    cancelled: asyncio.Event = field(default_factory=asyncio.Event)  # set by POST /close_communicator

    @property
    def deadline(self) -> float:
        """When the control plane gives the join up, whatever the workers' rendezvous still does."""
        return self.started + self.timeout_s + JOIN_GRACE_S

    def describe(self) -> str:
        age = time.monotonic() - self.started
        left = max(0.0, self.deadline - time.monotonic())
        return (
            f"a join of the group at {self.host}:{self.port} is pending ({age:.1f}s so far; it is given up "
            f"in {left:.1f}s, or now with POST /close_communicator)"
        )


class ControlPlaneState:
    """What the control plane holds between requests, and the steps both push paths share."""

    def __init__(
        self,
        guard: WeightsGuard,
        port: WeightSyncPort,
        metrics: ServerMetrics,
        store: WeightsStore | None = None,
        *,
        max_lora_rank: int = 0,
    ) -> None:
        self.guard = guard
        self.port = port
        self.calls = WorkerCalls(port)  # the worker-extension calls, typed
        self.manifest: dict[str, ParamMeta] = port.manifest()
        self.max_lora_rank = max_lora_rank  # 0: adapter pushes are refused
        self.adapter: ServedAdapter | None = None  # the adapter scoring uses
        self.adapter_ids = 0  # a fresh id per adapter version
        self.metrics = metrics
        self.store = store  # --weights-dir: every committed push is saved there (persistence.py)
        self._persistence_ready = False
        self.tasks: set[asyncio.Task[None]] = set()
        self.last_error: str | None = None
        # The last finished update's timeline (GET /get_num_background_tasks → last_update).
        self.last_update: dict[str, Any] | None = None
        self.init_task: asyncio.Task[None] | None = None
        self.pending_join: PendingJoin | None = None
        self.update_task: asyncio.Task[None] | None = None
        # the running HTTP-started update has committed and only hands its host copies to the
        # persisting thread: a push right behind it waits for that moment instead of a 409
        self.update_committed = False
        self.has_comm = False
        self.senders = 1  # the trainer's sending ranks in the group joined last
        # Validated push layouts by layout_id (most recent last): later pushes name them by id.
        self.layouts: OrderedDict[str, Layout] = OrderedDict()
        # Layouts the workers hold (their cache, mirrored with the same remember_layout): the
        # receive call then carries the id only — ~290 entries cost ~0.4 ms per vLLM RPC.
        self.worker_layouts: dict[str, None] = {}
        # Pushes started from the data plane: the thread waiting for the group's headers, and the
        # push it admitted (an update is running while it is set).
        self.listener: PushListener | None = None
        self.data_push: DataPush | None = None

    def spawn(self, coro: Awaitable[None], name: str) -> asyncio.Task[None]:
        task = asyncio.ensure_future(coro)
        task.set_name(name)
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)
        return task

    async def let_committed_update_finish(self, timeout_s: float) -> None:
        task = self.update_task
        if task is not None and not task.done() and self.update_committed:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(asyncio.shield(task), timeout_s)

    def background_count(self) -> int:
        """Work of this control plane still running: its tasks, and a push started from the data
        plane (its receive may wait on a dead trainer until the group's timeout)."""
        return len(self.tasks) + (self.data_push is not None)

    def busy(self) -> bool:
        """A weight update (receive, apply, commit) is running."""
        return self.data_push is not None or (self.update_task is not None and not self.update_task.done())

    def failed_idle(self) -> bool:
        """The last update failed and none is running: waiting for a newer version is pointless."""
        return not self.busy() and self.last_error is not None

    def delta_refusal(self, base_version: int | None) -> str | None:
        """Why a delta push on ``base_version`` cannot land here (None: it can, or it is no delta).
        Both push paths ask before any byte moves."""
        if base_version is None:
            return None
        g = self.guard
        return delta_refusal(base_version, served=g.version, state=g.state, delta_base=g.delta_base)

    def joining(self) -> PendingJoin | None:
        return self.pending_join if self.init_task is not None and not self.init_task.done() else None

    def record(
        self,
        version: int,
        mode: str,
        result: dict[str, Any],
        stamps: dict[str, float | None],
        arrived: float,
        start: float,
        via: str = "http",
    ) -> None:
        """The finished update's timeline, metrics, log line and error (HTTP or data-plane start)."""
        guard = self.guard
        self.last_update = {
            "version": version,
            "mode": mode,
            "via": via,
            # sliced: each rank got only what it keeps of each tensor (protocol.slices)
            "wire": "sliced" if result.get("sliced") else "broadcast",
            "ok": bool(result["ok"]),
            "bytes": result.get("bytes", 0),
            # received straight into the parameters (per-tensor wire, once the copy plan knows them)
            "in_place_bytes": result.get("in_place_bytes", 0),
            "announced_at": arrived,  # time.monotonic() of this host, to line up with the trainer's clock
            "after_announce_ms": {
                k: round(1000 * (t - arrived), 3) for k, t in stamps.items() if t is not None
            },
        }
        self.metrics.record_push(
            mode,
            bool(result["ok"]),
            result.get("bytes", 0),
            time.monotonic() - start,
            self.last_update["after_announce_ms"],
        )
        self.metrics.weights_version.set(guard.version)
        if result["ok"]:
            self.last_error = None
            log.info(
                "weights version %d loaded (%s, %s, %d bytes, %.1f ms; waited %.1f ms for the lock, received "
                "in %.1f ms)",
                version,
                mode,
                via,
                result["bytes"],
                1000 * (time.monotonic() - start),
                1000 * result.get("lock_s", 0.0),
                1000 * result.get("receive_s", 0.0),
            )
        else:
            self.last_error = f"update to version {version} failed: {result['error']}"
            log.error(self.last_error)

    async def drop_adapter_under(self, mode: RewardModelTrainingMode) -> None:
        """A full or merged (lora) push carries the whole model, the adapter's effect included: the
        adapter goes. A head_only push keeps it (it adapts the backbone, the head is separate)."""
        if self.adapter is None or mode not in (RewardModelTrainingMode.FULL, RewardModelTrainingMode.LORA):
            return
        await self.calls.clear_adapter()
        self.adapter = None
        self.port.use_adapter(None)

    # ---- persistence (--weights-dir) ---------------------------------------------------------
    async def prepare_workers(self) -> None:
        """Once, before anything is loaded: fingerprint the base model (saved weights carry it and
        are never restored onto another base) and tell the workers where to persist, so each keeps
        host copies (HF names) of what it loads (vLLM's workers exist only after start)."""
        store = self.store
        if store is None or self._persistence_ready:
            return
        if not store.base:
            params = await self.calls.named_parameters()
            store.base = base_fingerprint(self.manifest, params[0] if params else None)
        # every worker saves its own part: the replica's version is the one all of them saved
        store.ranks = max(1, len(await self.calls.local_ranks()))
        await self.calls.persist_to(str(store.dir), store.base, store.ranks)
        self._persistence_ready = True

    async def persist(self, version: int) -> None:
        """After ``guard.commit(version)``: the workers hold host copies of what this update loaded;
        each merges its own into its saved union in a background thread. A tracked
        task waits for that write, so ``/get_num_background_tasks`` counts it (bounded)."""
        if self.store is None:
            return
        writes = await self.calls.persist(version)
        if not any(writes):
            log.warning("version %d: no worker kept the pushed weights; it is not persisted", version)
            return

        async def wait_written() -> None:
            loop = asyncio.get_running_loop()
            deadline = loop.time() + PERSIST_WAIT_S
            while any(await self.calls.persist_pending()):
                if loop.time() > deadline:
                    log.error(
                        "persisting version %d took over %.0fs; still running in the workers",
                        version,
                        PERSIST_WAIT_S,
                    )
                    return
                await asyncio.sleep(0.05)

        self.spawn(wait_written(), f"persist-v{version}")


async def task_error(task: asyncio.Task[None]) -> str | None:
    """None when ``task`` succeeded, else its error."""
    try:
        await task
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"
    return None


def slowest(steps: Iterable[Mapping[str, float | None]]) -> dict[str, float]:
    """Each step's latest stamp over the workers' stamps (their ``times``): when every worker was past it."""
    times: dict[str, float] = {}
    for r in steps:
        for key, t in r.items():
            if t is not None:
                times[key] = max(t, times.get(key, t))
    return times


def merge(results: Sequence[WorkerReceived]) -> dict[str, Any]:
    """One verdict from every worker's result."""
    errors = [str(r.error) for r in results if not r.ok]
    return {
        "times": slowest(r.times for r in results),
        "ok": not errors,
        "partial": any(r.partial for r in results),
        "bytes": max((r.bytes for r in results), default=0),
        "in_place_bytes": min((r.in_place_bytes for r in results), default=0),
        "error": "; ".join(errors) if errors else None,
        "sliced": any(r.sliced for r in results),  # the workers agreed on it, all alike
    }
