"""The scoring-under-pushes benchmark's analysis (benchmarks/push_load_analysis.py) on synthetic
timelines: a known pause comes out as the throughput lost, and answers that break the server's
version guarantees are caught."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

sys.path.append(str(Path(__file__).resolve().parents[2]))  # benchmarks/, after everything else

from benchmarks.push_load_analysis import (  # noqa: E402
    Completions,
    PushSpan,
    lost_around,
    version_violations,
    window_rate,
)

STEP_S = 0.01  # one answer of 8 prompts every engine step


def steady_answers(t0: float, t1: float, pause: tuple[float, float] | None = None) -> Completions:
    times = np.arange(t0, t1, STEP_S)
    if pause is not None:
        times = times[(times < pause[0]) | (times >= pause[1])]
    return Completions.of(times.tolist(), [8] * len(times), [800] * len(times))


def test_a_pause_is_lost_throughput_and_steady_scoring_loses_nothing() -> None:
    base = window_rate(steady_answers(0, 10), 0, 10, align_s=0)
    assert abs(base.prompts_s - 800) < 1
    paused = steady_answers(0, 20, pause=(12.0, 12.2))
    lost = lost_around(paused, base, start=12.0, end=12.1, pad_before=0.5, pad_after=1.0, align_s=0)
    assert abs(lost["lost_s"] - 0.2) < 0.02, lost
    steady = lost_around(steady_answers(0, 20), base, 12.0, 12.1, 0.5, 1.0, align_s=0)
    assert abs(steady["lost_s"]) < 0.02, steady


def test_answers_older_than_a_finished_push_or_mixed_versions_are_violations() -> None:
    push = PushSpan(version=1, t_call=1.0, t_return=1.1, ok=True)
    sends, dones = [0.5, 0.9, 1.2, 1.3], [0.6, 1.05, 1.25, 1.35]
    ok, _ = version_violations(sends, dones, [0, 0, 1, 1], [0, 0, 1, 1], [push], initial=0)
    assert ok == 0
    # sent after the push returned, answered by the old weights
    stale, found = version_violations(sends, dones, [0, 0, 1, 0], [0, 0, 1, 0], [push], initial=0)
    assert stale >= 1 and found
    # the body and the header name different versions
    mixed, _ = version_violations(sends, dones, [0, 0, 1, 1], [0, 0, 1, 0], [push], initial=0)
    assert mixed >= 1
