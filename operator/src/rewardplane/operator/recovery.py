"""Pure restart-recovery decisions: which replicas came back on older weights than the model serves,
and which the operator admits to traffic (``rewardplane.protocol.admission``).

A server that restarts (new Pod UID, or a higher container restart count) loads its base weights.
If it then reports a version older than the model's, it is *stale*: left out of the endpoints,
restored from its persisted weights (``POST /restore_weights``), then re-admitted once it reports
the model's version. A replica that merely lags during a push (same identity as when it last served
the model's version) is not stale. A stale replica is restored from the weights it saved, or
else from a healthy peer over the data plane (``restore_plan``), without the trainer.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from functools import cached_property
from typing import Any

from rewardplane.api.status import STATE_BROKEN, STATE_SLEEPING

from .planning import Plan
from .pods import pod_restarts
from .status import ProbeResult

Identity = tuple[str, int]  # (pod UID, container restarts)


def identity(pod: Mapping[str, Any]) -> Identity:
    return str((pod.get("metadata") or {}).get("uid", "")), pod_restarts(pod)


def stale_replicas(
    pods: Sequence[Mapping[str, Any]],
    probes: Mapping[str, ProbeResult],
    target: int,
    current: Mapping[str, Identity],
    completed: int = 0,
) -> tuple[set[str], dict[str, Identity]]:
    """(stale pod names, updated map pod → identity last seen serving ``target``).

    ``current`` is that map from the previous pass (empty after an operator restart: then every
    replica behind the model counts as stale, which is right since no push is running).
    ``completed``: the version of the model's last completed push. A replica behind it is stale
    whatever its identity: every target of that push serves it, so this one was left out (it did
    not answer when the push was planned) and will not catch up by itself.
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
        if seen.get(name) != ident or probe.version < completed:
            stale.add(name)
    return stale, {k: v for k, v in seen.items() if k in live}


@dataclass(frozen=True)
class RestorePlan:
    """How the stale replicas of one pass are brought to the model's version."""

    from_disk: tuple[str, ...] = ()
    """Replicas asked to load the weights they saved (``POST /restore_weights``)."""
    peer_source: str | None = None
    """A healthy replica serving the version, that sends it to ``from_peer``."""
    from_peer: tuple[str, ...] = ()
    unrecoverable: tuple[str, ...] = ()
    """Stale replicas with neither a disk restore left to try nor a peer to copy from."""


def restore_plan(
    stale: Collection[str],
    probes: Mapping[str, ProbeResult],
    target: int,
    *,
    persisted: bool,
    disk_failed: Collection[str] = (),
    busy: Collection[str] = (),
    pod_copies: Collection[str] = (),
) -> RestorePlan:
    """Saved weights first (cheap, no peer involved), then a peer that serves ``target``.

    ``disk_failed``: replicas whose disk restore already failed for their current identity (no
    saved weights, another version or base); ``busy``: replicas with a restore in flight, left
    alone until it ends; ``pod_copies``: replicas (without ``persisted``) whose container
    restarted in its Pod, which keeps a copy of the pushed weights. A full push from the trainer
    repairs whatever is left.
    """
    todo = sorted(n for n in stale if n not in busy)
    from_disk = tuple(n for n in todo if (persisted or n in pod_copies) and n not in disk_failed)
    rest = [n for n in todo if n not in from_disk]
    sources = sorted(
        n
        for n, p in probes.items()
        if n not in stale
        and n not in busy
        and p.error is None
        and p.version == target
        and p.state not in (STATE_BROKEN, STATE_SLEEPING)  # a sleeping replica cannot send
    )
    if not rest:
        return RestorePlan(from_disk=from_disk)
    if not sources:
        return RestorePlan(from_disk=from_disk, unrecoverable=tuple(rest))
    return RestorePlan(from_disk=from_disk, peer_source=sources[0], from_peer=tuple(rest))


@dataclass(frozen=True)
class AdmissionChanges:
    """Which replicas the operator admits to traffic, and which it takes the admission back from."""

    admit: tuple[str, ...] = ()
    revoke: tuple[str, ...] = ()


def admission_changes(
    probes: Mapping[str, ProbeResult], target: int, stale: Collection[str]
) -> AdmissionChanges:
    """Admit an unadmitted replica that serves ``target`` (the model's version) and is not stale;
    take the admission back from an admitted one that is stale (behind the model: restarted onto
    older weights, or left out of a completed push). A replica mid-push (one version behind while
    the others commit) is not stale, so it is never taken out for a push in flight."""
    answered = {n: p for n, p in probes.items() if p.error is None and p.version is not None}
    admit = sorted(
        n
        for n, p in answered.items()
        if not p.admitted and p.version == target and n not in stale and p.state != STATE_BROKEN
    )
    revoke = sorted(n for n, p in answered.items() if p.admitted and n in stale)
    return AdmissionChanges(tuple(admit), tuple(revoke))


@dataclass(frozen=True)
class ReplicaView:
    """One model's live replicas as one reconcile pass sees them: their Pods, what their servers
    answered, which are stale, and the weights version they should serve."""

    rm: Mapping[str, Any]
    plan: Plan
    pods: Sequence[Mapping[str, Any]]
    probes: Mapping[str, ProbeResult]
    stale: Collection[str]
    target: int

    @property
    def key(self) -> tuple[str, str]:
        return self.rm["metadata"]["namespace"], self.rm["metadata"]["name"]

    @cached_property
    def by_name(self) -> dict[str, Mapping[str, Any]]:
        return {p["metadata"]["name"]: p for p in self.pods}

    def url(self, pod: Mapping[str, Any]) -> str:
        """The pod's server."""
        return replica_url(pod, self.plan)


def replica_url(pod: Mapping[str, Any], plan: Plan) -> str:
    return f"http://{pod['status']['podIP']}:{plan.ports.http}"
