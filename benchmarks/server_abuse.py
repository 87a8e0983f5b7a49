"""``/health`` latency of a real reward server while clients send 10 MB inputs, against the same
server idle (the baseline, measured in the same run); the server's CPU time per 10 MB request
(on a shared machine less noisy than the latency tail, and what the server takes from the cores
the clients and /health share); the server's peak RSS.

    python benchmarks/server_abuse.py [--abusers 3] [--seconds 5]
    python benchmarks/server_abuse.py --body token-ids [--abusers 2]

``--body token-ids``: the clients post ``{"input": [[16, 22]] * 200000}`` (2 MB, far over
``--max-items-per-request``) to /classify, and the run is made twice in a row: first with every body
parsed on the event loop (the helper process of ``http/body_parse.py`` switched off in the server
process), then as the server runs.

The abusers are separate processes, so the client's own GIL does not colour the figures."""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import httpx

from rewardplane.testing.servers import ServerHandle, launch_server, start_server, wait_healthy
from rewardplane.tinymodel import build_tiny_reward_model

# The server as before the helper process: every body parsed on the event loop.
_LOOP_PARSE = (
    "import runpy, rewardplane.server.http.body_parse as b; b.BodyParser._costly = lambda self, raw: False; "
    "runpy.run_module('rewardplane.server', run_name='__main__')"
)


def _body(kind: str) -> bytes:
    if kind == "token-ids":
        return json.dumps({"input": [[16, 22]] * 200000}).encode()
    return json.dumps({"input": ["word " * (2 * 1024 * 1024)]}).encode()


def _abuse(url: str, path: str, stop_at: float, out: mp.Queue[list[tuple[int, float]]], kind: str) -> None:
    body = _body(kind)
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


def _start(model: Path, work: Path, loop_parse: bool) -> ServerHandle:
    if not loop_parse:
        return start_server(model, work, max_model_len=64)
    handle = launch_server(model, work, max_model_len=64)  # started only for its arguments
    handle.stop()
    args = [handle.args[0], "-c", _LOOP_PARSE, *handle.args[3:]]
    log = open(work / f"server-loop-{handle.port}.log", "wb")  # noqa: SIM115 - the server's lifetime
    proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    return wait_healthy(
        ServerHandle(
            url=handle.url, port=handle.port, process=proc, log_path=Path(log.name), token=None, args=args
        )
    )


def _run(model: Path, work: Path, args: argparse.Namespace, label: str, loop_parse: bool = False) -> None:
    server = _start(model, work, loop_parse)
    try:
        idle = _health(server.url, args.seconds)
        idle_hwm = _hwm_mib(server.process.pid)
        cpu_before = _cpu_s(server.process.pid)
        q: mp.Queue[list[tuple[int, float]]] = mp.Queue()
        stop_at = time.monotonic() + args.seconds + 1
        paths = ["/classify"] if args.body == "token-ids" else ["/score", "/classify", "/pooling"]
        procs = [
            mp.Process(target=_abuse, args=(server.url, paths[i % len(paths)], stop_at, q, args.body))
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
    size = "2 MB token-id" if args.body == "token-ids" else "10 MB"
    statuses = sorted({s for s, _ in answers})
    refusal = sorted(t for _, t in answers)
    print(f"== {label}")
    print(f"/health idle:                        {_fmt(idle)}")
    print(f"/health with {args.abusers} clients sending {size}: {_fmt(busy)}")
    print(
        f"ratio p50 {statistics.median(busy) / statistics.median(idle):.2f}x, p99 {busy[int(0.99 * (len(busy) - 1))] / idle[int(0.99 * (len(idle) - 1))]:.2f}x"
    )
    print(
        f"{size} requests: {len(answers)} answered {statuses}, time to the answer p50 {statistics.median(refusal) * 1e3:.0f} ms"
    )
    print(
        f"server CPU per {size} request: {cpu / len(answers) * 1e3:.0f} ms ({cpu:.1f} s for {len(answers)})"
    )
    print(f"server peak RSS (VmHWM): {idle_hwm:.0f} MiB before the {size} requests, {hwm:.0f} MiB after")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--abusers", type=int, default=3)
    ap.add_argument("--seconds", type=float, default=5.0)
    ap.add_argument("--body", choices=["text", "token-ids"], default="text")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        model = build_tiny_reward_model(Path(tmp) / "model", num_labels=1, seed=0)
        if args.body == "token-ids":
            _run(model, Path(tmp), args, "every body parsed on the event loop (before)", loop_parse=True)
        _run(model, Path(tmp), args, "as the server runs")


if __name__ == "__main__":
    main()
