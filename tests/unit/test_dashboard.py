"""The chart's Grafana dashboard: generated from scripts/dashboard.py and current; its panels cover
what operators look at; every query names only metrics that the reward server and the operator
export (their registries built here, in-process)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from prometheus_client import REGISTRY, CollectorRegistry

from rewardplane.server.metrics import ServerMetrics
from tests.fixtures.dashboard import METRIC, as_prometheus_runs_it, panel_queries

ROOT = Path(__file__).resolve().parents[2]
# the sample names each kind of metric family exposes
SUFFIXES = {"counter": ("_total",), "histogram": ("_bucket", "_sum", "_count"), "gauge": ("",)}


def _exported(registry: CollectorRegistry) -> set[str]:
    return {
        family.name + suffix
        for family in registry.collect()
        if family.name.startswith("rewardplane:")
        for suffix in SUFFIXES.get(family.type, ("",))
    }


def test_the_dashboard_is_generated_and_current() -> None:
    check = [sys.executable, str(ROOT / "scripts/dashboard.py"), "--check"]
    done = subprocess.run(check, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr


def test_the_panels_cover_scoring_pushes_sleep_and_the_operator() -> None:
    titles = {title for title, _ in panel_queries()}
    assert titles == {
        "Scoring rate",
        "Scoring latency",
        "Time per request stage",
        "Queue depth",
        "Push timeline",
        "Weights version per replica",
        "Sleep state",
        "Operator reconciles",
    }


def test_every_query_names_only_exported_metrics() -> None:
    import rewardplane.operator.metrics  # noqa: F401  (registers the operator's metrics)

    exported = _exported(ServerMetrics().registry) | _exported(REGISTRY)
    assert "rewardplane:operator_queue_depth" in exported and "rewardplane:weights_version" in exported
    for title, expr in panel_queries():
        names = set(METRIC.findall(expr))
        assert names, f"{title}: {expr} names no rewardplane metric"
        assert names <= exported, f"{title}: {sorted(names - exported)} are not exported"


def test_prometheus_gets_the_queries_without_grafana_variables() -> None:
    for _, expr in panel_queries():
        assert "$" not in as_prometheus_runs_it(expr), expr
