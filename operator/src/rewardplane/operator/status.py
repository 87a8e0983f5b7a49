"""Pure status computation: Pods + server probes → RewardModel status, conditions and events.

The handlers gather the facts (Pods of the model, each ready server's ``/health`` and
``/runtime_version``) and write what ``compute_status`` returns; ``transition_events`` says which
Kubernetes Events the change deserves, so an unchanged status posts nothing.
"""

from __future__ import annotations

import json
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from rewardplane.api.names import (
    ANNOTATION_GROUP_PORT,
    ANNOTATION_RANK_OFFSET,
    ANNOTATION_SPEC_HASH,
    LABEL_REPLICA,
    pod_name,
    server_selector,
)
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
    STATE_BROKEN,
    STATE_SLEEPING,
    STATE_STALE,
    WEIGHTS_LOST,
)
from rewardplane.protocol.errors import MODEL_FILES_UNREADABLE
from rewardplane.protocol.model_sources import EXIT_PERMANENT, FETCH_CONTAINER

from .planning import Plan


@dataclass(frozen=True)
class ProbeResult:
    """What one server answered on /health and /runtime_version (error set when it did not)."""

    version: int | None = None
    state: str | None = None
    error: str | None = None
    sleep_level: int | None = None
    admitted: bool = True
    """False while the server waits for the operator's admission (``rewardplane.protocol.admission``)."""


@dataclass(frozen=True)
class Event:
    type: str  # Normal | Warning
    reason: str
    message: str


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


def watched_state(pod: Mapping[str, Any]) -> tuple[Any, ...]:
    """What of a Pod the operator reacts to at once (its events carry kubelet heartbeats too):
    readiness, a started server, its IP, deletion, its labels (edited by hand: a drift to repair),
    its phase and reason (a Pod the kubelet refused, e.g. OutOfcpu, ends Failed with nothing
    else changed: its cause is named in the status then, not at the next resync), and its model
    download starting, ending or failing."""
    meta, status, fetch = pod.get("metadata") or {}, pod.get("status") or {}, _fetch_status(pod)
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


def _last_lines(text: str, limit: int = 300) -> str:
    """The end of a termination message (the server prints its fatal error last), on one line."""
    lines = [line.strip() for line in text.strip().splitlines() if line.strip()]
    tail = " | ".join(lines[-2:])
    return tail if len(tail) <= limit else "…" + tail[-limit:]


# Reasons a replica does not start, each named in the Degraded condition, the Event and the
# REASON column (status.reason), with what to do about it.
IMAGE_PULL = "ImagePullBackOff"
FAILED_MOUNT = "FailedMount"
CONTAINER_CONFIG = "CreateContainerConfigError"
UNSCHEDULABLE = "Unschedulable"
OOM_KILLED = "OOMKilled"
CRASH_LOOP = "CrashLoopBackOff"
MODEL_UNREADABLE = "ModelUnreadable"
MODEL_DOWNLOAD_FAILED = "ModelDownloadFailed"
BROKEN_WEIGHTS = "BrokenWeights"
REPLICAS_UNHEALTHY = "ReplicasUnhealthy"  # several causes at once, or an exit without a known one
_IMAGE_WAITING = {
    "ImagePullBackOff",
    "ErrImagePull",
    "InvalidImageName",
    "ErrImageNeverPull",
    "RegistryUnavailable",
}
_CONFIG_WAITING = {"CreateContainerConfigError", "CreateContainerError", "RunContainerError"}


@dataclass(frozen=True)
class Cause:
    """Why one replica does not serve: a reason (one of the names above) and a message that says
    what happened and what to do."""

    reason: str
    message: str


def _memory_limit(pod: Mapping[str, Any]) -> str:
    for c in (pod.get("spec") or {}).get("containers") or []:
        limit = ((c.get("resources") or {}).get("limits") or {}).get("memory")
        if limit:
            return str(limit)
    return "none set"


def replica_cause(
    pod: Mapping[str, Any], probe: ProbeResult | None, mount_problem: str | None = None
) -> Cause | None:
    """Why a replica does not start or serve, from its Pod's status (and the message of a
    ``FailedMount`` Event on it, which the Pod's status never shows); None while nothing is known
    to be wrong (a replica still starting)."""
    name = (pod.get("metadata") or {}).get("name", "")
    if probe is not None and probe.state == STATE_BROKEN:
        return Cause(BROKEN_WEIGHTS, replica_problem(pod, probe))
    status = pod.get("status") or {}
    for cond in status.get("conditions") or []:
        if (
            cond.get("type") == "PodScheduled"
            and cond.get("status") == "False"
            and cond.get("reason") == UNSCHEDULABLE
        ):
            return Cause(
                UNSCHEDULABLE,
                f"{name} cannot be scheduled: {cond.get('message') or 'no node fits'}; free capacity or "
                "lower spec.resources / spec.gpu",
            )
    if status.get("phase") == "Failed" and status.get("reason"):
        # the kubelet refused the Pod the operator placed on its node (OutOfcpu, OutOfmemory, ...)
        return Cause(
            UNSCHEDULABLE,
            f"{name} was refused by node {(pod.get('spec') or {}).get('nodeName', '?')}: {status['reason']}"
            f" ({status.get('message') or 'no message'}); free capacity on the node or lower spec.resources",
        )
    download = download_failure(pod)
    if download is not None:
        return download
    for cs in [*(status.get("initContainerStatuses") or []), *(status.get("containerStatuses") or [])]:
        waiting = (cs.get("state") or {}).get("waiting") or {}
        why, detail = waiting.get("reason"), waiting.get("message") or ""
        if why in _IMAGE_WAITING:
            return Cause(
                IMAGE_PULL,
                f"{name}: the image {cs.get('image') or '?'} cannot be pulled ({why}: {detail or 'no detail'}); "
                "set spec.engine.image (omitted: the operator's default, the chart's serverImage) to an "
                "image the node can pull (or load it onto the node), with spec.engine.imagePullPolicy "
                "and the pull secret it needs",
            )
        if why in _CONFIG_WAITING:
            return Cause(
                CONTAINER_CONFIG,
                f"{name}: the container cannot be created ({why}: {detail or 'no detail'}); fix what it "
                "names (a missing Secret or ConfigMap, a bad command) in the RewardModel or the namespace",
            )
        last = (
            (cs.get("lastState") or {}).get("terminated") or (cs.get("state") or {}).get("terminated") or {}
        )
        if last.get("reason") == OOM_KILLED:
            return Cause(
                OOM_KILLED,
                f"{name}: the server was killed for going over its memory limit ({_memory_limit(pod)}; OOMKilled, "
                f"exit code {last.get('exitCode', 137)}, {pod_restarts(pod)} restart(s)); raise "
                "spec.resources.limits.memory (the model's weights, its activations and the tokenizer must fit)",
            )
        if MODEL_FILES_UNREADABLE in str(last.get("message") or ""):
            return Cause(MODEL_UNREADABLE, unreadable_problem(pod, str(last["message"])))
    if mount_problem:
        return Cause(
            FAILED_MOUNT,
            f"{name}: a volume cannot be mounted: {mount_problem}; check spec.model.source (the PVC, its "
            "path, the node directory) and spec.weightSync.persistDir",
        )
    if pod_restarts(pod) > 0 and not pod_ready(pod):
        statuses = status.get("containerStatuses") or [{}]
        looping = ((statuses[0].get("state") or {}).get("waiting") or {}).get("reason") == CRASH_LOOP
        return Cause(CRASH_LOOP if looping else REPLICAS_UNHEALTHY, replica_problem(pod, probe))
    return None


def node_paths(pod: Mapping[str, Any], text: str) -> str:
    """``text`` with the container's paths of hostPath volumes written as the node's (where an
    administrator fixes them); a path on a PersistentVolumeClaim is named with its claim."""
    spec = pod.get("spec") or {}
    volumes = {v.get("name"): v for v in spec.get("volumes") or []}
    mounts = [m for c in spec.get("containers") or [] for m in c.get("volumeMounts") or []]
    claims: list[str] = []
    # the deepest mount first: /mnt/models/x must not be rewritten by a mount at /mnt
    for mount in sorted(mounts, key=lambda m: -len(str(m.get("mountPath") or ""))):
        where, volume = str(mount.get("mountPath") or "").rstrip("/"), volumes.get(mount.get("name")) or {}
        if not where or where not in text:
            continue
        if volume.get("hostPath"):
            node = str(volume["hostPath"].get("path") or "").rstrip("/") + (
                "/" + mount["subPath"] if mount.get("subPath") else ""
            )
            text = text.replace(where + "/", node + "/").replace(where + " ", node + " ")
        elif volume.get("persistentVolumeClaim"):
            claim = volume["persistentVolumeClaim"].get("claimName")
            claims.append(
                f"{where} is PersistentVolumeClaim {claim}"
                + (f" at {mount['subPath']}" if mount.get("subPath") else "")
            )
    return text + (f" ({'; '.join(claims)})" if claims else "")


def unreadable_problem(pod: Mapping[str, Any], message: str) -> str:
    """The server's whole "model files unreadable" line (file, mode, owner, uid, the fix), with the
    node's paths: the fix is made on the node or the volume, not inside the container."""
    name = (pod.get("metadata") or {}).get("name", "")
    line = next(
        (ln.strip() for ln in message.splitlines() if MODEL_FILES_UNREADABLE in ln),
        message.strip(),
    )
    line = line[line.index(MODEL_FILES_UNREADABLE) :] if MODEL_FILES_UNREADABLE in line else line
    return f"{name}: {node_paths(pod, line)}; {pod_restarts(pod)} restart(s)"


def mount_problem(events: Sequence[Mapping[str, Any]]) -> str | None:
    """The message of a Pod's FailedMount Events that names the cause. The kubelet alternates two:
    the volume's own error (the missing path) and a generic "Unable to attach or mount volumes ...
    timed out waiting for the condition"; the newest of the first kind wins."""

    def stamp(e: Mapping[str, Any]) -> str:
        return str(e.get("lastTimestamp") or e.get("eventTime") or "")

    specific = [e for e in events if "timed out waiting for the condition" not in str(e.get("message") or "")]
    chosen = max(specific or events, key=stamp, default=None)
    return " ".join(str(chosen.get("message") or "").split()) if chosen is not None else None


def _fetch_status(pod: Mapping[str, Any]) -> Mapping[str, Any]:
    for cs in (pod.get("status") or {}).get("initContainerStatuses") or []:
        if cs.get("name") == FETCH_CONTAINER:
            return cs
    return {}


def download_failure(pod: Mapping[str, Any]) -> Cause | None:
    """The model download of this Pod failed (its ``fetch-model`` init container exited non-zero),
    with the fetcher's reason (its termination message)."""
    cs = _fetch_status(pod)
    state = cs.get("state") or {}
    if (state.get("terminated") or {}).get("exitCode") == 0 or "running" in state:
        return None  # downloaded, or trying again right now
    last = state.get("terminated") or (cs.get("lastState") or {}).get("terminated") or {}
    code = last.get("exitCode")
    if code in (None, 0):
        return None
    name = (pod.get("metadata") or {}).get("name", "")
    source = _fetch_arg(pod, "--source")
    what = _last_lines(str(last.get("message") or ""), limit=600) or f"exit code {code}"
    then = (
        "fix spec.model.source, sourceSecret or sourceEndpoint (the download is retried with backoff)"
        if code == EXIT_PERMANENT
        else "the download is retried with backoff; check that the store is reachable from the node"
    )
    return Cause(
        MODEL_DOWNLOAD_FAILED,
        f"{name}: the model cannot be downloaded from {source}: {what}; {then} "
        f"({int(cs.get('restartCount', 0)) + 1} attempt(s) failed)",
    )


def _fetch_arg(pod: Mapping[str, Any], flag: str) -> str:
    for c in (pod.get("spec") or {}).get("initContainers") or []:
        args = list(c.get("args") or [])
        if c.get("name") == FETCH_CONTAINER and flag in args[:-1]:
            return str(args[args.index(flag) + 1])
    return "?"


def downloading(pod: Mapping[str, Any]) -> bool:
    """The Pod's model download runs now (its progress is in the fetcher's log)."""
    return "running" in (_fetch_status(pod).get("state") or {})


def waits_for_mount(pod: Mapping[str, Any]) -> bool:
    """The Pod's containers wait in ContainerCreating: a volume may not mount (the cause is only in
    the Pod's Events, which the operator then reads)."""
    statuses = (pod.get("status") or {}).get("containerStatuses") or []
    return any(
        ((cs.get("state") or {}).get("waiting") or {}).get("reason") == "ContainerCreating" for cs in statuses
    )


def replica_problem(pod: Mapping[str, Any], probe: ProbeResult | None) -> str:
    """What is wrong with one broken replica, from its container status and its server's answer.

    The cause comes first (a container's termination message is the end of its log when the Pod
    asks for ``FallbackToLogsOnError``: the server prints its fatal error last), then the restarts.
    """
    name = (pod.get("metadata") or {}).get("name", "")
    if probe is not None and probe.state == STATE_BROKEN:
        return (
            f"{name}: the server reports broken weights (a push failed midway); the next full push repairs it"
        )
    statuses = (pod.get("status") or {}).get("containerStatuses") or []
    restarts = pod_restarts(pod)
    for cs in statuses:
        terminated = (cs.get("lastState") or {}).get("terminated") or (cs.get("state") or {}).get(
            "terminated"
        )
        waiting = (cs.get("state") or {}).get("waiting") or {}
        if not terminated and not waiting.get("reason"):
            continue
        parts = [f"{name}: the server exited"]
        if terminated:
            parts[0] += f" with code {terminated.get('exitCode', '?')}"
            if terminated.get("message"):
                parts.append(_last_lines(str(terminated["message"])))
        if restarts:
            parts.append(f"{restarts} restart(s)")
        if waiting.get("reason") == "CrashLoopBackOff":
            parts.append("restarts back off exponentially (CrashLoopBackOff)")
        if not (terminated or {}).get("message"):
            parts.append(
                log_hint(pod, str(cs.get("name") or "reward-server"), str(cs.get("containerID") or ""))
            )
        return "; ".join(parts)
    if (pod.get("status") or {}).get("phase") == "Failed":
        return f"{name}: the Pod failed ({(pod.get('status') or {}).get('reason') or 'no reason given'})"
    return f"{name}: restarted {restarts} time(s) and is not ready"


LOCAL_NODE_CONTAINER_PREFIX = "rewardplane-node://"
"""containerID prefix of Pods run by the local node agent (processes, no kubelet API)."""


def log_hint(pod: Mapping[str, Any], container: str, container_id: str) -> str:
    """Where the server's log is: ``kubectl logs`` on a kubelet; on the local node agent, which
    has no kubelet API, the file it writes."""
    meta = pod.get("metadata") or {}
    ns, name, uid = meta.get("namespace", "default"), meta.get("name", ""), str(meta.get("uid", ""))
    if container_id.startswith(LOCAL_NODE_CONTAINER_PREFIX):
        return (
            f"its log: <node agent state dir>/pods/{ns}_{name}_{uid[:8]}/{container}.log "
            "(`rewardplane dev up`: ~/.cache/rewardplane/dev/node/pods/...)"
        )
    return f"its log: kubectl logs -n {ns} {name} --previous"


def restore_failed_message(pod: str, target: int, detail: str, persist_dir: str | None) -> str:
    """The RestoreFailed Event: what failed and the way out that applies to this model."""
    way_out = (
        "the operator tries a healthy peer next; a full push also repairs it"
        if persist_dir
        else "set spec.weightSync.persistDir to restore from disk, or push the full weights again"
    )
    return f"{pod} could not be restored to weights version {target}: {detail}; it stays out of the endpoints ({way_out})"


# Multus (secondary networks, e.g. for RDMA) lists a Pod's interfaces and addresses here.
NETWORK_STATUS_ANNOTATION = "k8s.v1.cni.cncf.io/network-status"


def nccl_address(pod: Mapping[str, Any], interface: str | None) -> str:
    """The address NCCL of this replica uses: ``interface``'s, where the Pod's network status
    (Multus) lists it, else the Pod's IP (the host's, with hostNetwork)."""
    meta, status = pod.get("metadata") or {}, pod.get("status") or {}
    pod_ip = str(status.get("podIP") or "")
    raw = (meta.get("annotations") or {}).get(NETWORK_STATUS_ANNOTATION)
    if not interface or not raw:
        return pod_ip
    try:
        networks = json.loads(raw)
    except ValueError:
        return pod_ip  # written by the CNI: a malformed one is not this replica's fault
    for net in networks if isinstance(networks, list) else []:
        if isinstance(net, Mapping) and net.get("interface") == interface and net.get("ips"):
            return str(net["ips"][0])
    return pod_ip


def _endpoint(
    pod: Mapping[str, Any],
    http_port: int,
    probe: ProbeResult | None,
    world_size: int,
    interface: str | None = None,
) -> dict[str, Any]:
    meta, status = pod.get("metadata") or {}, pod.get("status") or {}
    annotations = meta.get("annotations") or {}
    ip = status.get("podIP")
    ep: dict[str, Any] = {
        "replica": replica_index(pod) or 0,
        "pod": meta.get("name", ""),
        "node": (pod.get("spec") or {}).get("nodeName", ""),
        "url": f"http://{ip}:{http_port}" if ip else "",
        "ncclAddress": nccl_address(pod, interface),
        "groupPort": int(annotations.get(ANNOTATION_GROUP_PORT, 0)),
        "rankOffset": int(annotations.get(ANNOTATION_RANK_OFFSET, 0)),
        "worldSize": world_size,
        "state": (probe.state or "") if probe else "",
        "ready": False,
        "restarts": pod_restarts(pod),
        "podUid": meta.get("uid", ""),
    }
    if probe is not None and probe.version is not None:
        ep["weightsVersion"] = probe.version
    if probe is not None and probe.state == STATE_SLEEPING and probe.sleep_level is not None:
        ep["sleepLevel"] = probe.sleep_level
    return ep


def sleeping_message(asleep: Sequence[str], endpoints: Sequence[Mapping[str, Any]]) -> str:
    """The Available=False message of a model whose ready replicas all sleep."""
    levels = sorted({int(ep["sleepLevel"]) for ep in endpoints if ep["pod"] in asleep and "sleepLevel" in ep})
    level = f" (sleep level {', '.join(map(str, levels))})" if levels else ""
    return (
        f"every ready replica is asleep{level}: {', '.join(asleep)}; wake them to score "
        "(SDK: `async with handle.awake():`, or POST /wake)"
    )


def _without_empty_strings(obj: dict[str, Any]) -> dict[str, Any]:
    # The Debian-built 1.20 API server decodes "" in custom resources as null and then refuses it
    # as "must be of type string"; an absent field means the same to readers.
    return {k: v for k, v in obj.items() if v != ""}


def _healthy(pod: Mapping[str, Any], probe: ProbeResult | None) -> bool:
    return pod_ready(pod) and probe is not None and probe.error is None and probe.state != STATE_BROKEN


def _condition(
    previous: Sequence[Mapping[str, Any]],
    ctype: str,
    ok: bool,
    reason: str,
    message: str,
    generation: int,
    now: str,
) -> dict[str, Any]:
    status = "True" if ok else "False"
    before = next((c for c in previous if c.get("type") == ctype), None)
    # lastTransitionTime moves only when the status flips, as Kubernetes conventions require.
    since = before.get("lastTransitionTime") if before and before.get("status") == status else None
    return _without_empty_strings(
        {
            "type": ctype,
            "status": status,
            "reason": reason,
            "message": message,
            "observedGeneration": generation,
            "lastTransitionTime": since or now,
        }
    )


def compute_status(
    rm: Mapping[str, Any],
    plan: Plan | None,
    pods: Sequence[Mapping[str, Any]],
    probes: Mapping[str, ProbeResult],
    now: str,
    errors: Sequence[str] = (),
    error_reason: str = "InvalidSpec",
    desired_hashes: Mapping[str, str] | None = None,
    target_version: int | None = None,
    known_version: int | None = None,
    stale_pods: Collection[str] = (),
    mount_problems: Mapping[str, str] | None = None,
    lost_pods: Collection[str] = (),
    downloads: Mapping[str, str] | None = None,
) -> dict[str, Any]:
    """The full status of a RewardModel.

    ``plan`` is None when the spec was refused (``errors``/``error_reason`` say why); existing Pods
    are still reported, since the operator leaves them running. ``desired_hashes`` maps Pod name →
    spec hash of its desired rendering (an outdated Pod counts as rolling out). ``target_version``
    is the weights version replicas must serve; by default the newest one a healthy replica reports,
    and never below ``known_version`` (the newest version a WeightSync completed): a replica that
    restarted onto base weights must not pull the model's version down. ``stale_pods`` restarted onto
    older weights and wait for a restore: state ``stale``, never ready. ``downloads`` maps a Pod
    whose model is being downloaded to the download's progress, in words.
    """
    meta = rm.get("metadata") or {}
    previous = rm.get("status") or {}
    generation = int(meta.get("generation") or 0)
    prev_conditions = previous.get("conditions") or []
    live = sorted(
        (p for p in pods if not (p.get("metadata") or {}).get("deletionTimestamp")),
        key=lambda p: (replica_index(p) is None, replica_index(p) or 0),
    )
    desired = len(plan.replicas) if plan else int((rm.get("spec") or {}).get("replicas", 1) or 0)
    http_port = plan.ports.http if plan else 0
    world_size = plan.spec.tensor_parallel_size if plan else 1
    interface = plan.spec.transport.interface if plan else None

    healthy_names = {p["metadata"]["name"] for p in live if _healthy(p, probes.get(p["metadata"]["name"]))}
    reported = [v for n in healthy_names if (v := probes[n].version) is not None]
    if target_version is None:
        target_version = max(reported) if reported else int(previous.get("weightsVersion") or 0)
        if known_version is not None:
            target_version = max(target_version, known_version)

    endpoints = []
    for pod in live:
        name = pod["metadata"]["name"]
        ep = _endpoint(pod, http_port, probes.get(name), world_size, interface)
        ep["ready"] = name in healthy_names and ep.get("weightsVersion") == target_version and bool(ep["url"])
        if name in stale_pods:
            ep["state"], ep["ready"] = STATE_STALE, False
        endpoints.append(_without_empty_strings(ep))
    ready = sum(1 for ep in endpoints if ep["ready"])
    # Asleep (POST /sleep) is healthy and stays ready: the SDK must reach a sleeping replica to wake it.
    asleep = sorted(ep["pod"] for ep in endpoints if ep["ready"] and ep.get("state") == STATE_SLEEPING)

    # What still has to change before the rollout is complete.
    wanted = {pod_name(plan.name, r.index) for r in plan.replicas} if plan else set()
    have = {p["metadata"]["name"] for p in live}
    missing = sorted(wanted - have)
    extra = sorted(have - wanted) if plan else []
    desired_hashes = desired_hashes or {}
    outdated = sorted(
        name
        for p in live
        if (name := p["metadata"]["name"]) in desired_hashes
        and (p["metadata"].get("annotations") or {}).get(ANNOTATION_SPEC_HASH) != desired_hashes[name]
    )
    not_ready = sorted(have - healthy_names)
    stale = sorted(ep["pod"] for ep in endpoints if ep["pod"] in healthy_names and not ep["ready"])
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
    for name in lost_pods:
        if name in have:
            causes[name] = Cause(
                WEIGHTS_LOST,
                f"{name} lost weights version {target_version}: it restarted on its base weights and "
                "neither a saved copy nor a healthy replica on that version can restore it; push "
                f"version {target_version} again (a full push)"
                + (
                    f" (its saved copy under spec.weightSync.persistDir on node "
                    f"{(next((p for p in live if p['metadata']['name'] == name), {}).get('spec') or {}).get('nodeName', '?')}"
                    " does not hold that version: the node's directory was emptied, or the replica moved there)"
                    if persisted
                    else ", or set spec.weightSync.persistDir to keep pushed weights across Pod replacements"
                ),
            )
    broken = sorted(causes)

    def conds(
        available: tuple[bool, str, str],
        progressing: tuple[bool, str, str],
        in_sync: tuple[bool, str, str],
        degraded: tuple[bool, str, str],
    ) -> list[dict[str, Any]]:
        return [
            _condition(prev_conditions, t, *v, generation, now)
            for t, v in zip(CONDITION_TYPES, (available, progressing, in_sync, degraded), strict=True)
        ]

    if not desired:
        available = (False, "ScaledToZero", "spec.replicas is 0")
    elif ready and len(asleep) == ready:
        available = (False, "Sleeping", sleeping_message(asleep, endpoints))
    elif ready:
        available = (
            True,
            "ReplicasReady",
            f"{ready}/{desired} replicas ready" + (f"; {', '.join(asleep)} asleep" if asleep else ""),
        )
    else:
        available = (False, "NoReplicaReady", f"0/{desired} replicas ready")
    # Every name in "behind" restarted onto, or lags behind, the model's weights version.
    behind = sorted({*stale, *(n for n in stale_pods if n in have)})
    if behind:
        in_sync = (
            False,
            "StaleReplicas",
            f"{', '.join(behind)} do not serve weights version {target_version}",
        )
    elif ready:
        in_sync = (True, "AllReplicasCurrent", f"every ready replica serves weights version {target_version}")
    else:
        # Nothing serves, so nothing can be said to serve the current weights.
        in_sync = (False, "NoReplicas", "no replica is serving yet")
    restoring = [n for n in behind if n not in lost_pods]  # the lost ones wait for a push
    if errors:
        message = "; ".join(errors)
        retry = {
            PLACEMENT_REFUSED: "the cluster is checked again periodically; free the capacity or change the spec",
            NO_IMAGE: "set spec.engine.image, or the operator's default reward-server image",
        }.get(error_reason, "fix the spec")
        conditions = conds(
            available,
            (
                False,
                error_reason,
                f"no change is rolled out until this is resolved ({retry}); running replicas are left as they are",
            ),
            in_sync,
            (True, error_reason, message),
        )
        # A spec the cluster refuses has Failed; one that is fine but names no image (and the
        # operator has none to give) is Degraded: the operator's configuration is what is missing.
        phase = PHASE_DEGRADED if error_reason == NO_IMAGE else PHASE_FAILED
    else:
        pending_work = [
            *(f"creating {n}" for n in missing),
            *(f"replacing {n}" for n in outdated),
            *(f"removing {n}" for n in extra),
            *(
                f"waiting for {n} to become ready"
                + (f" ({download})" if (download := (downloads or {}).get(n)) else "")
                for n in not_ready
                if n not in broken
            ),
        ]
        if pending_work:
            progressing = (True, "RollingOut", "; ".join(pending_work))
        elif restoring:
            # Pods are all there but some still have to reach the model's weights version.
            progressing = (
                True,
                "RestoringWeights",
                f"bringing {', '.join(restoring)} to weights version {target_version}",
            )
        elif broken:
            # every Pod is as the spec wants, yet not every replica serves: nothing is rolling out
            progressing = (
                False,
                "ReplicasBroken",
                f"{ready}/{desired} replica(s) serve; {', '.join(broken)} cannot start or serve (see Degraded)",
            )
        else:
            progressing = (False, "RolloutComplete", f"{desired} replica(s) up to date")
        reasons = {c.reason for c in causes.values()}
        degraded = (
            (
                True,
                reasons.pop() if len(reasons) == 1 else REPLICAS_UNHEALTHY,
                "; ".join(causes[n].message for n in broken),
            )
            if broken
            else (False, "AsExpected", "no replica is broken")
        )
        conditions = conds(available, progressing, in_sync, degraded)
        message = degraded[2] if broken else progressing[2] if progressing[0] else available[2]
        if broken:
            phase = PHASE_DEGRADED
        elif not progressing[0] and ready == desired and asleep and len(asleep) == ready:
            phase, message = PHASE_SLEEPING, available[2]
        elif not progressing[0] and ready == desired:
            phase = PHASE_READY
        elif ready == 0:
            phase = PHASE_PENDING
        else:
            phase = PHASE_PROGRESSING

    shown = next(
        c
        for c in conditions
        if c["type"] == (DEGRADED if phase in (PHASE_DEGRADED, PHASE_FAILED) else "Progressing")
    )
    out = _without_empty_strings(
        {
            "phase": phase,
            # the REASON column: why the phase is what it is (the Degraded reason when degraded)
            "reason": shown.get("reason", "") if phase != PHASE_READY else "",
            "ready": f"{ready}/{desired}",
            "observedGeneration": generation,
            "readyReplicas": ready,
            # the scale subresource's statusReplicasPath and labelSelectorPath (kubectl scale, HPA)
            "replicas": len(live),
            "selector": server_selector(str(meta.get("name") or "")),
            "weightsVersion": target_version,
            "message": message,
            "conditions": conditions,
            "endpoints": endpoints,
        }
    )
    spec = plan.spec if plan else None
    if spec is not None and spec.gpu.mode is not GpuMode.NONE:
        # Only a model on GPUs has a memory fraction; on CPU the GPU-Frac column stays empty.
        out["gpuMemoryFraction"] = spec.gpu.memory_fraction
    return out


def transition_events(previous: Mapping[str, Any], current: Mapping[str, Any]) -> list[Event]:
    """Events worth posting for a status change (nothing when phase and Degraded message hold)."""
    events: list[Event] = []
    before_phase = previous.get("phase")
    after_phase = current.get("phase")

    def degraded(status: Mapping[str, Any]) -> Mapping[str, Any]:
        return next((c for c in status.get("conditions") or [] if c.get("type") == DEGRADED), {})

    after_degraded = degraded(current)
    degraded_changed = after_degraded.get("status") == "True" and (
        after_degraded.get("message") != degraded(previous).get("message")
    )
    if after_phase in (PHASE_DEGRADED, PHASE_FAILED) and (before_phase != after_phase or degraded_changed):
        reason = str(after_degraded.get("reason") or after_phase)
        events.append(
            Event("Warning", reason, str(after_degraded.get("message") or f"RewardModel is {after_phase}"))
        )
    elif before_phase != after_phase:
        events.append(
            Event("Normal", str(after_phase), str(current.get("message") or f"RewardModel is {after_phase}"))
        )
    return events
