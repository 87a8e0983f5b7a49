"""The scoring benchmark's per-stage timing (benchmarks/scoring_gpu.py ``stage_totals`` and
``stage_times``), read from the reward server's own metrics registry between two scrapes."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from prometheus_client import generate_latest

from rewardplane.server.metrics import ServerMetrics

sys.path.append(str(Path(__file__).resolve().parents[2]))  # benchmarks/, after everything else

from benchmarks.scoring_gpu import stage_times, stage_totals  # noqa: E402


def _scrape(m: ServerMetrics) -> dict[str, tuple[float, float]]:
    return stage_totals(generate_latest(m.registry).decode())


def test_the_requests_between_two_scrapes_per_stage() -> None:
    m = ServerMetrics()
    m.stage_seconds.labels("parse").observe(0.5)  # before the round: not counted
    m.latency.labels("/pooling").observe(9.0)
    before = _scrape(m)
    for _ in range(4):
        m.stage_seconds.labels("parse").observe(0.001)
        m.stage_seconds.labels("engine").observe(0.100)
        m.latency.labels("/pooling").observe(0.110)
    m.latency.labels("/score").observe(5.0)  # another endpoint's latency is not /pooling's
    stages = stage_times(before, _scrape(m))
    assert stages["parse"]["requests"] == 4 and stages["parse"]["mean_ms"] == pytest.approx(1.0)
    assert stages["engine"]["seconds"] == pytest.approx(0.4)
    assert stages["e2e"]["mean_ms"] == pytest.approx(110.0)
    assert stages["other"]["mean_ms"] == pytest.approx(9.0)  # 110 - 1 - 100
    assert "tokenize" not in stages  # token ids: never tokenized


def test_no_requests_no_stages() -> None:
    m = ServerMetrics()
    scrape = _scrape(m)
    assert stage_times(scrape, scrape) == {}
