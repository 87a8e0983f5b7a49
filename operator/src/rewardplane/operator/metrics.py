"""The operator's own Prometheus metrics, served on ``/metrics`` by ``python -m rewardplane.operator``."""

from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram, start_http_server

RECONCILES = Counter(
    "rewardplane_operator_reconciles_total",
    "RewardModel reconciles, by trigger and result",
    ["trigger", "result"],
)
ERRORS = Counter(
    "rewardplane_operator_errors_total", "Reconciles that failed on an API or probe error", ["stage"]
)
DURATION = Histogram(
    "rewardplane_operator_reconcile_duration_seconds",
    "Time of one RewardModel reconcile (read, plan, apply, status)",
    buckets=(0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30),
)
POD_ACTIONS = Counter("rewardplane_operator_pod_actions_total", "Pods created or deleted", ["action"])
MODELS = Gauge("rewardplane_operator_models", "RewardModels by phase, as last reconciled", ["phase"])


def serve(port: int, addr: str = "0.0.0.0") -> None:
    """Start the /metrics endpoint in a background thread."""
    start_http_server(port, addr=addr)
