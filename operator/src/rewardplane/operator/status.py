"""Pure status computation: Pods + server probes → RewardModel status, conditions and events.

The handlers gather the facts (Pods of the model, each ready server's ``/health`` and
``/runtime_version``) and write what ``conditions.compute_status`` returns, from the causes,
endpoints and messages here; ``transition_events`` says which
Kubernetes Events the change deserves, so an unchanged status posts nothing.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from rewardplane.api.names import (
    ANNOTATION_GROUP_PORT,
    ANNOTATION_RANK_OFFSET,
)
from rewardplane.api.status import (
    DEGRADED,
    PHASE_DEGRADED,
    PHASE_FAILED,
    STATE_BROKEN,
    STATE_SLEEPING,
)
from rewardplane.protocol.errors import MODEL_FILES_UNREADABLE
from rewardplane.protocol.model_sources import EXIT_PERMANENT, FETCH_CONTAINER

from .pods import (
    fetch_status,
    pod_ready,
    pod_restarts,
    replica_index,
)


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


def download_failure(pod: Mapping[str, Any]) -> Cause | None:
    """The model download of this Pod failed (its ``fetch-model`` init container exited non-zero),
    with the fetcher's reason (its termination message)."""
    cs = fetch_status(pod)
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
