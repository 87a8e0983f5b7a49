"""How a benchmark's repeated rounds are summarised and judged: the median with the spread around
it, and a goal met only when its lower quartile meets it.

A median of three rounds moved by 10% between two runs of the same command on two hosts; the
spread says how far a figure can be trusted, and the lower quartile is the figure that a re-run
on another host is still likely to reach. Pure functions: the scoring benchmark calls them on the
per-round ratios it measured, and its tests call them directly.
"""

from __future__ import annotations

from collections.abc import Sequence
from statistics import median, quantiles
from typing import NamedTuple

MIN_ROUNDS = 5  # fewer rounds give a lower quartile that one slow round decides


class Spread(NamedTuple):
    """Rounds of one figure: its median and the spread around it (quartiles inclusive of the
    extremes, so with 5 rounds the quartiles are the 2nd and 4th values)."""

    n: int
    min: float
    q1: float
    median: float
    q3: float
    max: float

    def as_dict(self) -> dict[str, float]:
        return self._asdict()

    def describe(self, spec: str = ".3f", bound: float | None = None) -> str:
        """``median (min, quartiles q1-q3, max; n rounds)`` as printed beside a figure, each value in
        format ``spec``; with a ``bound``, a lower quartile under it that would round up to it shows
        more digits (0.99999 is not 1.000)."""
        if self.n == 1:
            return f"{self.median:{spec}} (1 round)"
        q1 = f"{self.q1:{spec}}" if bound is None else shown(self.q1, bound)
        return (
            f"{self.median:{spec}} (min {self.min:{spec}}, quartiles {q1}-{self.q3:{spec}}, "
            f"max {self.max:{spec}}; {self.n} rounds)"
        )


def shown(x: float, bound: float, digits: int = 3) -> str:
    """``x`` to ``digits`` places, or to 6 where those would round a value under ``bound`` up to it."""
    text = f"{x:.{digits}f}"
    return f"{x:.6f}" if x < bound <= float(text) else text


def spread(values: Sequence[float]) -> Spread:
    """The median and spread of ``values`` (at least one)."""
    if not values:
        raise ValueError("no rounds to summarise: the figure was measured zero times")
    xs = sorted(values)
    if len(xs) == 1:
        q1 = q3 = xs[0]
    else:
        q1, _, q3 = quantiles(xs, n=4, method="inclusive")
    return Spread(len(xs), xs[0], q1, median(xs), q3, xs[-1])


class Verdict(NamedTuple):
    """A goal's outcome: ``met`` only when judged and its lower quartile meets the bound; ``why``
    says what was decided, for the printed line and the result file."""

    judged: bool
    met: bool
    why: str


def goal_verdict(rounds: Sequence[float], bound: float, min_rounds: int = MIN_ROUNDS) -> Verdict:
    """Whether a ratio's rounds meet ``bound`` (a ratio that must be at least ``bound``): judged on
    at least ``min_rounds`` rounds, met when their lower quartile is at least the bound. A median
    above the bound with a lower quartile under it is a miss: a re-run would fall short about as
    often as not."""
    if len(rounds) < min_rounds:
        return Verdict(
            False,
            False,
            f"not judged: {len(rounds)} round(s), a goal needs at least {min_rounds} (--rounds {min_rounds})",
        )
    s = spread(rounds)
    if s.q1 >= bound:
        return Verdict(True, True, f"met: lower quartile {s.q1:.3f} >= {bound}")
    short = bound - s.q1
    by = f"{short:.3f}" if short >= 0.0005 else f"{short:.1e}"
    return Verdict(True, False, f"MISSED: lower quartile {shown(s.q1, bound)} < {bound} by {by}")
