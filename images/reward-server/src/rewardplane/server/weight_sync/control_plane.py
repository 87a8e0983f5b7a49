"""The weight-sync control plane: what the authenticated endpoints (``routes.control_router``)
do, driven through the engine's ``WeightSyncPort``. Requests are validated before any byte moves;
the receive runs in the background while the trainer broadcasts; the version is bumped only after
the whole update. Built once per server by ``app.build_app``."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from rewardplane.protocol import (
    MAX_LAYOUTS,
    InitCommunicatorRequest,
    ParamMeta,
    PushHeader,
    PushLoaded,
    PushVerdict,
    RewardModelTrainingMode,
    UpdateParamBatchRequest,
    check_adapter_metadata,
    check_metadata,
    layout_id,
    plan_buckets,
    remember_layout,
)
from rewardplane.server.engines.engine import ServedAdapter, WeightSyncPort
from rewardplane.server.errors import BadRequest, Conflict, Unavailable
from rewardplane.server.locking import WeightsGuard
from rewardplane.server.metrics import ServerMetrics
from rewardplane.server.weight_sync.data_push import RESET_CACHE_AT, PushListener
from rewardplane.server.weight_sync.persistence import PERSIST_WAIT_S, WeightsStore, base_fingerprint
from rewardplane.server.weight_sync.push_channel import ChannelHub

log = logging.getLogger(__name__)
# How long a replica's workers have to join the push channel after a group is formed (seconds).
CHANNEL_CONNECT_TIMEOUT_S = 30.0


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


@dataclass(frozen=True)
class PendingJoin:
    """The one join of a trainer's group this server is waiting on."""

    host: str
    port: int
    started: float  # time.monotonic()
    timeout_s: float

    def describe(self) -> str:
        age = time.monotonic() - self.started
        left = max(0.0, self.timeout_s - age)
        return f"a join of the group at {self.host}:{self.port} is pending ({age:.1f}s so far; it gives up in {left:.1f}s)"


class WeightSyncService:
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
        self.manifest: dict[str, ParamMeta] = port.manifest()
        self.max_lora_rank = max_lora_rank  # 0: adapter pushes are refused
        self.adapter: ServedAdapter | None = None  # the adapter scoring uses
        self._adapter_ids = 0  # a fresh id per adapter version
        self.metrics = metrics
        self.store = store  # --weights-dir: every committed push is saved there (persistence.py)
        self._persistence_ready = False
        self.tasks: set[asyncio.Task[None]] = set()
        self.last_error: str | None = None
        # The last finished update's timeline (GET /get_num_background_tasks → last_update).
        self.last_update: dict[str, Any] | None = None
        self._init_task: asyncio.Task[None] | None = None
        self._pending_join: PendingJoin | None = None
        self._update_task: asyncio.Task[None] | None = None
        # the running HTTP-started update has committed and only hands its host copies to the
        # persisting thread: a push right behind it waits for that moment instead of a 409
        self._update_committed = False
        self._has_comm = False
        # Validated push layouts by layout_id (most recent last): later pushes name them by id.
        self._layouts: OrderedDict[str, Layout] = OrderedDict()
        # Layouts the workers hold (their cache, mirrored with the same remember_layout): the
        # receive call then carries the id only — ~290 entries cost ~0.4 ms per vLLM RPC.
        self._worker_layouts: dict[str, None] = {}
        # Pushes started from the data plane: the thread waiting for the group's headers, and the
        # push it admitted (an update is running while it is set).
        self._listener: PushListener | None = None
        self._data_push: DataPush | None = None

    def _spawn(self, coro: Awaitable[None], name: str) -> asyncio.Task[None]:
        task = asyncio.ensure_future(coro)
        task.set_name(name)
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)
        return task

    async def _let_committed_update_finish(self, timeout_s: float) -> None:
        task = self._update_task
        if task is not None and not task.done() and self._update_committed:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(asyncio.shield(task), timeout_s)

    def busy(self) -> bool:
        """A weight update (receive, apply, commit) is running."""
        return self._data_push is not None or (self._update_task is not None and not self._update_task.done())

    def failed_idle(self) -> bool:
        """The last update failed and none is running: waiting for a newer version is pointless."""
        return not self.busy() and self.last_error is not None

    def _joining(self) -> PendingJoin | None:
        return self._pending_join if self._init_task is not None and not self._init_task.done() else None

    # ---- init / close -----------------------------------------------------------------------
    async def init_communicator(self, req: InitCommunicatorRequest) -> None:
        if self.busy():
            raise Conflict(
                "a weight update is in progress; wait for it (GET /get_num_background_tasks) and retry"
            )
        # One join at a time: a join blocks in the rendezvous until the trainer's store answers or
        # its timeout passes, and nothing can interrupt that wait, so a second one could only pile up.
        pending = self._joining()
        if pending is not None:
            raise Conflict(
                f"{pending.describe()}: one join at a time — create the trainer's side of that group, "
                "or wait until it gives up (GET /get_num_background_tasks shows its outcome) and join again"
            )
        group_id = req.group_id or uuid.uuid4().hex[:12]
        self._stop_listening()

        async def join() -> None:
            try:
                await self.port.call_workers(
                    "rp_init_communicator",
                    req.host,
                    req.port,
                    req.world_size,
                    req.rank_offset,
                    req.backend,
                    req.timeout_s,
                    group_id,
                )
                self._has_comm = True
                self.last_error = None
                await self._listen(req, group_id)
            except Exception as exc:
                self._has_comm = False
                self.last_error = f"joining the trainer's group at {req.host}:{req.port} failed: {exc}"
                log.error(self.last_error)

        self._has_comm = False
        self._pending_join = PendingJoin(req.host, req.port, time.monotonic(), req.timeout_s)
        self._init_task = self._spawn(join(), "init-communicator")

    async def close(self) -> None:
        if self.busy():
            raise Conflict("a weight update is in progress; close the communicator after it finishes")
        pending = self._joining()
        if pending is not None:
            raise Conflict(f"{pending.describe()}; close the communicator after it finishes")
        self._stop_listening()
        await self.port.call_workers("rp_close_communicator")
        self._has_comm = False

    # ---- update -----------------------------------------------------------------------------
    def _layout_of(self, req: UpdateParamBatchRequest) -> Layout:
        """The announced layout, validated against the served model (once per layout)."""
        adapter = req.training_mode == RewardModelTrainingMode.ADAPTER
        if adapter and self.max_lora_rank == 0:
            raise Conflict(
                "this server does not serve LoRA adapters, so it refuses adapter-only pushes: enable LoRA on the "
                "RewardModel (spec.lora.enabled; server flag --enable-lora), or push merged weights (sync mode "
                "full / training_mode lora)"
            )
        if not req.metadata:
            assert req.layout_id is not None  # the request model guarantees one or the other
            known = self._layouts.get(req.layout_id)
            if known is None or known.bucket_bytes != req.bucket_bytes or known.adapter != adapter:
                raise Conflict(
                    f"unknown layout_id {req.layout_id!r} (this server restarted or forgot it); announce the "
                    "metadata again — the SDK does so by itself on the next push"
                )
            self._layouts.move_to_end(req.layout_id)
            return known
        if adapter:
            assert req.adapter is not None  # the request model guarantees it
            problems = check_adapter_metadata(
                req.metadata, self.manifest, req.adapter, max_rank=self.max_lora_rank
            )
        else:
            problems = check_metadata(req.metadata, self.manifest)
        if problems:
            raise BadRequest(
                f"{len(problems)} announced parameter(s) do not fit the served model; nothing was received: "
                + "; ".join(problems[:10])
                + (" …" if len(problems) > 10 else ""),
                detail=problems,
            )
        layout = Layout(
            # a given layout_id was checked against the metadata when the request was parsed
            req.layout_id or layout_id(req.metadata, req.bucket_bytes),
            req.bucket_bytes,
            [m.name for m in req.metadata],
            [m.model_dump(mode="json") for m in req.metadata],
            sum(b.nbytes for b in plan_buckets(req.metadata, req.bucket_bytes)),
            adapter,
        )
        self._layouts[layout.id] = layout
        self._layouts.move_to_end(layout.id)
        while len(self._layouts) > MAX_LAYOUTS:
            self._layouts.popitem(last=False)
        return layout

    async def update(self, req: UpdateParamBatchRequest) -> int:
        arrived = time.monotonic()
        layout = self._layout_of(req)
        guard = self.guard
        if (refusal := guard.write_refusal()) is not None:
            raise Conflict(refusal)
        if guard.needs_full_push and set(layout.names) != set(self.manifest):
            raise Conflict(
                f"this replica's weights are gone ({guard.broken_reason}); only a push of every parameter "
                f"({len(self.manifest)}, training mode full) or a restore repairs it, not {len(layout.names)}"
            )
        version = req.version if req.version is not None else guard.version + 1
        if version <= guard.version and guard.state != "broken":
            raise Conflict(
                f"version {version} is not newer than the served version {guard.version}; versions must increase"
            )
        await self._let_committed_update_finish(req.timeout_s)
        if self.busy():
            raise Conflict("another weight update is in progress; wait for it to finish")
        if self._init_task is not None and not self._init_task.done():
            try:  # the trainer forms the group right after /init_communicator; give it that long
                await asyncio.wait_for(asyncio.shield(self._init_task), timeout=req.timeout_s)
            except TimeoutError as exc:
                raise Conflict(
                    "the communicator is still forming; the trainer must create its side of the group"
                ) from exc
        if not self._has_comm:
            raise Conflict(
                "no communicator: call /init_communicator (and create the trainer's side of the group) first"
                + (f"; the last attempt failed: {self.last_error}" if self.last_error else "")
            )
        if req.atomic and not layout.adapter:  # refused now, while nothing moves, not mid-receive
            problems = [p for p in await self.port.call_workers("rp_staging_problem", layout.nbytes) if p]
            if problems:
                raise Conflict(problems[0])
        self._update_task = self._spawn(self._run_update(req, layout, version, arrived), f"update-v{version}")
        # once the outcome is known (the task is done), wake trainers waiting on /runtime_version
        self._update_task.add_done_callback(lambda _: guard.signal_change())
        return version

    async def _run_update(
        self, req: UpdateParamBatchRequest, layout: Layout, version: int, arrived: float
    ) -> None:
        guard = self.guard
        self._update_committed = False
        metadata = layout.metadata
        mode = req.training_mode.value
        start = time.monotonic()
        stamps: dict[str, float | None] = {"task": start}
        result: dict[str, Any] = {"ok": False, "error": "not started", "partial": False, "bytes": 0}
        adapter = req.training_mode == RewardModelTrainingMode.ADAPTER
        try:
            await self._prepare_workers()  # once: the workers keep what they load when --weights-dir is set
            if req.atomic or adapter:
                # Stage while the old weights keep serving, then swap under the exclusive lock. An
                # adapter is always staged: it is small, and vLLM builds it from the whole set.
                result = _merge(await self._receive(layout, False))
                stamps.update(result.pop("times"), returned=time.monotonic())
                if result["ok"]:
                    async with guard.updating(timeout_s=req.timeout_s):
                        stamps["locked"] = time.monotonic()
                        if adapter:
                            stamps.update(await self._apply_adapter(layout, req))
                        else:
                            await self.port.call_workers("rp_apply_staged", metadata)
                            await self._drop_adapter_under(req.training_mode)
                        await self.port.reset_cache()
                        guard.commit(version)
                        self._update_committed = True
                        stamps["committed"] = time.monotonic()
                        if adapter:
                            if self.store is not None:
                                log.warning(
                                    "version %d is an adapter push: adapters are not persisted, so a restart "
                                    "cannot be restored to it (push again after a restart)",
                                    version,
                                )
                        else:
                            await self._persist(version)
                else:
                    await self.port.call_workers("rp_drop_staged")
            else:
                async with guard.updating(timeout_s=req.timeout_s):
                    stamps["locked"] = locked = time.monotonic()
                    # The cache reset goes out first, alongside the receive: nothing is scored while
                    # the exclusive lock is held, so no block made from old weights can enter the
                    # cache after it, and its round trip to the engine leaves the critical path.
                    # Both finish before the lock is released, whatever happens to either.
                    reset, received = await asyncio.gather(
                        self.port.reset_cache(),
                        self._receive(layout, True),
                        return_exceptions=True,
                    )
                    stamps["returned"] = time.monotonic()
                    if isinstance(received, BaseException):
                        raise received
                    result = _merge(received)
                    stamps.update(result.pop("times"))
                    if isinstance(reset, BaseException) and result["ok"]:
                        raise reset  # new weights, but cached blocks of the old ones: refuse to serve
                    result["lock_s"], result["receive_s"] = locked - start, time.monotonic() - locked
                    if result["ok"]:
                        await self._drop_adapter_under(req.training_mode)
                        guard.commit(version)
                        self._update_committed = True
                        stamps["committed"] = time.monotonic()
                        await self._persist(version)
                    elif result["partial"]:
                        guard.mark_broken(f"update to version {version} failed part-way: {result['error']}")
        except Exception as exc:
            result = {"ok": False, "partial": False, "bytes": 0, "error": f"{type(exc).__name__}: {exc}"}
            if guard.state == "updating":
                guard.mark_broken(f"update to version {version} failed: {exc}")
        self._record(version, mode, result, stamps, arrived, start)
        if not result["ok"]:
            self._has_comm = False  # a failed transfer leaves the group unusable; the trainer re-inits
            try:
                await self.port.call_workers("rp_close_communicator")
            except Exception:
                log.debug("closing the communicator after a failure failed", exc_info=True)

    def _record(
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
            "ok": bool(result["ok"]),
            "bytes": result.get("bytes", 0),
            # received straight into the parameters (per-tensor wire, once the copy plan knows them)
            "in_place_bytes": result.get("in_place_bytes", 0),
            "announced_at": arrived,  # time.monotonic() of this host, to line up with the trainer's clock
            "after_announce_ms": {
                k: round(1000 * (t - arrived), 3) for k, t in stamps.items() if t is not None
            },
        }
        self.metrics.weight_update_bytes.inc(result.get("bytes", 0))
        self.metrics.weight_update_seconds.observe(time.monotonic() - start)
        self.metrics.weight_updates.labels(mode, "ok" if result["ok"] else "failed").inc()
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

    # ---- pushes started from the data plane (data_push.PushListener calls these) ------------------
    async def _listen(self, req: InitCommunicatorRequest, group_id: str) -> None:
        """After a join: wait for the trainer's push headers on the group's store. Where the workers
        cannot listen, or the store cannot be reached, pushes keep going over HTTP only."""
        channel = ChannelHub()
        try:
            listening = await self.port.call_workers("rp_listen", channel.address, channel.authkey)
            if not listening or not all(listening):
                channel.close()
                return
            ranks = [req.rank_offset + i for i in range(len(listening))]
            await asyncio.to_thread(channel.accept, ranks, CHANNEL_CONNECT_TIMEOUT_S)
            group = (req.host, req.port, group_id, req.timeout_s)
            loop = asyncio.get_running_loop()
            listener = await asyncio.to_thread(
                PushListener, self, loop, group, req.rank_offset, ranks, channel
            )
            await asyncio.to_thread(listener.start)
            self._listener = listener
        except Exception as exc:
            channel.close()  # the workers' listeners end: pushes go over HTTP
            log.warning("pushes from this group go over HTTP only: listening for them failed (%s)", exc)

    def _stop_listening(self) -> None:
        listener, self._listener = self._listener, None
        if listener is not None:
            listener.stop()

    async def admit_data_push(self, header: PushHeader, arrived: float) -> DataPush:
        """Validate a push header like an announce (same checks, same messages), then take the
        exclusive lock (streamed) and send the cache reset; or refuse it, moving nothing."""
        push = DataPush(header, arrived)
        guard = self.guard
        await self._let_committed_update_finish(header.timeout_s)
        layout = self._layouts.get(header.layout_id)
        if (
            layout is None
            or layout.bucket_bytes != header.bucket_bytes
            or layout.id not in self._worker_layouts
        ):
            push.error, push.code = (
                f"layout {header.layout_id} is not known to this replica's workers (restarted, or forgotten); "
                "announce it over HTTP — the SDK does so by itself",
                "unknown_layout",
            )
        elif header.version <= guard.version and guard.state != "broken":
            push.error = f"version {header.version} is not newer than the served version {guard.version}; versions must increase"
        elif self.busy():
            push.error = "another weight update is in progress; wait for it to finish"
        elif (refusal := guard.write_refusal()) is not None:  # as the HTTP path's lock would answer (409)
            push.error = refusal
        elif not self._has_comm:
            push.error = "no communicator: the group failed; form it again (/init_communicator)"
        if push.error is not None or layout is None:  # an unknown layout was refused above
            push.code = "unknown_layout" if push.code == "unknown_layout" else "refused"
            return push
        push.layout = layout
        self._layouts.move_to_end(layout.id)
        self._data_push = push
        push.stamps["task"] = time.monotonic()
        if header.atomic:
            return push  # staged while the old weights serve; the lock only for the swap
        lock = guard.updating(timeout_s=header.timeout_s)
        try:
            await lock.__aenter__()
        except TimeoutError:
            self._data_push = None
            push.error = f"scoring in flight did not finish within timeout_s={header.timeout_s:g}s; retry"
            push.code = "refused"
            return push
        push.lock = lock
        push.stamps["locked"] = time.monotonic()
        if RESET_CACHE_AT == "lock":
            self.start_cache_reset(push)
        return push

    def start_cache_reset(self, push: DataPush) -> None:
        """Nothing is scored while the lock is held: cached blocks of the old weights are dropped
        while the bytes arrive (as in the HTTP path). Sent when ``RESET_CACHE_AT`` says (the lock,
        the go, or the first posted receive; ``PushListener``): in vLLM the reset runs in the engine
        process, where it competes for the GIL with the worker thread that receives. Once per push."""
        if push.lock is not None and push.reset is None:
            push.stamps["reset"] = time.monotonic()
            push.reset = asyncio.ensure_future(self.port.reset_cache())

    async def finish_data_push(
        self, push: DataPush, results: list[PushLoaded], tell: Callable[[PushVerdict], None]
    ) -> PushVerdict:
        """The workers' reports in: commit (atomic: swap under the lock first), or mark broken
        where weights were partly overwritten; release the lock. The verdict goes to the workers
        through ``tell`` (they confirm it to the trainer in the commit reduction) unless the ready
        reduction refused the push (then no worker waits for one): a commit is told as soon as the
        lock is released, before its bookkeeping, since the trainer waits for it."""
        header, guard = push.header, self.guard
        if push.error is not None:  # refused at admission: nothing was held
            return PushVerdict(committed=False, code="refused", error=push.error)
        version, layout = header.version, push.layout
        assert layout is not None
        merged = _merge([r.model_dump() for r in results])
        push.stamps.update(merged.pop("times"))
        push.stamps["returned"] = time.monotonic()
        refused = any(r.refused for r in results)
        committed = False
        try:
            if refused:
                merged["error"] = merged["error"] or "another replica refused the push"
            elif header.atomic and merged["ok"]:
                async with guard.updating(timeout_s=header.timeout_s):
                    push.stamps["locked"] = time.monotonic()
                    await self.port.call_workers("rp_apply_staged", layout.metadata)
                    await self._drop_adapter_under(header.training_mode)
                    await self.port.reset_cache()
                    guard.commit(version)
                    committed = True
            elif header.atomic:
                await self.port.call_workers("rp_drop_staged")
            else:
                self.start_cache_reset(push)  # where the go never went out
                assert push.reset is not None
                reset_error = await _outcome(push.reset)
                if merged["ok"] and reset_error is None:
                    # a full or merged push replaces what a served adapter adapted (HTTP path alike)
                    await self._drop_adapter_under(header.training_mode)
                    guard.commit(version)
                    committed = True
                elif merged["ok"] or merged["partial"]:
                    reason = merged["error"] or f"the prefix cache was not reset: {reset_error}"
                    guard.mark_broken(f"update to version {version} failed part-way: {reason}")
        except Exception as exc:
            merged["error"] = f"{type(exc).__name__}: {exc}"
            if guard.state == "updating":
                guard.mark_broken(f"update to version {version} failed: {exc}")
        finally:
            if push.lock is not None:
                await push.lock.__aexit__(None, None, None)
            self._data_push = None
            guard.signal_change()
        if committed:
            push.stamps["committed"] = time.monotonic()
            tell(PushVerdict(committed=True))
        merged["ok"] = committed
        stamps = push.stamps  # for the log line: waited for the lock, then received (streamed)
        if not header.atomic and "locked" in stamps:
            merged["lock_s"] = stamps["locked"] - stamps["task"]
            merged["receive_s"] = stamps["returned"] - stamps["locked"]
        if refused:  # nothing moved: not a failure of this replica
            log.info("push of version %d refused: %s", version, merged["error"])
            return PushVerdict(committed=False, code="refused", error=merged["error"])
        self._record(
            version,
            header.training_mode.value,
            merged,
            dict(push.stamps),
            push.arrived,
            push.arrived,
            "data_plane",
        )
        if not committed:
            self._has_comm = False  # the workers leave the group after the commit reduction
            verdict = PushVerdict(committed=False, code="failed", error=merged["error"])
            tell(verdict)
            return verdict
        if self.store is not None:
            self._spawn(self._persist(version), f"persist-start-v{version}")
        return PushVerdict(committed=True)

    async def push_outcomes(self, seq: int, timeout_s: float) -> list[PushLoaded]:
        """The workers' reports of push ``seq`` asked over the engine (the store is gone)."""
        outcomes = await self.port.call_workers("rp_push_outcome", seq, timeout_s)
        return [PushLoaded.model_validate(o) for o in outcomes]

    async def _apply_adapter(self, layout: Layout, req: UpdateParamBatchRequest) -> dict[str, float]:
        """Under the exclusive lock: every worker serves the staged adapter under a fresh id, then
        scoring names it. If any worker fails, every worker drops its adapter (they could disagree)
        and the caller marks the replica broken until the next push. Returns the slowest worker's
        steps (the update's timeline)."""
        assert req.adapter is not None
        self._adapter_ids += 1
        adapter_id = self._adapter_ids
        try:
            applied = await self.port.call_workers(
                "rp_apply_adapter", layout.metadata, req.adapter.model_dump(mode="json"), adapter_id
            )
        except Exception:
            self.adapter = None
            self.port.use_adapter(None)
            try:
                await self.port.call_workers("rp_clear_adapter")
            except Exception:
                log.exception("dropping the adapters after a failed adapter update failed")
            raise
        self.adapter = ServedAdapter(adapter_id, applied[0]["path"] if applied else None)
        self.port.use_adapter(self.adapter)
        return _slowest(applied)

    async def _drop_adapter_under(self, mode: RewardModelTrainingMode) -> None:
        """A full or merged (lora) push carries the whole model, the adapter's effect included: the
        adapter goes. A head_only push keeps it (it adapts the backbone, the head is separate)."""
        if self.adapter is None or mode not in (RewardModelTrainingMode.FULL, RewardModelTrainingMode.LORA):
            return
        await self.port.call_workers("rp_clear_adapter")
        self.adapter = None
        self.port.use_adapter(None)

    async def _receive(self, layout: Layout, apply: bool) -> list[dict[str, Any]]:
        """``rp_receive`` on every worker; the metadata only travels when the workers lack it."""
        known = layout.id in self._worker_layouts
        results = await self.port.call_workers(
            "rp_receive", None if known else layout.metadata, layout.bucket_bytes, apply, layout.id
        )
        if known and any(r.get("unknown_layout") for r in results):
            # nothing was posted: the trainer's broadcast waits for the second call
            log.warning("the workers no longer hold layout %s; sending its metadata", layout.id)
            self._worker_layouts.pop(layout.id, None)
            results = await self.port.call_workers(
                "rp_receive", layout.metadata, layout.bucket_bytes, apply, layout.id
            )
        remember_layout(self._worker_layouts, layout.id, None)  # the workers cached it
        return results

    # ---- persistence (--weights-dir) ---------------------------------------------------------
    async def _prepare_workers(self) -> None:
        """Once, before anything is loaded: fingerprint the base model (saved weights carry it and
        are never restored onto another base) and tell the workers where to persist, so the first
        worker keeps host copies (HF names) of what it loads (vLLM's workers exist only after start)."""
        store = self.store
        if store is None or self._persistence_ready:
            return
        if not store.base:
            params = await self.port.call_workers("rp_named_parameters")
            store.base = base_fingerprint(self.manifest, params[0] if params else None)
        await self.port.call_workers("rp_persist_to", str(store.dir), store.base)
        self._persistence_ready = True

    async def _persist(self, version: int) -> None:
        """After ``guard.commit(version)``: the workers hold host copies of what this update loaded;
        the replica's first worker merges them into the saved union in a background thread. A tracked
        task waits for that write, so ``/get_num_background_tasks`` counts it (bounded)."""
        if self.store is None:
            return
        writes = await self.port.call_workers("rp_persist", version)
        if not any(writes):
            log.warning("version %d: no worker kept the pushed weights; it is not persisted", version)
            return

        async def wait_written() -> None:
            loop = asyncio.get_running_loop()
            deadline = loop.time() + PERSIST_WAIT_S
            while any(await self.port.call_workers("rp_persist_pending")):
                if loop.time() > deadline:
                    log.error(
                        "persisting version %d took over %.0fs; still running in the workers",
                        version,
                        PERSIST_WAIT_S,
                    )
                    return
                await asyncio.sleep(0.05)

        self._spawn(wait_written(), f"persist-v{version}")

    async def restore(self, version: int, timeout_s: float) -> int:
        """Load the persisted state for ``version`` in every worker (through the engine's own loader,
        one parameter at a time on the device) and commit it; returns the parameters restored."""
        if self.busy():
            raise Conflict("a weight update is in progress; restore after it finishes")
        if (refusal := self.guard.write_refusal()) is not None:
            raise Conflict(refusal)
        store = await self.restorable(version)
        assert store is not None
        guard = self.guard
        try:
            async with guard.updating(timeout_s=timeout_s):
                try:
                    count = await self.load_saved(version)
                except Exception as exc:  # some parameters may be loaded: never serve a mix
                    if not isinstance(exc, Conflict):
                        guard.mark_broken(f"restoring version {version} failed part-way: {exc}")
                    raise
                guard.commit(version)
        except TimeoutError as exc:
            raise Unavailable(
                f"scoring in flight did not finish within timeout_s={timeout_s:g}s; nothing was restored: retry"
            ) from exc
        self.metrics.weights_version.set(guard.version)
        log.info("restored persisted weights version %d (%d parameters)", version, count)
        return count

    async def restorable(self, version: int) -> WeightsStore:
        """The store, once it is sure to hold ``version`` saved onto this base model (else 409 with
        what to do)."""
        store = self.store
        if store is None:
            raise Conflict(
                "this server persists no weights: start it with --weights-dir (RewardModel "
                "spec.weightSync.persistDir) to make restores possible"
            )
        await self._prepare_workers()
        saved = store.saved_version()
        if saved is None:
            raise Conflict(
                f"no persisted weights in {store.dir}: nothing was pushed to this replica's directory yet; "
                "push the weights again"
            )
        if store.saved_base() != store.base:
            raise Conflict(
                f"the weights saved in {store.dir} were pushed onto another base model (fingerprint "
                f"{store.saved_base() or 'missing'}, this server loaded {store.base}); they are not restored "
                "onto this one: push the weights again"
            )
        if saved != version:
            raise Conflict(
                f"the persisted weights are version {saved}, not {version}; push version {version} again"
            )
        return store

    async def load_saved(self, version: int) -> int:
        """Inside the exclusive lock: load the saved union of ``version`` in every worker and drop
        what the engine cached; the parameters restored (the caller commits)."""
        try:
            counts = await self.port.call_workers("rp_restore", version)
        except LookupError as exc:  # the store changed between the check and the load
            raise Conflict(f"{exc}; push version {version} again") from exc
        await self.port.reset_cache()
        return int(max(counts, default=0))

    async def param_checksums(self) -> tuple[int, list[Any]]:
        """The SHA-256 of every live parameter on every worker, and the version they are (hashed under
        the scoring side of the lock: no update runs meanwhile)."""
        async with self.guard.scoring() as version:
            workers = await self.port.call_workers("rp_param_checksums")
        return version, workers


async def _outcome(task: asyncio.Task[None]) -> str | None:
    """None when ``task`` succeeded, else its error."""
    try:
        await task
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"
    return None


def _slowest(results: list[dict[str, Any]]) -> dict[str, float]:
    """Each step's latest stamp over the workers' results (``times``): when every worker was past it."""
    times: dict[str, float] = {}
    for r in results:
        for key, t in (r.get("times") or {}).items():
            if t is not None:
                times[key] = max(t, times.get(key, t))
    return times


def _merge(results: list[dict[str, Any]]) -> dict[str, Any]:
    """One verdict from every worker's result."""
    errors = [r["error"] for r in results if not r["ok"]]
    return {
        "times": _slowest(results),
        "ok": not errors,
        "partial": any(r["partial"] for r in results),
        "bytes": max((r["bytes"] for r in results), default=0),
        "in_place_bytes": min((r.get("in_place_bytes", 0) for r in results), default=0),
        "error": "; ".join(errors) if errors else None,
    }
