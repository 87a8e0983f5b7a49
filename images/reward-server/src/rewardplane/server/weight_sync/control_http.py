"""The control plane's side of the group and of pushes announced over HTTP: joining and leaving the
trainer's group, validating an announced layout, and running the receive and commit."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from typing import Any

from rewardplane.protocol import (
    JOIN_GRACE_S,
    MAX_LAYOUTS,
    STALE_BASE,
    TRAINER_ABSENT,
    UPDATE_IN_PROGRESS,
    CancelledJoin,
    InitCommunicatorRequest,
    RewardModelTrainingMode,
    UpdateParamBatchRequest,
    check_adapter_metadata,
    check_metadata,
    layout_id,
    plan_buckets,
    remember_layout,
    settings,
)
from rewardplane.server.engines.engine import ServedAdapter
from rewardplane.server.errors import BadRequest, Conflict
from rewardplane.server.weight_sync.control_data_plane import CHANNEL_CONNECT_TIMEOUT_S, DataPlanePushes
from rewardplane.server.weight_sync.control_state import (
    ControlPlaneState,
    Layout,
    PendingJoin,
    merge,
    slowest,
)
from rewardplane.server.weight_sync.worker.group import GroupJoin
from rewardplane.server.weight_sync.worker_calls import WorkerReceived
from rewardplane.transport.comm import first_line

log = logging.getLogger(__name__)
# How often a pending join asks the workers whether their rendezvous is done (a short worker call).
JOIN_POLL_S = 0.05


def _join_failed(req: InitCommunicatorRequest, exc: Exception) -> str:
    """Log a failed join as one line naming its cause (the C++ frames at debug); that line."""
    message = f"joining the trainer's group at {req.host}:{req.port} failed: {first_line(exc)}"
    log.error("%s", message)
    log.debug("the join of %s:%d failed", req.host, req.port, exc_info=exc)
    return message


class JoinCancelled(Exception):
    """A pending join was cancelled (``POST /close_communicator``)."""


class GroupMembership:
    """Joining the trainer's group (``/init_communicator``) and leaving it (``/close_communicator``)."""

    def __init__(self, state: ControlPlaneState, data_plane: DataPlanePushes) -> None:
        self.state = state
        self.data_plane = data_plane  # listens for the group's pushes once it is formed

    async def init_communicator(self, req: InitCommunicatorRequest) -> None:
        limit = settings.MAX_JOIN_TIMEOUT_S.get()
        if req.timeout_s > limit:
            raise BadRequest(
                f"timeout_s={req.timeout_s:g} is over this server's maximum of {limit:g}s for a join "
                f"(--max-join-timeout-s, {settings.MAX_JOIN_TIMEOUT_S.name}): ask for at most {limit:g}s"
            )
        if self.state.busy():
            raise Conflict(
                "a weight update is in progress; wait for it (GET /get_num_background_tasks) and retry",
                detail={"code": UPDATE_IN_PROGRESS},
            )
        # One join at a time: the rendezvous cannot be interrupted, only given up on, so joins are
        # not queued; a pending one ends by forming, by its deadline or by POST /close_communicator.
        pending = self.state.joining()
        if pending is not None:
            raise Conflict(
                f"{pending.describe()}: one join at a time — create the trainer's side of that group, wait "
                "until it is given up (GET /get_num_background_tasks shows its outcome), or cancel it"
            )
        group_id = req.group_id or uuid.uuid4().hex[:12]
        self.data_plane.stop_listening()
        pending = PendingJoin(
            req.host, req.port, group_id, time.monotonic(), req.timeout_s, attempt=uuid.uuid4().hex
        )

        async def join() -> None:
            try:
                await self._form_group(req, pending)
                self.state.has_comm = True
                self.state.last_error = None
                await self.data_plane.listen(req, group_id)
            except JoinCancelled as exc:
                self.state.has_comm = False
                log.info("%s", exc)
            except Exception as exc:
                self.state.has_comm = False
                self.state.last_error = _join_failed(req, exc)

        self.state.has_comm = False
        # an announce may arrive while the join waits for the trainer (the operator's does)
        self.state.senders = req.senders
        self.state.pending_join = pending
        self.state.init_task = self.state.spawn(join(), "init-communicator")

    async def _form_group(self, req: InitCommunicatorRequest, pending: PendingJoin) -> None:
        """The workers' rendezvous, polled until every worker is in the group, one fails, the
        deadline passes or the join is cancelled; in the last three cases the attempt is abandoned."""
        join = GroupJoin(
            req.host,
            req.port,
            req.world_size,
            req.rank_offset,
            req.backend,
            req.timeout_s,
            pending.group_id,
            req.senders,
        )
        await self.state.calls.join_start(pending.attempt, join)
        try:
            while True:
                polls = await self.state.calls.join_poll(pending.attempt)
                errors = [str(p.error) for p in polls if p.done and p.error]
                if errors:
                    raise RuntimeError("; ".join(errors))
                if all(p.done for p in polls):
                    return
                if pending.cancelled.is_set():
                    raise JoinCancelled(
                        f"the join of the group at {req.host}:{req.port} ({pending.group_id}) was cancelled "
                        "(POST /close_communicator)"
                    )
                if time.monotonic() >= pending.deadline:
                    raise TimeoutError(
                        f"the trainer's group did not form within timeout_s={req.timeout_s:g}s (+{JOIN_GRACE_S:g}s): "
                        "check that the trainer hosts its store there and joins the group itself; this "
                        "attempt is abandoned"
                    )
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(pending.cancelled.wait(), JOIN_POLL_S)
        except BaseException:
            try:
                await self.state.calls.join_abandon(pending.attempt)
            except Exception:
                log.warning("abandoning join %s in the workers failed", pending.group_id, exc_info=True)
            raise

    def in_group(self, group_id: str) -> bool:
        """Whether this server is joining, or in, the group named ``group_id``."""
        last = self.state.pending_join  # the last join: pending, formed (then its group), or over
        return (
            last is not None
            and last.group_id == group_id
            and (self.state.joining() is not None or self.state.has_comm)
        )

    async def close(self, group_id: str | None = None) -> tuple[bool, CancelledJoin | None]:
        """Leave the group; a join still waiting for the trainer is cancelled (and returned). With
        ``group_id``, only that group: (False, None) and nothing changed when the server is
        neither joining nor in it."""
        if group_id is not None and not self.in_group(group_id):
            return False, None
        if self.state.busy():
            raise Conflict("a weight update is in progress; close the communicator after it finishes")
        cancelled = None
        pending, task = self.state.joining(), self.state.init_task
        if pending is not None and task is not None:
            pending.cancelled.set()
            cancelled = CancelledJoin(
                host=pending.host,
                port=pending.port,
                group_id=pending.group_id,
                pending_s=round(time.monotonic() - pending.started, 3),
            )
            # the poll sees the flag at once; a join already past its rendezvous (connecting the
            # push channel) ends within that step's own bound
            with contextlib.suppress(Exception):
                await asyncio.wait_for(asyncio.shield(task), CHANNEL_CONNECT_TIMEOUT_S + JOIN_POLL_S)
        self.data_plane.stop_listening()
        await self.state.calls.close_communicator()
        self.state.has_comm = False
        return True, cancelled


class AnnouncedPushes:
    """Pushes announced with ``/update_param_batch``."""

    def __init__(self, state: ControlPlaneState) -> None:
        self.state = state

    def _layout_of(self, req: UpdateParamBatchRequest) -> Layout:
        """The announced layout, validated against the served model (once per layout)."""
        adapter = req.training_mode == RewardModelTrainingMode.ADAPTER
        if adapter and self.state.max_lora_rank == 0:
            raise Conflict(
                "this server does not serve LoRA adapters, so it refuses adapter-only pushes: enable LoRA on the "
                "RewardModel (spec.lora.enabled; server flag --enable-lora), or push merged weights (sync mode "
                "full / training_mode lora)"
            )
        if not req.metadata:
            assert req.layout_id is not None  # the request model guarantees one or the other
            known = self.state.layouts.get(req.layout_id)
            if known is None or known.bucket_bytes != req.bucket_bytes or known.adapter != adapter:
                raise Conflict(
                    f"unknown layout_id {req.layout_id!r} (this server restarted or forgot it); announce the "
                    "metadata again — the SDK does so by itself on the next push"
                )
            self.state.layouts.move_to_end(req.layout_id)
            return known
        if adapter:
            assert req.adapter is not None  # the request model guarantees it
            problems = check_adapter_metadata(
                req.metadata, self.state.manifest, req.adapter, max_rank=self.state.max_lora_rank
            )
        else:
            problems = check_metadata(req.metadata, self.state.manifest)
        problems += [
            f"parameter {m.name!r} names sender {max(m.senders)}, but the trainer's group has "
            f"{self.state.senders} sending rank(s); join with senders={max(m.senders) + 1} or more"
            for m in req.metadata
            if max(m.senders) >= self.state.senders
        ]
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
        self.state.layouts[layout.id] = layout
        self.state.layouts.move_to_end(layout.id)
        while len(self.state.layouts) > MAX_LAYOUTS:
            self.state.layouts.popitem(last=False)
        return layout

    async def update(self, req: UpdateParamBatchRequest) -> int:
        arrived = time.monotonic()
        layout = self._layout_of(req)
        guard = self.state.guard
        if (refusal := guard.write_refusal()) is not None:
            raise Conflict(refusal)
        if guard.needs_full_push and set(layout.names) != set(self.state.manifest):
            raise Conflict(
                f"this replica's weights are gone ({guard.broken_reason}); only a push of every parameter "
                f"({len(self.state.manifest)}, training mode full) or a restore repairs it, not {len(layout.names)}"
            )
        version = req.version if req.version is not None else guard.version + 1
        if version <= guard.version and guard.state != "broken":
            raise Conflict(
                f"version {version} is not newer than the served version {guard.version}; versions must increase"
            )
        if (refusal := self.state.delta_refusal(req.base_version)) is not None:
            raise Conflict(refusal, detail={"code": STALE_BASE})
        await self.state.let_committed_update_finish(req.timeout_s)
        if self.state.busy():
            raise Conflict("another weight update is in progress; wait for it to finish")
        if self.state.init_task is not None and not self.state.init_task.done():
            try:  # the trainer forms the group right after /init_communicator; give it that long
                await asyncio.wait_for(asyncio.shield(self.state.init_task), timeout=req.timeout_s)
            except TimeoutError as exc:
                raise Conflict(
                    "the communicator is still forming; the trainer must create its side of the group",
                    detail={"code": TRAINER_ABSENT},
                ) from exc
        if not self.state.has_comm:
            raise Conflict(
                "no communicator: call /init_communicator (and create the trainer's side of the group) first"
                + (f"; the last attempt failed: {self.state.last_error}" if self.state.last_error else "")
            )
        if req.atomic and not layout.adapter:  # refused now, while nothing moves, not mid-receive
            problems = await self.state.calls.staging_problems(layout.nbytes)
            if problems:
                raise Conflict(problems[0])
        self.state.update_task = self.state.spawn(
            self._run_update(req, layout, version, arrived), f"update-v{version}"
        )
        # once the outcome is known (the task is done), wake trainers waiting on /runtime_version
        self.state.update_task.add_done_callback(lambda _: guard.signal_change())
        return version

    async def _run_update(
        self, req: UpdateParamBatchRequest, layout: Layout, version: int, arrived: float
    ) -> None:
        guard = self.state.guard
        self.state.update_committed = False
        metadata = layout.metadata
        mode = req.training_mode.value
        start = time.monotonic()
        stamps: dict[str, float | None] = {"task": start}
        result: dict[str, Any] = {"ok": False, "error": "not started", "partial": False, "bytes": 0}
        adapter = req.training_mode == RewardModelTrainingMode.ADAPTER
        try:
            await (
                self.state.prepare_workers()
            )  # once: the workers keep what they load when --weights-dir is set
            if req.atomic or adapter:
                # Stage while the old weights keep serving, then swap under the exclusive lock. An
                # adapter is always staged: it is small, and vLLM builds it from the whole set.
                result = merge(await self._receive(layout, False, req.agree_slicing))
                stamps.update(result.pop("times"), returned=time.monotonic())
                if result["ok"]:
                    async with guard.updating(timeout_s=req.timeout_s):
                        stamps["locked"] = time.monotonic()
                        if adapter:
                            stamps.update(await self._apply_adapter(layout, req))
                        else:
                            await self.state.calls.apply_staged(metadata)
                            await self.state.drop_adapter_under(req.training_mode)
                        await self.state.port.reset_cache()
                        # a delta push never builds on an adapter: a full push drops it
                        guard.commit(version, pushed=not adapter)
                        self.state.update_committed = True
                        stamps["committed"] = time.monotonic()
                        if adapter:
                            if self.state.store is not None:
                                log.warning(
                                    "version %d is an adapter push: adapters are not persisted, so a restart "
                                    "cannot be restored to it (push again after a restart)",
                                    version,
                                )
                        else:
                            await self.state.persist(version)
                else:
                    await self.state.calls.drop_staged()
            else:
                async with guard.updating(timeout_s=req.timeout_s):
                    stamps["locked"] = locked = time.monotonic()
                    # The cache reset goes out first, alongside the receive: nothing is scored while
                    # the exclusive lock is held, so no block made from old weights can enter the
                    # cache after it, and its round trip to the engine leaves the critical path.
                    # Both finish before the lock is released, whatever happens to either.
                    reset, received = await asyncio.gather(
                        self.state.port.reset_cache(),
                        self._receive(layout, True, req.agree_slicing),
                        return_exceptions=True,
                    )
                    stamps["returned"] = time.monotonic()
                    if isinstance(received, BaseException):
                        raise received
                    result = merge(received)
                    stamps.update(result.pop("times"))
                    if isinstance(reset, BaseException) and result["ok"]:
                        raise reset  # new weights, but cached blocks of the old ones: refuse to serve
                    result["lock_s"], result["receive_s"] = locked - start, time.monotonic() - locked
                    if result["ok"]:
                        await self.state.drop_adapter_under(req.training_mode)
                        guard.commit(version)
                        self.state.update_committed = True
                        stamps["committed"] = time.monotonic()
                        await self.state.persist(version)
                    elif result["partial"]:
                        guard.mark_broken(f"update to version {version} failed part-way: {result['error']}")
        except Exception as exc:
            result = {"ok": False, "partial": False, "bytes": 0, "error": f"{type(exc).__name__}: {exc}"}
            if guard.state == "updating":
                guard.mark_broken(f"update to version {version} failed: {exc}")
        self.state.record(version, mode, result, stamps, arrived, start)
        if not result["ok"]:
            self.state.has_comm = False  # a failed transfer leaves the group unusable; the trainer re-inits
            try:
                await self.state.calls.close_communicator()
            except Exception:
                log.debug("closing the communicator after a failure failed", exc_info=True)

    async def _apply_adapter(self, layout: Layout, req: UpdateParamBatchRequest) -> dict[str, float]:
        """Under the exclusive lock: every worker serves the staged adapter under a fresh id, then
        scoring names it. If any worker fails, every worker drops its adapter (they could disagree)
        and the caller marks the replica broken until the next push. Returns the slowest worker's
        steps (the update's timeline)."""
        assert req.adapter is not None
        self.state.adapter_ids += 1
        adapter_id = self.state.adapter_ids
        try:
            applied = await self.state.calls.apply_adapter(
                layout.metadata, req.adapter.model_dump(mode="json"), adapter_id
            )
        except Exception:
            self.state.adapter = None
            self.state.port.use_adapter(None)
            try:
                await self.state.calls.clear_adapter()
            except Exception:
                log.exception("dropping the adapters after a failed adapter update failed")
            raise
        self.state.adapter = ServedAdapter(adapter_id, applied[0].path if applied else None)
        self.state.port.use_adapter(self.state.adapter)
        return slowest(a.times for a in applied)

    async def _receive(
        self, layout: Layout, apply: bool, agree_slicing: bool = False
    ) -> list[WorkerReceived]:
        """The receive on every worker; the metadata only travels when the workers lack it.
        ``agree_slicing``: the workers and the trainer agree whether the push is sliced first."""
        known = layout.id in self.state.worker_layouts
        results = await self.state.calls.receive(
            None if known else layout.metadata,
            layout.bucket_bytes,
            apply,
            layout.id,
            agree_slicing,
        )
        if known and any(r.unknown_layout for r in results):
            # nothing was posted: the trainer's broadcast waits for the second call
            log.warning("the workers no longer hold layout %s; sending its metadata", layout.id)
            self.state.worker_layouts.pop(layout.id, None)
            results = await self.state.calls.receive(
                layout.metadata, layout.bucket_bytes, apply, layout.id, agree_slicing
            )
        remember_layout(self.state.worker_layouts, layout.id, None)  # the workers cached it
        return results
