"""A RewardModel's status from what the reconciler found: the facts first (:class:`StatusFacts`,
gathered once from the Pods, the server probes and the plan), then one function per condition
over them, then the phase. Pure; ``compute_status`` is the entry point.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from rewardplane.api.names import ANNOTATION_SPEC_HASH, pod_name, server_selector
from rewardplane.api.spec import NO_IMAGE, PLACEMENT_REFUSED, GpuMode
from rewardplane.api.status import (
    CONDITION_TYPES,
    DEGRADED,
    PHASE_DEGRADED,
    PHASE_FAILED,
    PHASE_PENDING,
    PHASE_PROGRESSING,
    PHASE_READY,
    PHASE_SLEEPING,
    STATE_SLEEPING,
    STATE_STALE,
    WEIGHTS_LOST,
)

from .planning import Plan
from .pods import replica_index
from .status import (
    REPLICAS_UNHEALTHY,
    Cause,
    ProbeResult,
    _condition,
    _endpoint,
    _healthy,
    _without_empty_strings,
    replica_cause,
    sleeping_message,
)

Verdict = tuple[bool, str, str]  # (status, reason, message) of one condition


@dataclass(frozen=True)
class StatusFacts:
    """What the status is computed from, gathered once."""

    desired: int
    target_version: int
    endpoints: list[dict[str, Any]]
    ready: int
    asleep: list[str]  # ready and asleep (POST /sleep): healthy, still ready
    missing: list[str]  # Pods the plan wants that do not exist
    extra: list[str]  # Pods that exist and the plan does not want
    outdated: list[str]  # Pods whose spec hash differs from their desired rendering
    not_ready: list[str]
    behind: list[str]  # restarted onto, or lagging behind, the model's weights version
    restoring: list[str]  # behind and being restored (the lost ones wait for a push)
    causes: dict[str, Cause]  # Pod → why it does not start or serve
    downloads: Mapping[str, str]
    errors: Sequence[str] = ()
    error_reason: str = "InvalidSpec"

    @property
    def broken(self) -> list[str]:
        return sorted(self.causes)


def _lost_cause(name: str, version: int, node: str | None) -> Cause:
    """``name`` restarted on its base weights and nothing can bring back ``version``; ``node``:
    where its saved copy (persistDir) should have been, None without persistDir."""
    way_out = (
        f" (its saved copy under spec.weightSync.persistDir on node {node or '?'} does not hold that "
        "version: the node's directory was emptied, or the replica moved there)"
        if node is not None
        else ", or set spec.weightSync.persistDir to keep pushed weights across Pod replacements"
    )
    return Cause(
        WEIGHTS_LOST,
        f"{name} lost weights version {version}: it restarted on its base weights and neither a saved "
        f"copy nor a healthy replica on that version can restore it; push version {version} again "
        f"(a full push){way_out}",
    )


def gather(
    rm: Mapping[str, Any],
    plan: Plan | None,
    pods: Sequence[Mapping[str, Any]],
    probes: Mapping[str, ProbeResult],
    *,
    errors: Sequence[str] = (),
    error_reason: str = "InvalidSpec",
    desired_hashes: Mapping[str, str] | None = None,
    target_version: int | None = None,
    known_version: int | None = None,
    stale_pods: Collection[str] = (),
    mount_problems: Mapping[str, str] | None = None,
    lost_pods: Collection[str] = (),
    downloads: Mapping[str, str] | None = None,
) -> StatusFacts:
    """The facts of the status (the parameters as :func:`compute_status` documents them)."""
    previous = rm.get("status") or {}
    live = sorted(
        (p for p in pods if not (p.get("metadata") or {}).get("deletionTimestamp")),
        key=lambda p: (replica_index(p) is None, replica_index(p) or 0),
    )
    desired = len(plan.replicas) if plan else int((rm.get("spec") or {}).get("replicas", 1) or 0)
    healthy = {p["metadata"]["name"] for p in live if _healthy(p, probes.get(p["metadata"]["name"]))}
    if target_version is None:
        reported = [v for n in healthy if (v := probes[n].version) is not None]
        target_version = max(reported) if reported else int(previous.get("weightsVersion") or 0)
        if known_version is not None:
            target_version = max(target_version, known_version)

    endpoints = []
    for pod in live:
        name = pod["metadata"]["name"]
        ep = _endpoint(
            pod,
            plan.ports.http if plan else 0,
            probes.get(name),
            plan.spec.tensor_parallel_size if plan else 1,
            plan.spec.transport.interface if plan else None,
        )
        ep["ready"] = name in healthy and ep.get("weightsVersion") == target_version and bool(ep["url"])
        if name in stale_pods:
            ep["state"], ep["ready"] = STATE_STALE, False
        endpoints.append(_without_empty_strings(ep))

    wanted = {pod_name(plan.name, r.index) for r in plan.replicas} if plan else set()
    have = {p["metadata"]["name"] for p in live}
    hashes = desired_hashes or {}
    causes = {
        name: cause
        for p in live
        if (
            cause := replica_cause(
                p, probes.get(name := p["metadata"]["name"]), (mount_problems or {}).get(name)
            )
        )
        is not None
    }
    persisted = bool(plan and plan.spec.weight_sync.persist_dir)
    nodes = {p["metadata"]["name"]: (p.get("spec") or {}).get("nodeName") for p in live}
    for name in lost_pods:
        if name in have:
            causes[name] = _lost_cause(name, target_version, nodes.get(name) if persisted else None)
    stale = [ep["pod"] for ep in endpoints if ep["pod"] in healthy and not ep["ready"]]
    behind = sorted({*stale, *(n for n in stale_pods if n in have)})
    return StatusFacts(
        desired=desired,
        target_version=target_version,
        endpoints=endpoints,
        ready=sum(1 for ep in endpoints if ep["ready"]),
        asleep=sorted(ep["pod"] for ep in endpoints if ep["ready"] and ep.get("state") == STATE_SLEEPING),
        missing=sorted(wanted - have),
        extra=sorted(have - wanted) if plan else [],
        outdated=sorted(
            name
            for p in live
            if (name := p["metadata"]["name"]) in hashes
            and (p["metadata"].get("annotations") or {}).get(ANNOTATION_SPEC_HASH) != hashes[name]
        ),
        not_ready=sorted(have - healthy),
        behind=behind,
        restoring=[n for n in behind if n not in lost_pods],
        causes=causes,
        downloads=downloads or {},
        errors=errors,
        error_reason=error_reason,
    )


def available(f: StatusFacts) -> Verdict:
    if not f.desired:
        return (False, "ScaledToZero", "spec.replicas is 0")
    if f.ready and len(f.asleep) == f.ready:
        return (False, "Sleeping", sleeping_message(f.asleep, f.endpoints))
    if f.ready:
        asleep = f"; {', '.join(f.asleep)} asleep" if f.asleep else ""
        return (True, "ReplicasReady", f"{f.ready}/{f.desired} replicas ready{asleep}")
    return (False, "NoReplicaReady", f"0/{f.desired} replicas ready")


def weights_in_sync(f: StatusFacts) -> Verdict:
    if f.behind:
        return (
            False,
            "StaleReplicas",
            f"{', '.join(f.behind)} do not serve weights version {f.target_version}",
        )
    if f.ready:
        return (True, "AllReplicasCurrent", f"every ready replica serves weights version {f.target_version}")
    # Nothing serves, so nothing can be said to serve the current weights.
    return (False, "NoReplicas", "no replica is serving yet")


_RETRY = {
    PLACEMENT_REFUSED: "the cluster is checked again periodically; free the capacity or change the spec",
    NO_IMAGE: "set spec.engine.image, or the operator's default reward-server image",
}


def progressing(f: StatusFacts) -> Verdict:
    if f.errors:
        retry = _RETRY.get(f.error_reason, "fix the spec")
        return (
            False,
            f.error_reason,
            f"no change is rolled out until this is resolved ({retry}); running replicas are left as they are",
        )
    pending_work = [
        *(f"creating {n}" for n in f.missing),
        *(f"replacing {n}" for n in f.outdated),
        *(f"removing {n}" for n in f.extra),
        *(
            f"waiting for {n} to become ready"
            + (f" ({download})" if (download := f.downloads.get(n)) else "")
            for n in f.not_ready
            if n not in f.causes
        ),
    ]
    if pending_work:
        return (True, "RollingOut", "; ".join(pending_work))
    if f.restoring:
        # Pods are all there but some still have to reach the model's weights version.
        return (
            True,
            "RestoringWeights",
            f"bringing {', '.join(f.restoring)} to weights version {f.target_version}",
        )
    if f.causes:
        # every Pod is as the spec wants, yet not every replica serves: nothing is rolling out
        return (
            False,
            "ReplicasBroken",
            f"{f.ready}/{f.desired} replica(s) serve; {', '.join(f.broken)} cannot start or serve (see Degraded)",
        )
    return (False, "RolloutComplete", f"{f.desired} replica(s) up to date")


def degraded(f: StatusFacts) -> Verdict:
    if f.errors:
        return (True, f.error_reason, "; ".join(f.errors))
    if not f.causes:
        return (False, "AsExpected", "no replica is broken")
    reasons = {c.reason for c in f.causes.values()}
    return (
        True,
        reasons.pop() if len(reasons) == 1 else REPLICAS_UNHEALTHY,
        "; ".join(f.causes[n].message for n in f.broken),
    )


def phase(f: StatusFacts, verdicts: Mapping[str, Verdict]) -> tuple[str, str]:
    """The phase and the status's message."""
    if f.errors:
        # A spec the cluster refuses has Failed; one that is fine but names no image (and the
        # operator has none to give) is Degraded: the operator's configuration is what is missing.
        return (PHASE_DEGRADED if f.error_reason == NO_IMAGE else PHASE_FAILED), verdicts[DEGRADED][2]
    rolling, broken = verdicts["Progressing"][0], bool(f.causes)
    message = (
        verdicts[DEGRADED][2]
        if broken
        else verdicts["Progressing"][2]
        if rolling
        else verdicts["Available"][2]
    )
    if broken:
        return PHASE_DEGRADED, message
    if not rolling and f.ready == f.desired and f.asleep and len(f.asleep) == f.ready:
        return PHASE_SLEEPING, verdicts["Available"][2]
    if not rolling and f.ready == f.desired:
        return PHASE_READY, message
    return (PHASE_PENDING if f.ready == 0 else PHASE_PROGRESSING), message


def compute_status(
    rm: Mapping[str, Any],
    plan: Plan | None,
    pods: Sequence[Mapping[str, Any]],
    probes: Mapping[str, ProbeResult],
    now: str,
    **facts: Any,
) -> dict[str, Any]:
    """The full status of a RewardModel.

    ``facts``: the keyword arguments of :func:`gather`. ``plan`` is None when the spec was
    refused (``errors``/``error_reason`` say why); existing Pods
    are still reported, since the operator leaves them running. ``desired_hashes`` maps Pod name →
    spec hash of its desired rendering (an outdated Pod counts as rolling out). ``target_version``
    is the weights version replicas must serve; by default the newest one a healthy replica reports,
    and never below ``known_version`` (the newest version a WeightSync completed): a replica that
    restarted onto base weights must not pull the model's version down. ``stale_pods`` restarted onto
    older weights and wait for a restore: state ``stale``, never ready. ``downloads`` maps a Pod
    whose model is being downloaded to the download's progress, in words.
    """
    f = gather(rm, plan, pods, probes, **facts)
    meta, previous = rm.get("metadata") or {}, rm.get("status") or {}
    generation = int(meta.get("generation") or 0)
    verdicts = dict(
        zip(CONDITION_TYPES, (available(f), progressing(f), weights_in_sync(f), degraded(f)), strict=True)
    )
    conditions = [
        _condition(previous.get("conditions") or [], t, *v, generation, now) for t, v in verdicts.items()
    ]
    the_phase, message = phase(f, verdicts)
    shown = verdicts[DEGRADED if the_phase in (PHASE_DEGRADED, PHASE_FAILED) else "Progressing"]
    out = _without_empty_strings(
        {
            "phase": the_phase,
            # the REASON column: why the phase is what it is (the Degraded reason when degraded)
            "reason": shown[1] if the_phase != PHASE_READY else "",
            "ready": f"{f.ready}/{f.desired}",
            "observedGeneration": generation,
            "readyReplicas": f.ready,
            # the scale subresource's statusReplicasPath and labelSelectorPath (kubectl scale, HPA)
            "replicas": len(f.endpoints),
            "selector": server_selector(str(meta.get("name") or "")),
            "weightsVersion": f.target_version,
            "message": message,
            "conditions": conditions,
            "endpoints": f.endpoints,
        }
    )
    if plan is not None and plan.spec.gpu.mode is not GpuMode.NONE:
        # Only a model on GPUs has a memory fraction; on CPU the GPU-Frac column stays empty.
        out["gpuMemoryFraction"] = plan.spec.gpu.memory_fraction
    return out
