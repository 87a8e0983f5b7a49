"""The closed-loop scoring load of ``benchmarks/scoring_under_push.py``, in a process of its own
(so that its CPU never competes with the trainer's or the analysis'): N senders over the SDK's
sharded HTTP pool, each sending its next ``/pooling`` request of fresh token-id prompts as soon as
the last is answered, every answer's completion time and weights version recorded.

``LoadGen`` starts and stops the process from the orchestrator; ``python
benchmarks/push_load_generator.py --url ... --control DIR ...`` is the process itself: it runs until
``DIR/stop`` exists or ``--max-duration-s``, writes ``status.json`` every half second and
``records.json`` at the end.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.push_load_analysis import Records  # noqa: E402

# ---- the load generator (a process of its own) ------------------------------------------------


def make_request(rng: np.random.Generator, n: int, lo: int, hi: int, vocab: int) -> list[list[int]]:
    """``n`` prompts of token ids, lengths uniform in [lo, hi], ids in [4, vocab) (past the
    tokenizer's special tokens): fresh every time, so the prefix cache never hits."""
    lengths = rng.integers(lo, hi + 1, size=n)
    ids = rng.integers(4, vocab, size=int(lengths.sum())).tolist()
    out, at = [], 0
    for length in lengths.tolist():
        out.append(ids[at : at + length])
        at += length
    return out


# what one request returns: (the body's version, the header's version, None) or (None, None, error)
Answer = tuple[int | None, int | None, str | None]
Send = Callable[[list[list[int]]], Awaitable[Answer]]


async def closed_loop(
    send: Send,
    make: Callable[[], list[list[int]]],
    concurrency: int,
    stop: asyncio.Event,
    clock: Callable[[], float] = time.monotonic,
    error_pause_s: float = 0.05,
    records: Records | None = None,
) -> Records:
    """``concurrency`` senders, each sending its next request as soon as the last one is answered,
    until ``stop`` is set; requests still in flight then are cancelled and not recorded. A sender
    that fails outside ``send`` (a bug) stops everything and is raised. ``records``: filled as
    answers come (the caller may watch it), returned."""
    records = records if records is not None else Records()

    async def sender() -> None:
        while not stop.is_set():
            prompts = make()
            t_send = clock()
            try:
                version, header, error = await send(prompts)
            except (asyncio.CancelledError, KeyboardInterrupt):
                raise
            except Exception as exc:  # a transport error: recorded, and the sender goes on
                version, header, error = None, None, f"{type(exc).__name__}: {exc}"
            t_done = clock()
            if error is not None or version is None:
                records.fail(t_send, t_done, error or "no version in the answer")
                await asyncio.sleep(error_pause_s)
                continue
            records.add(t_send, t_done, len(prompts), sum(map(len, prompts)), version, header)

    tasks = [asyncio.create_task(sender()) for _ in range(concurrency)]
    stopped = asyncio.create_task(stop.wait())
    try:
        done, _ = await asyncio.wait([stopped, *tasks], return_when=asyncio.FIRST_COMPLETED)
    finally:
        for t in [stopped, *tasks]:
            t.cancel()
        outcomes = await asyncio.gather(*tasks, return_exceptions=True)
    for outcome in outcomes:
        if isinstance(outcome, BaseException) and not isinstance(outcome, asyncio.CancelledError):
            raise outcome
    return records


def http_sender(client: Any, url: str) -> Send:
    """POST ``{"input": prompts}`` to the server's ``/pooling`` (token ids in, raw rows out)."""
    from rewardplane.protocol import VERSION_HEADER

    endpoint = url.rstrip("/") + "/pooling"

    async def send(prompts: list[list[int]]) -> Answer:
        r = await client.post(endpoint, json={"input": prompts})
        if r.status_code != 200:
            return None, None, f"HTTP {r.status_code}: {r.text[:300]}"
        body = r.json()
        if len(body.get("data", [])) != len(prompts):
            return None, None, f"{len(body.get('data', []))} rows for {len(prompts)} prompts"
        header = r.headers.get(VERSION_HEADER)
        return int(body["version"]), (int(header) if header is not None else None), None

    return send


def write_json(path: Path, obj: Any, indent: int | None = None) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(obj, indent=indent))
    os.replace(tmp, path)


def loadgen_main(args: argparse.Namespace) -> int:
    """The load generator's process: runs until ``<control>/stop`` exists or ``--max-duration-s``;
    writes ``status.json`` (answers and failures so far, CPU seconds) every half second and
    ``records.json`` at the end."""
    import httpx

    from rewardplane.sdk.http_pool import ShardedAsyncClient

    control = Path(args.control)
    rng = np.random.default_rng(args.seed)
    started = time.monotonic()
    records = Records()

    def status() -> None:
        write_json(
            control / "status.json",
            {
                "t": time.monotonic(),
                "answered": len(records.t_done),
                "failed": records.n_errors,
                "first_error": records.errors[0]["error"] if records.errors else None,
                "cpu_s": time.process_time(),
            },
        )

    async def run() -> None:
        stop = asyncio.Event()
        timeout = httpx.Timeout(args.request_timeout_s, connect=30.0)
        async with ShardedAsyncClient(max_connections=args.concurrency, timeout=timeout) as client:
            gen = asyncio.create_task(
                closed_loop(
                    http_sender(client, args.url),
                    lambda: make_request(rng, args.per_request, args.min_len, args.max_len, args.vocab),
                    args.concurrency,
                    stop,
                    records=records,
                )
            )
            try:
                while not gen.done():
                    if (control / "stop").exists() or time.monotonic() - started > args.max_duration_s:
                        stop.set()
                        break
                    status()
                    await asyncio.sleep(0.5)
                await asyncio.wait_for(gen, 60)  # raises what stopped it early, if anything did
            finally:
                if not gen.done():
                    gen.cancel()

    asyncio.run(run())
    status()
    out = records.to_json()
    out["cpu_s"] = time.process_time()
    out["wall_s"] = time.monotonic() - started
    write_json(control / "records.json", out)
    return 0


class LoadGen:
    """The load generator's process, seen from the orchestrator."""

    def __init__(
        self, work: Path, url: str, args: argparse.Namespace, vocab: int, max_duration_s: float
    ) -> None:
        self.control = work / "loadgen"
        self.control.mkdir(parents=True, exist_ok=True)
        self.cpu_s: float | None = None  # its CPU and wall seconds, once stopped
        self.wall_s: float | None = None
        self.log_path = work / "loadgen.log"
        cmd = [
            sys.executable,
            os.path.abspath(__file__),
            "--url",
            url,
            "--control",
            str(self.control),
            "--concurrency",
            str(args.concurrency),
            "--per-request",
            str(args.per_request),
            "--min-len",
            str(args.min_len),
            "--max-len",
            str(args.max_len),
            "--vocab",
            str(vocab),
            "--seed",
            str(args.seed),
            "--max-duration-s",
            str(max_duration_s),
            "--request-timeout-s",
            str(args.request_timeout_s),
        ]
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)

    def tail(self, n: int = 4000) -> str:
        return self.log_path.read_text(errors="replace")[-n:] if self.log_path.exists() else ""

    def check(self) -> None:
        if self.proc.poll() is not None:
            raise RuntimeError(f"the load generator exited with {self.proc.returncode}:\n{self.tail()}")

    def stop(self, timeout_s: float) -> Records:
        (self.control / "stop").touch()
        try:
            self.proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self.kill()
            raise RuntimeError(
                f"the load generator did not stop within {timeout_s:.0f}s:\n{self.tail()}"
            ) from None
        path = self.control / "records.json"
        if self.proc.returncode != 0 or not path.exists():
            raise RuntimeError(f"the load generator failed (exit {self.proc.returncode}):\n{self.tail()}")
        raw = json.loads(path.read_text())
        self.cpu_s, self.wall_s = raw.pop("cpu_s", None), raw.pop("wall_s", None)
        return Records.from_json(raw)

    def status(self) -> dict[str, Any]:
        """The generator's progress (``status.json``); {} before the first."""
        with contextlib.suppress(OSError, ValueError):
            return dict(json.loads((self.control / "status.json").read_text()))
        return {}

    def cpu_s_now(self) -> float | None:
        cpu = self.status().get("cpu_s")
        return float(cpu) if cpu is not None else None

    def kill(self) -> None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout=10)


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--url", required=True, help="the reward server")
    p.add_argument("--control", required=True, help="the folder of stop, status.json, records.json")
    p.add_argument("--concurrency", type=int, required=True, help="requests in flight")
    p.add_argument("--per-request", type=int, required=True, help="prompts per request")
    p.add_argument("--min-len", type=int, required=True, help="shortest prompt, tokens")
    p.add_argument("--max-len", type=int, required=True, help="longest prompt, tokens")
    p.add_argument("--vocab", type=int, required=True, help="token ids are drawn from [4, vocab)")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--max-duration-s", type=float, required=True)
    p.add_argument("--request-timeout-s", type=float, default=300.0)
    return p.parse_args(argv)


if __name__ == "__main__":
    raise SystemExit(loadgen_main(parse()))
