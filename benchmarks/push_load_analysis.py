"""The analysis of ``scoring_under_push.py``'s timeline, pure: the answers' times, sizes and
versions and the pushes' timestamps in, the figures out (rates per phase, the throughput lost
around each push against the baseline's own noise, gaps, latency, the version guarantees), and
the printed report. ``python benchmarks/scoring_under_push.py --reanalyze FILE`` runs it again
on a saved timeline, without a GPU."""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np
import numpy.typing as npt

Array = npt.NDArray[np.float64]


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
