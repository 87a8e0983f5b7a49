"""Prometheus metrics of one server (a registry per app, so tests can run several in a process)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30)
_SIZE_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)


class ServerMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("rewardplane_requests", "HTTP requests", ["endpoint", "status"], registry=r)
        self.latency = Histogram(
            "rewardplane_request_seconds",
            "Request latency",
            ["endpoint"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.errors = Counter(
            "rewardplane_errors", "Requests answered with an error", ["endpoint", "kind"], registry=r
        )
        self.batch_items = Histogram(
            "rewardplane_batch_items", "Items per engine micro-batch", buckets=_SIZE_BUCKETS, registry=r
        )
        self.batch_tokens = Histogram(
            "rewardplane_batch_padded_tokens",
            "Padded tokens per engine micro-batch",
            buckets=tuple(b * 64 for b in _SIZE_BUCKETS),
            registry=r,
        )
        self.tokens = Counter("rewardplane_prompt_tokens", "Prompt tokens scored", registry=r)
        self.items = Counter("rewardplane_scored_items", "Inputs scored", registry=r)
        self.weights_version = Gauge(
            "rewardplane_weights_version", "Weights version being served", registry=r
        )
        self.sleep_level = Gauge(
            "rewardplane_sleep_level", "0 while awake, else the sleep level (1 or 2)", registry=r
        )
        self.weight_updates = Counter(
            "rewardplane_weight_updates", "Weight updates", ["training_mode", "result"], registry=r
        )
        self.weight_update_seconds = Histogram(
            "rewardplane_weight_update_seconds",
            "Weight update duration (announce to committed)",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.weight_update_bytes = Counter(
            "rewardplane_weight_update_bytes", "Bytes received by weight updates", registry=r
        )
