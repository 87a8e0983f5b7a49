"""The server's request middleware: per-endpoint counts and latency, and an unhandled error turned
into a logged JSON 500 (the server keeps serving)."""

from __future__ import annotations

import asyncio

import httpx
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from rewardplane.server.http.app import ObserveMiddleware
from rewardplane.server.metrics import ServerMetrics


def _app(metrics: ServerMetrics) -> Starlette:
    async def ok(_: Request) -> JSONResponse:
        return JSONResponse({"ok": True}, status_code=201)

    async def boom(_: Request) -> JSONResponse:
        raise RuntimeError("engine exploded")

    app = Starlette(routes=[Route("/ok", ok), Route("/boom", boom)])
    app.add_middleware(ObserveMiddleware, metrics=metrics)
    return app


def _sample(metrics: ServerMetrics, name: str, **labels: str) -> float:
    value = metrics.registry.get_sample_value(name, labels)
    return 0.0 if value is None else value


def test_counts_latency_and_turns_errors_into_500() -> None:
    metrics = ServerMetrics()

    async def run() -> list[httpx.Response]:
        transport = httpx.ASGITransport(app=_app(metrics), raise_app_exceptions=False)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            return [await client.get("/ok"), await client.get("/boom"), await client.get("/ok")]

    first, failed, again = asyncio.run(run())
    assert first.status_code == 201 and again.status_code == 201  # still serving after the error
    assert failed.status_code == 500
    assert "internal server error" in failed.json()["error"]
    assert _sample(metrics, "rewardplane:requests_total", endpoint="/ok", status="201") == 2
    assert _sample(metrics, "rewardplane:requests_total", endpoint="/boom", status="500") == 1
    assert _sample(metrics, "rewardplane:request_errors_total", endpoint="/boom", kind="internal") == 1
    assert _sample(metrics, "rewardplane:e2e_request_latency_seconds_count", endpoint="/ok") == 2


def test_unknown_paths_share_one_label() -> None:
    metrics = ServerMetrics()

    async def run() -> None:
        transport = httpx.ASGITransport(app=_app(metrics))
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            for i in range(50):
                assert (await client.get(f"/scan/{i}")).status_code == 404

    asyncio.run(run())
    assert _sample(metrics, "rewardplane:requests_total", endpoint="<unmatched>", status="404") == 50
    assert _sample(metrics, "rewardplane:requests_total", endpoint="/scan/0", status="404") == 0
