"""Pure restart-recovery decisions: which replicas came back on older weights than the model serves.

A server that restarts (new Pod UID, or a higher container restart count) loads its base weights.
If it then reports a version older than the model's, it is *stale*: left out of the endpoints,
restored from its persisted weights (``POST /restore_weights``), then re-admitted once it reports
the model's version. A replica that merely lags during a push (same identity as when it last served
the model's version) is not stale.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from rewardplane.api.status import STATE_BROKEN

from .status import ProbeResult, pod_restarts

Identity = tuple[str, int]  # (pod UID, container restarts)


def identity(pod: Mapping[str, Any]) -> Identity:
    return str((pod.get("metadata") or {}).get("uid", "")), pod_restarts(pod)


def stale_replicas(
    pods: Sequence[Mapping[str, Any]],
    probes: Mapping[str, ProbeResult],
    target: int,
    current: Mapping[str, Identity],
) -> tuple[set[str], dict[str, Identity]]:
    """(stale pod names, updated map pod → identity last seen serving ``target``).

    ``current`` is that map from the previous pass (empty after an operator restart: then every
    replica behind the model counts as stale, which is right since no push is running).
    """
    stale: set[str] = set()
    seen = {k: v for k, v in current.items()}
    live = set()
    for pod in pods:
        name = (pod.get("metadata") or {}).get("name", "")
        live.add(name)
        probe = probes.get(name)
        if probe is None or probe.error is not None or probe.version is None:
            continue
        ident = identity(pod)
        if probe.version >= target:
            seen[name] = ident
            continue
        if probe.state == STATE_BROKEN:
            continue  # a failed push left it broken; the next push repairs it
        if seen.get(name) != ident:
            stale.add(name)
    return stale, {k: v for k, v in seen.items() if k in live}
