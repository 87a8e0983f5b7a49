"""Writing what the operator found: a RewardModel's status (only when it changed, fields it no
longer has removed), the Events of its transitions, and the gauge of models per phase.

A status PATCH answers the model as written; until the watch index has caught up with it, the
reconciler reads that answer instead of the index's older copy (:meth:`StatusWriter.fresher`).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from datetime import datetime, timezone
from typing import Any

from rewardplane.api.heartbeat import confirmation
from rewardplane.api.kube import Kube, KubeError, core_path, custom_path
from rewardplane.api.names import API_VERSION
from rewardplane.api.names import RM_KIND as KIND

from . import metrics
from .cluster import Key, freshest, plain
from .status import Event, transition_events

log = logging.getLogger("rewardplane.operator")

COMPONENT = "rewardplane-operator"
EVENT_MESSAGE_LIMIT = 1024  # the API server refuses longer Event messages
PHASES = ("Pending", "Progressing", "Ready", "Degraded", "Failed")


def now_rfc3339() -> str:
    return datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def event_body(rm: Mapping[str, Any], event: Event, stamp: str) -> dict[str, Any]:
    """The core/v1 Event about ``rm`` (a RewardModel, or any object of the group that names its kind)."""
    meta = rm["metadata"]
    return {
        "apiVersion": "v1",
        "kind": "Event",
        "metadata": {"generateName": f"{meta['name']}.", "namespace": meta["namespace"]},
        "involvedObject": {
            "apiVersion": API_VERSION,
            "kind": rm.get("kind") or KIND,
            "name": meta["name"],
            "namespace": meta["namespace"],
            "uid": meta.get("uid", ""),
        },
        "type": event.type,
        "reason": event.reason,
        "message": event.message[:EVENT_MESSAGE_LIMIT],
        "source": {"component": COMPONENT},
        "reportingComponent": COMPONENT,
        "firstTimestamp": stamp,
        "lastTimestamp": stamp,
        "count": 1,
    }


def post_event(kube: Kube, rm: Mapping[str, Any], event: Event) -> None:
    """Post an Event about ``rm`` (best effort) and log it."""
    meta = rm["metadata"]
    try:
        kube.create(core_path("events", meta["namespace"]), event_body(rm, event, now_rfc3339()))
    except KubeError as exc:  # an Event is best effort; the status already says it all
        log.warning(
            "could not post event %s for %s/%s: %s", event.reason, meta["namespace"], meta["name"], exc
        )
    (log.warning if event.type == "Warning" else log.info)(
        "%s/%s %s: %s", meta["namespace"], meta["name"], event.reason, event.message
    )


class StatusWriter:
    def __init__(self, kube: Kube, confirm_interval_s: float = 30.0) -> None:
        self.kube = kube
        # the heartbeat (status.confirmedAt) is refreshed once this old: one write per interval
        self.confirm_interval_s = confirm_interval_s
        self._phases: dict[Key, str] = {}
        # The model as our last status PATCH answered, until the index has caught up with it.
        self._written: dict[Key, dict[str, Any]] = {}

    def write(self, rm: Mapping[str, Any], status: dict[str, Any], *, remember: bool) -> None:
        """Write ``status`` when it differs from the model's, then post the Events of the
        transitions; ``remember``: keep the answer until the index shows it."""
        previous = rm.get("status") or {}
        status = {**status, **confirmation(previous, datetime.now(timezone.utc), self.confirm_interval_s)}
        key = (rm["metadata"]["namespace"], rm["metadata"]["name"])
        self._phases[key] = status["phase"]
        self._update_phase_gauge()
        # A field the status no longer has (status.reason once Ready) is removed: a merge patch
        # keeps whatever it does not name, so it names them with null.
        gone = {k: None for k in previous if k not in status}
        if not gone and all(previous.get(k) == v for k, v in status.items()):
            return  # unchanged: no write, no watch event, no churn
        written = self.kube.merge_patch(
            custom_path(key[0], key[1]) + "/status", {"status": {**status, **gone}}
        )
        if remember and written:
            self._written[key] = plain(written)
        for event in transition_events(previous, status):
            post_event(self.kube, rm, event)

    def fresher(self, key: Key, indexed: dict[str, Any] | None) -> dict[str, Any] | None:
        """The index's copy of the model, or the last written one while the index lags behind it."""
        rm = freshest(indexed, self._written.get(key))
        if rm is indexed:
            self._written.pop(key, None)  # the index has caught up (or the model is gone)
        return rm

    def forget(self, key: Key) -> None:
        self._phases.pop(key, None)
        self._written.pop(key, None)
        self._update_phase_gauge()

    def _update_phase_gauge(self) -> None:
        counts: dict[str, int] = {}
        for phase in self._phases.values():
            counts[phase] = counts.get(phase, 0) + 1
        for phase in PHASES:
            metrics.MODELS.labels(phase=phase).set(counts.get(phase, 0))
