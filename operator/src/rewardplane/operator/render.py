"""Pure rendering: a Plan → the Kubernetes objects that realise it (Pods, headless Service, token Secret).

Children carry the labels ``rewardplane.io/model=<name>`` and ``rewardplane.io/replica=<i>`` and
an owner reference to the RewardModel. Each Pod carries a hash of what it was rendered from, so
the reconciler replaces a Pod when (and only when) its rendering changes.
"""

from __future__ import annotations

import base64
import hashlib
import json
import secrets
from collections.abc import Mapping
from typing import Any

from rewardplane.api.names import (
    ANNOTATION_GROUP_PORT,
    ANNOTATION_RANK_OFFSET,
    ANNOTATION_SPEC_HASH,
    API_VERSION,
    LABEL_COMPONENT,
    LABEL_MANAGED_BY,
    LABEL_MODEL,
    LABEL_REPLICA,
    LABEL_TRAINER_OF,
    TOKEN_KEY,
    service_name,
    token_secret_name,
)
from rewardplane.api.names import RM_KIND as KIND
from rewardplane.api.spec import INTERFACE_VARIABLES, EngineKind, GpuMode, ProcessSpec
from rewardplane.protocol import TOKEN_FILE_ENV, Endpoints, ModelKind, ModelTask

from .planning import GPU_RESOURCE, Plan, ReplicaPlan
from .storage import ModelDelivery, delivery

CONTAINER_NAME = "reward-server"
SERVER_COMMAND = ("python", "-m", "rewardplane.server")
TOKEN_VOLUME = "control-token"
TOKEN_MOUNT_DIR = "/var/run/rewardplane"
TOKEN_FILE = f"{TOKEN_MOUNT_DIR}/{TOKEN_KEY}"
WEIGHTS_VOLUME = "persisted-weights"
POD_COPY_DIR = "/rewardplane-weights"  # the emptyDir of spec.weightSync.podCopy
# The root filesystem is read-only: temporary files and caches (HOME) go to an emptyDir here.
SCRATCH_VOLUME = "scratch"
SCRATCH_DIR = "/rewardplane-scratch"
NON_ROOT_UID = 65532
HTTP_PORT_NAME = "http"
GROUP_PORT_NAME = "nccl-group"
# Readiness (GET /ready): a server takes traffic only once the operator admitted it at the model's
# weights version (rewardplane.protocol.admission); probed often, since the admission waits for it.
READINESS_PERIOD_S = 1
READINESS_TIMEOUT_S = 3
READINESS_FAILURES = 5
# Loading a large model takes minutes: the startup probe allows up to 30 min before liveness
# (a stuck event loop, or a broken replica: /health answers 503) may restart the container.
STARTUP_PERIOD_S = 1
STARTUP_FAILURES = 1800
LIVENESS_PERIOD_S = 10
LIVENESS_TIMEOUT_S = 5
LIVENESS_FAILURES = 6
# SIGTERM: the server stops taking requests and drains in-flight ones (--graceful-shutdown-s,
# 10 s by default); the kubelet kills it after this grace period.
TERMINATION_GRACE_S = 30


def model_labels(model_name: str) -> dict[str, str]:
    return {LABEL_MODEL: model_name, LABEL_MANAGED_BY: "rewardplane"}


def selector(model_name: str) -> str:
    """Label selector matching every child of a RewardModel."""
    return f"{LABEL_MODEL}={model_name}"


def owner_reference(rm: Mapping[str, Any]) -> dict[str, Any]:
    meta = rm["metadata"]
    return {
        "apiVersion": API_VERSION,
        "kind": KIND,
        "name": meta["name"],
        "uid": meta["uid"],
        "controller": True,
        "blockOwnerDeletion": True,
    }


def _metadata(rm: Mapping[str, Any], name: str, labels: dict[str, str]) -> dict[str, Any]:
    return {
        "name": name,
        "namespace": rm["metadata"].get("namespace", "default"),
        "labels": labels,
        "ownerReferences": [owner_reference(rm)],
    }


# --------------------------------------------------------------------------------------------
# Pods
# --------------------------------------------------------------------------------------------


def model_delivery(plan: Plan) -> ModelDelivery:
    return delivery(plan.spec.model, plan.image, plan.model_cache)


def weights_dir(persist_dir: str, owner_uid: str, plan: Plan, replica: ReplicaPlan) -> str:
    """Where one replica saves pushed weights: bound to the RewardModel's UID and its base model.

    A RewardModel deleted and created again under the same name has a new UID, and a changed
    ``spec.model`` (source, revision, labels) a new base key, so saved weights are never restored
    onto another model; the directories of a deleted RewardModel are never read again (retired).
    One directory per replica: replicas on one node share the hostPath but never a file.
    """
    model = plan.spec.model
    key: list[object] = [model.source, model.revision, model.num_labels]
    if model.task is not ModelTask.SCORE:  # scorers keep the keys they had before tasks existed
        key.append(model.task.value)
    if model.kind is not ModelKind.SEQUENCE:  # a PRM's head reads other rows: another model's weights
        key.append(model.kind.value)
    base = json.dumps(key, separators=(",", ":"))
    base_key = hashlib.sha256(base.encode()).hexdigest()[:12]
    return f"{persist_dir.rstrip('/')}/{owner_uid}/{base_key}/{replica.pod_name}"


def process_args(process: ProcessSpec, engine: EngineKind) -> list[str]:
    """The server flags of a process reward model (``spec.model.process``)."""
    assert process.step_tag is not None  # validate_spec refuses a PRM without one
    args = [
        "--model-kind",
        ModelKind.PROCESS.value,
        "--step-tag",
        process.step_tag,
        "--step-separator",
        process.step_separator,
        "--good-label",
        str(process.good_label),
    ]
    if process.aggregation is not None:
        args += ["--step-aggregation", process.aggregation.value]
    if engine is EngineKind.VLLM:
        args += ["--prm-pooling", process.vllm_pooling]
    return args


def server_args(plan: Plan, replica: ReplicaPlan, owner_uid: str = "") -> list[str]:
    """Command-line arguments of ``python -m rewardplane.server`` for one replica."""
    spec = plan.spec
    on_gpu = spec.gpu.mode is not GpuMode.NONE
    args = [
        "--model",
        model_delivery(plan).model_arg,
        "--engine",
        spec.engine.kind.value,
        "--host",
        "$(POD_IP)",  # expanded by the kubelet (or node agent) from the env below
        "--port",
        str(plan.ports.http),
        "--served-model-name",
        plan.served_name,
        "--dtype",
        spec.model.dtype,
        "--device",
        "cuda" if on_gpu else "cpu",
        "--token-file",
        TOKEN_FILE,
        "--task",
        spec.model.task.value,
        # out of the Service until the operator admits it at the model's version (a restarted
        # container comes back on its base weights)
        "--require-admission",
    ]
    if spec.model.kind is ModelKind.PROCESS:  # step scores at the step tags: no pooling, two labels
        args += process_args(spec.model.process, spec.engine.kind)
    elif spec.model.task is ModelTask.SCORE:  # the score head's options; a generative model has none
        args += ["--pooling", spec.model.pooling, "--num-labels", str(spec.model.num_labels)]
    # Requests may name the model by its source; the server loads a mounted or downloaded
    # directory instead, so the source itself becomes an alias.
    aliases = list(spec.model.aliases)
    if spec.model.source not in aliases:
        aliases.append(spec.model.source)
    if aliases:
        args += ["--model-alias", *aliases]
    if spec.model.max_length is not None:
        args += ["--max-model-len", str(spec.model.max_length)]
    if on_gpu:
        args += ["--gpu-memory-utilization", f"{spec.gpu.memory_fraction:g}"]
    if on_gpu or spec.engine.kind is EngineKind.VLLM:
        args += ["--tensor-parallel-size", str(replica.world_size)]
    if spec.weight_sync.persist_dir:
        args += ["--weights-dir", weights_dir(spec.weight_sync.persist_dir, owner_uid, plan, replica)]
    elif spec.weight_sync.pod_copy:
        args += ["--weights-dir", POD_COPY_DIR]
    if spec.lora.enabled:
        args += ["--enable-lora", "--max-lora-rank", str(spec.lora.max_rank)]
    return args + list(spec.engine.extra_args)


def _env(plan: Plan, replica: ReplicaPlan) -> list[dict[str, Any]]:
    env: list[dict[str, Any]] = [
        {"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
        {"name": TOKEN_FILE_ENV, "value": TOKEN_FILE},
        {"name": "TMPDIR", "value": SCRATCH_DIR},
        {"name": "HOME", "value": SCRATCH_DIR},
    ]
    if replica.device_ids:
        # Shared mode pins devices itself: no nvidia.com/gpu request (the device plugin would hand
        # out whole devices), so the visible-devices variables do the pinning.
        ids = ",".join(str(d) for d in replica.device_ids)
        env += [
            {"name": "CUDA_VISIBLE_DEVICES", "value": ids},
            {"name": "NVIDIA_VISIBLE_DEVICES", "value": ids},
        ]
    transport = dict(plan.spec.transport.env)
    if plan.spec.transport.interface:
        transport |= dict.fromkeys(INTERFACE_VARIABLES, plan.spec.transport.interface)
    return env + [{"name": k, "value": v} for k, v in sorted(transport.items())]


def _resources(plan: Plan, replica: ReplicaPlan) -> dict[str, Any]:
    limits: dict[str, Any] = dict(plan.spec.resources.limits)
    requests: dict[str, Any] = dict(plan.spec.resources.requests)
    if replica.gpus:
        limits[GPU_RESOURCE] = replica.gpus
        requests.pop(GPU_RESOURCE, None)  # extended resources: limits alone are enough and must match
    out: dict[str, Any] = {}
    if limits:
        out["limits"] = limits
    if requests:
        out["requests"] = requests
    return out


def security_context(plan: Plan) -> dict[str, Any]:
    """Least privilege for the server container: no privilege escalation, no capabilities, a
    read-only root filesystem (scratch space is an emptyDir), and a non-root user, except where a
    capability is needed, which only root gets: DAC_OVERRIDE with ``persistDir`` (the kubelet creates
    that hostPath owned by root, and it may already exist under another owner), IPC_LOCK with
    ``transport.ipcLock`` (RDMA registers the buffers it sends from)."""
    ctx: dict[str, Any] = {
        "allowPrivilegeEscalation": False,
        "readOnlyRootFilesystem": True,
        "capabilities": {"drop": ["ALL"]},
        "seccompProfile": {"type": "RuntimeDefault"},
    }
    added: list[str] = []
    if plan.spec.weight_sync.persist_dir:
        # root without capabilities still cannot write a directory someone else owns (a persistDir
        # made by another uid, or by an administrator): DAC_OVERRIDE, only then
        added.append("DAC_OVERRIDE")
    if plan.spec.transport.ipc_lock:
        added.append("IPC_LOCK")
    if not added:
        ctx |= {"runAsNonRoot": True, "runAsUser": NON_ROOT_UID, "runAsGroup": NON_ROOT_UID}
    else:
        # An added capability is effective only for root: Kubernetes gives a non-root process none
        # (no ambient capabilities). The image's own user is 65532, hence explicit.
        ctx |= {"runAsUser": 0, "runAsGroup": 0, "capabilities": {"drop": ["ALL"], "add": added}}
    return ctx


def spec_hash(pod: Mapping[str, Any], pinned_node: str | None) -> str:
    """Hash of what a Pod was rendered from. The chosen node is left out unless the spec pins it:
    a node joining the cluster must not move running replicas."""
    spec = {k: v for k, v in pod["spec"].items() if k != "nodeName"}
    payload = json.dumps(
        {"spec": spec, "labels": pod["metadata"]["labels"], "node": pinned_node}, sort_keys=True
    )
    return hashlib.sha256(payload.encode()).hexdigest()[:16]


def _health_probe(plan: Plan, path: str = Endpoints.HEALTH, **timing: int) -> dict[str, Any]:
    return {"httpGet": {"path": path, "port": plan.ports.http}, **timing}


def _server_container(
    rm: Mapping[str, Any], plan: Plan, replica: ReplicaPlan, model: ModelDelivery
) -> dict[str, Any]:
    """The reward server's container of one replica: its command, ports, probes and mounts."""
    container: dict[str, Any] = {
        "name": CONTAINER_NAME,
        "image": plan.image,
        "imagePullPolicy": plan.spec.engine.image_pull_policy,
        "command": list(SERVER_COMMAND),
        "args": server_args(plan, replica, rm["metadata"].get("uid", "")),
        "env": _env(plan, replica),
        "ports": [
            {"name": HTTP_PORT_NAME, "containerPort": plan.ports.http, "protocol": "TCP"},
            {"name": GROUP_PORT_NAME, "containerPort": replica.group_port, "protocol": "TCP"},
        ],
        "startupProbe": _health_probe(
            plan,
            periodSeconds=STARTUP_PERIOD_S,
            timeoutSeconds=READINESS_TIMEOUT_S,
            failureThreshold=STARTUP_FAILURES,
        ),
        "readinessProbe": _health_probe(
            plan,
            Endpoints.READY,
            periodSeconds=READINESS_PERIOD_S,
            timeoutSeconds=READINESS_TIMEOUT_S,
            failureThreshold=READINESS_FAILURES,
        ),
        "livenessProbe": _health_probe(
            plan,
            periodSeconds=LIVENESS_PERIOD_S,
            timeoutSeconds=LIVENESS_TIMEOUT_S,
            failureThreshold=LIVENESS_FAILURES,
        ),
        "volumeMounts": [
            {"name": TOKEN_VOLUME, "mountPath": TOKEN_MOUNT_DIR, "readOnly": True},
            model.mount,
            {"name": SCRATCH_VOLUME, "mountPath": SCRATCH_DIR},
        ],
        "securityContext": security_context(plan),
        # The server prints a fatal start error last: the kubelet then makes it the termination
        # message, which the operator puts in the Degraded condition and its Event.
        "terminationMessagePolicy": "FallbackToLogsOnError",
    }
    resources = _resources(plan, replica)
    if resources:
        container["resources"] = resources
    return container


def _pod_volumes(plan: Plan, model: ModelDelivery, container: dict[str, Any]) -> list[dict[str, Any]]:
    """The Pod's volumes; the pushed weights' volume, where the spec keeps them, is mounted into
    ``container`` too."""
    volumes: list[dict[str, Any]] = [
        # Mode 0440 + fsGroup: the non-root server reads the token, nobody else on the node does.
        {"name": TOKEN_VOLUME, "secret": {"secretName": token_secret_name(plan.name), "defaultMode": 0o440}},
        model.volume,
        {"name": SCRATCH_VOLUME, "emptyDir": {}},
    ]
    persist_dir = plan.spec.weight_sync.persist_dir
    if persist_dir:
        container["volumeMounts"].append({"name": WEIGHTS_VOLUME, "mountPath": persist_dir})
        volumes.append(
            {"name": WEIGHTS_VOLUME, "hostPath": {"path": persist_dir, "type": "DirectoryOrCreate"}}
        )
    elif plan.spec.weight_sync.pod_copy:
        # lives as long as the Pod: a restarted container finds the pushed weights here
        container["volumeMounts"].append({"name": WEIGHTS_VOLUME, "mountPath": POD_COPY_DIR})
        volumes.append({"name": WEIGHTS_VOLUME, "emptyDir": {}})
    return volumes


def _fetch_container(plan: Plan, fetch_spec: Mapping[str, Any]) -> dict[str, Any]:
    """The init container that downloads the model, with the server's pull policy and scratch."""
    fetch = dict(fetch_spec, imagePullPolicy=plan.spec.engine.image_pull_policy)
    # the root filesystem is read-only: the hub client's and Python's temporary files go here
    fetch["volumeMounts"] = [*fetch["volumeMounts"], {"name": SCRATCH_VOLUME, "mountPath": SCRATCH_DIR}]
    fetch["env"] = [{"name": "TMPDIR", "value": SCRATCH_DIR}, {"name": "HOME", "value": SCRATCH_DIR}]
    return fetch


def render_pod(rm: Mapping[str, Any], plan: Plan, replica: ReplicaPlan) -> dict[str, Any]:
    """The Pod of one replica, placed by the operator itself (``spec.nodeName``: no scheduler needed)."""
    labels = {**model_labels(plan.name), LABEL_REPLICA: str(replica.index), LABEL_COMPONENT: "reward-server"}
    model = model_delivery(plan)
    container = _server_container(rm, plan, replica, model)
    volumes = _pod_volumes(plan, model, container)
    pod: dict[str, Any] = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            **_metadata(rm, replica.pod_name, labels),
            "annotations": {
                ANNOTATION_RANK_OFFSET: str(replica.rank_offset),
                ANNOTATION_GROUP_PORT: str(replica.group_port),
            },
        },
        "spec": {
            "nodeName": replica.node,
            # hostname + subdomain give each replica a stable DNS name through the headless Service.
            "hostname": replica.pod_name,
            "subdomain": service_name(plan.name),
            "restartPolicy": "Always",
            "terminationGracePeriodSeconds": TERMINATION_GRACE_S,
            # The pause container is PID 1, not the server: the kernel drops a signal to PID 1 that
            # has no handler, so a SIGTERM that lands while Python is still starting (before the
            # server installs its handler) would wait out the whole grace period. Any image, with
            # or without an init, now stops at once; pause also reaps the engine's orphans.
            "shareProcessNamespace": True,
            # The server never calls the Kubernetes API: no credentials in its pod.
            "automountServiceAccountToken": False,
            # Volumes (the token Secret, a PVC, emptyDirs) readable by the server's group.
            "securityContext": {"fsGroup": NON_ROOT_UID},
            "containers": [container],
            "volumes": volumes,
        },
    }
    if model.fetch is not None:
        pod["spec"]["initContainers"] = [_fetch_container(plan, model.fetch)]
    if plan.spec.transport.host_network:
        # the host's NICs and addresses for NCCL; the cluster's DNS stays reachable
        pod["spec"] |= {"hostNetwork": True, "dnsPolicy": "ClusterFirstWithHostNet"}
    if plan.spec.transport.host_ipc:
        # a colocated trainer's CUDA IPC handles and /dev/shm buffers open only within one IPC namespace
        pod["spec"]["hostIPC"] = True
    pod["metadata"]["annotations"][ANNOTATION_SPEC_HASH] = spec_hash(pod, plan.spec.gpu.node)
    return pod


def needs_replacement(existing: Mapping[str, Any], desired: Mapping[str, Any]) -> bool:
    """Whether a running Pod was rendered from a different spec than ``desired``, or a label the
    operator sets was edited by hand (the Service selects replicas by them: a Pod without its
    component label would serve no client of the Service, and a Pod's labels cannot be checked
    against its spec hash, which records what was rendered)."""
    meta = existing.get("metadata") or {}
    have = (meta.get("annotations") or {}).get(ANNOTATION_SPEC_HASH)
    if have != desired["metadata"]["annotations"][ANNOTATION_SPEC_HASH]:
        return True
    labels = meta.get("labels") or {}
    return any(labels.get(k) != v for k, v in desired["metadata"]["labels"].items())


# --------------------------------------------------------------------------------------------
# Service and Secret
# --------------------------------------------------------------------------------------------


def render_service(rm: Mapping[str, Any], plan: Plan) -> dict[str, Any]:
    """Headless Service: stable per-replica DNS names (``<pod>.<model>``), no load balancing,
    because the SDK spreads requests over ``status.endpoints`` itself."""
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": _metadata(rm, service_name(plan.name), model_labels(plan.name)),
        "spec": {
            "clusterIP": "None",
            "selector": {LABEL_MODEL: plan.name, LABEL_COMPONENT: "reward-server"},
            "ports": [
                {
                    "name": HTTP_PORT_NAME,
                    "port": plan.ports.http,
                    "targetPort": plan.ports.http,
                    "protocol": "TCP",
                },
                {
                    "name": GROUP_PORT_NAME,
                    "port": plan.ports.group,
                    "targetPort": plan.ports.group,
                    "protocol": "TCP",
                },
            ],
            "publishNotReadyAddresses": False,
        },
    }


def render_network_policy(rm: Mapping[str, Any], plan: Plan) -> dict[str, Any]:
    """Who may reach a model's servers: anyone on the HTTP port (scoring; the control-plane routes
    on that port also need the bearer token), and only the model's trainers (Pods labelled
    ``rewardplane.io/trainer-of=<model>``) and its own replicas (peer restore) on every other port:
    the group port and the ephemeral ports gloo and NCCL connect ranks over."""
    http_only = [{"port": plan.ports.http, "protocol": "TCP"}]
    own = {LABEL_MODEL: plan.name, LABEL_COMPONENT: "reward-server"}
    return {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": _metadata(rm, network_policy_name(plan.name), model_labels(plan.name)),
        "spec": {
            "podSelector": {"matchLabels": own},
            "policyTypes": ["Ingress"],
            "ingress": [
                {"ports": http_only},
                {
                    "from": [
                        {"podSelector": {"matchLabels": {LABEL_TRAINER_OF: plan.name}}},
                        {"podSelector": {"matchLabels": own}},
                    ]
                },
            ],
        },
    }


def network_policy_name(model_name: str) -> str:
    return f"{model_name}-servers"


def new_token() -> str:
    """A fresh control-plane token (256 bits)."""
    return secrets.token_urlsafe(32)


def render_token_secret(rm: Mapping[str, Any], token: str) -> dict[str, Any]:
    """The control-plane token Secret. Created once and never rotated by reconciles: running
    servers read it at start, so a new token would lock the operator and trainers out."""
    name = rm["metadata"]["name"]
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "type": "Opaque",
        "metadata": _metadata(rm, token_secret_name(name), model_labels(name)),
        "data": {TOKEN_KEY: base64.b64encode(token.encode()).decode()},
    }


def render_children(rm: Mapping[str, Any], plan: Plan) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """Desired Pods (in replica order) and the Service; the Secret is separate (created once), and
    so is the NetworkPolicy (``render_network_policy``)."""
    return [render_pod(rm, plan, r) for r in plan.replicas], render_service(rm, plan)
