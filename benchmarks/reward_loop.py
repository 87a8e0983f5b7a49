"""The reward loop's concurrency: 200 samples through a mix of sync and async reward functions,
with the loop's limit at 1 (one call at a time: the baseline) and at N, in one run.

    python benchmarks/reward_loop.py                 # simulated 20 ms rules + a real reward server
    python benchmarks/reward_loop.py --no-server     # simulated rules only

The functions: a sync rule that blocks for ``--latency-ms`` (a sandboxed check, a blocking HTTP
call: it runs in the loop's thread pool), an async rule that awaits as long, and, unless
``--no-server``, an async judge that scores each sample with its own request to a real reward
server on loopback (a tiny model) plus the batched RM component.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from rewardplane.sdk import AsyncRewardClient, RewardLoop, RewardSample  # noqa: E402
from rewardplane.testing.servers import start_server  # noqa: E402
from rewardplane.tinymodel import build_tiny_reward_model  # noqa: E402


def build_loop(client: AsyncRewardClient | None, limit: int, latency_s: float) -> RewardLoop:
    loop = RewardLoop(client, max_concurrency=limit)

    @loop.register
    def blocking_rule(sample: RewardSample) -> float:
        time.sleep(latency_s)
        return float(len(sample.response) % 7)

    @loop.register
    async def async_rule(sample: RewardSample) -> dict[str, object]:
        await asyncio.sleep(latency_s)
        return {"score": 1.0, "checked": True}

    if client is not None:

        @loop.register
        async def judge(sample: RewardSample, client: AsyncRewardClient) -> float:
            (score,) = await client.score_batch([f"Rate this answer: {sample.response}"])
            return float(score)  # type: ignore[arg-type]

        loop.add_reward_model(batch_size=64)
    return loop


async def timed(url: str | None, limit: int, samples: list[RewardSample], latency_s: float) -> float:
    client = AsyncRewardClient(url) if url else None
    try:
        loop = build_loop(client, limit, latency_s)
        await loop.run(samples[:8])  # warm-up: connections, thread pool
        start = time.perf_counter()
        results = await loop.run(samples)
        elapsed = time.perf_counter() - start
        assert len(results) == len(samples) and all("async_rule" in r.extra for r in results)
        return elapsed
    finally:
        if client is not None:
            await client.aclose()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--samples", type=int, default=200)
    p.add_argument("--concurrency", type=int, default=64)
    p.add_argument("--latency-ms", type=float, default=20.0)
    p.add_argument("--no-server", action="store_true")
    args = p.parse_args()
    samples = [
        RewardSample(prompt=f"question {i}", response=f"answer {i} " * (i % 9 + 1))
        for i in range(args.samples)
    ]
    server = None
    if not args.no_server:
        work = Path(tempfile.mkdtemp(prefix="rewardplane-bench-loop-"))
        server = start_server(build_tiny_reward_model(work / "rm"), work)
    try:
        url = server.url if server else None
        latency = args.latency_ms / 1000
        base = asyncio.run(timed(url, 1, samples, latency))
        fast = asyncio.run(timed(url, args.concurrency, samples, latency))
    finally:
        if server is not None:
            server.stop()
    functions = 3 if server else 2
    print(
        f"{args.samples} samples x {functions} functions (+ batched RM: {bool(server)}), {args.latency_ms:g} ms rules"
    )
    print(f"  max_concurrency=1:  {base:.2f} s")
    print(f"  max_concurrency={args.concurrency}: {fast:.2f} s")
    print(f"  speed-up: {base / fast:.1f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
