"""The scoring benchmark's goal lines: each goal shows the median and spread of its rounds, is
judged on the lower quartile of at least five rounds, and a miss is never printed as the bound."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.append(str(Path(__file__).resolve().parents[2]))  # benchmarks/, after everything else
from benchmarks.scoring_gpu import goal_line, goals  # noqa: E402


def _row(**figures: object) -> dict[str, object]:
    return {"kind": "score", "size": "7b", "goal_server_vs_offline": 0.97, **figures}


def test_a_miss_by_a_hair_shows_the_digits_that_make_it_a_miss() -> None:
    rounds = [1.01, 0.999998555887545, 1.002, 0.9999, 1.0003]
    [vs_serve] = goals([_row(server_vs_vllm_serve=1.0003, server_vs_vllm_serve_rounds=rounds)])
    line = goal_line(vs_serve)
    assert vs_serve["judged"] and not vs_serve["met"], line
    assert (
        "quartiles 0.999999-1.002" in line and "MISSED: lower quartile 0.999999 < 1.0 by 1.4e-06" in line
    ), line


def test_each_goal_is_judged_on_its_lower_quartile() -> None:
    row = _row(
        server_vs_offline=1.012,
        server_vs_offline_rounds=[1.007, 1.014, 0.995, 1.012, 1.02],
        server_vs_vllm_serve=1.01,
        server_vs_vllm_serve_rounds=[1.01, 1.024, 0.989, 0.99, 1.03],
    )
    offline, serve = goals([row])
    assert offline["met"] and offline["spread"]["q1"] == 1.007
    assert goal_line(offline).endswith(
        "1.012 (min 0.995, quartiles 1.007-1.014, max 1.020; 5 rounds), goal: lower quartile >= 0.97: met"
    )
    # a median over the bound, a lower quartile under it: a re-run would miss about as often
    assert not serve["met"] and serve["value"] > 1.0
    assert goal_line(serve).endswith(
        "goal: lower quartile >= 1.0: MISSED: lower quartile 0.990 < 1.0 by 0.010"
    )


def test_too_few_rounds_are_not_judged() -> None:
    [offline] = goals([_row(server_vs_offline=1.2, server_vs_offline_rounds=[1.2, 1.25, 1.19])])
    assert not offline["judged"] and not offline["met"]
    assert goal_line(offline).endswith("not judged: 3 round(s), a goal needs at least 5 (--rounds 5)")
    [one] = goals([_row(server_vs_offline=0.9)])  # a figure without rounds: one round
    assert "0.900 (1 round)" in goal_line(one) and not one["judged"]
