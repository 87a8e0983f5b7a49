"""What the cluster handle reads from a RewardModel's status, and its bounded waits on it.

The replicas as the status lists them (:class:`ReplicaEndpoint`), which of them serve, and the
three waits of :class:`~rewardplane.sdk.RewardModelHandle`: until the model is ready, until a
replica is ready (for a scoring client), and until the status shows a pushed version. Each wait
reads the cluster through a function it is given, so it is the same loop for any reader.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, fields
from typing import Any

from rewardplane.api.status import WEIGHTS_LOST, EndpointStatus, RewardModelStatus

from ._exceptions import ClusterError, RewardplaneTimeout

log = logging.getLogger("rewardplane.sdk.cluster")

READY_POLL_S = 0.2  # wait_ready: status reads while the model comes up
CLIENT_POLL_S = 0.5  # client(): status reads while no replica is ready
VERSION_POLL_S = 0.02  # after a push: status reads until it shows the new version (a push is short)


@dataclass(frozen=True)
class ReplicaEndpoint:
    """One replica as ``status.endpoints`` lists it."""

    replica: int
    pod: str
    url: str
    weights_version: int | None
    state: str
    ready: bool
    rank_offset: int = 0
    world_size: int = 1


def replica_of(e: EndpointStatus) -> ReplicaEndpoint:
    """The handle's view of ``e``: every field of ``ReplicaEndpoint``, read from the status under its name."""
    return ReplicaEndpoint(**{f.name: getattr(e, f.name) for f in fields(ReplicaEndpoint)})


def ready_replicas(endpoints: Sequence[ReplicaEndpoint]) -> list[ReplicaEndpoint]:
    """The replicas that serve (ready, with a URL), in replica order."""
    return sorted((e for e in endpoints if e.ready and e.url), key=lambda e: e.replica)


def wait_until_ready(
    read: Callable[[], Mapping[str, Any]], label: str, timeout_s: float, min_replicas: int | None
) -> RewardModelStatus:
    """Read the RewardModel (``read``) until every desired replica (or ``min_replicas``) is ready;
    returns its status. Raises RewardplaneTimeout with the phase and message when it is not, and
    ClusterError at once when the operator reports the weights lost (only a push helps)."""
    deadline = time.monotonic() + timeout_s
    while True:
        rm = read()
        status = RewardModelStatus.model_validate(rm.get("status") or {})
        desired = int((rm.get("spec") or {}).get("replicas", 1))
        want = desired if min_replicas is None else min_replicas
        ready = len([e for e in status.endpoints if e.ready])
        # Sleeping: every replica ready and asleep (awake() wakes them)
        if ready >= want and (min_replicas is not None or status.phase in ("Ready", "Sleeping")):
            return status
        if status.reason == WEIGHTS_LOST:
            raise ClusterError(f"RewardModel {label} will not become ready by itself: {status.message}")
        if time.monotonic() > deadline:
            raise RewardplaneTimeout(
                f"RewardModel {label} not ready after {timeout_s:.0f}s: phase "
                f"{status.phase!r}, {ready}/{want} replicas ready ({status.message or 'no message'}); "
                "see `kubectl describe rm` and the pods' logs"
            )
        time.sleep(READY_POLL_S)


def wait_for_urls(
    urls: Callable[[], Sequence[str]], message: Callable[[], str | None], label: str, wait_s: float
) -> tuple[str, ...]:
    """Called when no replica is ready: the ready replicas' URLs (``urls``) once there are some,
    read every half second for up to ``wait_s``; then ClusterError naming the model's status
    ``message``."""
    deadline = time.monotonic() + wait_s
    found: tuple[str, ...] = ()
    while not found:
        if time.monotonic() >= deadline:
            raise ClusterError(
                f"RewardModel {label} has no ready replica after {wait_s:.0f}s ({message() or 'no message'}); "
                "wait_ready() first, or see `kubectl describe rm`"
            )
        time.sleep(CLIENT_POLL_S)
        found = tuple(urls())
    return found


def wait_for_version(
    get_status: Callable[[], RewardModelStatus], label: str, version: int, deadline: float
) -> None:
    """Until the RewardModel's status (and so its endpoints) shows ``version``; best effort: a
    warning, not an error, when the deadline passes."""
    while time.monotonic() < deadline:
        status = get_status()
        if status.weights_version >= version and any(e.ready for e in status.endpoints):
            return
        time.sleep(VERSION_POLL_S)
    log.warning("RewardModel %s status does not show version %d yet", label, version)
