"""What the scoring client itself costs under many concurrent requests, measured in one run:

    the SDK's ShardedAsyncClient (pools of 32)  ÷  one httpx.AsyncClient pool of the same size
    the SDK's request bodies (``http_pool.json_body``: pydantic's Rust JSON encoder)  ÷  httpx's
        ``json=`` (``json.dumps``), both over the sharded client

against a loopback server (another process) that answers a ``/pooling`` request at once, with
the GPU scoring benchmark's request shape: 2048 prompts of U[64, 1024] token ids, 8 per request,
256 requests in flight. With a GPU behind the server, the client's CPU time per request is what
caps a single trainer process's scoring throughput (``benchmarks/scoring_gpu.py`` drives the
reward server with this client).

    python benchmarks/http_client.py [--concurrency 256] [--reps 3]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.scoring_gpu import make_prompts  # noqa: E402
from rewardplane.sdk.http_pool import ShardedAsyncClient, json_body  # noqa: E402


def serve(port: int) -> None:
    """The loopback server: parse the body, answer one score per prompt (no model)."""
    import uvicorn
    from starlette.applications import Starlette
    from starlette.requests import Request
    from starlette.responses import JSONResponse
    from starlette.routing import Route

    async def pooling(request: Request) -> JSONResponse:
        prompts = (await request.json())["input"]
        return JSONResponse({"data": [{"index": i, "data": [0.0]} for i in range(len(prompts))]})

    app = Starlette(routes=[Route("/pooling", pooling, methods=["POST"])])
    uvicorn.run(app, host="127.0.0.1", port=port, log_level="warning", access_log=False)


async def drive(
    client: Any, url: str, prompts: list[list[int]], per_request: int, concurrency: int, encoded: bool
) -> float:
    chunks = [prompts[i : i + per_request] for i in range(0, len(prompts), per_request)]
    sem = asyncio.Semaphore(concurrency)

    async def one(chunk: list[list[int]]) -> None:
        body = {"input": chunk}
        async with sem:
            r = await client.post(url + "/pooling", **(json_body(body) if encoded else {"json": body}))
            r.raise_for_status()
            assert len(r.json()["data"]) == len(chunk)

    t0 = time.perf_counter()
    await asyncio.gather(*(one(c) for c in chunks))
    return time.perf_counter() - t0


async def measure(kind: str, url: str, prompts: list[list[int]], args: argparse.Namespace) -> list[float]:
    timeout = httpx.Timeout(120.0)
    if kind == "one-pool":
        limits = httpx.Limits(max_connections=args.concurrency, max_keepalive_connections=args.concurrency)
        client: Any = httpx.AsyncClient(timeout=timeout, limits=limits)
    else:
        client = ShardedAsyncClient(max_connections=args.concurrency, timeout=timeout)
    encoded = kind == "sdk"  # the sharded client as the SDK sends: bodies encoded by json_body
    async with client:
        await drive(client, url, prompts[:256], args.per_request, args.concurrency, encoded)  # warm-up
        return [
            await drive(client, url, prompts, args.per_request, args.concurrency, encoded)
            for _ in range(args.reps)
        ]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts", type=int, default=2048)
    ap.add_argument("--per-request", type=int, default=8)
    ap.add_argument("--concurrency", type=int, default=256)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--serve", type=int, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.serve:
        serve(args.serve)
        return 0
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    url = f"http://127.0.0.1:{port}"
    server = subprocess.Popen([sys.executable, __file__, "--serve", str(port)])
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                httpx.post(url + "/pooling", json={"input": [[1]]}, timeout=1).raise_for_status()
                break
            except httpx.HTTPError:
                if time.monotonic() > deadline or server.poll() is not None:
                    raise RuntimeError("the loopback server did not start") from None
                time.sleep(0.2)
        prompts = make_prompts(args.prompts, 64, 1024, seed=1)
        times = {
            kind: statistics.median(asyncio.run(measure(kind, url, prompts, args)))
            for kind in ("one-pool", "sharded", "sdk")
        }
    finally:
        server.terminate()
        server.wait(10)
    result = {
        "prompts": args.prompts,
        "per_request": args.per_request,
        "concurrency": args.concurrency,
        "cpus": os.cpu_count(),
        "prompts_per_s": {k: args.prompts / v for k, v in times.items()},
        "sharded_vs_one_pool": times["one-pool"] / times["sharded"],
        "sdk_vs_sharded": times["sharded"] / times["sdk"],
    }
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], "http_client.json").write_text(json.dumps(result, indent=2))
    for kind, rate in result["prompts_per_s"].items():
        print(
            f"{kind:>9}: {rate:8.0f} prompts/s  ({args.concurrency} requests in flight, {args.per_request} prompts each)"
        )
    print(f"sharded ÷ one pool: {result['sharded_vs_one_pool']:.2f}x")
    print(f"sdk (Rust-encoded bodies) ÷ sharded (json=): {result['sdk_vs_sharded']:.2f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
