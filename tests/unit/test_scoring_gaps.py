"""The scoring benchmark's score gaps between engines (benchmarks/scoring_gpu.py): beside the
largest gap, its median and 99th percentile and the scores' spread, so that one prompt's rounding
outlier and a real difference read differently."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.append(str(ROOT))  # benchmarks/, after everything else

import benchmarks.scoring_gpu as bench  # noqa: E402

RESULT = ROOT / "benchmarks/results/scoring_gpu-pooled-rows-all-sizes-judge-H200-2026-11-30-dd09e58.json"


def test_one_outlier_shows_in_the_max_only() -> None:
    offline = [[float(i % 7) - 3.0] for i in range(200)]
    server = [[x + 0.001] for (x,) in offline]
    server[17] = [offline[17][0] + 0.1]  # one prompt rounded differently
    gaps = bench.score_gaps(server, offline)
    assert gaps["max"] == pytest.approx(0.1)
    assert gaps["p99"] == pytest.approx(0.001) and gaps["median"] == pytest.approx(0.001)
    assert gaps["sd"] == pytest.approx(2.0, rel=0.01)  # the offline scores' spread, for scale
    fields = bench.gap_fields("server_vs_offline", server, offline)
    assert fields == {"server_vs_offline_max_abs_diff": gaps["max"], "server_vs_offline_abs_diff": gaps}


def test_a_shift_moves_the_median() -> None:
    offline = [[0.0, 1.0], [2.0, 3.0]]  # two labels per prompt: every label counts
    gaps = bench.score_gaps([[0.05, 1.05], [2.05, 3.05]], offline)
    assert gaps["median"] == pytest.approx(0.05) and gaps["max"] == pytest.approx(0.05)


def test_no_scores_is_an_error_not_a_zero_gap() -> None:
    with pytest.raises(ValueError, match="no scores"):
        bench.score_gaps([], [])


def test_the_table_prints_each_engines_gaps(capsys: pytest.CaptureFixture[str]) -> None:
    saved = json.loads(RESULT.read_text())
    row = next(r for r in saved["rows"] if r["kind"] == "score")
    gap = {"max": 0.0218, "p99": 0.004, "median": 0.0005, "sd": 1.0}
    row = {**row, "server_vs_offline_abs_diff": gap, "vllm_serve_vs_offline_abs_diff": {**gap, "max": 0.1154}}
    bench.print_scoring_table([row], argparse.Namespace(**saved["args"]))
    out = capsys.readouterr().out
    line = next(s for s in out.splitlines() if "|score - offline's|" in s)
    assert "server median 0.0005, p99 0.0040, max 0.0218 (sd 1.000)" in line
    assert "vllm serve median 0.0005, p99 0.0040, max 0.1154" in line
    assert "transformers" not in line  # that row's transformers run predates the gaps
