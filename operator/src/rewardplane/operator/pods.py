"""What the operator reads off one Pod of a model: readiness, a started server, its replica index,
restarts, its model download (the ``fetch-model`` init container) and a wait for its volumes.
Pure functions over the Pod as the API server returns it."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from rewardplane.api.names import LABEL_REPLICA
from rewardplane.protocol.model_sources import FETCH_CONTAINER


def pod_ready(pod: Mapping[str, Any]) -> bool:
    if (pod.get("metadata") or {}).get("deletionTimestamp"):
        return False
    conditions = (pod.get("status") or {}).get("conditions") or []
    return any(c.get("type") == "Ready" and c.get("status") == "True" for c in conditions)


def server_started(pod: Mapping[str, Any]) -> bool:
    """The replica's server is up: its startup probe passed (it may still wait for admission, so
    the Pod is not Ready yet). The operator probes such a replica to admit or restore it."""
    if (pod.get("metadata") or {}).get("deletionTimestamp") or not (pod.get("status") or {}).get("podIP"):
        return False
    return pod_ready(pod) or any(
        c.get("started") or c.get("ready") for c in (pod.get("status") or {}).get("containerStatuses") or []
    )


def pod_restarts(pod: Mapping[str, Any]) -> int:
    return sum(
        int(c.get("restartCount", 0)) for c in (pod.get("status") or {}).get("containerStatuses") or []
    )


def replica_index(pod: Mapping[str, Any]) -> int | None:
    raw = ((pod.get("metadata") or {}).get("labels") or {}).get(LABEL_REPLICA)
    try:
        return int(raw) if raw is not None else None
    except ValueError:
        return None


def fetch_status(pod: Mapping[str, Any]) -> Mapping[str, Any]:
    for cs in (pod.get("status") or {}).get("initContainerStatuses") or []:
        if cs.get("name") == FETCH_CONTAINER:
            return cs
    return {}


def downloading(pod: Mapping[str, Any]) -> bool:
    """The Pod's model download runs now (its progress is in the fetcher's log)."""
    return "running" in (fetch_status(pod).get("state") or {})


def waits_for_mount(pod: Mapping[str, Any]) -> bool:
    """The Pod's containers wait in ContainerCreating: a volume may not mount (the cause is only in
    the Pod's Events, which the operator then reads)."""
    statuses = (pod.get("status") or {}).get("containerStatuses") or []
    return any(
        ((cs.get("state") or {}).get("waiting") or {}).get("reason") == "ContainerCreating" for cs in statuses
    )


def watched_state(pod: Mapping[str, Any]) -> tuple[Any, ...]:
    """What of a Pod the operator reacts to at once (its events carry kubelet heartbeats too):
    readiness, a started server, its IP, deletion, its labels (edited by hand: a drift to repair),
    its phase and reason (a Pod the kubelet refused, e.g. OutOfcpu, ends Failed with nothing
    else changed: its cause is named in the status then, not at the next resync), and its model
    download starting, ending or failing."""
    meta, status, fetch = pod.get("metadata") or {}, pod.get("status") or {}, fetch_status(pod)
    return (
        pod_ready(pod),
        server_started(pod),  # up and waiting for its admission (ready only after it)
        status.get("podIP"),
        bool(meta.get("deletionTimestamp")),
        tuple(sorted((meta.get("labels") or {}).items())),
        status.get("phase"),
        status.get("reason"),
        tuple(fetch.get("state") or {}),
        fetch.get("restartCount"),
    )
