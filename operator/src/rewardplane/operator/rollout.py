"""Pure rollout decisions: desired Pods vs live Pods → which to delete and which to create."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from .pods import pod_ready
from .render import needs_replacement


@dataclass(frozen=True)
class PodActions:
    delete: list[tuple[str, str]] = field(default_factory=list)
    """(pod name, why) to delete now."""
    create: list[dict[str, Any]] = field(default_factory=list)
    """Pods to create now."""

    def any(self) -> bool:
        return bool(self.delete or self.create)


# A Pod that ended (the kubelet refused it at admission, e.g. OutOfcpu, or evicted it) never runs
# again: it is replaced, as a ReplicaSet does, once it has been visible this long (the status names
# its cause meanwhile, and a kubelet that keeps refusing sees one new Pod per replica this often).
ENDED_POD_GRACE_S = 10.0


def _terminating(pod: Mapping[str, Any]) -> bool:
    return bool(pod["metadata"].get("deletionTimestamp"))


def _ended(pod: Mapping[str, Any], now: datetime | None) -> str | None:
    """Why the Pod is to be replaced (its phase and reason), once it ended over the grace ago."""
    status = pod.get("status") or {}
    if status.get("phase") not in ("Failed", "Succeeded") or now is None:
        return None
    since = status.get("startTime") or pod["metadata"].get("creationTimestamp")
    try:
        at = datetime.fromisoformat(str(since).replace("Z", "+00:00"))
    except ValueError:
        at = None
    if at is not None and (now - at).total_seconds() < ENDED_POD_GRACE_S:
        return None
    reason = status.get("reason") or status.get("phase")
    return f"ended ({reason}: {status.get('message') or 'no message'}); replaced"


def pod_actions(
    desired: Sequence[dict[str, Any]], live: Sequence[Mapping[str, Any]], now: datetime | None = None
) -> PodActions:
    """One rollout step (``now``: the time, timezone-aware, to judge ended Pods by).

    - Pods beyond spec.replicas go (scale down).
    - A Pod that ended (refused or evicted by the kubelet) is replaced once it was seen for
      ``ENDED_POD_GRACE_S``.
    - Outdated Pods (spec hash differs) are replaced: not-ready ones at once (they serve nothing),
      ready ones one at a time and only while every other replica is ready, so a spec change
      keeps the model available.
    - Missing Pods are created; a Pod still terminating keeps its name, so its replacement waits
      for the next step.
    """
    wanted = {p["metadata"]["name"]: p for p in desired}
    have = {p["metadata"]["name"]: p for p in live}
    actions = PodActions()
    for name, pod in have.items():
        if name not in wanted and not _terminating(pod):
            actions.delete.append((name, "scale down"))
        elif name in wanted and not _terminating(pod) and (why := _ended(pod, now)) is not None:
            actions.delete.append((name, why))
    unavailable = {n for n, p in have.items() if n in wanted and (not pod_ready(p) or _terminating(p))}
    unavailable |= {n for n in wanted if n not in have}
    deleting = {name for name, _ in actions.delete}
    for name, pod in sorted(have.items()):
        if (
            name not in wanted
            or name in deleting
            or _terminating(pod)
            or not needs_replacement(pod, wanted[name])
        ):
            continue
        if not pod_ready(pod) or not (unavailable - {name}):
            actions.delete.append((name, "spec changed"))
            unavailable.add(name)
    actions.create.extend(pod for name, pod in wanted.items() if name not in have)
    return actions
