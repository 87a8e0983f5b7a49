"""The weight-sync control plane: authenticated HTTP endpoints that drive the
worker extension. Requests are validated before any byte moves; the receive runs in the
background while the trainer broadcasts; the version is bumped only after the whole update."""

from __future__ import annotations

import asyncio
import hmac
import logging
import time
import uuid
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from fastapi import Depends, FastAPI, Request

from rewardplane.protocol import (
    MAX_LAYOUTS,
    BackgroundTasksResponse,
    Endpoints,
    InitCommunicatorRequest,
    ParamChecksumsResponse,
    ParamMeta,
    StatusResponse,
    UpdateParamBatchRequest,
    check_metadata,
    layout_id,
    remember_layout,
)
from rewardplane.protocol.auth import resolve_token

from .config import ServerConfig
from .engine import RewardEngine
from .errors import BadRequest, Conflict, ServerError, Unauthorized
from .metrics import ServerMetrics
from .peer import install_peer_send
from .persistence import install_restore, persist_after_commit, prepare_workers

log = logging.getLogger(__name__)

# Runs a worker-extension method on every worker that holds weights; returns one result per worker.
WorkerCall = Callable[..., Awaitable[list[Any]]]


class Forbidden(ServerError):
    status_code = 403


@dataclass(frozen=True)
class Layout:
    """One validated push layout: what the workers are told to receive."""

    id: str
    bucket_bytes: int
    names: list[str]
    metadata: list[dict[str, Any]]  # ParamMeta as JSON, for the worker calls


class WeightSyncService:
    def __init__(
        self,
        engine: RewardEngine,
        call: WorkerCall,
        manifest: dict[str, ParamMeta],
        metrics: ServerMetrics,
        reset_cache: Callable[[], Awaitable[None]] | None = None,
    ) -> None:
        self.engine = engine
        self.call = call
        self.manifest = manifest
        self.metrics = metrics
        self.reset_cache = reset_cache
        self.tasks: set[asyncio.Task[None]] = set()
        self.last_error: str | None = None
        # The last finished update's timeline (GET /get_num_background_tasks → last_update).
        self.last_update: dict[str, Any] | None = None
        self._init_task: asyncio.Task[None] | None = None
        self._update_task: asyncio.Task[None] | None = None
        self._has_comm = False
        # Validated push layouts by layout_id (most recent last): later pushes name them by id.
        self._layouts: OrderedDict[str, Layout] = OrderedDict()
        # Layouts the workers hold (their cache, mirrored with the same remember_layout): the
        # receive call then carries the id only — ~290 entries cost ~0.4 ms per vLLM RPC.
        self._worker_layouts: dict[str, None] = {}

    def _spawn(self, coro: Awaitable[None], name: str) -> asyncio.Task[None]:
        task = asyncio.ensure_future(coro)
        task.set_name(name)
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)
        return task

    def _busy(self) -> bool:
        return self._update_task is not None and not self._update_task.done()

    def failed_idle(self) -> bool:
        """The last update failed and none is running: waiting for a newer version is pointless."""
        return not self._busy() and self.last_error is not None

    # ---- init / close -----------------------------------------------------------------------
    async def init_communicator(self, req: InitCommunicatorRequest) -> None:
        if self._busy():
            raise Conflict(
                "a weight update is in progress; wait for it (GET /get_num_background_tasks) and retry"
            )
        group_id = req.group_id or uuid.uuid4().hex[:12]

        async def join() -> None:
            try:
                await self.call(
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
            except Exception as exc:
                self._has_comm = False
                self.last_error = f"joining the trainer's group at {req.host}:{req.port} failed: {exc}"
                log.error(self.last_error)

        self._has_comm = False
        self._init_task = self._spawn(join(), "init-communicator")

    async def close(self) -> None:
        if self._busy():
            raise Conflict("a weight update is in progress; close the communicator after it finishes")
        await self.call("rp_close_communicator")
        self._has_comm = False

    # ---- update -----------------------------------------------------------------------------
    def _layout_of(self, req: UpdateParamBatchRequest) -> Layout:
        """The announced layout, validated against the served model (once per layout)."""
        if not req.metadata:
            assert req.layout_id is not None  # the request model guarantees one or the other
            known = self._layouts.get(req.layout_id)
            if known is None or known.bucket_bytes != req.bucket_bytes:
                raise Conflict(
                    f"unknown layout_id {req.layout_id!r} (this server restarted or forgot it); announce the "
                    "metadata again — the SDK does so by itself on the next push"
                )
            self._layouts.move_to_end(req.layout_id)
            return known
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
        )
        self._layouts[layout.id] = layout
        self._layouts.move_to_end(layout.id)
        while len(self._layouts) > MAX_LAYOUTS:
            self._layouts.popitem(last=False)
        return layout

    async def update(self, req: UpdateParamBatchRequest) -> int:
        arrived = time.monotonic()
        layout = self._layout_of(req)
        guard = self.engine.guard
        version = req.version if req.version is not None else guard.version + 1
        if version <= guard.version and guard.state != "broken":
            raise Conflict(
                f"version {version} is not newer than the served version {guard.version}; versions must increase"
            )
        if self._busy():
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
        self._update_task = self._spawn(self._run_update(req, layout, version, arrived), f"update-v{version}")
        # once the outcome is known (the task is done), wake trainers waiting on /runtime_version
        self._update_task.add_done_callback(lambda _: guard.signal_change())
        return version

    async def _run_update(
        self, req: UpdateParamBatchRequest, layout: Layout, version: int, arrived: float
    ) -> None:
        guard = self.engine.guard
        metadata = layout.metadata
        mode = req.training_mode.value
        start = time.monotonic()
        stamps: dict[str, float | None] = {"task": start}
        result: dict[str, Any] = {"ok": False, "error": "not started", "partial": False, "bytes": 0}
        try:
            await prepare_workers(self)  # once: the workers keep what they load when --weights-dir is set
            if req.atomic:
                # Stage while the old weights keep serving, then swap under the exclusive lock.
                result = _merge(await self._receive(layout, False))
                stamps.update(result.pop("times"), returned=time.monotonic())
                if result["ok"]:
                    async with guard.updating(timeout_s=req.timeout_s):
                        await self.call("rp_apply_staged", metadata)
                        await self._reset_cache()
                        guard.commit(version)
                        stamps["committed"] = time.monotonic()
                        await persist_after_commit(self, layout.names, version)
                else:
                    await self.call("rp_drop_staged")
            else:
                async with guard.updating(timeout_s=req.timeout_s):
                    stamps["locked"] = locked = time.monotonic()
                    # The cache reset goes out first, alongside the receive: nothing is scored while
                    # the exclusive lock is held, so no block made from old weights can enter the
                    # cache after it, and its round trip to the engine leaves the critical path.
                    # Both finish before the lock is released, whatever happens to either.
                    reset, received = await asyncio.gather(
                        self._reset_cache(),
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
                        guard.commit(version)
                        stamps["committed"] = time.monotonic()
                        await persist_after_commit(self, layout.names, version)
                    elif result["partial"]:
                        guard.mark_broken(f"update to version {version} failed part-way: {result['error']}")
        except Exception as exc:
            result = {"ok": False, "partial": False, "bytes": 0, "error": f"{type(exc).__name__}: {exc}"}
            if guard.state == "updating":
                guard.mark_broken(f"update to version {version} failed: {exc}")
        self.last_update = {
            "version": version,
            "mode": mode,
            "ok": bool(result["ok"]),
            "bytes": result.get("bytes", 0),
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
                "weights version %d loaded (%s, %d bytes, %.1f ms; waited %.1f ms for the lock, received "
                "in %.1f ms)",
                version,
                mode,
                result["bytes"],
                1000 * (time.monotonic() - start),
                1000 * result.get("lock_s", 0.0),
                1000 * result.get("receive_s", 0.0),
            )
        else:
            self.last_error = f"update to version {version} failed: {result['error']}"
            log.error(self.last_error)
            self._has_comm = False  # a failed transfer leaves the group unusable; the trainer re-inits
            try:
                await self.call("rp_close_communicator")
            except Exception:
                log.debug("closing the communicator after a failure failed", exc_info=True)

    async def _receive(self, layout: Layout, apply: bool) -> list[dict[str, Any]]:
        """``rp_receive`` on every worker; the metadata only travels when the workers lack it."""
        known = layout.id in self._worker_layouts
        results = await self.call(
            "rp_receive", None if known else layout.metadata, layout.bucket_bytes, apply, layout.id
        )
        if known and any(r.get("unknown_layout") for r in results):
            # nothing was posted: the trainer's broadcast waits for the second call
            log.warning("the workers no longer hold layout %s; sending its metadata", layout.id)
            self._worker_layouts.pop(layout.id, None)
            results = await self.call("rp_receive", layout.metadata, layout.bucket_bytes, apply, layout.id)
        remember_layout(self._worker_layouts, layout.id, None)  # the workers cached it
        return results

    async def _reset_cache(self) -> None:
        if self.reset_cache is not None:
            await self.reset_cache()


def _merge(results: list[dict[str, Any]]) -> dict[str, Any]:
    """One verdict from every worker's result."""
    errors = [r["error"] for r in results if not r["ok"]]
    times: dict[str, float] = {}
    for r in results:  # the slowest worker's stamps
        for key, t in (r.get("times") or {}).items():
            if t is not None:
                times[key] = max(t, times.get(key, t))
    return {
        "times": times,
        "ok": not errors,
        "partial": any(r["partial"] for r in results),
        "bytes": max((r["bytes"] for r in results), default=0),
        "error": "; ".join(errors) if errors else None,
    }


def install_control_plane(
    app: FastAPI, engine: RewardEngine, cfg: ServerConfig, metrics: ServerMetrics
) -> None:
    token = resolve_token(cfg.token, cfg.token_file)
    service: WeightSyncService = engine.weight_sync_service(metrics)  # type: ignore[attr-defined]
    app.state.weight_sync = service

    def require_token(request: Request) -> None:
        if token is None:
            raise Forbidden(
                "the weight-sync control plane is disabled: start the server with REWARDPLANE_TOKEN or --token-file"
            )
        header = request.headers.get("authorization", "")
        scheme, _, given = header.partition(" ")
        if scheme.lower() != "bearer" or not given:
            raise Unauthorized(
                "missing bearer token: send 'Authorization: Bearer <token>' (REWARDPLANE_TOKEN)"
            )
        if not hmac.compare_digest(given.strip().encode(), token.encode()):
            raise Unauthorized("wrong bearer token: use the token this server was started with")

    auth = [Depends(require_token)]

    @app.post(Endpoints.INIT_COMMUNICATOR, response_model=StatusResponse, dependencies=auth)
    async def init_communicator(req: InitCommunicatorRequest) -> StatusResponse:
        await service.init_communicator(req)
        return StatusResponse()

    @app.post(Endpoints.UPDATE_PARAM_BATCH, response_model=StatusResponse, dependencies=auth)
    async def update_param_batch(req: UpdateParamBatchRequest) -> StatusResponse:
        version = await service.update(req)
        return StatusResponse(detail={"version": version})

    @app.post(Endpoints.CLOSE_COMMUNICATOR, response_model=StatusResponse, dependencies=auth)
    async def close_communicator() -> StatusResponse:
        await service.close()
        return StatusResponse()

    @app.api_route(
        Endpoints.NUM_BACKGROUND_TASKS,
        methods=["GET", "POST"],
        response_model=BackgroundTasksResponse,
        dependencies=auth,
    )
    async def num_background_tasks() -> BackgroundTasksResponse:
        return BackgroundTasksResponse(
            num_background_tasks=len(service.tasks),
            last_error=service.last_error,
            last_update=service.last_update,
        )

    @app.get(Endpoints.PARAM_MANIFEST, response_model=list[ParamMeta], dependencies=auth)
    async def param_manifest() -> list[ParamMeta]:
        return list(service.manifest.values())

    @app.get(Endpoints.PARAM_CHECKSUMS, response_model=ParamChecksumsResponse, dependencies=auth)
    async def param_checksums() -> ParamChecksumsResponse:
        # under the scoring side of the lock: no update runs while the weights are hashed
        async with engine.guard.scoring() as version:
            workers = await service.call("rp_param_checksums")
        return ParamChecksumsResponse(version=version, workers=workers)

    install_restore(app, service, cfg.weights_dir, auth)  # POST /restore_weights (persistence.py)
    install_peer_send(app, service, auth)  # POST /send_weights (peer.py)
