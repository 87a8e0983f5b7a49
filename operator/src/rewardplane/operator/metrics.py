"""The operator's own Prometheus metrics, served on ``/metrics`` by ``python -m rewardplane.operator``.
Named like the reward servers' (``rewardplane:`` prefix, docs/operator.md#metrics)."""

from __future__ import annotations

import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from prometheus_client import REGISTRY, Counter, Gauge, Histogram, generate_latest

RECONCILES = Counter(
    "rewardplane:operator_reconciles",
    "RewardModel reconciles, by trigger and result",
    ["trigger", "result"],
)
ERRORS = Counter("rewardplane:operator_errors", "Reconciles that failed on an API or probe error", ["stage"])
DURATION = Histogram(
    "rewardplane:operator_reconcile_duration_seconds",
    "Time of one RewardModel reconcile (read, plan, apply, status)",
    buckets=(0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30),
)
QUEUE_DEPTH = Gauge(
    "rewardplane:operator_queue_depth",
    "Reconciles requested and not started yet: periodic ones waiting for a thread, and models "
    "asked again while their reconcile runs",
)
POD_ACTIONS = Counter("rewardplane:operator_pod_actions", "Pods created or deleted", ["action"])
MODELS = Gauge("rewardplane:operator_models", "RewardModels by phase, as last reconciled", ["phase"])


# Prometheus' text format, whatever the scraper asks for: prometheus_client answers a scraper that
# prefers OpenMetrics (Prometheus does) with every ':' escaped to '_', which would rename these.
TEXT_FORMAT = "text/plain; version=0.0.4; charset=utf-8"


class _MetricsHandler(BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        body = generate_latest(REGISTRY)
        self.send_response(200)
        self.send_header("Content-Type", TEXT_FORMAT)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: object) -> None:
        """Every scrape would be a log line."""


def serve(port: int, addr: str = "0.0.0.0") -> None:
    """Start the /metrics endpoint in a background thread."""
    server = ThreadingHTTPServer((addr, port), _MetricsHandler)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, name="metrics", daemon=True).start()
