"""The scoring benchmark's answer profile (benchmarks/scoring_gpu.py ``answer_profile``): a round
that runs at a steady rate after a ramp comes out as that rate and that ramp, on synthetic
arrival times."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest

sys.path.append(str(Path(__file__).resolve().parents[2]))  # benchmarks/, after everything else

from benchmarks.scoring_gpu import answer_profile  # noqa: E402


def test_a_ramp_then_a_steady_rate() -> None:
    # nothing for 0.3 s, then one 1000-token answer every 10 ms (100,000 tok/s) for 100 answers
    done = [0.3 + 0.01 * i for i in range(100)]
    p = answer_profile(done, [1000] * 100, seconds=done[-1])
    assert p["first_answer_s"] == pytest.approx(0.3)
    assert p["steady_tok_s"] == pytest.approx(100_000, rel=1e-6)
    # at 100,000 tok/s the 100,000 tokens take 1 s; the round took 1.29 s: 0.29 s of ramp
    assert p["outside_steady_s"] == pytest.approx(0.29, abs=1e-6)
    assert p["t10_s"] < p["t50_s"] < p["t90_s"]


def test_a_slow_tail_lowers_nothing_but_the_tail() -> None:
    done = [0.01 * i for i in range(1, 91)] + [0.9 + 0.1 * i for i in range(1, 11)]  # 10 stragglers
    p = answer_profile(done, [100] * 100, seconds=done[-1])
    assert p["steady_tok_s"] == pytest.approx(10_000, rel=0.02)
    assert p["outside_steady_s"] == pytest.approx(done[-1] - 1.0, abs=0.02)


def test_order_of_the_requests_does_not_matter() -> None:
    done = [0.5, 0.1, 0.3, 0.2, 0.4]
    tokens = [10, 20, 30, 40, 50]
    a = answer_profile(done, tokens, seconds=0.5)
    b = answer_profile(list(reversed(done)), list(reversed(tokens)), seconds=0.5)
    assert a == b


def test_everything_at_once_has_no_steady_rate() -> None:
    p = answer_profile([0.2] * 4, [10] * 4, seconds=0.2)
    assert math.isnan(p["steady_tok_s"]) and math.isnan(p["outside_steady_s"])
