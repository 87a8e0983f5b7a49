"""The FastAPI application: the engine's scoring routes and the drop-in compatibility routes
(open), the weight-sync control plane, persistence and sleep/wake (token), built once from the engine and its ``WeightSyncPort``; one error shape
for every answer that is not a success (``errors.py``); a request-size limit before any parsing."""

from __future__ import annotations

import contextlib
import gc
import logging
import time
from collections.abc import AsyncIterator
from pathlib import Path

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from fastapi.routing import APIRoute
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from rewardplane.protocol import Endpoints
from rewardplane.server.engines.engine import RewardEngine
from rewardplane.server.engines.sleep import SleepService
from rewardplane.server.errors import ServerError, error_response
from rewardplane.server.http.admission import Admission
from rewardplane.server.http.body_parse import BodyParser
from rewardplane.server.http.compat_routes import compat_router
from rewardplane.server.http.inputs import Limits
from rewardplane.server.http.model_names import ModelNames
from rewardplane.server.http.request_body import BodyLimitMiddleware
from rewardplane.server.http.routes import (
    admission_router,
    control_router,
    persistence_router,
    scoring_router,
    sleep_router,
)
from rewardplane.server.http.service import ScoringService
from rewardplane.server.metrics import ServerMetrics
from rewardplane.server.threads import tokenizer_pool
from rewardplane.server.weight_sync.control_plane import WeightSyncService
from rewardplane.server.weight_sync.control_state import ControlPlaneState
from rewardplane.server.weight_sync.persistence import WeightsStore

log = logging.getLogger(__name__)

DEFAULT_MAX_REQUEST_BYTES = 64 << 20
UNMATCHED = "<unmatched>"  # the endpoint label of requests to paths the server does not have


def _validation_message(exc: RequestValidationError) -> str:
    parts = []
    for err in exc.errors()[:10]:
        if err.get("type") == "json_invalid":  # json_route.not_json's message says where it breaks
            return f"invalid request: {err.get('ctx', {}).get('error') or err.get('msg')}"
        loc = ".".join(str(x) for x in err.get("loc", ()) if x != "body")
        parts.append(f"{loc or 'body'}: {err.get('msg')}")
    more = len(exc.errors()) - len(parts)
    return "invalid request: " + "; ".join(parts) + (f"; and {more} more" if more > 0 else "")


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
                await error_response(500, "internal server error; see the server log", path=path)(
                    scope, receive, send
                )
            return
        if status == 404:
            path = UNMATCHED  # one label for every unknown path: a scanner must not grow the registry
        if path != Endpoints.METRICS:
            self.metrics.requests.labels(path, str(status)).inc()
            self.metrics.latency.labels(path).observe(time.perf_counter() - start)


def build_app(
    engine: RewardEngine,
    *,
    limits: Limits,
    metrics: ServerMetrics,
    token: str | None = None,
    names: ModelNames | None = None,
    weights_dir: Path | None = None,
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES,
    require_admission: bool = False,
) -> FastAPI:
    """The server's app. The control plane is built here, once, from ``engine.weight_port()``."""
    service = WeightSyncService(
        ControlPlaneState(
            engine.guard,
            engine.weight_port(),
            metrics,
            store=WeightsStore(weights_dir) if weights_dir is not None else None,
            max_lora_rank=engine.info.max_lora_rank,
        )
    )
    tokenizers = tokenizer_pool()
    admission = Admission(engine.guard, required=require_admission)
    scoring = ScoringService(
        engine, limits, metrics, names or ModelNames.of(engine.info.served_model_name), tokenizers, admission
    )

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        await engine.start()
        # The model, torch and transformers leave hundreds of thousands of long-lived objects: out
        # of the collector's sight, a request that allocates many containers (a 2 MB body of token
        # lists parses into 200,000) no longer triggers full collections over all of them (~250 ms
        # each, on the event loop).
        gc.collect()
        gc.freeze()
        metrics.weights_version.set(engine.guard.version)
        try:
            yield
        finally:
            await engine.stop()
            tokenizers.shutdown(wait=False, cancel_futures=True)
            await app.state.body_parser.close()

    app = FastAPI(title="rewardplane reward server", lifespan=lifespan)
    app.state.limits = limits  # checked on the parsed body before validation (body_parse.check_body_shape)
    app.state.body_parser = BodyParser()
    app.state.metrics = metrics  # the parse stage's timing (json_route.JSONRequest)

    @app.exception_handler(ServerError)
    async def _server_error(request: Request, exc: ServerError) -> JSONResponse:
        metrics.errors.labels(request.url.path, type(exc).__name__).inc()
        return error_response(exc.status_code, exc.message, exc.detail, path=request.url.path)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        metrics.errors.labels(request.url.path, "validation").inc()
        detail = [
            {"loc": list(e.get("loc", ())), "msg": e.get("msg"), "type": e.get("type")} for e in exc.errors()
        ]
        return error_response(422, _validation_message(exc), detail, path=request.url.path)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        # Starlette's own answers (404 unknown path, 405 wrong method, 413 from BodyLimitMiddleware)
        label = UNMATCHED if exc.status_code == 404 else request.url.path
        metrics.errors.labels(label, str(exc.status_code)).inc()
        hint = {404: f"no endpoint {request.url.path}; see /docs for the endpoints"}.get(exc.status_code)
        response = error_response(exc.status_code, hint or str(exc.detail), path=request.url.path)
        for key, value in (exc.headers or {}).items():
            response.headers[key] = value
        if exc.status_code == 405 and request.url.path in allowed:
            # Starlette's Allow names the first matching route's methods only
            response.headers["allow"] = ", ".join(sorted(allowed[request.url.path]))
        return response

    app.add_middleware(BodyLimitMiddleware, max_bytes=max_request_bytes)
    app.add_middleware(ObserveMiddleware, metrics=metrics)  # outermost: it sees every answer

    routers = [
        scoring_router(scoring, update_failed=service.failed_idle),
        compat_router(scoring),  # vLLM / OpenAI / OpenRLHF shapes, root and /v1
        control_router(service, token),
        admission_router(admission, token),
        persistence_router(service, token),
        sleep_router(SleepService(engine, service, metrics), token),
    ]
    allowed: dict[str, set[str]] = {}  # path → methods, for the Allow header of a 405
    for router in routers:
        for route in router.routes:
            if isinstance(route, APIRoute):
                allowed.setdefault(route.path, set()).update(route.methods or ())
        app.include_router(router)
    return app
