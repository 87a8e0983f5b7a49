"""The FastAPI application: scoring endpoints (open) and the weight-sync control plane (token)."""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import AsyncIterator, Callable

from fastapi import FastAPI, Query, Request, Response
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from rewardplane.protocol import (
    VERSION_HEADER,
    Endpoints,
    ErrorResponse,
    HealthResponse,
    ModelInfo,
    RuntimeVersionResponse,
    ScoringRequest,
    ScoringResponse,
    ScoringResult,
    Usage,
    WorldSizeResponse,
)

from .compat_routes import compat_router
from .engine import RewardEngine
from .errors import BadRequest, ServerError
from .inputs import Limits, check_items, tokenize_texts
from .metrics import ServerMetrics
from .model_names import ModelNames
from .scoring import to_score
from .service import ScoringService

log = logging.getLogger(__name__)


def _validation_message(exc: RequestValidationError) -> str:
    parts = []
    for err in exc.errors():
        loc = ".".join(str(x) for x in err.get("loc", ()) if x != "body")
        parts.append(f"{loc or 'body'}: {err.get('msg')}")
    return "invalid request: " + "; ".join(parts)


def error_response(status_code: int, message: str, detail: object = None) -> JSONResponse:
    """Every error body has the protocol's one shape: ``{"error": message, "detail": ...}``."""
    return JSONResponse(
        ErrorResponse(error=message, detail=detail).model_dump(mode="json"), status_code=status_code
    )


class ObserveMiddleware:
    """Request counts and latency per endpoint; an unhandled error becomes a logged 500.

    A plain ASGI middleware: Starlette's ``BaseHTTPMiddleware`` (``@app.middleware("http")``) runs
    every request through an extra task and memory stream, a cost paid per scoring request."""

    def __init__(self, app: ASGIApp, metrics: ServerMetrics) -> None:
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        start = time.perf_counter()
        path = scope["path"]
        status = 500
        started = False

        async def observed_send(message: Message) -> None:
            nonlocal status, started
            if message["type"] == "http.response.start":
                status, started = int(message["status"]), True
            await send(message)

        try:
            await self.app(scope, receive, observed_send)
        except Exception:
            log.exception("unhandled error on %s", path)
            self.metrics.errors.labels(path, "internal").inc()
            self.metrics.requests.labels(path, "500").inc()
            if not started:
                await error_response(500, "internal server error; see the server log")(scope, receive, send)
            return
        if path != Endpoints.METRICS:
            self.metrics.requests.labels(path, str(status)).inc()
            self.metrics.latency.labels(path).observe(time.perf_counter() - start)


def build_app(
    engine: RewardEngine,
    *,
    limits: Limits,
    metrics: ServerMetrics,
    names: ModelNames | None = None,
    control_plane: Callable[[FastAPI], None] | None = None,
) -> FastAPI:
    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        await engine.start()
        metrics.weights_version.set(engine.guard.version)
        try:
            yield
        finally:
            await engine.stop()

    app = FastAPI(title="rewardplane reward server", lifespan=lifespan)
    app.state.engine = engine
    app.state.metrics = metrics
    info = engine.info

    @app.exception_handler(ServerError)
    async def _server_error(request: Request, exc: ServerError) -> JSONResponse:
        metrics.errors.labels(request.url.path, type(exc).__name__).inc()
        return error_response(exc.status_code, exc.message, exc.detail)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        metrics.errors.labels(request.url.path, "validation").inc()
        detail = [
            {"loc": list(e.get("loc", ())), "msg": e.get("msg"), "type": e.get("type")} for e in exc.errors()
        ]
        return error_response(422, _validation_message(exc), detail)

    app.add_middleware(ObserveMiddleware, metrics=metrics)

    service = ScoringService(engine, limits, metrics, names or ModelNames.of(info.served_model_name))
    check_model, run = service.check_model, service.run

    @app.get(Endpoints.HEALTH, response_model=HealthResponse)
    async def health(response: Response) -> HealthResponse:
        g = engine.guard
        if g.state == "broken":
            response.status_code = 503  # not ready: take this replica out of rotation
        return HealthResponse(version=g.version, state=g.state)

    @app.get(Endpoints.RUNTIME_VERSION, response_model=RuntimeVersionResponse)
    async def runtime_version(
        wait_for_version: int | None = Query(default=None, ge=0),
        timeout_s: float = Query(default=30.0, ge=0, le=300),
    ) -> RuntimeVersionResponse:
        """With ``wait_for_version``, answer once that version serves, the update failed, or the
        timeout passed: a trainer learns the outcome of a push in one round trip."""
        g = engine.guard
        if wait_for_version is not None:
            deadline = time.monotonic() + timeout_s
            sync = getattr(app.state, "weight_sync", None)
            while (
                g.version < wait_for_version
                and g.state != "broken"
                and time.monotonic() < deadline
                and not (sync is not None and sync.failed_idle())
            ):
                # woken by the commit or the update's end; the cap only bounds a missed wake-up
                await g.wait_change(min(0.05, max(0.0, deadline - time.monotonic())))
        return RuntimeVersionResponse(version=g.version, state=g.state, detail=g.broken_reason)

    @app.get(Endpoints.WORLD_SIZE, response_model=WorldSizeResponse)
    async def world_size() -> WorldSizeResponse:
        return WorldSizeResponse(world_size=info.world_size)

    @app.get(Endpoints.MODEL_INFO, response_model=ModelInfo)
    async def model_info() -> ModelInfo:
        return ModelInfo(
            model=info.served_model_name,
            engine=info.engine,
            num_labels=info.num_labels,
            dtype=info.dtype,
            head_dtype=info.head_dtype,
            max_model_len=info.max_model_len,
            pooling_type=info.pooling_types[0],
            version=engine.guard.version,
        )

    @app.get(Endpoints.METRICS)
    async def prometheus() -> Response:
        metrics.weights_version.set(engine.guard.version)
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.post(Endpoints.SCORE, response_model=ScoringResponse)
    async def score(req: ScoringRequest, response: Response) -> ScoringResponse:
        check_model(req.model)
        if req.n_labels is not None and req.n_labels != info.num_labels:
            raise BadRequest(
                f"n_labels {req.n_labels} does not match the served model, which has {info.num_labels} "
                "label(s): drop n_labels or point at the right reward model"
            )
        if req.return_hidden_states:
            raise BadRequest("return_hidden_states is not supported by this server; send false")
        if req.pooling_type not in info.pooling_types:
            raise BadRequest(
                f"pooling_type {req.pooling_type.value!r} is not available for this model; "
                f"use one of {[p.value for p in info.pooling_types]}"
            )
        check_items(len(req.inputs), limits)
        rows, version, prompts = await run(
            tokenize_texts(engine.tokenizer, req.inputs), req.pooling_type, req.truncate
        )
        response.headers[VERSION_HEADER] = str(version)
        ntok = sum(len(p) for p in prompts)
        return ScoringResponse(
            model=info.served_model_name,
            data=[
                ScoringResult(index=i, score=to_score(row, normalize=req.normalize), num_tokens=len(p))
                for i, (row, p) in enumerate(zip(rows, prompts, strict=True))
            ],
            usage=Usage(prompt_tokens=ntok, total_tokens=ntok),
            version=version,
            metadata={"version": version},
        )

    app.include_router(compat_router(service))  # vLLM / OpenAI / OpenRLHF shapes, root and /v1

    if control_plane is not None:
        control_plane(app)
    return app
