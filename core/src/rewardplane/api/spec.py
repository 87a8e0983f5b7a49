"""The RewardModel spec as typed objects, with the defaults and checks of crds/rewardmodel.yaml.

The CRD schema already refuses most bad values, but Kubernetes 1.20 enforces no CEL and an
object written before a schema change may still carry old values, so the operator parses every
spec itself and reports *all* problems at once, each naming the field and what to do.
"""

from __future__ import annotations

from enum import Enum
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from rewardplane.protocol import (
    DEFAULT_POLICY_GROUP_PORT,
    DEFAULT_POLICY_HTTP_PORT,
    DEFAULT_PORT_OFFSET,
    DEFAULT_STEP_SEPARATOR,
    ModelKind,
    ModelTask,
    StepAggregation,
)

DEFAULT_MEMORY_FRACTION = 0.9


class _Spec(BaseModel):
    # camelCase on the wire (the CRD), snake_case in Python; unknown fields are ignored because the
    # API server already prunes them and an old operator must not choke on a newer field.
    model_config = ConfigDict(populate_by_name=True, extra="ignore", frozen=True)


class GpuMode(str, Enum):
    EXCLUSIVE = "exclusive"
    SHARED = "shared"
    NONE = "none"


class EngineKind(str, Enum):
    VLLM = "vllm"
    HF = "hf"


class ProcessSpec(_Spec):
    """A process reward model's step marking (``spec.model.process``; the server's step flags)."""

    step_tag: str | None = Field(default=None, min_length=1, alias="stepTag")
    step_separator: str = Field(default=DEFAULT_STEP_SEPARATOR, min_length=1, alias="stepSeparator")
    good_label: int = Field(default=1, ge=0, alias="goodLabel")
    aggregation: StepAggregation | None = None
    # vLLM: step (vLLM's STEP pooler) or token (every token's row, selected by the server)
    vllm_pooling: str = Field(default="step", pattern="^(step|token)$", alias="vllmPooling")


class ModelSpec(_Spec):
    source: str = Field(min_length=1)
    revision: str | None = None
    # A Secret whose keys become the download's environment (AWS_ACCESS_KEY_ID, HF_TOKEN, ...).
    source_secret: str | None = Field(default=None, min_length=1, alias="sourceSecret")
    # An S3-compatible store's URL, or a hub mirror's.
    source_endpoint: str | None = Field(default=None, min_length=1, alias="sourceEndpoint")
    served_name: str | None = Field(default=None, alias="servedName")
    # More names requests may carry as `model` (the served name and the source are always accepted).
    aliases: tuple[str, ...] = ()
    dtype: str = Field(default="auto", pattern="^(auto|float32|bfloat16|float16)$")
    max_length: int | None = Field(default=None, ge=1, alias="maxLength")
    num_labels: int = Field(default=1, ge=1, alias="numLabels")
    pooling: str = Field(default="last", pattern="^(last|mean|cls)$")
    normalize: bool = False
    # score: a score head (the scoring endpoints); generate: a causal LM answering chats (an LLM judge)
    task: ModelTask = ModelTask.SCORE
    # sequence: one score per text; process: a process reward model scoring each step (``process``)
    kind: ModelKind = ModelKind.SEQUENCE
    process: ProcessSpec = Field(default_factory=ProcessSpec)


class EngineSpec(_Spec):
    kind: EngineKind = EngineKind.VLLM
    # None (or empty): the operator's default reward-server image (the chart's serverImage value,
    # the operator's ``--default-server-image``).
    image: str | None = None
    image_pull_policy: str = Field(
        default="IfNotPresent", pattern="^(Always|IfNotPresent|Never)$", alias="imagePullPolicy"
    )
    extra_args: tuple[str, ...] = Field(default=(), alias="extraArgs")


class GpuSpec(_Spec):
    mode: GpuMode = GpuMode.EXCLUSIVE
    node: str | None = None
    device_ids: tuple[int, ...] = Field(default=(), alias="deviceIds")
    memory_fraction: float = Field(default=DEFAULT_MEMORY_FRACTION, gt=0, le=1, alias="memoryFraction")


class PortsSpec(_Spec):
    policy_http_port: int = Field(default=DEFAULT_POLICY_HTTP_PORT, alias="policyHttpPort")
    policy_group_port: int = Field(default=DEFAULT_POLICY_GROUP_PORT, alias="policyGroupPort")
    offset: int = DEFAULT_PORT_OFFSET
    http: int | None = None
    group: int | None = None


class WeightSyncSpec(_Spec):
    enabled: bool = True
    default_training_mode: str = Field(
        default="full", pattern="^(head_only|lora|full)$", alias="defaultTrainingMode"
    )
    timeout_seconds: int = Field(default=600, ge=1, alias="timeoutSeconds")
    persist_dir: str | None = Field(default=None, alias="persistDir")
    # Without persistDir: a copy of the pushed weights in an emptyDir of each Pod, so a container
    # that restarts in its Pod gets them back (costs node disk about the size of what was pushed).
    pod_copy: bool = Field(default=True, alias="podCopy")


class LoraSpec(_Spec):
    """Serve pushed LoRA adapters (WeightSync trainingMode adapter) over untouched base weights."""

    enabled: bool = False
    max_rank: int = Field(default=16, ge=1, le=512, alias="maxRank")


class NetworkPolicySpec(_Spec):
    enabled: bool = True


# Environment a RewardModel may pass to its servers for the weight transfer: the collective
# libraries' own settings, never variables the operator sets itself (CUDA_VISIBLE_DEVICES, ...).
TRANSPORT_ENV_PREFIXES = ("NCCL_", "GLOO_", "TORCH_NCCL_", "UCX_", "NVSHMEM_")
# What spec.transport.interface sets: NCCL's interface on GPUs, gloo's on CPU.
INTERFACE_VARIABLES = ("NCCL_SOCKET_IFNAME", "GLOO_SOCKET_IFNAME")


class TransportSpec(_Spec):
    """What a push between hosts needs of the reward servers' Pods: the collective library's
    environment, the interface it uses, the host's network, and locked memory for RDMA."""

    env: dict[str, str] = Field(default_factory=dict)
    # The interface the transfer uses (NCCL_SOCKET_IFNAME, GLOO_SOCKET_IFNAME); with a secondary
    # network (Multus), the address status.endpoints gives for NCCL is this interface's.
    interface: str | None = Field(default=None, min_length=1, pattern=r"^[A-Za-z0-9_.:@-]{1,15}$")
    host_network: bool = Field(default=False, alias="hostNetwork")
    # CAP_IPC_LOCK: RDMA verbs register (lock) the buffers they send from, beyond RLIMIT_MEMLOCK.
    ipc_lock: bool = Field(default=False, alias="ipcLock")
    # The node's IPC namespace (and /dev/shm): a trainer in another Pod on the same node and GPUs
    # pushes through CUDA IPC (shared memory on CPU) only when both Pods share it.
    host_ipc: bool = Field(default=False, alias="hostIPC")


class ResourcesSpec(_Spec):
    limits: dict[str, int | str] = Field(default_factory=dict)
    requests: dict[str, int | str] = Field(default_factory=dict)


class RewardModelSpec(_Spec):
    model: ModelSpec
    engine: EngineSpec = Field(default_factory=EngineSpec)
    replicas: int = Field(default=1, ge=0)
    tensor_parallel_size: int = Field(default=1, ge=1, alias="tensorParallelSize")
    gpu: GpuSpec = Field(default_factory=GpuSpec)
    ports: PortsSpec = Field(default_factory=PortsSpec)
    weight_sync: WeightSyncSpec = Field(default_factory=WeightSyncSpec, alias="weightSync")
    lora: LoraSpec = Field(default_factory=LoraSpec)
    resources: ResourcesSpec = Field(default_factory=ResourcesSpec)
    network_policy: NetworkPolicySpec = Field(default_factory=NetworkPolicySpec, alias="networkPolicy")
    transport: TransportSpec = Field(default_factory=TransportSpec)

    @property
    def devices_needed(self) -> int:
        """GPUs the whole model occupies (0 on CPU)."""
        return 0 if self.gpu.mode is GpuMode.NONE else self.replicas * self.tensor_parallel_size


INVALID_SPEC = "InvalidSpec"
PLACEMENT_REFUSED = "PlacementRefused"
"""The spec is valid but the cluster cannot place it now (retried: capacity may free up)."""
NO_IMAGE = "NoImage"
"""spec.engine.image is omitted and the operator has no default reward-server image."""


class InvalidSpecError(ValueError):
    """The spec cannot be served as written; ``errors`` lists every problem."""

    def __init__(self, errors: list[str], reason: str = INVALID_SPEC) -> None:
        super().__init__("; ".join(errors))
        self.errors = errors
        self.reason = reason
        """CamelCase reason for the Degraded condition: InvalidSpec, PlacementRefused or NoImage."""


def _field_path(loc: tuple[Any, ...]) -> str:
    return "spec." + ".".join(str(p) for p in loc)


def _pydantic_errors(exc: ValidationError) -> list[str]:
    # by_alias locations give the camelCase names a user wrote in the manifest.
    return [f"{_field_path(e['loc'])}: {e['msg']} (got {e.get('input')!r})" for e in exc.errors()]


def parse_spec(spec: dict[str, Any]) -> RewardModelSpec:
    """Parse a RewardModel ``spec`` dict, applying the CRD's defaults.

    Raises InvalidSpecError with every type/range problem (not the cross-field ones: see
    ``validate_spec``).
    """
    try:
        return RewardModelSpec.model_validate(spec or {})
    except ValidationError as exc:
        raise InvalidSpecError(_pydantic_errors(exc)) from None
