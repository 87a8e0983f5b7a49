"""``/health`` latency of a real reward server while clients send 10 MB inputs, against the same
server idle (the baseline, measured in the same run); the server's CPU time per 10 MB request
(on a shared machine less noisy than the latency tail, and what the server takes from the cores
the clients and /health share); the server's peak RSS.

    python benchmarks/server_abuse.py [--abusers 3] [--seconds 5]

The abusers are separate processes, so the client's own GIL does not colour the figures."""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import statistics
import tempfile
import time
from pathlib import Path

import httpx

from rewardplane.testing.servers import start_server
from rewardplane.tinymodel import build_tiny_reward_model


def _abuse(url: str, path: str, stop_at: float, out: mp.Queue[list[tuple[int, float]]]) -> None:
    body = json.dumps({"input": ["word " * (2 * 1024 * 1024)]}).encode()
    answers = []
    with httpx.Client(timeout=120) as c:
        while time.monotonic() < stop_at:
            start = time.perf_counter()
            r = c.post(url + path, content=body, headers={"content-type": "application/json"})
            answers.append((r.status_code, time.perf_counter() - start))
    out.put(answers)


def _health(url: str, seconds: float) -> list[float]:
    took = []
    with httpx.Client(timeout=30) as c:
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            start = time.perf_counter()
            c.get(url + "/health").raise_for_status()
            took.append(time.perf_counter() - start)
            time.sleep(0.01)
    return sorted(took)


def _hwm_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError("no VmHWM in /proc status")


def _cpu_s(pid: int) -> float:
    """User + system CPU seconds of a process, all its threads (/proc/<pid>/stat fields 14, 15)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _fmt(xs: list[float]) -> str:
    p99 = xs[int(0.99 * (len(xs) - 1))]
    return f"p50 {statistics.median(xs) * 1e3:.1f} ms, p99 {p99 * 1e3:.1f} ms, max {xs[-1] * 1e3:.1f} ms (n={len(xs)})"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--abusers", type=int, default=3)
    ap.add_argument("--seconds", type=float, default=5.0)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        model = build_tiny_reward_model(Path(tmp) / "model", num_labels=1, seed=0)
        server = start_server(model, Path(tmp), max_model_len=64)
        try:
            idle = _health(server.url, args.seconds)
            idle_hwm = _hwm_mib(server.process.pid)
            cpu_before = _cpu_s(server.process.pid)
            q: mp.Queue[list[tuple[int, float]]] = mp.Queue()
            stop_at = time.monotonic() + args.seconds + 1
            paths = ["/score", "/classify", "/pooling"]
            procs = [
                mp.Process(target=_abuse, args=(server.url, paths[i % 3], stop_at, q))
                for i in range(args.abusers)
            ]
            for p in procs:
                p.start()
            time.sleep(0.5)
            busy = _health(server.url, args.seconds)
            answers = [a for _ in procs for a in q.get(timeout=300)]
            for p in procs:
                p.join(timeout=60)
            hwm = _hwm_mib(server.process.pid)
            cpu = _cpu_s(server.process.pid) - cpu_before
        finally:
            server.stop()
    statuses = sorted({s for s, _ in answers})
    refusal = sorted(t for _, t in answers)
    print(f"/health idle:                        {_fmt(idle)}")
    print(f"/health with {args.abusers} clients sending 10 MB: {_fmt(busy)}")
    print(
        f"ratio p50 {statistics.median(busy) / statistics.median(idle):.2f}x, p99 {busy[int(0.99 * (len(busy) - 1))] / idle[int(0.99 * (len(idle) - 1))]:.2f}x"
    )
    print(
        f"10 MB requests: {len(answers)} answered {statuses}, time to the answer p50 {statistics.median(refusal) * 1e3:.0f} ms"
    )
    print(f"server CPU per 10 MB request: {cpu / len(answers) * 1e3:.0f} ms ({cpu:.1f} s for {len(answers)})")
    print(f"server peak RSS (VmHWM): {idle_hwm:.0f} MiB before the 10 MB requests, {hwm:.0f} MiB after")


if __name__ == "__main__":
    main()
