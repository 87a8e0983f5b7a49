"""Scoring throughput: the reward server over HTTP (many concurrent clients) ÷ the same engine
in-process on the same workload, measured in one run (CPU by default).

    python benchmarks/scoring.py                    # 1024 texts, 64 concurrent clients
    python benchmarks/scoring.py --texts 256 --quick

Both sides tokenize the same texts and use the same micro-batch plan (length-sorted, padded-token
budget); the ratio is what HTTP, JSON and the dynamic batcher cost.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from rewardplane.sdk.http_pool import ShardedAsyncClient  # noqa: E402
from rewardplane.server.config import ServerConfig  # noqa: E402
from rewardplane.server.engines.batching import plan_micro_batches  # noqa: E402
from rewardplane.server.engines.hf_engine import HFEngine  # noqa: E402
from rewardplane.testing.servers import start_server  # noqa: E402
from rewardplane.tinymodel import build_tiny_reward_model, corpus_lines  # noqa: E402


def make_texts(n: int, seed: int = 0, max_words: int = 120) -> list[str]:
    rng = random.Random(seed)
    words = " ".join(corpus_lines()).split()
    return [" ".join(rng.choice(words) for _ in range(rng.randint(8, max_words))) for _ in range(n)]


def in_process(engine: HFEngine, texts: list[str], max_tokens: int, max_items: int) -> float:
    ids = engine.tokenizer(texts)["input_ids"]
    start = time.perf_counter()
    for batch in plan_micro_batches([len(x) for x in ids], max_tokens=max_tokens, max_items=max_items):
        engine.forward([ids[i] for i in batch])
    return time.perf_counter() - start


async def over_http(url: str, texts: list[str], clients: int, per_request: int) -> float:
    chunks = [texts[i : i + per_request] for i in range(0, len(texts), per_request)]
    queue: asyncio.Queue[list[str]] = asyncio.Queue()
    for c in chunks:
        queue.put_nowait(c)

    async def worker(client: ShardedAsyncClient) -> None:
        while not queue.empty():
            chunk = queue.get_nowait()
            r = await client.post(f"{url}/score", json={"input": chunk, "normalize": False})
            r.raise_for_status()

    async with ShardedAsyncClient(max_connections=clients, timeout=httpx.Timeout(300.0)) as client:
        start = time.perf_counter()
        await asyncio.gather(*(worker(client) for _ in range(clients)))
        return time.perf_counter() - start


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--texts", type=int, default=1024)
    ap.add_argument("--clients", type=int, default=64)
    ap.add_argument("--per-request", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args()
    if args.quick:
        args.texts, args.reps = 256, 1
    work = Path(tempfile.mkdtemp(prefix="score-bench-"))
    model = build_tiny_reward_model(
        work / "rm", hidden_size=args.hidden, num_layers=args.layers, num_heads=max(1, args.hidden // 64)
    )
    texts = make_texts(args.texts)
    cfg = ServerConfig(model=str(model), device="cpu")
    engine = HFEngine(cfg)
    ntok = sum(len(x) for x in engine.tokenizer(texts)["input_ids"])
    in_proc = [
        in_process(engine, texts, cfg.max_batch_tokens, cfg.max_batch_items) for _ in range(args.reps + 1)
    ][1:]
    del engine

    import torch

    # same thread count as the in-process run (the test fixture defaults servers to one thread)
    server = start_server(model, work, env_extra={"OMP_NUM_THREADS": str(torch.get_num_threads())})
    try:
        asyncio.run(over_http(server.url, texts[:64], args.clients, args.per_request))  # warm-up
        http = [
            asyncio.run(over_http(server.url, texts, args.clients, args.per_request))
            for _ in range(args.reps)
        ]
    finally:
        server.stop()
    t_in, t_http = statistics.median(in_proc), statistics.median(http)
    result = {
        "texts": len(texts),
        "tokens": ntok,
        "clients": args.clients,
        "per_request": args.per_request,
        "model": f"llama hidden {args.hidden}, {args.layers} layers",
        "cpu_threads": os.cpu_count(),
        "in_process_texts_per_s": len(texts) / t_in,
        "http_texts_per_s": len(texts) / t_http,
        "in_process_tokens_per_s": ntok / t_in,
        "http_tokens_per_s": ntok / t_http,
        "ratio": t_in / t_http,
    }
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], "scoring.json").write_text(json.dumps(result, indent=2))
    print(json.dumps(result, indent=1))
    print(
        f"\nin-process engine : {result['in_process_texts_per_s']:8.1f} texts/s  {result['in_process_tokens_per_s']:9.0f} tokens/s"
    )
    print(
        f"server over HTTP  : {result['http_texts_per_s']:8.1f} texts/s  {result['http_tokens_per_s']:9.0f} tokens/s"
        f"  ({args.clients} clients x {args.per_request} texts/request)"
    )
    print(f"ratio HTTP / in-process: {result['ratio']:.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
