"""The SDK's sharded HTTP client: many concurrent requests all answered over at most
``max_connections`` real TCP connections, spread over every shard, and closed together."""

from __future__ import annotations

import asyncio
import socket
import threading
import time
from collections.abc import Iterator

import httpx
import pytest
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from rewardplane.sdk.http_pool import ShardedAsyncClient


async def _slow_echo(request: Request) -> JSONResponse:
    await asyncio.sleep(0.05)  # keeps every connection busy while the others are opened
    assert request.client is not None
    return JSONResponse({"port": request.client.port, "body": (await request.json())["i"]})


@pytest.fixture(scope="module")
def url() -> Iterator[str]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = uvicorn.Server(
        uvicorn.Config(
            Starlette(routes=[Route("/echo", _slow_echo, methods=["POST"])]),
            host="127.0.0.1",
            port=port,
            log_level="warning",
        )
    )
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 20
    while not server.started:
        assert time.monotonic() < deadline, "test server did not start"
        time.sleep(0.02)
    yield f"http://127.0.0.1:{port}"
    server.should_exit = True
    thread.join(10)


def test_concurrent_requests_use_every_shard_within_the_connection_limit(url: str) -> None:
    async def run() -> tuple[list[dict[str, int]], ShardedAsyncClient]:
        client = ShardedAsyncClient(max_connections=64, timeout=httpx.Timeout(30.0), per_shard=32)
        async with client:
            replies = await asyncio.gather(*(client.post(url + "/echo", json={"i": i}) for i in range(160)))
        return [r.json() for r in replies], client

    replies, client = asyncio.run(run())
    assert [r["body"] for r in replies] == list(range(160))  # every answer, each to its own request
    ports = {r["port"] for r in replies}
    assert 32 < len(ports) <= 64  # both shards opened connections; never more than the limit in all
    assert len(client.shards) == 2 and client.is_closed


def test_shards_split_the_limit_evenly() -> None:
    client = ShardedAsyncClient(max_connections=100, timeout=httpx.Timeout(1.0), per_shard=32)
    assert len(client.shards) == 4  # ceil(100 / 32); each holds ceil(100 / 4) = 25 connections
    asyncio.run(client.aclose())
    with pytest.raises(ValueError, match="max_connections"):
        ShardedAsyncClient(max_connections=0, timeout=httpx.Timeout(1.0))
