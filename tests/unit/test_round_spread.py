"""How the scoring benchmark summarises and judges its rounds (benchmarks/round_spread.py): the
median with min, quartiles and max, and a goal met only when the lower quartile of at least five
rounds meets it, so that a figure that a re-run on another host would miss by chance is a miss."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.append(str(Path(__file__).resolve().parents[2]))  # benchmarks/, after everything else

from benchmarks.round_spread import MIN_ROUNDS, goal_verdict, spread  # noqa: E402


def test_five_rounds_give_the_second_and_fourth_values_as_quartiles() -> None:
    s = spread([1.05, 0.90, 1.00, 0.95, 1.10])  # any order
    assert (s.n, s.min, s.q1, s.median, s.q3, s.max) == (5, 0.90, 0.95, 1.00, 1.05, 1.10)
    assert s.as_dict()["q1"] == 0.95
    assert s.describe() == "1.000 (min 0.900, quartiles 0.950-1.050, max 1.100; 5 rounds)"


def test_one_round_is_its_own_spread_and_none_is_an_error() -> None:
    s = spread([0.98])
    assert s.min == s.q1 == s.median == s.q3 == s.max == 0.98
    assert s.describe() == "0.980 (1 round)"
    with pytest.raises(ValueError, match="zero times"):
        spread([])


def test_a_median_over_the_bound_with_a_lower_quartile_under_it_is_a_miss() -> None:
    # The shape of the 0.39B judge in two runs: a median above 1.0, two of five rounds below it.
    rounds = [1.04, 0.96, 1.02, 0.97, 1.05]
    assert spread(rounds).median >= 1.0
    verdict = goal_verdict(rounds, 1.0)
    assert verdict.judged and not verdict.met
    assert verdict.why == "MISSED: lower quartile 0.970 < 1.0 by 0.030"


def test_a_lower_quartile_at_the_bound_meets_it() -> None:
    verdict = goal_verdict([0.95, 0.97, 1.01, 0.99, 0.93], 0.95)
    assert verdict.judged and verdict.met and verdict.why.startswith("met: lower quartile 0.950")


def test_fewer_than_five_rounds_are_not_judged_however_good() -> None:
    verdict = goal_verdict([1.5, 1.6, 1.55], 1.0)
    assert MIN_ROUNDS == 5
    assert not verdict.judged and not verdict.met
    assert "3 round(s), a goal needs at least 5" in verdict.why
