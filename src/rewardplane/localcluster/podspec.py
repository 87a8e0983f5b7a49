"""Pure logic of the node agent: from a Pod (the API's JSON, camelCase dicts) to a local process.

Nothing here does I/O, so it is unit-testable without a cluster:
- ``expand_vars``: Kubernetes ``$(VAR)`` expansion (``$$`` escapes, unknown names stay as is).
- ``resolve_env``: a container's ``env`` / ``envFrom`` with ``fieldRef``, ``secretKeyRef``,
  ``configMapKeyRef``.
- ``rewrite_mount_paths``: a volumeMount's ``mountPath`` prefix → the local directory that holds
  the volume's files (there are no mount namespaces: the process sees the host filesystem).
- ``plan_process``: argv, env and working directory for the first container.
- ``IPAllocator``: one loopback address 127.N.0.x per live pod (x from 2 up; N is the agent's
  pod network, 0 by default).
- ``ContainerRuntime`` + ``build_pod_status``: what the agent knows → the Pod's ``status``.
"""

from __future__ import annotations

import base64
import re
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path, PurePosixPath
from typing import Any

Pod = dict[str, Any]
# (namespace, name) -> {key: bytes}; what the agent read from the API before planning.
Objects = Mapping[tuple[str, str], Mapping[str, bytes]]

PYTHON_NAMES = re.compile(r"^python(3(\.\d+)?)?$")
HOST_IP = "127.0.0.1"


class PodConfigError(ValueError):
    """The pod cannot be run as asked (the kubelet's CreateContainerConfigError)."""


# -- $(VAR) expansion ----------------------------------------------------------------------------
def expand_vars(text: str, env: Mapping[str, str]) -> str:
    """Kubernetes' ``$(VAR)`` expansion (k8s.io/kubernetes third_party/forked/golang/expansion).

    ``$(NAME)`` becomes ``env[NAME]`` when defined and stays verbatim otherwise; ``$$`` is a
    literal ``$`` (so ``$$(NAME)`` gives ``$(NAME)``); any other ``$`` is kept.
    """
    out: list[str] = []
    i, n = 0, len(text)
    while i < n:
        ch = text[i]
        if ch != "$" or i + 1 >= n:
            out.append(ch)
            i += 1
            continue
        nxt = text[i + 1]
        if nxt == "$":
            out.append("$")
            i += 2
        elif nxt == "(":
            close = text.find(")", i + 2)
            if close == -1:  # unterminated: keep the rest as written
                out.append(text[i:])
                break
            name = text[i + 2 : close]
            out.append(env[name] if name in env else text[i : close + 1])
            i = close + 1
        else:
            out.append(ch)
            i += 1
    return "".join(out)


# -- env -----------------------------------------------------------------------------------------
def field_ref_value(pod: Pod, field_path: str, pod_ip: str) -> str:
    meta = pod.get("metadata", {})
    spec = pod.get("spec", {})
    simple = {
        "metadata.name": meta.get("name", ""),
        "metadata.namespace": meta.get("namespace", "default"),
        "metadata.uid": meta.get("uid", ""),
        "spec.nodeName": spec.get("nodeName", ""),
        "spec.serviceAccountName": spec.get("serviceAccountName", "default"),
        "status.podIP": pod_ip,
        "status.podIPs": pod_ip,
        "status.hostIP": HOST_IP,
    }
    if field_path in simple:
        return str(simple[field_path])
    m = re.fullmatch(r"metadata\.(labels|annotations)\['(.+)'\]", field_path)
    if m:
        return str((meta.get(m.group(1)) or {}).get(m.group(2), ""))
    raise PodConfigError(
        f"unsupported fieldRef.fieldPath {field_path!r}; the node agent supports "
        f"{sorted(simple)} and metadata.labels/annotations['key']"
    )


def _key_ref(kind: str, ref: Mapping[str, Any], namespace: str, objects: Objects) -> str | None:
    obj = objects.get((namespace, ref.get("name", "")))
    optional = bool(ref.get("optional"))
    if obj is None:
        if optional:
            return None
        raise PodConfigError(f'{kind} "{ref.get("name")}" not found in namespace {namespace}')
    if ref.get("key") not in obj:
        if optional:
            return None
        raise PodConfigError(f'{kind} "{ref.get("name")}" has no key "{ref.get("key")}"')
    return obj[ref["key"]].decode("utf-8", errors="replace")


def resolve_env(
    container: Mapping[str, Any], pod: Pod, *, pod_ip: str, secrets: Objects, configmaps: Objects
) -> dict[str, str]:
    """The container's env as the kubelet builds it: ``envFrom`` first, then ``env`` in order,
    each ``value`` expanded with the variables defined before it."""
    namespace = pod.get("metadata", {}).get("namespace", "default")
    env: dict[str, str] = {}
    for src in container.get("envFrom") or []:
        prefix = src.get("prefix", "")
        for kind, key, objects in (
            ("secret", "secretRef", secrets),
            ("configmap", "configMapRef", configmaps),
        ):
            ref = src.get(key)
            if ref is None:
                continue
            obj = objects.get((namespace, ref.get("name", "")))
            if obj is None:
                if ref.get("optional"):
                    continue
                raise PodConfigError(f'{kind} "{ref.get("name")}" not found in namespace {namespace}')
            for k, v in obj.items():
                env[prefix + k] = v.decode("utf-8", errors="replace")
    for var in container.get("env") or []:
        name = var["name"]
        if "valueFrom" not in var:
            env[name] = expand_vars(var.get("value", ""), env)
            continue
        vf = var["valueFrom"]
        value: str | None
        if "fieldRef" in vf:
            value = field_ref_value(pod, vf["fieldRef"]["fieldPath"], pod_ip)
        elif "secretKeyRef" in vf:
            value = _key_ref("secret", vf["secretKeyRef"], namespace, secrets)
        elif "configMapKeyRef" in vf:
            value = _key_ref("configmap", vf["configMapKeyRef"], namespace, configmaps)
        else:
            raise PodConfigError(
                f"env {name}: unsupported valueFrom {sorted(vf)}; the node agent "
                "supports fieldRef, secretKeyRef and configMapKeyRef"
            )
        if value is not None:
            env[name] = value
    return env


# -- volumes -------------------------------------------------------------------------------------
@dataclass(frozen=True)
class VolumePlan:
    """Where a pod volume's files live on this machine and what to write there."""

    name: str
    directory: Path
    files: dict[str, bytes] = field(default_factory=dict)  # relative path -> content
    mode: int = 0o644


def plan_volumes(
    pod: Pod,
    *,
    pod_dir: Path,
    shared_dir: Path,
    secrets: Objects,
    configmaps: Objects,
    volumes_dir: Path | None = None,
) -> dict[str, VolumePlan]:
    """Local directories for the pod's volumes.

    secret / configMap → a per-pod directory holding the keys as files; emptyDir → an empty
    per-pod directory; hostPath → that path; persistentVolumeClaim → a directory per claim under
    ``shared_dir`` that outlives pods (as a PV would). The per-pod ones live in ``volumes_dir``
    (default ``pod_dir/volumes``; the node agent passes a short link to it: Unix socket paths).
    """
    namespace = pod.get("metadata", {}).get("namespace", "default")
    plans: dict[str, VolumePlan] = {}
    per_pod = volumes_dir if volumes_dir is not None else pod_dir / "volumes"
    for vol in pod.get("spec", {}).get("volumes") or []:
        name = vol["name"]
        local = per_pod / name
        if "secret" in vol or "configMap" in vol:
            is_secret = "secret" in vol
            src = vol["secret"] if is_secret else vol["configMap"]
            ref_name = src.get("secretName") if is_secret else src.get("name")
            obj = (secrets if is_secret else configmaps).get((namespace, ref_name or ""))
            kind = "secret" if is_secret else "configmap"
            if obj is None:
                if src.get("optional"):
                    plans[name] = VolumePlan(name, local)
                    continue
                raise PodConfigError(f'volume {name}: {kind} "{ref_name}" not found in namespace {namespace}')
            items = src.get("items")
            files: dict[str, bytes] = {}
            if items:
                for item in items:
                    if item["key"] not in obj:
                        if src.get("optional"):
                            continue
                        raise PodConfigError(f'volume {name}: {kind} "{ref_name}" has no key "{item["key"]}"')
                    files[_safe_relpath(item["path"], name)] = obj[item["key"]]
            else:
                files = {_safe_relpath(k, name): v for k, v in obj.items()}
            plans[name] = VolumePlan(name, local, files, int(src.get("defaultMode", 0o644)))
        elif "emptyDir" in vol:
            plans[name] = VolumePlan(name, local)
        elif "hostPath" in vol:
            plans[name] = VolumePlan(name, Path(vol["hostPath"]["path"]))
        elif "persistentVolumeClaim" in vol:
            claim = vol["persistentVolumeClaim"]["claimName"]
            plans[name] = VolumePlan(name, shared_dir / "pvc" / namespace / claim)
        else:
            kinds = sorted(k for k in vol if k != "name")
            raise PodConfigError(
                f"volume {name}: unsupported type {kinds}; the node agent supports "
                "secret, configMap, emptyDir, hostPath and persistentVolumeClaim"
            )
    return plans


def _safe_relpath(path: str, volume: str) -> str:
    p = PurePosixPath(path)
    if p.is_absolute() or ".." in p.parts:
        raise PodConfigError(f"volume {volume}: key path {path!r} must be relative without '..'")
    return str(p)


def mount_map(container: Mapping[str, Any], volumes: Mapping[str, VolumePlan]) -> dict[str, str]:
    """mountPath → local path for each of the container's volumeMounts (subPath honoured)."""
    mapping: dict[str, str] = {}
    for vm in container.get("volumeMounts") or []:
        plan = volumes.get(vm["name"])
        if plan is None:
            raise PodConfigError(f"volumeMount {vm['mountPath']}: no volume named {vm['name']!r}")
        local = plan.directory / vm["subPath"] if vm.get("subPath") else plan.directory
        mapping[vm["mountPath"].rstrip("/") or "/"] = str(local)
    return mapping


def rewrite_mount_paths(text: str, mounts: Mapping[str, str]) -> str:
    """Replace each mountPath prefix in ``text`` by its local directory.

    A mountPath matches only as a whole path prefix: ``/etc/creds`` rewrites ``/etc/creds`` and
    ``/etc/creds/token`` (also inside ``--flag=/etc/creds/token``) but not ``/etc/credsx``.
    Longer mountPaths win, so nested mounts resolve to the innermost volume.
    """
    if not mounts:
        return text
    ordered = sorted(mounts, key=len, reverse=True)
    pattern = re.compile(r"(?<![\w./-])(" + "|".join(re.escape(m) for m in ordered) + r")(?=/|$|[^\w.-])")
    return pattern.sub(lambda m: mounts[m.group(1)], text)


# -- the process ---------------------------------------------------------------------------------
@dataclass(frozen=True)
class ProcessPlan:
    argv: list[str]
    env: dict[str, str]  # the pod's own variables (the agent adds them to its environment)
    cwd: str | None
    mounts: dict[str, str] = field(default_factory=dict)  # mountPath -> local path


def plan_process(
    pod: Pod,
    *,
    pod_ip: str,
    secrets: Objects,
    configmaps: Objects,
    volumes: Mapping[str, VolumePlan],
    python: str = sys.executable,
) -> ProcessPlan:
    """argv/env/cwd for the pod's first container.

    ``python``/``python3``/``python3.N`` as command[0] become ``python`` (the agent's own
    interpreter, so the process sees the same installed packages).
    """
    containers = pod.get("spec", {}).get("containers") or []
    if not containers:
        raise PodConfigError("pod has no containers")
    container = containers[0]
    command = list(container.get("command") or [])
    args = list(container.get("args") or [])
    if not command:
        raise PodConfigError(
            f"container {container.get('name')!r} has no command: the node agent runs "
            "command+args as a local process and cannot run an image's entrypoint; set `command`"
        )
    env = resolve_env(container, pod, pod_ip=pod_ip, secrets=secrets, configmaps=configmaps)
    mounts = mount_map(container, volumes)
    argv = map_argv(command + args, env, mounts, python=python)
    env = {k: rewrite_mount_paths(v, mounts) for k, v in env.items()}
    cwd = container.get("workingDir")
    if cwd:
        cwd = rewrite_mount_paths(cwd, mounts)
    return ProcessPlan(argv=argv, env=env, cwd=cwd, mounts=mounts)


def map_argv(
    argv: list[str], env: Mapping[str, str], mounts: Mapping[str, str], *, python: str = sys.executable
) -> list[str]:
    """``$(VAR)`` expansion, then mountPath rewriting, then the python interpreter swap (also
    used for exec probes, which see the container's filesystem the same way)."""
    out = [rewrite_mount_paths(expand_vars(a, env), mounts) for a in argv]
    if out and PYTHON_NAMES.match(out[0]):
        out[0] = python
    return out


def decode_secret_data(data: Mapping[str, str] | None) -> dict[str, bytes]:
    return {k: base64.b64decode(v) for k, v in (data or {}).items()}


def encode_configmap_data(
    data: Mapping[str, str] | None, binary: Mapping[str, str] | None = None
) -> dict[str, bytes]:
    out = {k: v.encode() for k, v in (data or {}).items()}
    out.update({k: base64.b64decode(v) for k, v in (binary or {}).items()})
    return out


def gpu_request(pod: Pod) -> int:
    """``nvidia.com/gpu`` the first container asks for (limits win over requests, as for
    extended resources they must be equal anyway)."""
    containers = pod.get("spec", {}).get("containers") or [{}]
    res = containers[0].get("resources") or {}
    raw = (res.get("limits") or {}).get("nvidia.com/gpu") or (res.get("requests") or {}).get("nvidia.com/gpu")
    return int(raw or 0)


# -- loopback IPs --------------------------------------------------------------------------------
class IPAllocator:
    """Unique loopback addresses for live pods: 127.N.0.2, 127.N.0.3, ... (all of 127/8 reaches
    ``lo`` on Linux, so each pod can bind its own ports without clashing). ``network`` is N: node
    agents on one host need different ones, or their pods take each other's addresses."""

    def __init__(self, first: int = 2, last: int = 65534, *, network: int = 0) -> None:
        if not 0 <= network <= 255:
            raise ValueError(f"pod network {network} is not an octet (0-255): pods get 127.<network>.x.y")
        self._first, self._last, self._network = first, last, network
        self._by_owner: dict[str, str] = {}

    def _addr(self, i: int) -> str:
        return f"127.{self._network}.{i // 256}.{i % 256}"

    def _index(self, ip: str) -> int | None:
        parts = ip.split(".")
        if len(parts) != 4 or parts[0] != "127" or parts[1] != str(self._network):
            return None
        try:
            i = int(parts[2]) * 256 + int(parts[3])
        except ValueError:
            return None
        return i if self._first <= i <= self._last and i % 256 not in (0, 255) else None

    def allocate(self, owner: str, preferred: str | None = None) -> str:
        """The owner's address (stable while it holds one); ``preferred`` (e.g. the podIP the
        pod had before an agent restart) is used when it is free."""
        if owner in self._by_owner:
            return self._by_owner[owner]
        used = set(self._by_owner.values())
        if preferred and preferred not in used and self._index(preferred) is not None:
            self._by_owner[owner] = preferred
            return preferred
        for i in range(self._first, self._last + 1):
            if i % 256 in (0, 255):
                continue
            ip = self._addr(i)
            if ip not in used:
                self._by_owner[owner] = ip
                return ip
        raise RuntimeError("no free loopback address left for another pod")

    def release(self, owner: str) -> None:
        self._by_owner.pop(owner, None)

    def in_use(self) -> dict[str, str]:
        return dict(self._by_owner)


# -- status --------------------------------------------------------------------------------------
def rfc3339(ts: float) -> str:
    return datetime.fromtimestamp(ts, tz=timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


@dataclass
class ContainerRuntime:
    """What the agent knows about the pod's (first) container; ``build_pod_status`` turns it into
    the Pod's status. Times are UNIX seconds."""

    name: str
    image: str = ""
    pod_ip: str | None = None
    pod_start: float | None = None
    pid: int | None = None
    running_since: float | None = None
    started: bool = False  # the startup probe passed (or there is none)
    ready: bool = False
    restart_count: int = 0
    waiting_reason: str | None = "ContainerCreating"
    waiting_message: str | None = None
    # the last termination: (exitCode, reason, startedAt, finishedAt)
    last_exit: tuple[int, str, float, float] | None = None
    last_exit_message: str | None = None  # the termination message (the failed log's tail)
    terminal_phase: str | None = None  # Succeeded / Failed once the pod will not run again
    # lastTransitionTime per condition type, so a condition's time changes only when it flips
    transitions: dict[str, tuple[bool, float]] = field(default_factory=dict)

    def mark(self, cond: str, value: bool, now: float) -> float:
        prev = self.transitions.get(cond)
        if prev is None or prev[0] != value:
            self.transitions[cond] = (value, now)
            return now
        return prev[1]


def _terminated(rt: ContainerRuntime) -> dict[str, Any]:
    assert rt.last_exit is not None
    exit_code, reason, started, finished = rt.last_exit
    terminated: dict[str, Any] = {
        "exitCode": exit_code,
        "reason": reason,
        "startedAt": rfc3339(started),
        "finishedAt": rfc3339(finished),
    }
    if rt.last_exit_message:
        terminated["message"] = rt.last_exit_message
    return {"terminated": terminated}


def build_pod_status(rt: ContainerRuntime, now: float) -> dict[str, Any]:
    """The pod's ``status`` (for a strategic-merge patch of the status subresource)."""
    if rt.terminal_phase:
        phase = rt.terminal_phase
    elif rt.running_since is not None or rt.restart_count > 0 or rt.last_exit is not None:
        phase = "Running"
    else:
        phase = "Pending"

    if rt.running_since is not None:
        state: dict[str, Any] = {"running": {"startedAt": rfc3339(rt.running_since)}}
    elif rt.terminal_phase and rt.last_exit:
        state = _terminated(rt)
    else:
        state = {"waiting": {"reason": rt.waiting_reason or "ContainerCreating"}}
        if rt.waiting_message:
            state["waiting"]["message"] = rt.waiting_message
    ready = bool(rt.ready and rt.running_since is not None)
    cs: dict[str, Any] = {
        "name": rt.name,
        "image": rt.image,
        "imageID": "",
        "ready": ready,
        "started": rt.running_since is not None and rt.started,
        "restartCount": rt.restart_count,
        "state": state,
        "lastState": _terminated(rt) if rt.last_exit and not rt.terminal_phase else {},
    }
    if rt.pid is not None:
        cs["containerID"] = f"rewardplane-node://{rt.pid}"

    def cond(ctype: str, value: bool, reason: str | None = None) -> dict[str, Any]:
        c: dict[str, Any] = {
            "type": ctype,
            "status": "True" if value else "False",
            "lastProbeTime": None,
            "lastTransitionTime": rfc3339(rt.mark(ctype, value, now)),
        }
        if not value and reason:
            c["reason"] = reason
            c["message"] = f"containers with unready status: [{rt.name}]"
        return c

    not_ready = "PodCompleted" if rt.terminal_phase else "ContainersNotReady"
    status: dict[str, Any] = {
        "phase": phase,
        "hostIP": HOST_IP,
        "conditions": [
            cond("PodScheduled", True),
            cond("Initialized", True),
            cond("ContainersReady", ready, not_ready),
            cond("Ready", ready, not_ready),
        ],
        "containerStatuses": [cs],
    }
    if rt.pod_ip:
        status["podIP"] = rt.pod_ip
        status["podIPs"] = [{"ip": rt.pod_ip}]
    if rt.pod_start is not None:
        status["startTime"] = rfc3339(rt.pod_start)
    return status


def referenced_objects(pod: Pod) -> tuple[set[str], set[str]]:
    """Names of the Secrets and ConfigMaps a pod's first container and volumes refer to."""
    secrets: set[str] = set()
    cms: set[str] = set()
    spec = pod.get("spec", {})
    for c in (spec.get("containers") or [])[:1]:
        for src in c.get("envFrom") or []:
            if src.get("secretRef"):
                secrets.add(src["secretRef"]["name"])
            if src.get("configMapRef"):
                cms.add(src["configMapRef"]["name"])
        for var in c.get("env") or []:
            vf = var.get("valueFrom") or {}
            if vf.get("secretKeyRef"):
                secrets.add(vf["secretKeyRef"]["name"])
            if vf.get("configMapKeyRef"):
                cms.add(vf["configMapKeyRef"]["name"])
    for vol in spec.get("volumes") or []:
        if vol.get("secret"):
            secrets.add(vol["secret"].get("secretName", ""))
        if vol.get("configMap"):
            cms.add(vol["configMap"].get("name", ""))
    return secrets - {""}, cms - {""}
