"""Write the chart's Grafana dashboard (charts/rewardplane/dashboards/rewardplane.json) from the
panels below.

``python scripts/dashboard.py`` writes it; ``--check`` only says whether it is current (exit 1 if
not; scripts/test.sh runs it). The queries use the metrics docs/observability.md lists, with the
labels the chart's PodMonitor adds (``rewardmodel``, ``replica``); tests/unit/test_dashboard.py
checks every name against what the server and the operator export, and the real-node e2e suite
runs every query against a Prometheus scraping the cluster.
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from generated_file import write_or_check

OUT = Path(__file__).resolve().parents[1] / "charts" / "rewardplane" / "dashboards" / "rewardplane.json"
UID = "rewardplane"
M = 'rewardmodel=~"$rewardmodel"'  # the model selector every reward-server query carries
# the routes that score (vLLM's, OpenRLHF's and rewardplane's own); probes and the control plane aside
SCORING = 'endpoint=~"/score|/classify|/pooling|/get_reward|/embeddings|/v1/.*"'
RATE = "$__rate_interval"


@dataclass(frozen=True)
class Panel:
    title: str
    description: str
    queries: tuple[tuple[str, str], ...]  # (PromQL, legend)
    unit: str = "short"
    kind: str = "timeseries"
    stepped: bool = False  # a value that jumps (versions, states), drawn as steps


def _quantiles(metric: str, selector: str, legend: str = "") -> tuple[tuple[str, str], ...]:
    return tuple(
        (
            f"histogram_quantile({q}, sum by (le, rewardmodel) (rate({metric}_bucket{{{selector}}}[{RATE}])))",
            f"{legend}p{round(q * 100)} {{{{rewardmodel}}}}",
        )
        for q in (0.5, 0.99)
    )


PANELS: tuple[Panel, ...] = (
    Panel(
        "Scoring rate",
        "Inputs scored per second, and scoring requests per second, per RewardModel.",
        (
            (
                f"sum by (rewardmodel) (rate(rewardplane:scored_items_total{{{M}}}[{RATE}]))",
                "inputs {{rewardmodel}}",
            ),
            (
                f"sum by (rewardmodel) (rate(rewardplane:requests_total{{{M}, {SCORING}}}[{RATE}]))",
                "requests {{rewardmodel}}",
            ),
        ),
        unit="reqps",
    ),
    Panel(
        "Scoring latency",
        "Request latency (arrival to answer) of the scoring routes, and the part spent queued "
        "(for a batch, or for the weights lock while a push holds it).",
        _quantiles("rewardplane:e2e_request_latency_seconds", f"{M}, {SCORING}")
        + _quantiles("rewardplane:request_queue_time_seconds", M, "queued "),
        unit="s",
    ),
    Panel(
        "Time per request stage",
        "Mean time a scoring request spends in each stage of the server: parse (body read and "
        "JSON parsed), tokenize (texts only), engine (submitted to scored); the rest of its "
        "latency is the event loop, validation and the answer.",
        (
            (
                f"sum by (rewardmodel, stage) (rate(rewardplane:request_stage_seconds_sum{{{M}}}[{RATE}]))"
                f" / sum by (rewardmodel, stage) (rate(rewardplane:request_stage_seconds_count{{{M}}}[{RATE}]))",
                "{{stage}} {{rewardmodel}}",
            ),
        ),
        unit="s",
    ),
    Panel(
        "Queue depth",
        "Requests waiting for the engine and requests running, per replica.",
        (
            (
                f"sum by (rewardmodel, replica) (rewardplane:num_requests_waiting{{{M}}})",
                "waiting {{rewardmodel}}/{{replica}}",
            ),
            (
                f"sum by (rewardmodel, replica) (rewardplane:num_requests_running{{{M}}})",
                "running {{rewardmodel}}/{{replica}}",
            ),
        ),
    ),
    Panel(
        "Push timeline",
        "Where weight pushes spend their time, per phase (queue, wait_lock, receive, commit; "
        "docs/observability.md), stacked: seconds per second of wall time, summed over replicas.",
        (
            (
                f"sum by (phase) (rate(rewardplane:weight_push_phase_seconds_sum{{{M}}}[{RATE}]))",
                "{{phase}}",
            ),
            (
                f"sum by (rewardmodel) (rate(rewardplane:weight_push_bytes_total{{{M}}}[{RATE}]))",
                "bytes/s {{rewardmodel}}",
            ),
        ),
    ),
    Panel(
        "Weights version per replica",
        "The weights version each replica serves: after a push every replica steps up together.",
        (
            (
                f"max by (rewardmodel, replica) (rewardplane:weights_version{{{M}}})",
                "{{rewardmodel}}/{{replica}}",
            ),
        ),
        stepped=True,
    ),
    Panel(
        "Sleep state",
        "Replicas awake, and asleep at level 1 (weights_offloaded) or level 2 (discard_all).",
        (
            (
                f"sum by (rewardmodel, sleep_state) (rewardplane:engine_sleep_state{{{M}}})",
                "{{rewardmodel}} {{sleep_state}}",
            ),
        ),
        stepped=True,
    ),
    Panel(
        "Operator reconciles",
        "The operator's reconciles per second by result, their p99 time, and the reconciles "
        "waiting to start.",
        (
            (
                "sum by (result) (rate(rewardplane:operator_reconciles_total[$__rate_interval]))",
                "{{result}}/s",
            ),
            (
                "histogram_quantile(0.99, sum by (le) "
                "(rate(rewardplane:operator_reconcile_duration_seconds_bucket[$__rate_interval])))",
                "p99 seconds",
            ),
            ("sum(rewardplane:operator_queue_depth)", "queue depth"),
        ),
    ),
)


def _panel(i: int, p: Panel) -> dict[str, Any]:
    custom: dict[str, Any] = {"fillOpacity": 10, "showPoints": "never"}
    if p.title == "Push timeline":
        custom.update(stacking={"mode": "normal", "group": "A"}, drawStyle="bars", fillOpacity=60)
    if p.stepped:
        custom["lineInterpolation"] = "stepAfter"
    return {
        "id": i + 1,
        "type": p.kind,
        "title": p.title,
        "description": p.description,
        "datasource": {"type": "prometheus", "uid": "${datasource}"},
        "gridPos": {"h": 8, "w": 12, "x": 12 * (i % 2), "y": 8 * (i // 2)},
        "fieldConfig": {"defaults": {"unit": p.unit, "custom": custom}, "overrides": []},
        "options": {"legend": {"displayMode": "list", "placement": "bottom"}, "tooltip": {"mode": "multi"}},
        "targets": [
            {
                "refId": chr(ord("A") + j),
                "datasource": {"type": "prometheus", "uid": "${datasource}"},
                "expr": expr,
                "legendFormat": legend,
            }
            for j, (expr, legend) in enumerate(p.queries)
        ],
    }


def dashboard() -> dict[str, Any]:
    return {
        "uid": UID,
        "title": "rewardplane",
        "description": "Reward servers and the rewardplane operator (docs/observability.md).",
        "tags": ["rewardplane"],
        "editable": True,
        "schemaVersion": 39,
        "time": {"from": "now-1h", "to": "now"},
        "refresh": "30s",
        "templating": {
            "list": [
                {"name": "datasource", "type": "datasource", "query": "prometheus", "label": "Data source"},
                {
                    "name": "rewardmodel",
                    "type": "query",
                    "label": "RewardModel",
                    "datasource": {"type": "prometheus", "uid": "${datasource}"},
                    "query": {
                        "query": "label_values(rewardplane:weights_version, rewardmodel)",
                        "refId": "rm",
                    },
                    "includeAll": True,
                    "multi": True,
                    "allValue": ".*",
                    "current": {"text": "All", "value": "$__all"},
                    "refresh": 2,
                },
            ]
        },
        "panels": [_panel(i, p) for i, p in enumerate(PANELS)],
    }


def render() -> str:
    return json.dumps(dashboard(), indent=2) + "\n"


def main(argv: list[str] | None = None) -> int:
    return write_or_check(OUT, render(), "scripts/dashboard.py", __doc__, argv)


if __name__ == "__main__":
    sys.exit(main())
