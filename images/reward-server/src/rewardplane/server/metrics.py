"""Prometheus metrics of one server (a registry per app, so tests can run several in a process).

Names follow vLLM's (``vllm:num_requests_running`` → ``rewardplane:num_requests_running``) where
the meaning is the same, so dashboards and alerts written for vLLM carry over; docs/operator.md
lists them all."""

from __future__ import annotations

import time
from collections.abc import Mapping

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from rewardplane.protocol.push_phases import PHASES, phase_spans

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30)
_SIZE_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)
# a request's stages: parsing a small body takes tens of microseconds
_STAGE_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, *_LATENCY_BUCKETS)
# vLLM's label values of vllm:engine_sleep_state, by sleep level (0: awake)
SLEEP_STATES = ("awake", "weights_offloaded", "discard_all")


class ServerMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("rewardplane:requests", "HTTP requests", ["endpoint", "status"], registry=r)

        def seconds(name: str, documentation: str, labels: tuple[str, ...] = ()) -> Histogram:
            """A latency histogram of this registry (seconds: the same buckets for all)."""
            return Histogram(name, documentation, labels, buckets=_LATENCY_BUCKETS, registry=r)

        self.latency = seconds(
            "rewardplane:e2e_request_latency_seconds", "Request latency, arrival to answer", ("endpoint",)
        )
        self.stage_seconds = Histogram(
            "rewardplane:request_stage_seconds",
            "Time a scoring request spent in one stage: parse (body read and JSON parsed), tokenize "
            "(texts to token ids, the pool's queue included), engine (submitted to every row scored)",
            ["stage"],
            buckets=_STAGE_BUCKETS,
            registry=r,
        )
        # resolved once: every scoring request observes two or three of them
        self.parse_stage = self.stage_seconds.labels("parse")
        self.tokenize_stage = self.stage_seconds.labels("tokenize")
        self.engine_stage = self.stage_seconds.labels("engine")
        self.errors = Counter(
            "rewardplane:request_errors", "Requests answered with an error", ["endpoint", "kind"], registry=r
        )
        self.running = Gauge(
            "rewardplane:num_requests_running", "Requests the engine is running now", registry=r
        )
        self.waiting = Gauge(
            "rewardplane:num_requests_waiting",
            "Requests waiting for the engine (a batch slot, or the weights lock during a push)",
            registry=r,
        )
        self.queue_time = seconds(
            "rewardplane:request_queue_time_seconds", "Time a request waited before the engine ran it"
        )
        self.batch_items = Histogram(
            "rewardplane:batch_items", "Items per engine micro-batch", buckets=_SIZE_BUCKETS, registry=r
        )
        self.batch_tokens = Histogram(
            "rewardplane:batch_padded_tokens",
            "Padded tokens per engine micro-batch",
            buckets=tuple(b * 64 for b in _SIZE_BUCKETS),
            registry=r,
        )
        self.tokens = Counter("rewardplane:prompt_tokens", "Prompt tokens scored", registry=r)
        self.items = Counter("rewardplane:scored_items", "Inputs scored", registry=r)
        self.weights_version = Gauge(
            "rewardplane:weights_version", "Weights version being served", registry=r
        )
        self.sleep_state = Gauge(
            "rewardplane:engine_sleep_state",
            "1 for the engine's sleep state (awake; weights_offloaded: level 1; discard_all: level 2)",
            ["sleep_state"],
            registry=r,
        )
        self.set_sleep_level(0)
        self.pushes = Counter(
            "rewardplane:weight_pushes",
            "Weight pushes, by training mode and result",
            ["training_mode", "result"],
            registry=r,
        )
        self.push_seconds = seconds(
            "rewardplane:weight_push_duration_seconds",
            "Weight push duration, announce to committed (or failed)",
        )
        self.push_phase_seconds = seconds(
            "rewardplane:weight_push_phase_seconds",
            f"Time of each phase of a weight push ({', '.join(PHASES)}; rewardplane.protocol.push_phases)",
            ("phase",),
        )
        self.push_bytes = Counter(
            "rewardplane:weight_push_bytes", "Bytes received by weight pushes", ["training_mode"], registry=r
        )

    def set_sleep_level(self, level: int) -> None:
        for i, state in enumerate(SLEEP_STATES):
            self.sleep_state.labels(state).set(1 if i == level else 0)

    def record_push(
        self, mode: str, ok: bool, nbytes: int, duration_s: float, after_announce_ms: Mapping[str, float]
    ) -> None:
        """One finished push: its count, bytes, duration and each phase's time."""
        self.pushes.labels(mode, "ok" if ok else "failed").inc()
        self.push_bytes.labels(mode).inc(nbytes)
        self.push_seconds.observe(duration_s)
        for phase, (start, end) in phase_spans(after_announce_ms).items():
            self.push_phase_seconds.labels(phase).observe((end - start) / 1000)


class RequestTimer:
    """One request's way through the engine: waiting (counted in ``num_requests_waiting``) from its
    creation, running once ``start`` is called (its queue time observed), gone at ``finish`` (or
    at the end of its ``with`` block, however the request ended)."""

    def __init__(self, metrics: ServerMetrics) -> None:
        self._m = metrics
        self._created = time.perf_counter()
        self._state = "waiting"
        metrics.waiting.inc()

    def start(self) -> None:
        if self._state == "waiting":
            self._m.waiting.dec()
            self._m.running.inc()
            self._m.queue_time.observe(time.perf_counter() - self._created)
            self._state = "running"

    def finish(self) -> None:
        if self._state == "waiting":
            self._m.waiting.dec()
        elif self._state == "running":
            self._m.running.dec()
        self._state = "done"

    def __enter__(self) -> RequestTimer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.finish()
