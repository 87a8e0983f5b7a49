"""The scoring benchmark's goal lines: a miss is never printed as the bound, and each goal shows
the spread of its rounds."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.append(str(Path(__file__).resolve().parents[2]))  # benchmarks/, after everything else
from benchmarks.scoring_gpu import goal_line, goals  # noqa: E402


def _row(**figures: object) -> dict[str, object]:
    return {"kind": "score", "size": "7b", "goal_server_vs_offline": 0.97, **figures}


def test_a_miss_by_a_hair_shows_the_digits_that_make_it_a_miss() -> None:
    [vs_serve] = goals([_row(server_vs_vllm_serve=0.999998555887545)])
    line = goal_line(vs_serve)
    assert not vs_serve["met"] and "0.999999" in line and "MISSED" in line, line


def test_each_goal_shows_its_rounds_spread() -> None:
    row = _row(
        server_vs_offline=1.012,
        server_vs_offline_rounds=[1.007, 1.014, 0.995],
        server_vs_vllm_serve=1.0,
        server_vs_vllm_serve_rounds=[1.0, 1.024, 0.989],
    )
    offline, serve = goals([row])
    assert offline["rounds"] == [0.995, 1.014] and offline["met"]
    assert "1.012 (goal >= 0.97; rounds 0.995-1.014): met" in goal_line(offline)
    assert "1.000 (goal >= 1.0; rounds 0.989-1.024): met" in goal_line(serve)


def test_one_round_prints_no_spread() -> None:
    [offline] = goals([_row(server_vs_offline=0.9, server_vs_offline_rounds=[0.9])])
    assert "rounds" not in offline
    assert goal_line(offline).endswith("0.900 (goal >= 0.97): MISSED")
