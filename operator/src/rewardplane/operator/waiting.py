"""Why a model's Pods wait, read from the cluster for the status: the FailedMount Events of Pods
stuck in ContainerCreating and the progress of model downloads. Each asks for the model to be
looked at again shortly, since a Pod waiting that way sends no further event."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import httpx

from rewardplane.api.kube import Kube, KubeError, core_path
from rewardplane.protocol.model_sources import FETCH_CONTAINER, FetchProgress

from .cluster import Key
from .pods import downloading, waits_for_mount
from .status import mount_problem

log = logging.getLogger("rewardplane.operator")

MOUNT_RECHECK_S = 5.0  # a Pod stuck in ContainerCreating: its FailedMount Events are read again
DOWNLOAD_RECHECK_S = 3.0  # a model download in progress: its log is read again for the status


class PodWaits:
    """Reads the causes of waiting Pods; ``retry_later(key, delay_s)`` schedules the next look."""

    def __init__(self, kube: Kube, retry_later: Callable[[Key, float], None]) -> None:
        self.kube = kube
        self.retry_later = retry_later

    def mount_problems(self, key: Key, pods: list[dict[str, Any]]) -> dict[str, str]:
        """Pod → the newest FailedMount Event's message, for Pods whose containers wait in
        ContainerCreating (the cause is only in their Events)."""
        waiting = [p for p in pods if waits_for_mount(p)]
        if not waiting:
            return {}
        out: dict[str, str] = {}
        for pod in waiting:
            name = pod["metadata"]["name"]
            try:
                events = self.kube.list(
                    core_path("events", key[0]),
                    field_selector=f"involvedObject.kind=Pod,involvedObject.name={name},reason=FailedMount",
                )
            except KubeError as exc:  # the status then only says it waits; nothing else depends on it
                log.info("%s/%s: cannot read the Events of %s: %s", *key, name, exc)
                continue
            uid = pod["metadata"].get("uid")
            problem = mount_problem(
                [e for e in events if (e.get("involvedObject") or {}).get("uid") in (None, uid)]
            )
            if problem:
                out[name] = problem
        self.retry_later(key, MOUNT_RECHECK_S)
        return out

    def download_progress(self, key: Key, pods: list[dict[str, Any]]) -> dict[str, str]:
        """Pod → its model download's progress in words, from the last progress line of its
        ``fetch-model`` init container's log, so the status follows the download."""
        fetching = [p for p in pods if downloading(p)]
        out: dict[str, str] = {}
        for pod in fetching:
            name = pod["metadata"]["name"]
            try:
                log_tail = self.kube.text(
                    core_path("pods", key[0], name) + "/log",
                    {"container": FETCH_CONTAINER, "tailLines": "20"},
                )
            except (KubeError, httpx.HTTPError) as exc:  # the status then only says it waits
                log.info("%s/%s: cannot read the download log of %s: %s", *key, name, exc)
                continue
            progress = FetchProgress.last_in(log_tail)
            if progress is not None:
                out[name] = progress.describe()
        if fetching:
            self.retry_later(key, DOWNLOAD_RECHECK_S)
        return out
