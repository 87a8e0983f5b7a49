"""Scoring throughput under weight pushes, end to end over HTTP (issue #28; two GPUs).

One vLLM reward server on GPU 0 (the 7B shape, ``--load-format dummy``: random weights, as
``benchmarks/weight_sync.py``), kept busy by a closed-loop load generator in a process of its own
(token-id prompts of U[lo, hi] tokens, 8 per ``/pooling`` request, N requests in flight through the
SDK's sharded HTTP pool; each answer's completion time and weights ``version`` recorded); the
trainer is this process, on GPU 1, with weights of the same shape. One run, one timeline:

  1. baseline          no weight-sync group at all
  2. group_idle        the group joined and set up (the first pushes announced the layouts over HTTP
                       and formed the NCCL communicator; the servers' listeners wait on the store),
                       nothing in flight: what an idle communicator costs
  3. receive_pending   atomic full pushes started from the data plane, each held by the trainer for
                       ``--hold-s`` after the ready reduction, before its first byte: the server has
                       agreed and posted the receive of every bucket into its staging buffers on its
                       transfer stream (the first NCCL broadcast group pending on GPU 0, the rest
                       queued behind it; its worker thread polls for it) while vLLM keeps scoring.
                       The SDK has no call that holds a push: the trainer's ready reduction is wrapped
                       for that push. A streamed push cannot be held this way without pausing
                       scoring (it takes the weights lock before its workers agree).
  4. full              ``--pushes`` full pushes (streamed, from the data plane), ``--spacing-s`` apart
  5. head_only         ``--pushes`` head-only pushes
  6. full_atomic       ``--atomic-pushes`` atomic full pushes (the transfer while scoring, the swap)

Reported: the baseline (prompts/s, tokens/s); each phase's rate ÷ baseline; for each push the
trainer's call → return, the server's wait for the weights lock (a streamed push waits for every
request in flight: with N × 8 prompts queued, that is their time on the engine) and lock → commit,
the longest gap without a completion, the time the smoothed rate spent below ``--below-frac`` of the
baseline, and the throughput lost = baseline rate × window − prompts completed in the window
(window: the push ± pads, its ends moved into gaps between completion bursts so that whole engine
steps are counted), in prompts and in seconds of baseline; the same statistics on windows of the
baseline phase as the noise floor; request latency p50/p99 in flight during pushes and outside
them; and the server's version guarantees checked on every answer (one version per answer, body and
header agree; an answer sent after another was answered is never older; none older than a push that
returned before it was sent, none of a version before its push began). A violation, a failed
request or a failed push exits 1; phases skipped for lack of time (``--budget-s``) exit 3.

    bash scripts/gpu-run.sh bench scoring_under_push                  # 7b, 2 GPUs, ~6 min
    bash scripts/gpu-run.sh bench scoring_under_push --shape small --quick
    python benchmarks/scoring_under_push.py --cpu                     # smoke: tiny model, CPU, gloo
    python benchmarks/scoring_under_push.py --reanalyze RESULT.json   # the analysis again, new options

Writes ``--out`` (default ``$OUT/scoring_under_push.json`` when OUT is set) and the raw timeline
beside it (``…records.json``: every answer), which ``--reanalyze`` reads.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import faulthandler
import json
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Awaitable, Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any
from unittest import mock

import numpy as np
import numpy.typing as npt

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

Array = npt.NDArray[np.float64]
TOKEN = "bench"
RESULT_NAME = "scoring_under_push.json"

# ---- the load generator (a process of its own) ------------------------------------------------


@dataclass
class Records:
    """Answered requests as columns (``time.monotonic()`` seconds: one clock for every process of
    the host), and the failed ones."""

    t_send: list[float] = field(default_factory=list)
    t_done: list[float] = field(default_factory=list)
    prompts: list[int] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)
    version: list[int] = field(default_factory=list)
    header_version: list[int | None] = field(default_factory=list)
    n_errors: int = 0
    errors: list[dict[str, Any]] = field(default_factory=list)  # the first ERRORS_KEPT

    ERRORS_KEPT = 50

    def add(
        self, t_send: float, t_done: float, prompts: int, tokens: int, version: int, header: int | None
    ) -> None:
        self.t_send.append(t_send)
        self.t_done.append(t_done)
        self.prompts.append(prompts)
        self.tokens.append(tokens)
        self.version.append(version)
        self.header_version.append(header)

    def fail(self, t_send: float, t_done: float, what: str) -> None:
        self.n_errors += 1
        if len(self.errors) < self.ERRORS_KEPT:
            self.errors.append({"t_send": t_send, "t_done": t_done, "error": what})

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, raw: dict[str, Any]) -> Records:
        return cls(**{k: raw[k] for k in cls.__dataclass_fields__ if k in raw})


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


# ---- analysis (pure: arrays and timestamps in, figures out) -----------------------------------


@dataclass(frozen=True)
class Completions:
    """Answered requests ordered by completion time, with cumulative prompts and tokens."""

    done: Array
    cum_prompts: Array  # length n + 1, from 0
    cum_tokens: Array

    @classmethod
    def of(cls, t_done: Sequence[float], prompts: Sequence[int], tokens: Sequence[int]) -> Completions:
        t = np.asarray(t_done, dtype=np.float64)
        order = np.argsort(t, kind="stable")
        zero = np.zeros(1)
        return cls(
            t[order],
            np.concatenate([zero, np.cumsum(np.asarray(prompts, dtype=np.float64)[order])]),
            np.concatenate([zero, np.cumsum(np.asarray(tokens, dtype=np.float64)[order])]),
        )

    def count(self, a: float, b: float) -> tuple[float, float]:
        """Prompts and tokens of the requests answered in (a, b]."""
        i = int(np.searchsorted(self.done, a, side="right"))
        j = int(np.searchsorted(self.done, b, side="right"))
        return float(self.cum_prompts[j] - self.cum_prompts[i]), float(
            self.cum_tokens[j] - self.cum_tokens[i]
        )

    def prompts_by(self, t: Array) -> Array:
        """Prompts answered at or before each time of ``t``."""
        return self.cum_prompts[np.searchsorted(self.done, t, side="right")]


def burst_boundary(done: Array, lo: float, hi: float) -> float:
    """A time in [lo, hi] between answers: the middle of the longest gap between consecutive answers
    there (``lo`` and ``hi`` count as answers). Answers come in bursts, one per engine step; a window
    whose ends both sit between bursts counts whole steps, not a fraction of one at each end."""
    inside = done[(done > lo) & (done < hi)]
    pts = np.concatenate([[lo], inside, [hi]])
    k = int(np.argmax(np.diff(pts)))
    return float((pts[k] + pts[k + 1]) / 2)


@dataclass(frozen=True)
class Rate:
    prompts_s: float
    tokens_s: float
    a: float  # the window, its ends aligned between bursts
    b: float
    prompts: float
    tokens: float

    @property
    def seconds(self) -> float:
        return self.b - self.a


def window_rate(c: Completions, t0: float, t1: float, align_s: float) -> Rate:
    """Answers per second in [t0, t1], the ends moved (inwards, by at most ``align_s``) between bursts."""
    a, b = t0, t1
    if t1 - t0 > 3 * align_s > 0:
        a, b = burst_boundary(c.done, t0, t0 + align_s), burst_boundary(c.done, t1 - align_s, t1)
    p, t = c.count(a, b)
    d = max(b - a, 1e-9)
    return Rate(p / d, t / d, a, b, p, t)


def pooled_rate(rates: Sequence[Rate]) -> Rate | None:
    """Several windows as one: their answers over their summed lengths."""
    if not rates:
        return None
    d = sum(r.seconds for r in rates)
    p, t = sum(r.prompts for r in rates), sum(r.tokens for r in rates)
    return Rate(p / d, t / d, rates[0].a, rates[-1].b, p, t)


def relative(r: Rate, base: Rate) -> dict[str, float]:
    return {
        "seconds": r.seconds,
        "prompts_s": r.prompts_s,
        "tokens_s": r.tokens_s,
        "rel_prompts": r.prompts_s / base.prompts_s,
        "rel_tokens": r.tokens_s / base.tokens_s,
    }


def window_noise(
    c: Completions, t0: float, t1: float, length: float, align_s: float, base: Rate
) -> dict[str, Any]:
    """The spread (sd) of rate ÷ baseline over consecutive windows of ``length`` in [t0, t1] (the
    baseline phase): how far apart two measurements of that length are with nothing going on."""
    rel_p, rel_t = [], []
    s = t0
    while s + length <= t1 and length > 0:
        r = window_rate(c, s, s + length, align_s)
        rel_p.append(r.prompts_s / base.prompts_s)
        rel_t.append(r.tokens_s / base.tokens_s)
        s += length
    return {
        "windows": len(rel_p),
        "length_s": length,
        "sd_rel_prompts": statistics.stdev(rel_p) if len(rel_p) > 1 else None,
        "sd_rel_tokens": statistics.stdev(rel_t) if len(rel_t) > 1 else None,
    }


def lost_around(
    c: Completions, base: Rate, start: float, end: float, pad_before: float, pad_after: float, align_s: float
) -> dict[str, float]:
    """Throughput lost around [start, end] (a push): baseline rate × window − answered in the window.
    The window is [start − pad_before, end + pad_after], each end moved outwards (by at most
    ``align_s``) between bursts. In prompts, tokens, and seconds of baseline."""
    a = (
        burst_boundary(c.done, start - pad_before - align_s, start - pad_before)
        if align_s > 0
        else start - pad_before
    )
    b = burst_boundary(c.done, end + pad_after, end + pad_after + align_s) if align_s > 0 else end + pad_after
    p, t = c.count(a, b)
    lost_p = base.prompts_s * (b - a) - p
    lost_t = base.tokens_s * (b - a) - t
    return {
        "a": a,
        "b": b,
        "window_s": b - a,
        "answered_prompts": p,
        "lost_prompts": lost_p,
        "lost_s": lost_p / base.prompts_s,
        "lost_tokens": lost_t,
        "lost_s_tokens": lost_t / base.tokens_s,
    }


def longest_gap(done: Array, t0: float, t1: float) -> tuple[float, float]:
    """The longest time without an answer that overlaps [t0, t1], and when it began (a gap running
    past an end of the window with no answer beyond it ends there)."""
    n = len(done)
    if n == 0:
        return t1 - t0, t0
    i0 = max(int(np.searchsorted(done, t0, side="right")) - 1, 0)
    i1 = min(int(np.searchsorted(done, t1, side="left")), n - 1)
    pts = done[i0 : i1 + 1]
    if pts[0] > t0:
        pts = np.concatenate([[t0], pts])
    if pts[-1] < t1:
        pts = np.concatenate([pts, [t1]])
    if len(pts) < 2:
        return 0.0, t0
    d = np.diff(pts)
    k = int(np.argmax(d))
    return float(d[k]), float(pts[k])


def below_span(c: Completions, t0: float, t1: float, rate_p: float, frac: float, width: float) -> float:
    """Seconds within [t0, t1] during which the rate, smoothed over ``width``, was below ``frac`` of
    ``rate_p`` (prompts/s)."""
    if t1 <= t0 or width <= 0:
        return 0.0
    dt = width / 10
    grid = np.arange(t0, t1, dt)
    r = (c.prompts_by(grid + width / 2) - c.prompts_by(grid - width / 2)) / width
    return float(np.count_nonzero(r < frac * rate_p) * dt)


def gap_stats(done: Array, t0: float, t1: float) -> dict[str, float]:
    inside = done[(done >= t0) & (done <= t1)]
    d = np.diff(inside)
    if len(d) == 0:
        return {"median_s": 0.0, "p99_s": 0.0, "max_s": 0.0}
    return {
        "median_s": float(np.median(d)),
        "p99_s": float(np.percentile(d, 99)),
        "max_s": float(d.max()),
    }


@dataclass(frozen=True)
class PushSpan:
    version: int
    t_call: float
    t_return: float | None
    ok: bool


def version_violations(
    t_send: Sequence[float],
    t_done: Sequence[float],
    version: Sequence[int],
    header_version: Sequence[int | None],
    pushes: Sequence[PushSpan],
    initial: int,
    limit: int = 20,
) -> tuple[int, list[str]]:
    """Every answer against the server's guarantees (docs/weight-sync.md, "Guarantees"): one version
    per answer (the body's and the header's agree); only versions that were served or pushed; an
    answer sent after another was answered is not older than it (scoring holds the weights lock
    shared, a push exclusively, and versions only grow); no answer sent after a push returned is
    older than that push, and none answered before a push began carries its version.
    Returns the number of violations and the first ``limit``, described."""
    send = np.asarray(t_send, dtype=np.float64)
    done = np.asarray(t_done, dtype=np.float64)
    ver = np.asarray(version, dtype=np.int64)
    found: list[str] = []
    n = 0

    def report(msg: str) -> None:
        nonlocal n
        n += 1
        if len(found) < limit:
            found.append(msg)

    for i, (v, h) in enumerate(zip(version, header_version, strict=True)):
        if h is not None and h != v:
            report(f"answer {i}: body version {v}, header version {h}")
    allowed = {initial} | {p.version for p in pushes}
    for i in np.flatnonzero(~np.isin(ver, np.asarray(sorted(allowed), dtype=np.int64))).tolist():
        report(f"answer {int(i)}: version {int(ver[i])} was never pushed (pushed: {sorted(allowed)})")
    if len(ver):
        order = np.argsort(done, kind="stable")
        done_sorted, ver_sorted = done[order], ver[order]
        best = np.maximum.accumulate(ver_sorted)  # the newest version answered by each time
        before = np.searchsorted(done_sorted, send, side="left")  # answers completed before each send
        for i in np.flatnonzero(before > 0).tolist():
            newest = int(best[before[i] - 1])
            if newest > ver[i]:
                report(
                    f"answer {int(i)} (sent at {send[i]:.4f}) has version {int(ver[i])}, but version {newest} "
                    "had already been answered: a version went back"
                )
    for p in pushes:
        if p.ok and p.t_return is not None:
            for i in np.flatnonzero((send > p.t_return) & (ver < p.version)).tolist():
                report(
                    f"answer {int(i)} sent {send[i] - p.t_return:.4f}s after push {p.version} returned has "
                    f"version {int(ver[i])}"
                )
        for i in np.flatnonzero((done < p.t_call) & (ver >= p.version)).tolist():
            report(f"answer {int(i)} answered before push {p.version} began has version {int(ver[i])}")
    return n, found


def latency_split(
    t_send: Sequence[float],
    t_done: Sequence[float],
    windows: dict[str, list[tuple[float, float]]],
    t_from: float,
) -> dict[str, dict[str, float | int | None]]:
    """Request latency p50/p99 of the requests in flight during each kind's windows, and of those
    (sent from ``t_from`` on) in flight during none."""
    send = np.asarray(t_send, dtype=np.float64)
    done = np.asarray(t_done, dtype=np.float64)
    lat = done - send
    any_window = np.zeros(len(send), dtype=bool)

    def stats(mask: npt.NDArray[np.bool_]) -> dict[str, float | int | None]:
        x = lat[mask]
        if len(x) == 0:
            return {"n": 0, "p50_s": None, "p99_s": None}
        return {"n": int(len(x)), "p50_s": float(np.percentile(x, 50)), "p99_s": float(np.percentile(x, 99))}

    out: dict[str, dict[str, float | int | None]] = {}
    for kind, spans in windows.items():
        mask = np.zeros(len(send), dtype=bool)
        for s, e in spans:
            mask |= (send < e) & (done > s)
        any_window |= mask
        out[kind] = stats(mask)
    out["outside"] = stats(~any_window & (send >= t_from))
    return out


@dataclass
class Phase:
    name: str
    label: str
    t0: float
    t1: float
    note: str = ""


@dataclass
class PushRecord:
    kind: str  # setup_*, held, full, head_only, full_atomic
    version: int
    t_call: float
    t_return: float | None = None
    ok: bool = False
    error: str | None = None
    atomic: bool = False
    hold_start: float | None = None
    hold_end: float | None = None
    via: str | None = None  # the server's last_update.via: data_plane or http
    trainer: dict[str, float] = field(default_factory=dict)  # the publisher's last_stats
    server: dict[str, Any] = field(default_factory=dict)  # the server's last_update


@dataclass(frozen=True)
class Options:
    pad_before_s: float
    pad_after_s: float
    align_s: float
    below_frac: float
    rate_width_s: float | None  # None: twice the baseline's p99 gap between answers
    hold_margin_s: float


MEASURED_KINDS = ("full", "head_only", "full_atomic", "held")


def median_of(values: Sequence[float | None]) -> float | None:
    vals = [v for v in values if v is not None]
    return statistics.median(vals) if vals else None


def server_stamps(p: PushRecord) -> dict[str, float | None]:
    """The server's lock wait (streamed: task → locked) and lock → commit, in ms."""
    ms = p.server.get("after_announce_ms") or {}
    lock_wait = ms["locked"] - ms["task"] if "locked" in ms and "task" in ms and not p.atomic else None
    held = ms["committed"] - ms["locked"] if "committed" in ms and "locked" in ms else None
    return {"lock_wait_ms": lock_wait, "locked_ms": held}


def analyze(
    records: Records,
    phases: Sequence[Phase],
    pushes: Sequence[PushRecord],
    initial_version: int,
    opt: Options,
) -> dict[str, Any]:
    """Every figure of the report, from the answers, the phases and the pushes."""
    c = Completions.of(records.t_done, records.prompts, records.tokens)
    by_name = {p.name: p for p in phases}
    if "baseline" not in by_name:
        raise ValueError("no baseline phase")
    bp = by_name["baseline"]
    base = window_rate(c, bp.t0, bp.t1, opt.align_s)
    if base.prompts == 0:
        raise ValueError("no answer in the baseline phase: nothing to compare with")
    gaps = gap_stats(c.done, bp.t0, bp.t1)
    width = opt.rate_width_s or max(2 * gaps["p99_s"], 0.01)
    out: dict[str, Any] = {
        "options": asdict(opt) | {"rate_width_s_used": width},
        "baseline": {
            "prompts_s": base.prompts_s,
            "tokens_s": base.tokens_s,
            "seconds": base.seconds,
            "answer_gaps": gaps,
        },
        "phases": {
            p.name: relative(window_rate(c, p.t0, p.t1, opt.align_s), base) | {"label": p.label}
            for p in phases
        },
    }
    # 3: the receive pending, the holds only (their first hold_margin_s left out: the receive is posted then)
    holds = [p for p in pushes if p.kind == "held"]
    spans = [(p.hold_start, p.hold_end) for p in holds if p.hold_start is not None and p.hold_end is not None]
    hold_rates = [
        window_rate(c, s + opt.hold_margin_s, e, opt.align_s) for s, e in spans if e - s > opt.hold_margin_s
    ]
    pooled = pooled_rate(hold_rates)
    if pooled is not None:
        length = statistics.median(r.seconds for r in hold_rates)
        out["holds"] = relative(pooled, base) | {
            "each": [relative(r, base) for r in hold_rates],
            "noise": window_noise(c, bp.t0, bp.t1, length, opt.align_s, base),
            "valid": all(p.via == "data_plane" and p.ok for p in holds),
        }
    # each push: its window, gap, drop below the threshold, loss; the same on baseline windows
    per_push: list[dict[str, Any]] = []
    kinds: dict[str, Any] = {}
    for kind in MEASURED_KINDS:
        mine = [p for p in pushes if p.kind == kind and p.ok and p.t_return is not None]
        rows: list[dict[str, Any]] = []
        for p in mine:
            assert p.t_return is not None
            start = p.hold_end if p.kind == "held" and p.hold_end is not None else p.t_call
            lost = lost_around(c, base, start, p.t_return, opt.pad_before_s, opt.pad_after_s, opt.align_s)
            gap, gap_at = longest_gap(c.done, start, p.t_return + opt.pad_after_s)
            row: dict[str, Any] = {
                "kind": kind,
                "version": p.version,
                "via": p.via,
                "trainer_ms": 1000 * (p.t_return - p.t_call),
                "hold_ms": 1000 * (p.hold_end - p.hold_start)
                if p.hold_end is not None and p.hold_start is not None
                else None,
                "measured_ms": 1000 * (p.t_return - start),
                **server_stamps(p),
                "longest_gap_ms": 1000 * gap,
                "longest_gap_from_start_ms": 1000 * (gap_at - start),
                "below_ms": 1000 * below_span(c, lost["a"], lost["b"], base.prompts_s, opt.below_frac, width),
                **lost,
            }
            rows.append(row)
        per_push += rows
        if not rows:
            continue
        # the noise floor: the same windows laid over the baseline phase, one after the other
        span = statistics.median(r["measured_ms"] for r in rows) / 1000
        controls = []
        s = bp.t0 + opt.pad_before_s + opt.align_s
        while s + span + opt.pad_after_s + opt.align_s <= bp.t1:
            ctl = lost_around(c, base, s, s + span, opt.pad_before_s, opt.pad_after_s, opt.align_s)
            cg, _ = longest_gap(c.done, s, s + span + opt.pad_after_s)
            ctl["longest_gap_ms"] = 1000 * cg
            ctl["below_ms"] = 1000 * below_span(c, ctl["a"], ctl["b"], base.prompts_s, opt.below_frac, width)
            controls.append(ctl)
            s = ctl["b"] + opt.pad_before_s + opt.align_s
        lost_s = [r["lost_s"] for r in rows]
        kinds[kind] = {
            "n": len(rows),
            "via_data_plane": sum(r["via"] == "data_plane" for r in rows),
            "trainer_ms_median": median_of([r["trainer_ms"] for r in rows]),
            "lock_wait_ms_median": median_of([r["lock_wait_ms"] for r in rows]),
            "locked_ms_median": median_of([r["locked_ms"] for r in rows]),
            "longest_gap_ms_median": median_of([r["longest_gap_ms"] for r in rows]),
            "longest_gap_ms_max": max(r["longest_gap_ms"] for r in rows),
            "below_ms_median": median_of([r["below_ms"] for r in rows]),
            "lost_prompts_mean": statistics.fmean(r["lost_prompts"] for r in rows),
            "lost_s_mean": statistics.fmean(lost_s),
            "lost_s_median": statistics.median(lost_s),
            "lost_s_tokens_mean": statistics.fmean(r["lost_s_tokens"] for r in rows),
            "lost_s_sem": statistics.stdev(lost_s) / len(lost_s) ** 0.5 if len(lost_s) > 1 else None,
            "window_s_median": statistics.median(r["window_s"] for r in rows),
            "baseline_windows": {
                "n": len(controls),
                "lost_s_mean": statistics.fmean(x["lost_s"] for x in controls) if controls else None,
                "lost_s_sd": statistics.stdev(x["lost_s"] for x in controls) if len(controls) > 1 else None,
                "longest_gap_ms_median": median_of([x["longest_gap_ms"] for x in controls]),
                "below_ms_median": median_of([x["below_ms"] for x in controls]),
            },
        }
    out["pushes"] = per_push
    out["kinds"] = kinds
    # latency: in flight during a push (each kind; holds included in "held") or during none
    windows: dict[str, list[tuple[float, float]]] = {}
    for p in pushes:
        end = p.t_return if p.t_return is not None else p.t_call
        kind = p.kind if p.kind in MEASURED_KINDS else "setup"
        windows.setdefault(kind, []).append((p.t_call, end))
    out["latency"] = latency_split(records.t_send, records.t_done, windows, bp.t0)
    n_bad, bad = version_violations(
        records.t_send,
        records.t_done,
        records.version,
        records.header_version,
        [PushSpan(p.version, p.t_call, p.t_return, p.ok) for p in pushes],
        initial_version,
    )
    out["versions"] = {
        "answers": len(records.version),
        "seen": sorted(set(records.version)),
        "pushed": [p.version for p in pushes],
        "violations": n_bad,
        "first_violations": bad,
    }
    out["requests"] = {
        "answered": len(records.t_done),
        "failed": records.n_errors,
        "first_errors": records.errors[:5],
    }
    return out


# ---- the report -------------------------------------------------------------------------------


def fmt(x: float | None, spec: str, scale: float = 1.0) -> str:
    return "-" if x is None else format(x * scale, spec)


def print_report(a: dict[str, Any], header: str, load: str) -> None:
    b = a["baseline"]
    g = b["answer_gaps"]
    print(f"\n== {header} ==")
    print(load)
    print(
        f"baseline: {b['prompts_s']:,.1f} prompts/s, {b['tokens_s']:,.0f} tokens/s over {b['seconds']:.1f} s; "
        f"gaps between answers: median {1000 * g['median_s']:.1f} ms, p99 {1000 * g['p99_s']:.0f} ms, "
        f"max {1000 * g['max_s']:.0f} ms"
    )
    print(f"\n{'phase':<44} {'seconds':>8} {'prompts/s':>10} {'÷ base':>7} {'tokens/s':>10} {'÷ base':>7}")
    rows = list(a["phases"].items())
    if "holds" in a:
        rows.insert(
            [k for k, _ in rows].index("receive_pending") + 1
            if "receive_pending" in a["phases"]
            else len(rows),
            ("holds", a["holds"] | {"label": "3 receive pending: the holds only"}),
        )
    for _, r in rows:
        print(
            f"{r['label']:<44} {r['seconds']:>8.1f} {r['prompts_s']:>10,.1f} {r['rel_prompts']:>7.3f} "
            f"{r['tokens_s']:>10,.0f} {r['rel_tokens']:>7.3f}"
        )
    if "holds" in a:
        nz = a["holds"]["noise"]
        print(
            f"  noise: sd of ÷ base over {nz['windows']} baseline windows of {nz['length_s']:.1f} s: "
            f"prompts {fmt(nz['sd_rel_prompts'], '.4f')}, tokens {fmt(nz['sd_rel_tokens'], '.4f')}"
            + ("" if a["holds"]["valid"] else "  [HOLDS NOT ALL FROM THE DATA PLANE: not a pending receive]")
        )
    o = a["options"]
    print(
        f"\npushes (medians; lost = baseline rate x window - answered in it; window = push - {o['pad_before_s']} s "
        f".. + {o['pad_after_s']} s, ends between answer bursts; <{o['below_frac']:.0%}: rate smoothed over "
        f"{o['rate_width_s_used']:.3f} s below {o['below_frac']:.0%} of baseline; held: from the hold's end)"
    )
    below = f"{o['below_frac']:.0%} ms"
    print(
        f"{'':<12} {'':>3} {'trainer':>9} {'lock':>9} {'lock →':>9} {'longest':>9} {'below':>9} "
        f"{'lost':>9} {'lost s':>16}   {'on baseline windows:'}"
    )
    print(
        f"{'kind':<12} {'n':>3} {'ms':>9} {'wait ms':>9} {'commit ms':>9} {'gap ms':>9} {below:>9} "
        f"{'prompts':>9} {'mean ± sem':>16}   {'gap ms':>9} {'lost s sd':>10}"
    )
    for kind, k in a["kinds"].items():
        bw = k["baseline_windows"]
        lost = f"{k['lost_s_mean']:.3f} ± {fmt(k['lost_s_sem'], '.3f')}"
        print(
            f"{kind:<12} {k['n']:>3} {fmt(k['trainer_ms_median'], '.1f'):>9} "
            f"{fmt(k['lock_wait_ms_median'], '.1f'):>9} {fmt(k['locked_ms_median'], '.1f'):>9} "
            f"{fmt(k['longest_gap_ms_median'], '.0f'):>9} {fmt(k['below_ms_median'], '.0f'):>9} "
            f"{k['lost_prompts_mean']:>9.1f} {lost:>16}   {fmt(bw['longest_gap_ms_median'], '.0f'):>9} "
            f"{fmt(bw['lost_s_sd'], '.3f'):>10}"
        )
    print("\nlatency (s)                      n      p50      p99")
    for kind, s in a["latency"].items():
        label = "outside pushes" if kind == "outside" else f"in flight during {kind}"
        print(f"  {label:<28} {s['n']:>6} {fmt(s['p50_s'], '8.3f')} {fmt(s['p99_s'], '8.3f')}")
    v, r = a["versions"], a["requests"]
    print(
        f"\nrequests: {r['answered']:,} answered, {r['failed']} failed"
        + (f" — first: {r['first_errors'][0]['error']}" if r["failed"] else "")
    )
    if v["violations"]:
        print(f"!! VERSION GUARANTEES VIOLATED: {v['violations']} time(s)")
        for line in v["first_violations"]:
            print(f"!!   {line}")
    else:
        print(
            f"versions: {v['answers']:,} answers, versions seen {v['seen'][:3]}..{v['seen'][-3:]}; one version per "
            "answer, never back in time, consistent with every push: OK"
        )


# ---- the run ------------------------------------------------------------------------------------


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
            "--role",
            "loadgen",
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


def server_last_update(url: str, version: int, timeout_s: float = 2.0) -> dict[str, Any]:
    """The server's record of its last update (``/get_num_background_tasks``), once it is ``version``'s
    (it is written just after the commit that answered the trainer); {} if it does not come."""
    import httpx

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        with contextlib.suppress(httpx.HTTPError, ValueError):
            last = (
                httpx.get(
                    f"{url}/get_num_background_tasks", headers={"Authorization": f"Bearer {TOKEN}"}, timeout=5
                )
                .json()
                .get("last_update")
            )
            if last and last.get("version") == version:
                return dict(last)
        time.sleep(0.02)
    return {}


def held_reduction(
    reduce: Callable[[int], int], hold_s: float, spans: list[tuple[float, float]]
) -> Callable[[int], int]:
    """The trainer's status reduction, holding for ``hold_s`` after the first one every rank agreed
    on — a data-plane push's ready reduction — so the push waits between accept and send."""

    def wrapped(value: int) -> int:
        out = reduce(value)
        if not spans and out == 0:
            t0 = time.monotonic()
            time.sleep(hold_s)
            spans.append((t0, time.monotonic()))
        return out

    return wrapped


class PushFailed(RuntimeError):
    pass


class Timeline:
    """The trainer's side of the run: phases, pushes, the time left."""

    def __init__(
        self,
        url: str,
        loadgen: LoadGen,
        params: dict[str, Any],
        head: dict[str, Any],
        deadline: float,
        args: argparse.Namespace,
        initial_version: int,
    ) -> None:
        self.url, self.loadgen, self.params, self.head = url, loadgen, params, head
        self.deadline, self.args = deadline, args
        self.phases: list[Phase] = []
        self.pushes: list[PushRecord] = []
        self.skipped: list[str] = []
        self.versions: Iterator[int] = iter(range(initial_version + 1, 1 << 30))
        self.pusher: Any = None
        self.join_s: float | None = None

    def time_left(self) -> float:
        return self.deadline - time.monotonic()

    def sleep(self, seconds: float) -> None:
        """Sleep, checking each second that the load generator still runs."""
        end = time.monotonic() + seconds
        while (left := end - time.monotonic()) > 0:
            time.sleep(min(left, 1.0))
            self.loadgen.check()

    def phase(self, name: str, label: str, seconds: float, note: str = "") -> None:
        t0 = time.monotonic()
        self.sleep(seconds)
        self.phases.append(Phase(name, label, t0, time.monotonic(), note))
        print(f"[{name}] {seconds:.0f} s done", flush=True)

    def join(self) -> None:
        from rewardplane.sdk.direct_sync import WeightPusher
        from rewardplane.testing.servers import free_port

        a = self.args
        # bounds forming the group and every collective: a ready reduction waits for the server's lock
        # (every request in flight answered), a held push for the hold
        group_timeout = min(600.0, max(120.0, 3 * a.hold_s + 60))
        self.pusher = WeightPusher(
            [self.url],
            group_port=free_port(),
            token=TOKEN,
            trainer_host="127.0.0.1",
            device=a.trainer_device,
            bucket_bytes=a.bucket_mib << 20,
            connect_timeout_s=group_timeout,
            timeout_s=300,  # a push's HTTP calls; the server's wait for its lock
        )
        t0 = time.perf_counter()
        self.pusher.open()
        self.join_s = time.perf_counter() - t0
        print(f"[join] group formed in {self.join_s:.2f} s", flush=True)

    def push(
        self, kind: str, *, head_only: bool = False, atomic: bool = False, hold_s: float = 0.0
    ) -> PushRecord:
        from rewardplane.protocol import RewardModelTrainingMode as Mode

        publisher = self.pusher.open()
        rec = PushRecord(kind=kind, version=next(self.versions), t_call=0.0, atomic=atomic)
        spans: list[tuple[float, float]] = []
        sd, mode = (self.head, Mode.HEAD_ONLY) if head_only else (self.params, Mode.FULL)
        publisher.atomic = atomic  # the same group and layout; the header says atomic
        self.pushes.append(rec)
        try:
            hold = (
                mock.patch.object(
                    publisher.comm, "max_flag", held_reduction(publisher.comm.max_flag, hold_s, spans)
                )
                if hold_s > 0
                else contextlib.nullcontext()
            )
            with hold:
                rec.t_call = time.monotonic()
                self.pusher.push(sd, version=rec.version, training_mode=mode)
                rec.t_return = time.monotonic()
            rec.ok = True
        except Exception as exc:
            rec.t_return = time.monotonic()
            rec.error = f"{type(exc).__name__}: {exc}"
            raise PushFailed(f"push {rec.version} ({kind}) failed: {rec.error}") from exc
        finally:
            publisher.atomic = False
            if spans:
                rec.hold_start, rec.hold_end = spans[0]
        rec.trainer = dict(publisher.last_stats)
        rec.server = server_last_update(self.url, rec.version)
        rec.via = rec.server.get("via")
        if hold_s > 0 and rec.via != "data_plane":
            print(
                f"!! held push {rec.version} went over {rec.via}: its hold is not a pending receive",
                flush=True,
            )
        return rec

    def series(self, name: str, label: str, k: int, push: Callable[[], PushRecord], reserve_s: float) -> None:
        """``k`` pushes ``--spacing-s`` apart (the phase begins and ends with a spacing); fewer where
        the time left is short."""
        spacing = self.args.spacing_s
        t0 = time.monotonic()
        self.sleep(spacing)
        took: list[float] = []
        for i in range(k):
            need = (max(took) if took else 10.0) + spacing + reserve_s
            if self.time_left() < need:
                self.skipped.append(f"{name}: {k - i} of {k} pushes (time left {self.time_left():.0f}s)")
                print(f"[{name}] out of time: {k - i} push(es) skipped", flush=True)
                break
            rec = push()
            took.append((rec.t_return or rec.t_call) - rec.t_call)
            self.sleep(spacing)
        self.phases.append(Phase(name, label, t0, time.monotonic(), f"{len(took)} pushes"))
        med = statistics.median(took) if took else float("nan")
        print(f"[{name}] {len(took)} push(es), median {1000 * med:.1f} ms call → return", flush=True)


def run_timeline(tl: Timeline, args: argparse.Namespace, reserve_s: float) -> None:
    """Phases 1-6 (docstring), each skipped where the time left would not see it through."""
    a = args
    tl.phase("baseline", "1 baseline (no group)", a.phase_s)
    tl.join()
    # set-up: layouts announced over HTTP (the copy plan learned), then one data-plane push of each
    # kind the phases use, so that one-time costs (first data-plane push, staging buffers) stay out
    for kind, head_only, atomic in (
        ("setup_full_http", False, False),
        ("setup_head_http", True, False),
        ("setup_full", False, False),
        ("setup_head", True, False),
        ("setup_full_atomic", False, True),
    ):
        if atomic and not (a.holds or a.atomic_pushes):
            continue
        tl.push(kind, head_only=head_only, atomic=atomic)
        tl.sleep(a.spacing_s)
    print(
        f"[setup] {', '.join(f'{p.kind} {1000 * ((p.t_return or 0) - p.t_call):.0f} ms via {p.via}' for p in tl.pushes)}"
    )
    steps: list[tuple[str, float, Callable[[], None]]] = [
        ("group_idle", a.phase_s, lambda: tl.phase("group_idle", "2 group joined, idle", a.phase_s)),
        (
            "receive_pending",
            a.holds * (a.hold_s + 2 * a.spacing_s + 10),
            lambda: tl.series(
                "receive_pending",
                "3 receive pending (whole phase)",
                a.holds,
                lambda: tl.push("held", atomic=True, hold_s=a.hold_s),
                reserve_s,
            ),
        ),
        (
            "full",
            2 * a.spacing_s + 5,
            lambda: tl.series(
                "full", "4 full pushes (whole phase)", a.pushes, lambda: tl.push("full"), reserve_s
            ),
        ),
        (
            "head_only",
            2 * a.spacing_s + 5,
            lambda: tl.series(
                "head_only",
                "5 head-only pushes (whole phase)",
                a.pushes,
                lambda: tl.push("head_only", head_only=True),
                reserve_s,
            ),
        ),
        (
            "full_atomic",
            2 * a.spacing_s + 5,
            lambda: tl.series(
                "full_atomic",
                "6 atomic full pushes (whole phase)",
                a.atomic_pushes,
                lambda: tl.push("full_atomic", atomic=True),
                reserve_s,
            ),
        ),
    ]
    for name, need, step in steps:
        if name == "receive_pending" and not a.holds or name == "full_atomic" and not a.atomic_pushes:
            continue
        if tl.time_left() < need + reserve_s:
            tl.skipped.append(f"{name}: the whole phase (time left {tl.time_left():.0f}s)")
            print(f"[{name}] skipped: {tl.time_left():.0f} s left", flush=True)
            continue
        step()
    tl.sleep(a.spacing_s)  # the last push's window ends inside the load


def git_commit() -> str | None:
    if os.environ.get("RP_COMMIT"):
        return os.environ["RP_COMMIT"]
    with contextlib.suppress(OSError, subprocess.SubprocessError):
        out = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True, timeout=10
        )
        if out.returncode == 0:
            return out.stdout.strip() or None
    return None


def run_meta(args: argparse.Namespace) -> dict[str, Any]:
    import torch

    meta: dict[str, Any] = {
        "commit": git_commit(),
        "date": time.strftime("%Y-%m-%d", time.gmtime()),
        "host": socket.gethostname(),
        "cpus": os.cpu_count(),
        "torch": torch.__version__,
        "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"),
        "switches": {k: v for k, v in os.environ.items() if k.startswith("REWARDPLANE_")},
    }
    if args.cpu:
        meta["card"] = "cpu"
    else:
        meta["card"] = torch.cuda.get_device_name(0)
        meta["trainer_card"] = torch.cuda.get_device_name(1)
        meta["gpus"] = torch.cuda.device_count()
        with contextlib.suppress(Exception):
            from importlib.metadata import version

            meta["vllm"] = version("vllm")
    return meta


def cpu_busy(pid: int) -> dict[str, float]:
    """CPU seconds of the server's processes (benchmarks/scoring_gpu.py's reader); {} where it fails."""
    try:
        from benchmarks.scoring_gpu import process_cpu_s

        return process_cpu_s(pid)
    except Exception:
        return {}


def start(args: argparse.Namespace, work: Path) -> tuple[Any, dict[str, Any], int, dict[str, Any]]:
    """The server (started, not yet healthy), the trainer's weights, the vocabulary, and facts of the model."""
    import torch

    from rewardplane.testing.servers import launch_server

    if args.cpu:
        from transformers import AutoModelForSequenceClassification

        from rewardplane.tinymodel import build_tiny_reward_model

        model_dir = build_tiny_reward_model(work / "model", num_labels=1, seed=0)
        server = launch_server(model_dir, work, token=TOKEN)
        try:
            model = AutoModelForSequenceClassification.from_pretrained(model_dir, dtype=torch.float32).eval()
        except BaseException:
            server.kill()
            raise
    else:
        from benchmarks.weight_sync import SIZES, build_trainer_model, make_checkpoint

        if args.shape not in SIZES:
            raise ValueError(f"--shape {args.shape}: choose from {sorted(SIZES)}")

        try:
            from benchmarks.scoring_gpu import wait_gpu_free

            wait_gpu_free()
        except Exception as exc:  # only a courtesy wait: never the reason a run fails
            print(f"(not waiting for free GPUs: {exc})")
        from rewardplane.testing.gpus import visible_gpus

        model_dir = make_checkpoint(args.shape, work)
        opts: dict[str, Any] = {
            "engine": "vllm",
            "dtype": "bfloat16",
            "load_format": "dummy",
            "gpu_memory_utilization": args.gpu_memory_utilization,
            "max_model_len": max(1024, args.max_len),
        }
        extra = (["--enforce-eager"] if args.enforce_eager else []) + args.server_args.split()
        server = launch_server(
            model_dir,
            work,
            token=TOKEN,
            extra_args=extra,
            env_extra={"CUDA_VISIBLE_DEVICES": visible_gpus(0), "VLLM_USE_FLASHINFER_SAMPLER": "0"},
            **opts,
        )
        try:  # the trainer's weights, built while the server starts
            torch.cuda.set_device(args.trainer_device)
            model = build_trainer_model(model_dir, args.trainer_device)
        except BaseException:
            server.kill()
            raise
    params = model.state_dict()
    vocab = int(json.loads((model_dir / "config.json").read_text())["vocab_size"])
    facts = {
        "params": sum(t.numel() for t in params.values()),
        "bytes_full": sum(t.numel() * t.element_size() for t in params.values()),
        "vocab": vocab,
    }
    return server, params, vocab, facts


def run(args: argparse.Namespace) -> int:
    import httpx
    import torch

    from rewardplane.protocol.naming import select_head
    from rewardplane.testing.servers import wait_healthy

    started = time.monotonic()
    deadline = started + args.budget_s
    # SystemExit on SIGTERM: the clean-up below ends the children (they run in sessions of their own)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    if not args.cpu and torch.cuda.device_count() < 2:
        print(f"needs 2 GPUs (server on GPU 0, trainer on GPU 1); {torch.cuda.device_count()} visible")
        return 2
    args.trainer_device = torch.device("cpu") if args.cpu else torch.device("cuda", 1)
    work = Path(tempfile.mkdtemp(prefix="scoring-under-push-"))
    children: list[Callable[[], None]] = []
    watchdog = start_watchdog(args.budget_s + 90, children)
    server = loadgen = None
    out_path = result_path(args)
    if out_path is not None:
        out_path.parent.mkdir(parents=True, exist_ok=True)
    results: dict[str, Any] = {"meta": run_meta(args), "args": jsonable(vars(args))}
    rc = 0
    try:
        server, params, vocab, facts = start(args, work)
        children.append(lambda: server.kill())
        results["model"] = facts | {"shape": "tiny" if args.cpu else args.shape}
        t0 = time.perf_counter()
        wait_healthy(server, args.server_timeout_s, poll_s=1.0)
        results["server_start_s"] = time.perf_counter() - t0
        results["server_args"] = server.args[1:]
        print(f"[server] healthy after {results['server_start_s']:.0f} s: {server.url}", flush=True)
        head = select_head(params)
        facts["bytes_head"] = sum(t.numel() * t.element_size() for t in head.values())
        initial = int(httpx.get(f"{server.url}/runtime_version", timeout=30).json()["version"])
        loadgen = LoadGen(work, server.url, args, vocab, max_duration_s=args.budget_s + 60)
        children.append(loadgen.kill)
        wait_flowing(loadgen, args.warmup_timeout_s)
        tl = Timeline(server.url, loadgen, params, head, deadline, args, initial)
        tl.sleep(args.warmup_s)
        cpu0, lg0, w0 = cpu_busy(server.process.pid), loadgen.cpu_s_now(), time.monotonic()
        try:
            run_timeline(tl, args, reserve_s=args.reserve_s)
        except PushFailed as exc:
            print(f"!! {exc}\n   (the timeline stops here; what was measured so far is analysed)", flush=True)
            rc = 1
        finally:
            results["cpu_busy_whole_run"] = busy_between(cpu0, cpu_busy(server.process.pid), w0)
            if lg0 is not None:
                results["cpu_busy_whole_run"]["load generator"] = round(
                    ((loadgen.cpu_s_now() or lg0) - lg0) / (time.monotonic() - w0), 3
                )
            if tl.pusher is not None:
                with contextlib.suppress(Exception):
                    tl.pusher.close()
        records = loadgen.stop(timeout_s=60)
        results.update(
            initial_version=initial,
            join_s=tl.join_s,
            skipped=tl.skipped,
            phases=[asdict(p) for p in tl.phases],
            push_records=[asdict(p) for p in tl.pushes],
            load_generator={"cpu_s": loadgen.cpu_s, "wall_s": loadgen.wall_s},
        )
        if out_path is not None:
            write_json(records_path(out_path), records.to_json())
            results["records_file"] = records_path(out_path).name
        analysis = analyze(records, tl.phases, tl.pushes, initial, options(args))
        results["analysis"] = analysis
        print_report(analysis, header(results), load_line(args, results))
        if tl.skipped:
            print(f"!! INCOMPLETE, skipped for time: {'; '.join(tl.skipped)} (exit 3)")
            rc = rc or 3
        if analysis["versions"]["violations"] or analysis["requests"]["failed"]:
            rc = 1
        if any(not p.ok for p in tl.pushes):
            rc = 1
    except Exception as exc:
        rc = 1
        results["error"] = f"{type(exc).__name__}: {exc}"
        print(f"!! FAILED: {type(exc).__name__}: {exc}", flush=True)
        if server is not None:
            print(f"--- server log (tail) ---\n{server.log()[-6000:]}", flush=True)
        if loadgen is not None:
            print(f"--- load generator log (tail) ---\n{loadgen.tail()}", flush=True)
    finally:
        if loadgen is not None:
            loadgen.kill()
        if server is not None:
            server.stop()
            lines = [ln for ln in server.log().splitlines() if "weights version" in ln]
            print("server log, the last pushes:\n  " + "\n  ".join(lines[-3:]), flush=True)
        watchdog.cancel()
        results["wall_s"] = time.monotonic() - started
        if out_path is not None:
            write_json(out_path, results, indent=2)
            for name, log in (
                ("server", server.log_path if server else None),
                ("loadgen", work / "loadgen.log"),
            ):
                if log is not None and log.exists():  # beside the result, for a look afterwards
                    shutil.copyfile(log, out_path.with_name(f"{out_path.stem}.{name}.log"))
            print(f"wrote {out_path}")
    print(f"total {time.monotonic() - started:.0f} s; exit {rc}")
    return rc


def wait_flowing(loadgen: LoadGen, timeout_s: float) -> None:
    """Until the load generator's first answers are in (bounded); fails at once on failed requests
    without any answer (e.g. a 400 for every request)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        loadgen.check()
        st = loadgen.status()
        if st.get("answered", 0) > 0:
            return
        if st.get("failed", 0) >= 3:
            raise RuntimeError(f"the load generator's requests fail: {st.get('first_error')}")
        time.sleep(0.2)
    raise RuntimeError(f"no answer within {timeout_s:.0f}s of load:\n{loadgen.tail()}")


def busy_between(before: dict[str, float], after: dict[str, float], t0: float) -> dict[str, float]:
    wall = max(time.monotonic() - t0, 1e-9)
    return {name: round((after[name] - before[name]) / wall, 3) for name in after if name in before}


def start_watchdog(seconds: float, children: list[Callable[[], None]]) -> threading.Timer:
    """A last resort: past ``seconds``, print every thread's stack, end the children, exit 124."""

    def fire() -> None:
        print(f"!! still running after {seconds:.0f}s: stacks, then everything is killed", flush=True)
        faulthandler.dump_traceback(all_threads=True)
        for kill in children:
            with contextlib.suppress(Exception):
                kill()
        os._exit(124)

    timer = threading.Timer(seconds, fire)
    timer.daemon = True
    timer.start()
    return timer


def jsonable(d: dict[str, Any]) -> dict[str, Any]:
    return {
        k: v if isinstance(v, (int, float, str, bool, type(None), list)) else str(v) for k, v in d.items()
    }


ANALYSIS_OPTIONS = ("pad_before_s", "pad_after_s", "align_s", "below_frac", "rate_width_s", "hold_margin_s")


def options(args: argparse.Namespace) -> Options:
    return Options(
        pad_before_s=args.pad_before_s,
        pad_after_s=args.pad_after_s,
        align_s=args.align_s,
        below_frac=args.below_frac,
        rate_width_s=args.rate_width_s,
        hold_margin_s=args.hold_margin_s,
    )


def header(results: dict[str, Any]) -> str:
    m, meta = results["model"], results["meta"]
    engine = (
        "transformers engine on CPU, gloo" if results["args"].get("cpu") else f"vLLM {meta.get('vllm', '?')}"
    )
    size = f"{m['params'] / 1e9:.2f}B" if m["params"] >= 1e9 else f"{m['params'] / 1e6:.2f}M"
    return (
        f"scoring under weight pushes: {engine}, {m['shape']} ({size} params, {m['bytes_full'] / 1e9:.3f} GB "
        f"a full push, {m.get('bytes_head', 0) / 1e3:.1f} kB head-only), {meta['card']}, commit "
        f"{meta['commit']}, {meta['date']}"
    )


def load_line(args: argparse.Namespace, results: dict[str, Any]) -> str:
    return (
        f"load: /pooling, {args.concurrency} requests in flight x {args.per_request} token-id prompts of "
        f"U[{args.min_len}, {args.max_len}]; group joined in {fmt(results.get('join_s'), '.2f')} s; "
        f"CPU busy (CPU s / wall s): {results.get('cpu_busy_whole_run')}"
    )


def result_path(args: argparse.Namespace) -> Path | None:
    if args.out is not None:
        return Path(args.out)
    if os.environ.get("OUT"):
        return Path(os.environ["OUT"]) / RESULT_NAME
    return None


def records_path(out: Path) -> Path:
    return out.with_name(out.stem + ".records.json")


def reanalyze(args: argparse.Namespace) -> int:
    path = Path(args.reanalyze)
    results = json.loads(path.read_text())
    records = Records.from_json(json.loads((path.parent / results["records_file"]).read_text()))
    phases = [Phase(**p) for p in results["phases"]]
    pushes = [PushRecord(**p) for p in results["push_records"]]
    saved = argparse.Namespace(**results["args"])
    for key in args.given:  # the options given now; the run's own for the others
        setattr(saved, key, getattr(args, key))
    analysis = analyze(records, phases, pushes, results["initial_version"], options(saved))
    print_report(analysis, header(results), load_line(saved, results))
    if args.out:
        write_json(Path(args.out), results | {"analysis": analysis}, indent=2)
    return 1 if analysis["versions"]["violations"] or analysis["requests"]["failed"] else 0


# ---- command line ------------------------------------------------------------------------------

# per mode: GPU (the 7B run on two GPUs), --quick (a short GPU run), --cpu (the smoke run here)
DEFAULTS: dict[str, dict[str, Any]] = {
    "gpu": {
        "concurrency": 32,
        "min_len": 64,
        "max_len": 1024,
        "phase_s": 30.0,
        "warmup_s": 10.0,
        "hold_s": 8.0,
        "holds": 3,
        "pushes": 6,
        "atomic_pushes": 3,
        "spacing_s": 3.0,
        "pad_before_s": 0.5,
        "pad_after_s": 1.5,
        "align_s": 1.0,
        "hold_margin_s": 0.5,
        "below_frac": 0.5,
        "budget_s": 450.0,
        "reserve_s": 40.0,
        "server_timeout_s": 600.0,
    },
    "quick": {"phase_s": 12.0, "warmup_s": 5.0, "hold_s": 5.0, "holds": 2, "pushes": 3, "atomic_pushes": 2},
    "cpu": {
        "concurrency": 8,
        "min_len": 16,
        "max_len": 64,
        "phase_s": 5.0,
        "warmup_s": 3.0,
        "hold_s": 3.0,
        "holds": 2,
        "pushes": 3,
        "atomic_pushes": 2,
        "spacing_s": 1.5,
        "pad_before_s": 0.3,
        "pad_after_s": 0.6,
        "align_s": 0.3,
        "hold_margin_s": 0.3,
        "budget_s": 150.0,
        "reserve_s": 15.0,
        "server_timeout_s": 120.0,
    },
}


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--cpu", action="store_true", help="smoke run: tiny model, transformers engine on CPU, gloo"
    )
    p.add_argument("--quick", action="store_true", help="shorter phases and fewer pushes (GPU)")
    p.add_argument("--shape", default="7b", help="the model's shape (GPU): 7b or small, as weight_sync.py")
    p.add_argument(
        "--concurrency",
        type=int,
        help="requests in flight (GPU 32, CPU 8); a streamed push waits for all of them to be answered",
    )
    p.add_argument("--per-request", type=int, default=8, help="prompts per request")
    p.add_argument("--min-len", type=int, help="shortest prompt, tokens (GPU 64)")
    p.add_argument("--max-len", type=int, help="longest prompt, tokens (GPU 1024)")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--phase-s", type=float, help="seconds of phases 1 and 2 (GPU 30)")
    p.add_argument("--warmup-s", type=float, help="load before the baseline begins (GPU 10)")
    p.add_argument("--hold-s", type=float, help="phase 3: how long each push is held (GPU 8)")
    p.add_argument("--holds", type=int, help="phase 3: held pushes (GPU 3; 0: no phase 3)")
    p.add_argument("--pushes", type=int, help="phases 4 and 5: pushes each (GPU 6)")
    p.add_argument("--atomic-pushes", type=int, help="phase 6: atomic full pushes (GPU 3; 0: no phase 6)")
    p.add_argument("--spacing-s", type=float, help="from one push's return to the next push (GPU 3)")
    p.add_argument("--pad-before-s", type=float, help="a push's window starts this long before its call")
    p.add_argument("--pad-after-s", type=float, help="a push's window ends this long after its return")
    p.add_argument(
        "--align-s", type=float, help="window ends move up to this far to fall between answer bursts"
    )
    p.add_argument("--hold-margin-s", type=float, help="the first part of a hold left out of its rate")
    p.add_argument("--below-frac", type=float, help="report the time below this share of baseline (0.5)")
    p.add_argument(
        "--rate-width-s",
        type=float,
        default=None,
        help="smoothing of that rate (default: 2x the baseline's p99 gap between answers)",
    )
    p.add_argument(
        "--budget-s",
        type=float,
        help="phases are skipped past this (GPU 450 s); a watchdog kills the run 90 s later",
    )
    p.add_argument("--reserve-s", type=float, help="time kept for stopping and the analysis")
    p.add_argument("--server-timeout-s", type=float, help="bound on the server's start")
    p.add_argument(
        "--warmup-timeout-s", type=float, default=120.0, help="bound on the load generator's start"
    )
    p.add_argument("--request-timeout-s", type=float, default=300.0)
    p.add_argument(
        "--gpu-memory-utilization",
        type=float,
        default=0.6,
        help="vLLM's share of GPU 0 (the rest holds an atomic push's staging copy)",
    )
    p.add_argument(
        "--enforce-eager",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="vLLM without CUDA graphs / compilation (the 7B server starts in ~1 min)",
    )
    p.add_argument("--server-args", default="", help="extra server flags")
    p.add_argument("--bucket-mib", type=int, default=1024)
    p.add_argument("--out", default=None, help=f"result JSON (default $OUT/{RESULT_NAME} when OUT is set)")
    p.add_argument("--reanalyze", default=None, help="a result JSON of an earlier run: analyse it again")
    # the load generator's process
    p.add_argument("--role", choices=["main", "loadgen"], default="main", help=argparse.SUPPRESS)
    p.add_argument("--url", help=argparse.SUPPRESS)
    p.add_argument("--control", help=argparse.SUPPRESS)
    p.add_argument("--vocab", type=int, help=argparse.SUPPRESS)
    p.add_argument("--max-duration-s", type=float, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    args.given = sorted(k for k in ANALYSIS_OPTIONS if getattr(args, k) is not None)
    mode = DEFAULTS["cpu"] if args.cpu else DEFAULTS["gpu"] | (DEFAULTS["quick"] if args.quick else {})
    for key, value in (DEFAULTS["gpu"] | mode).items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    if args.min_len < 1 or args.max_len < args.min_len:
        p.error(f"prompt lengths [{args.min_len}, {args.max_len}] make no sense")
    if args.pushes < 1:
        p.error("--pushes must be at least 1")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    if args.role == "loadgen":
        return loadgen_main(args)
    if args.reanalyze:
        return reanalyze(args)
    os.environ.setdefault("VLLM_USE_FLASHINFER_SAMPLER", "0")
    return run(args)


if __name__ == "__main__":
    raise SystemExit(main())
