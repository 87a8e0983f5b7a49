"""Pure planning: a RewardModel (plus what the cluster already holds) → where each replica runs.

No I/O and no Kubernetes client here: the handlers read the cluster into a ``ClusterView``,
call ``plan_reward_model`` and apply what ``rewardplane.operator.render`` makes of the plan.
Every problem is reported at once, each naming the field and what to change.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from rewardplane.api.names import LABEL_MODEL, RESERVATIONS_ANNOTATION, pod_name
from rewardplane.api.spec import (
    INTERFACE_VARIABLES,
    NO_IMAGE,
    PLACEMENT_REFUSED,
    TRANSPORT_ENV_PREFIXES,
    EngineKind,
    GpuMode,
    InvalidSpecError,
    RewardModelSpec,
    parse_spec,
)
from rewardplane.protocol import ModelKind, ModelTask, RewardModelPorts, derive_ports
from rewardplane.protocol.settings import SERVER_IMAGE

from .storage import InvalidSourceError, ModelCache, parse_model_source

GPU_RESOURCE = "nvidia.com/gpu"
"""Node annotation declaring GPU memory held by servers the operator does not manage (e.g. the
policy server a reward model is colocated with): a JSON list of {"device", "fraction", "owner"}."""

# Memory fractions are summed as floats; 0.7 + 0.3 must not count as over 1.
_FRACTION_EPSILON = 1e-9
# Pod hostnames are DNS labels (63 chars) and the headless Service name must be a DNS-1035 label.
_DNS_1035_LABEL = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")
_MAX_LABEL = 63


@dataclass(frozen=True)
class Reservation:
    """Memory on one device held by something the operator does not manage."""

    node: str
    device: int
    fraction: float
    owner: str


@dataclass(frozen=True)
class NodeInfo:
    name: str
    gpus: int = 0
    ready: bool = True
    reservations: tuple[Reservation, ...] = ()
    reservation_error: str | None = None
    """Why the node's reservations annotation could not be read (shared placement there is refused)."""


@dataclass(frozen=True)
class ClusterView:
    """What planning needs to know about the cluster, read by the handlers."""

    nodes: tuple[NodeInfo, ...] = ()
    peers: tuple[Mapping[str, Any], ...] = ()
    """Other RewardModel objects (any namespace). Only those created earlier count against this one,
    so a running model is never pushed out by a newer one that over-commits its device."""
    reservations: tuple[Reservation, ...] = ()
    """Extra reservations besides those declared on the nodes."""
    gpus_in_use: Mapping[str, int] = field(default_factory=dict)
    """Whole GPUs held per node by Pods that are not this model's (exclusive mode)."""
    current_nodes: Mapping[int, str] = field(default_factory=dict)
    """Replica index → node of this model's existing Pods; existing replicas stay where they are."""

    def node(self, name: str) -> NodeInfo | None:
        return next((n for n in self.nodes if n.name == name), None)


@dataclass(frozen=True)
class ReplicaPlan:
    index: int
    pod_name: str
    node: str
    device_ids: tuple[int, ...]
    """Pinned devices (shared mode); empty when the device plugin picks them or on CPU."""
    gpus: int
    """Whole GPUs requested through nvidia.com/gpu (exclusive mode)."""
    group_port: int
    rank_offset: int
    world_size: int
    """Ranks this replica's workers take in a weight push (its tensor parallel size)."""


@dataclass(frozen=True)
class Plan:
    name: str
    namespace: str
    spec: RewardModelSpec
    ports: RewardModelPorts
    replicas: tuple[ReplicaPlan, ...]
    image: str
    """The reward-server image: spec.engine.image, else the operator's default."""
    model_cache: ModelCache = ModelCache()
    """Where downloaded models are kept on the nodes (the operator's setting)."""

    @property
    def served_name(self) -> str:
        return self.spec.model.served_name or self.name


@dataclass(frozen=True)
class DeviceShare:
    """One claim on a device's memory, for the over-commit check."""

    node: str
    device: int
    fraction: float
    owner: str


# --------------------------------------------------------------------------------------------
# Names, ports, ranks
# --------------------------------------------------------------------------------------------


def rank_offset(index: int, tensor_parallel_size: int) -> int:
    """Replica ``index`` starts at the sum of the tensor parallel sizes of the replicas before it."""
    return index * tensor_parallel_size


def model_ports(spec: RewardModelSpec) -> RewardModelPorts:
    """HTTP and base group port: explicit ports win, else policy ports + offset (default +1)."""
    derived = derive_ports(spec.ports.policy_http_port, spec.ports.policy_group_port, spec.ports.offset)
    return RewardModelPorts(
        http=spec.ports.http if spec.ports.http is not None else derived.http,
        group=spec.ports.group if spec.ports.group is not None else derived.group,
    )


# --------------------------------------------------------------------------------------------
# Validation (spec alone, no cluster)
# --------------------------------------------------------------------------------------------


def _check_name(name: str, replicas: int) -> list[str]:
    errors = []
    if not _DNS_1035_LABEL.match(name):
        errors.append(
            f"metadata.name {name!r} must be a DNS-1035 label (lowercase letters, digits and '-', "
            "starting with a letter) because it names the headless Service; rename the RewardModel"
        )
    longest = pod_name(name, max(replicas - 1, 0))
    if len(longest) > _MAX_LABEL:
        errors.append(
            f"metadata.name {name!r} is too long: Pod hostname {longest!r} exceeds {_MAX_LABEL} "
            f"characters; use a name of at most {_MAX_LABEL - len(longest) + len(name)} characters"
        )
    return errors


def _check_ports(spec: RewardModelSpec) -> list[str]:
    p = spec.ports
    errors = []
    for value, where in ((p.policy_http_port, "policyHttpPort"), (p.policy_group_port, "policyGroupPort")):
        if not 1 <= value <= 65535:
            errors.append(f"spec.ports.{where} {value} is outside 1..65535; choose a valid TCP port")
    for explicit, where in ((p.http, "http"), (p.group, "group")):
        if explicit is not None and not 1 <= explicit <= 65535:
            errors.append(f"spec.ports.{where} {explicit} is outside 1..65535; choose a valid TCP port")
    if errors:
        return errors
    try:
        ports = model_ports(spec)
    except ValueError as exc:
        return [f"spec.ports: {exc}; change spec.ports.offset or set spec.ports.http/group explicitly"]
    last_group = ports.group + max(spec.replicas - 1, 0)
    if last_group > 65535:
        errors.append(
            f"spec.ports: replica {spec.replicas - 1} would use group port {last_group} (group "
            f"{ports.group} + replica index), beyond 65535; lower spec.ports.group or spec.replicas"
        )
    if ports.group <= ports.http <= last_group:
        errors.append(
            f"spec.ports: HTTP port {ports.http} collides with the group ports {ports.group}..{last_group} "
            "(group + replica index); choose ports that do not overlap"
        )
    return errors


def _check_gpu(spec: RewardModelSpec) -> list[str]:
    gpu, tp = spec.gpu, spec.tensor_parallel_size
    errors = []
    if gpu.mode is GpuMode.NONE:
        if spec.engine.kind is EngineKind.VLLM:
            errors.append(
                "spec.engine.kind vllm needs a GPU but spec.gpu.mode is none; set spec.engine.kind: hf "
                "to serve on CPU, or choose gpu.mode exclusive or shared"
            )
        if tp != 1:
            errors.append(f"spec.tensorParallelSize {tp} needs GPUs but spec.gpu.mode is none; set it to 1")
    if gpu.mode is not GpuMode.SHARED and gpu.device_ids:
        errors.append(
            f"spec.gpu.deviceIds only applies to gpu.mode shared (mode is {gpu.mode.value}); remove it, "
            "or set spec.gpu.mode: shared with spec.gpu.node"
        )
    if gpu.mode is GpuMode.SHARED:
        if not gpu.node:
            errors.append(
                "spec.gpu.node is required for gpu.mode shared: name the node whose devices the model "
                "shares (e.g. the node of the policy server)"
            )
        if len(set(gpu.device_ids)) != len(gpu.device_ids):
            errors.append(f"spec.gpu.deviceIds {list(gpu.device_ids)} lists a device twice; list each once")
        needed = spec.replicas * tp
        if len(gpu.device_ids) < needed:
            errors.append(
                f"spec.gpu.deviceIds has {len(gpu.device_ids)} device(s) but replicas ({spec.replicas}) × "
                f"tensorParallelSize ({tp}) = {needed} are needed (replica i uses ids "
                f"[i*{tp}, (i+1)*{tp})); list {needed} device ids or lower spec.replicas"
            )
    return errors


# Server flags the operator sets itself, and the spec field each one comes from.
OPERATOR_FLAGS = {
    "--model": "spec.model.source",
    "--engine": "spec.engine.kind",
    "--host": "(the Pod IP)",
    "--port": "spec.ports",
    "--served-model-name": "spec.model.servedName",
    "--model-alias": "spec.model.aliases",
    "--dtype": "spec.model.dtype",
    "--device": "spec.gpu.mode",
    "--task": "spec.model.task",
    "--pooling": "spec.model.pooling",
    "--num-labels": "spec.model.numLabels",
    "--max-model-len": "spec.model.maxLength",
    "--gpu-memory-utilization": "spec.gpu.memoryFraction",
    "--tensor-parallel-size": "spec.tensorParallelSize",
    "--token-file": "(the control-token Secret)",
    "--require-admission": "(the operator admits each replica at the model's weights version)",
    "--weights-dir": "spec.weightSync.persistDir",
    "--enable-lora": "spec.lora.enabled",
    "--max-lora-rank": "spec.lora.maxRank",
}


def _check_extra_args(spec: RewardModelSpec) -> list[str]:
    errors = []
    for arg in spec.engine.extra_args:
        flag = arg.split("=", 1)[0]
        if flag in OPERATOR_FLAGS:
            errors.append(
                f"spec.engine.extraArgs sets {flag}, which the operator sets from {OPERATOR_FLAGS[flag]}; "
                "remove it from extraArgs and use that field"
            )
    return errors


def validate_spec(spec: Mapping[str, Any], name: str | None = None) -> list[str]:
    """Every problem of a RewardModel spec (and name, when given) that needs no cluster to see.

    An empty list means the spec is valid on its own; placement can still refuse it
    (``plan_reward_model``).
    """
    try:
        parsed = parse_spec(dict(spec))
    except InvalidSpecError as exc:
        return list(exc.errors)
    errors = _check_name(name, parsed.replicas) if name is not None else []
    return (
        errors
        + _check_ports(parsed)
        + _check_gpu(parsed)
        + _check_extra_args(parsed)
        + _check_source(parsed)
        + _check_lora(parsed)
        + _check_task(parsed)
        + _check_kind(parsed)
        + _check_transport(parsed)
    )


def _check_transport(spec: RewardModelSpec) -> list[str]:
    """The transport environment holds the collective libraries' settings only, and agrees with
    ``interface``."""
    transport = spec.transport
    errors = [
        f"spec.transport.env sets {name}, which is not a setting of the weight transfer; give only names "
        f"starting with {', '.join(TRANSPORT_ENV_PREFIXES)} (other environment is the operator's)"
        for name in sorted(transport.env)
        if not name.startswith(TRANSPORT_ENV_PREFIXES)
    ]
    for variable in INTERFACE_VARIABLES:
        ifname = transport.env.get(variable)
        if transport.interface and ifname is not None and ifname != transport.interface:
            errors.append(
                f"spec.transport.env {variable}={ifname!r} contradicts spec.transport.interface "
                f"{transport.interface!r}; set the interface in one place (spec.transport.interface)"
            )
    return errors


def _check_host_network(spec: RewardModelSpec, nodes: list[str], ports: RewardModelPorts) -> list[str]:
    """On the host's network every replica of a node would listen on the same HTTP port."""
    if not spec.transport.host_network:
        return []
    seen: dict[str, int] = {}
    errors = []
    for i, node in enumerate(nodes):
        if node in seen:
            errors.append(
                f"replicas {seen[node]} and {i} would both run on node {node} with spec.transport.hostNetwork, "
                f"where they share the host's port {ports.http}; give each replica a node of its own (fewer "
                "replicas, unset spec.gpu.node, gpu.mode exclusive) or turn hostNetwork off"
            )
        else:
            seen[node] = i
    return errors


# vLLM 0.24 sizes its LoRA buffers by one of these ranks (LoRAConfig.max_lora_rank).
VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)


def _check_lora(spec: RewardModelSpec) -> list[str]:
    if (
        spec.lora.enabled
        and spec.engine.kind is EngineKind.VLLM
        and spec.lora.max_rank not in VLLM_LORA_RANKS
    ):
        return [
            f"spec.lora.maxRank {spec.lora.max_rank} is not a rank vLLM serves; use one of {list(VLLM_LORA_RANKS)} "
            "(at least the adapters' rank)"
        ]
    return []


def _check_kind(spec: RewardModelSpec) -> list[str]:
    """A process reward model needs its step tag and scores with it: no pooling, no generation."""
    model = spec.model
    if model.kind is not ModelKind.PROCESS:
        return []
    errors = []
    if model.process.step_tag is None:
        errors.append(
            "spec.model.kind is process but spec.model.process.stepTag is not set; give the token the model "
            "reads after each step (Qwen2.5-Math-PRM: <extra_0>)"
        )
    if model.task is not ModelTask.SCORE:
        errors.append(
            "spec.model.kind process scores steps: set spec.model.task to score (or kind: sequence)"
        )
    if model.pooling != "last":
        errors.append(
            f"spec.model.pooling is {model.pooling!r}, but a process reward model reads its step tags; remove "
            "spec.model.pooling"
        )
    return errors


def _check_task(spec: RewardModelSpec) -> list[str]:
    """A generative model (task generate) has no score head: numLabels and pooling mean nothing."""
    model = spec.model
    if model.task is not ModelTask.GENERATE:
        return []
    return [
        f"spec.model.{field} is {value!r}, but a generative model (spec.model.task: generate) has no score "
        f"head; remove spec.model.{field} (or use task: score for a *ForSequenceClassification model)"
        for field, value, default in (("numLabels", model.num_labels, 1), ("pooling", model.pooling, "last"))
        if value != default
    ]


def _check_source(spec: RewardModelSpec) -> list[str]:
    try:
        parse_model_source(spec.model)
    except InvalidSourceError as exc:
        return [str(exc)]
    return []


# --------------------------------------------------------------------------------------------
# Cluster facts
# --------------------------------------------------------------------------------------------


def parse_reservations(node: str, annotation: str | None) -> tuple[Reservation, ...]:
    """Read a node's ``rewardplane.io/gpu-reservations`` annotation; raises ValueError if malformed."""
    if not annotation:
        return ()
    hint = f'; expected a JSON list like [{{"device": 0, "fraction": 0.6, "owner": "policy"}}] on node {node}'
    try:
        items = json.loads(annotation)
    except json.JSONDecodeError as exc:
        raise ValueError(f"annotation {RESERVATIONS_ANNOTATION} is not JSON ({exc}){hint}") from None
    if not isinstance(items, list):
        raise ValueError(f"annotation {RESERVATIONS_ANNOTATION} is not a list{hint}")
    out = []
    for item in items:
        try:
            device, fraction = int(item["device"]), float(item["fraction"])
        except (KeyError, TypeError, ValueError):
            raise ValueError(f"annotation {RESERVATIONS_ANNOTATION} has a bad entry {item!r}{hint}") from None
        if device < 0 or not 0 < fraction <= 1:
            raise ValueError(
                f"annotation {RESERVATIONS_ANNOTATION} entry {item!r} needs device >= 0 and 0 < fraction <= 1"
            )
        out.append(
            Reservation(node=node, device=device, fraction=fraction, owner=str(item.get("owner", "?")))
        )
    return tuple(out)


def node_info(node: Mapping[str, Any]) -> NodeInfo:
    """A Kubernetes Node object → NodeInfo (GPUs from allocatable, else capacity)."""
    meta, status = node.get("metadata", {}), node.get("status", {}) or {}
    name = meta["name"]
    gpus_raw = (status.get("allocatable") or {}).get(GPU_RESOURCE) or (status.get("capacity") or {}).get(
        GPU_RESOURCE, 0
    )
    ready = any(
        c.get("type") == "Ready" and c.get("status") == "True" for c in status.get("conditions") or []
    ) or not status.get("conditions")  # a node that reports no conditions yet is not held against it
    try:
        reservations, error = (
            parse_reservations(name, (meta.get("annotations") or {}).get(RESERVATIONS_ANNOTATION)),
            None,
        )
    except ValueError as exc:
        reservations, error = (), str(exc)
    return NodeInfo(
        name=name, gpus=int(gpus_raw), ready=ready, reservations=reservations, reservation_error=error
    )


def gpus_requested(pod: Mapping[str, Any]) -> int:
    """Whole GPUs a Pod holds through nvidia.com/gpu limits."""
    total = 0
    for c in (pod.get("spec") or {}).get("containers") or []:
        limits = (c.get("resources") or {}).get("limits") or {}
        total += int(limits.get(GPU_RESOURCE, 0) or 0)
    return total


def gpus_in_use(
    pods: Iterable[Mapping[str, Any]], exclude_model: tuple[str, str] | None = None
) -> dict[str, int]:
    """Whole GPUs held per node by (non-terminated) Pods, leaving out one model's own Pods
    (``(namespace, name)``), whose replicas are being planned."""
    used: dict[str, int] = {}
    for pod in pods:
        meta, spec = pod.get("metadata", {}), pod.get("spec") or {}
        node = spec.get("nodeName")
        if not node or (pod.get("status") or {}).get("phase") in ("Succeeded", "Failed"):
            continue
        owner = ((meta.get("namespace")), (meta.get("labels") or {}).get(LABEL_MODEL))
        if exclude_model is not None and owner == exclude_model:
            continue
        used[node] = used.get(node, 0) + gpus_requested(pod)
    return used


def _creation_key(rm: Mapping[str, Any]) -> tuple[str, str, str]:
    meta = rm.get("metadata", {})
    # RFC 3339 timestamps in UTC sort as strings; a missing one (not yet stored) sorts last.
    return (meta.get("creationTimestamp") or "~", meta.get("namespace") or "", meta.get("name") or "")


def placed_before(other: Mapping[str, Any], rm: Mapping[str, Any]) -> bool:
    """Whether ``other`` claims its devices before ``rm`` (older first; name breaks ties)."""
    return _creation_key(other) < _creation_key(rm)


def model_device_shares(rm: Mapping[str, Any]) -> list[DeviceShare]:
    """Device memory a shared-mode RewardModel claims (nothing for other modes or invalid specs)."""
    meta = rm.get("metadata", {})
    if meta.get("deletionTimestamp"):
        return []
    try:
        spec = parse_spec(dict(rm.get("spec") or {}))
    except InvalidSpecError:
        return []
    if spec.gpu.mode is not GpuMode.SHARED or not spec.gpu.node:
        return []
    owner = f"RewardModel {meta.get('namespace', '')}/{meta.get('name', '')}"
    devices = spec.gpu.device_ids[: spec.replicas * spec.tensor_parallel_size]
    return [DeviceShare(spec.gpu.node, d, spec.gpu.memory_fraction, owner) for d in devices]


# --------------------------------------------------------------------------------------------
# Placement
# --------------------------------------------------------------------------------------------


def _overcommit_errors(
    spec: RewardModelSpec, devices: Iterable[int], cluster: ClusterView, rm: Mapping[str, Any]
) -> list[str]:
    node = spec.gpu.node or ""
    info = cluster.node(node)
    claims: list[DeviceShare] = [
        DeviceShare(r.node, r.device, r.fraction, f"reservation {r.owner}")
        for r in (*(info.reservations if info else ()), *cluster.reservations)
    ]
    for peer in cluster.peers:
        if placed_before(peer, rm):
            claims.extend(model_device_shares(peer))
    errors = []
    want = spec.gpu.memory_fraction
    for device in devices:
        others = [c for c in claims if c.node == node and c.device == device]
        taken = sum(c.fraction for c in others)
        if taken + want > 1.0 + _FRACTION_EPSILON:
            listing = ", ".join(f"{c.owner} {c.fraction:g}" for c in others)
            room = max(1.0 - taken, 0.0)
            fix = (
                f"lower spec.gpu.memoryFraction to at most {room:.2f}"
                if room > _FRACTION_EPSILON
                else "the device is full, so pick another device"
            )
            errors.append(
                f"device {device} on node {node} would be over-committed: this model asks "
                f"{want:g} but {listing} already hold {taken:g} (total {taken + want:g} > 1); {fix}, "
                "choose other spec.gpu.deviceIds, or shrink/move the others"
            )
    return errors


def _unknown_node(name: str, cluster: ClusterView) -> str:
    known = ", ".join(sorted(n.name for n in cluster.nodes)) or "none"
    return f"spec.gpu.node {name!r} is not a registered Node (nodes: {known}); fix the node name"


def _shared_placement(spec: RewardModelSpec, cluster: ClusterView, rm: Mapping[str, Any]) -> list[str]:
    node = spec.gpu.node or ""
    info = cluster.node(node)
    if info is None:
        return [_unknown_node(node, cluster)]
    errors = []
    if info.reservation_error:
        errors.append(f"node {node}: {info.reservation_error}")
    used = spec.gpu.device_ids[: spec.replicas * spec.tensor_parallel_size]
    missing = [d for d in used if d >= info.gpus]
    if missing:
        errors.append(
            f"spec.gpu.deviceIds {missing} do not exist on node {node}, which has {info.gpus} GPU(s) "
            f"(ids 0..{info.gpus - 1}); pick existing device ids"
        )
    return errors + _overcommit_errors(spec, used, cluster, rm)


def _pick_node(
    candidates: list[NodeInfo], load: Mapping[str, int], free: Mapping[str, int], need: int
) -> str | None:
    # Exclusive: the node with the most free GPUs that fits; CPU: the node with the fewest of this
    # model's replicas. Names break ties so the choice is deterministic.
    if need > 0:
        fits = [n for n in candidates if free.get(n.name, 0) >= need]
        fits.sort(key=lambda n: (-free.get(n.name, 0), n.name))
    else:
        fits = sorted(candidates, key=lambda n: (load.get(n.name, 0), n.name))
    return fits[0].name if fits else None


def _place_nodes(spec: RewardModelSpec, cluster: ClusterView) -> tuple[list[str], list[str]]:
    """Node of every replica (exclusive and CPU modes), or errors."""
    tp = spec.tensor_parallel_size
    need = tp if spec.gpu.mode is GpuMode.EXCLUSIVE else 0
    ready = [n for n in cluster.nodes if n.ready]
    if not cluster.nodes:
        return [], [
            "no Node is registered in the cluster; start a node agent (`rewardplane node`) or add nodes"
        ]
    if spec.gpu.node and cluster.node(spec.gpu.node) is None:
        return [], [_unknown_node(spec.gpu.node, cluster)]
    pinned_devices: dict[str, set[int]] = {}
    for r in (*cluster.reservations, *(r for n in cluster.nodes for r in n.reservations)):
        pinned_devices.setdefault(r.node, set()).add(r.device)
    for peer in cluster.peers:
        for s in model_device_shares(peer):
            pinned_devices.setdefault(s.node, set()).add(s.device)
    # Devices pinned by shared servers are not free for whole-GPU requests either.
    free = {
        n.name: n.gpus - cluster.gpus_in_use.get(n.name, 0) - len(pinned_devices.get(n.name, ()))
        for n in cluster.nodes
    }
    load: dict[str, int] = {}
    nodes: list[str] = []
    errors: list[str] = []
    for i in range(spec.replicas):
        # A pinned node wins; otherwise an existing replica stays where it runs; otherwise pick.
        node = spec.gpu.node or cluster.current_nodes.get(i) or _pick_node(ready, load, free, need)
        placed_earlier = not spec.gpu.node and i in cluster.current_nodes
        if node is None and not need:
            errors.append(
                f"replica {i} has no ready node to run on (none of {len(cluster.nodes)} is Ready); "
                "start or repair a node agent, or pin spec.gpu.node"
            )
            continue
        if node is None:
            listing = ", ".join(f"{n.name}={max(free.get(n.name, 0), 0)}" for n in cluster.nodes)
            errors.append(
                f"replica {i} needs {need} free {GPU_RESOURCE} but no ready node has that many "
                f"(free: {listing}); lower spec.tensorParallelSize or spec.replicas, free GPUs, or add a node"
            )
            continue
        if need and not placed_earlier and free.get(node, 0) < need:
            errors.append(
                f"replica {i} needs {need} free {GPU_RESOURCE} on node {node}, which has "
                f"{max(free.get(node, 0), 0)}; lower spec.tensorParallelSize or spec.replicas, free GPUs, "
                "or unset spec.gpu.node so the operator picks a node"
            )
            continue
        free[node] = free.get(node, 0) - need
        load[node] = load.get(node, 0) + 1
        nodes.append(node)
    return nodes, errors


def no_image_message() -> str:
    return (
        "spec.engine.image is not set and the operator has no default reward-server image: set "
        "spec.engine.image, or give the operator one (Helm value serverImage.repository, and "
        f"serverImage.tag; operator flag --default-server-image or ${SERVER_IMAGE.name})"
    )


def resolve_image(spec: RewardModelSpec, default_image: str | None) -> str:
    """spec.engine.image, else ``default_image``; InvalidSpecError (NoImage) when neither is set."""
    image = spec.engine.image or default_image
    if not image:
        raise InvalidSpecError([no_image_message()], reason=NO_IMAGE)
    return image


def plan_reward_model(
    rm: Mapping[str, Any],
    cluster: ClusterView,
    *,
    default_image: str | None = None,
    model_cache: ModelCache | None = None,
) -> Plan:
    """Plan every replica of a RewardModel object; raises InvalidSpecError listing every problem.

    ``default_image`` is the operator's reward-server image for a spec without
    ``spec.engine.image``; without either the model cannot run (reason NoImage). ``model_cache``
    is the operator's node cache for downloaded models.
    """
    meta = rm.get("metadata", {})
    name, namespace = meta.get("name", ""), meta.get("namespace", "default")
    errors = validate_spec(rm.get("spec") or {}, name)
    if errors:
        raise InvalidSpecError(errors)
    spec = parse_spec(dict(rm.get("spec") or {}))
    image = resolve_image(spec, default_image)
    ports = model_ports(spec)
    tp = spec.tensor_parallel_size

    if spec.gpu.mode is GpuMode.SHARED:
        errors = _shared_placement(spec, cluster, rm)
        nodes = [spec.gpu.node or ""] * spec.replicas
    else:
        nodes, errors = _place_nodes(spec, cluster)
    errors = errors or _check_host_network(spec, nodes, ports)
    if errors:
        raise InvalidSpecError(errors, reason=PLACEMENT_REFUSED)

    replicas = tuple(
        ReplicaPlan(
            index=i,
            pod_name=pod_name(name, i),
            node=nodes[i],
            device_ids=spec.gpu.device_ids[i * tp : (i + 1) * tp] if spec.gpu.mode is GpuMode.SHARED else (),
            gpus=tp if spec.gpu.mode is GpuMode.EXCLUSIVE else 0,
            group_port=ports.replica_group_port(i),
            rank_offset=rank_offset(i, tp),
            world_size=tp,
        )
        for i in range(spec.replicas)
    )
    return Plan(
        name=name,
        namespace=namespace,
        spec=spec,
        ports=ports,
        replicas=replicas,
        image=image,
        model_cache=model_cache or ModelCache(),
    )
