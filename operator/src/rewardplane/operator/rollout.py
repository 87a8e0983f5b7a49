"""Pure rollout decisions: desired Pods vs live Pods → which to delete and which to create."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from .render import needs_replacement
from .status import pod_ready


@dataclass(frozen=True)
class PodActions:
    delete: list[tuple[str, str]] = field(default_factory=list)
    """(pod name, why) to delete now."""
    create: list[dict[str, Any]] = field(default_factory=list)
    """Pods to create now."""

    def any(self) -> bool:
        return bool(self.delete or self.create)


def _terminating(pod: Mapping[str, Any]) -> bool:
    return bool(pod["metadata"].get("deletionTimestamp"))


def pod_actions(desired: Sequence[dict[str, Any]], live: Sequence[Mapping[str, Any]]) -> PodActions:
    """One rollout step.

    - Pods beyond spec.replicas go (scale down).
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
    unavailable = {n for n, p in have.items() if n in wanted and (not pod_ready(p) or _terminating(p))}
    unavailable |= {n for n in wanted if n not in have}
    for name, pod in sorted(have.items()):
        if name not in wanted or _terminating(pod) or not needs_replacement(pod, wanted[name]):
            continue
        if not pod_ready(pod) or not (unavailable - {name}):
            actions.delete.append((name, "spec changed"))
            unavailable.add(name)
    actions.create.extend(pod for name, pod in wanted.items() if name not in have)
    return actions
