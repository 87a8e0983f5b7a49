"""The wire protocol between the reward server and its clients, defined once.

Imported by the server (``rewardplane.server``), the SDK and the operator. It depends only on
pydantic so that a scoring-only client needs neither torch nor the server's dependencies.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import MutableMapping, Sequence
from enum import Enum
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

# --------------------------------------------------------------------------------------------
# Enums (seed 000 §5.2, seed 001 C.2)
# --------------------------------------------------------------------------------------------


class RewardModelTrainingMode(str, Enum):
    """Which parameters a weight push carries."""

    HEAD_ONLY = "head_only"
    """Only the score/classifier head (backbone frozen)."""
    LORA = "lora"
    """LoRA-trained model, merged into the backbone before sync (merge → sync → reinit)."""
    FULL = "full"
    """Every parameter, backbone and head."""


class PoolingType(str, Enum):
    """How a sequence's hidden states become one vector for the head."""

    LAST = "last"
    MEAN = "mean"
    CLS = "cls"
    STEP = "step"  # process reward models; not served yet (seed 001: deferred)


# --------------------------------------------------------------------------------------------
# Endpoint paths
# --------------------------------------------------------------------------------------------


class Endpoints:
    HEALTH = "/health"
    SCORE = "/score"
    CLASSIFY = "/classify"
    POOLING = "/pooling"
    RUNTIME_VERSION = "/runtime_version"
    WORLD_SIZE = "/get_world_size"
    METRICS = "/metrics"
    MODEL_INFO = "/model_info"
    # control plane (bearer token required)
    INIT_COMMUNICATOR = "/init_communicator"
    UPDATE_PARAM_BATCH = "/update_param_batch"
    CLOSE_COMMUNICATOR = "/close_communicator"
    NUM_BACKGROUND_TASKS = "/get_num_background_tasks"
    PARAM_MANIFEST = "/param_manifest"
    RESTORE_WEIGHTS = "/restore_weights"


CONTROL_PLANE_PATHS = frozenset(
    {
        Endpoints.INIT_COMMUNICATOR,
        Endpoints.UPDATE_PARAM_BATCH,
        Endpoints.CLOSE_COMMUNICATOR,
        Endpoints.NUM_BACKGROUND_TASKS,
        Endpoints.PARAM_MANIFEST,
        Endpoints.RESTORE_WEIGHTS,
    }
)

VERSION_HEADER = "X-Rewardplane-Weights-Version"
TOKEN_ENV = "REWARDPLANE_TOKEN"
TOKEN_FILE_ENV = "REWARDPLANE_TOKEN_FILE"

# --------------------------------------------------------------------------------------------
# Ports: the offset convention (seed 001 A.1) and per-server group ports (seed 004)
# --------------------------------------------------------------------------------------------

DEFAULT_POLICY_HTTP_PORT = 8000
DEFAULT_POLICY_GROUP_PORT = 51216
DEFAULT_PORT_OFFSET = 1
DEFAULT_HTTP_PORT = DEFAULT_POLICY_HTTP_PORT + DEFAULT_PORT_OFFSET  # 8001
DEFAULT_GROUP_PORT = DEFAULT_POLICY_GROUP_PORT + DEFAULT_PORT_OFFSET  # 51217


def _check_port(value: int, what: str) -> int:
    if not 1 <= value <= 65535:
        raise ValueError(f"{what} {value} is outside 1..65535; choose a valid TCP port")
    return value


class RewardModelPorts(BaseModel):
    model_config = ConfigDict(frozen=True)

    http: int
    group: int

    def replica_group_port(self, index: int) -> int:
        """Group port of server ``index`` when each replica has its own group: ``group + i``."""
        return replica_group_port(self.group, index)


def derive_ports(
    policy_http_port: int = DEFAULT_POLICY_HTTP_PORT,
    policy_group_port: int = DEFAULT_POLICY_GROUP_PORT,
    offset: int = DEFAULT_PORT_OFFSET,
) -> RewardModelPorts:
    """Reward-model ports = policy ports + offset (default +1: HTTP 8001, NCCL group 51217)."""
    _check_port(policy_http_port, "policy HTTP port")
    _check_port(policy_group_port, "policy group port")
    return RewardModelPorts(
        http=_check_port(policy_http_port + offset, f"HTTP port (policy {policy_http_port} + offset {offset})"),
        group=_check_port(
            policy_group_port + offset, f"group port (policy {policy_group_port} + offset {offset})"
        ),
    )


def replica_group_port(group_port: int, index: int) -> int:
    if index < 0:
        raise ValueError(f"replica index must be >= 0, got {index}")
    return _check_port(group_port + index, f"group port {group_port} + replica {index}")


def replica_group_ports(group_port: int, count: int) -> list[int]:
    return [replica_group_port(group_port, i) for i in range(count)]


def pair_servers(base_urls: str | list[str], group_ports: int | list[int]) -> list[tuple[str, int]]:
    """Seed 004's legacy paired-list form: lists pair by index; one int derives ``group_port + i``."""
    if isinstance(base_urls, str):
        if not isinstance(group_ports, int):
            raise ValueError("a single base_url takes a single int group_port")
        return [(base_urls, _check_port(group_ports, "group port"))]
    if not base_urls:
        raise ValueError("base_urls is empty: give at least one reward server URL")
    if isinstance(group_ports, int):
        return list(zip(base_urls, replica_group_ports(group_ports, len(base_urls)), strict=True))
    if len(group_ports) != len(base_urls):
        raise ValueError(
            f"{len(base_urls)} base_urls but {len(group_ports)} group_ports: give one group port per "
            "server, or a single int to derive group_port + i"
        )
    return [(u, _check_port(p, "group port")) for u, p in zip(base_urls, group_ports, strict=True)]


# --------------------------------------------------------------------------------------------
# Scoring (seed 000 §6.1 / §8.3, seed 001 C.2)
# --------------------------------------------------------------------------------------------

Score = float | list[float]


class ScoringRequest(BaseModel):
    """Body of ``POST /score``. ``inputs`` travels as ``input`` (the seed's wire name).

    ``normalize``: True applies the head's activation — sigmoid for one label, softmax over the
    labels for several. False returns the raw head output (what reward-model training uses).
    """

    model_config = ConfigDict(populate_by_name=True, frozen=True, extra="forbid")

    model: str = "reward-model"
    inputs: list[str] = Field(alias="input")
    pooling_type: PoolingType = PoolingType.LAST
    normalize: bool = True
    n_labels: int | None = Field(
        default=None, ge=1, description="Expected number of labels; the server rejects a mismatch."
    )
    truncate: bool = Field(
        default=False, description="Cut inputs longer than the server's max tokens instead of a 400."
    )
    return_hidden_states: bool = False

    @field_validator("inputs", mode="before")
    @classmethod
    def _one_string_is_a_list(cls, v: Any) -> Any:
        return [v] if isinstance(v, str) else v

    def wire(self) -> dict[str, Any]:
        return self.model_dump(mode="json", by_alias=True, exclude_defaults=False)


class ScoringResult(BaseModel):
    index: int
    score: Score
    num_tokens: int = 0


class Usage(BaseModel):
    prompt_tokens: int = 0
    total_tokens: int = 0


class ScoringResponse(BaseModel):
    """Body of the ``/score`` reply. ``version`` is the weights version that scored every item."""

    model: str
    data: list[ScoringResult]
    usage: Usage = Field(default_factory=Usage)
    version: int = 0
    metadata: dict[str, Any] = Field(default_factory=dict)

    @property
    def scores(self) -> list[Score]:
        return [d.score for d in sorted(self.data, key=lambda d: d.index)]


# vLLM-shaped endpoints, so a vLLM client (or the peer reward loop of seeds 002/003) works unchanged.
PromptInput = str | list[str] | list[int] | list[list[int]]


class ClassifyRequest(BaseModel):
    model_config = ConfigDict(extra="allow")

    model: str | None = None
    input: PromptInput
    use_activation: bool | None = None
    activation: bool | None = None  # older vLLM name of use_activation
    truncate_prompt_tokens: int | None = None
    user: str | None = None

    def activation_requested(self) -> bool:
        """Raw score unless the caller asks for the activation (a reward model wants raw scores)."""
        if self.use_activation is not None:
            return self.use_activation
        return bool(self.activation)


class ClassificationData(BaseModel):
    index: int
    label: str | None = None
    probs: list[float]
    num_classes: int


class ClassifyResponse(BaseModel):
    id: str
    object: str = "list"
    created: int
    model: str
    data: list[ClassificationData]
    usage: Usage
    version: int = 0


class PoolingRequest(ClassifyRequest):
    encoding_format: Literal["float"] = "float"


class PoolingData(BaseModel):
    index: int
    object: str = "pooling"
    data: list[float]


class PoolingResponse(BaseModel):
    id: str
    object: str = "list"
    created: int
    model: str
    data: list[PoolingData]
    usage: Usage
    version: int = 0


class HealthResponse(BaseModel):
    status: str = "ok"
    type: str = "reward_model"
    version: int = 0
    state: str = "serving"


class RuntimeVersionResponse(BaseModel):
    version: int
    state: Literal["serving", "updating", "broken"] = "serving"
    detail: str | None = None


class WorldSizeResponse(BaseModel):
    world_size: int


class ModelInfo(BaseModel):
    model: str
    engine: str
    num_labels: int
    dtype: str
    head_dtype: str
    max_model_len: int
    pooling_type: PoolingType
    version: int


class ErrorResponse(BaseModel):
    error: str
    detail: Any = None


# --------------------------------------------------------------------------------------------
# Control plane (seed 000 §6.3 / §8.3) and the data plane's bucket layout
# --------------------------------------------------------------------------------------------

# Element sizes, so the bucket layout can be computed without torch on either side.
DTYPE_ITEMSIZE: dict[str, int] = {
    "float64": 8,
    "float32": 4,
    "float16": 2,
    "bfloat16": 2,
    "int64": 8,
    "int32": 4,
    "int16": 2,
    "int8": 1,
    "uint8": 1,
    "bool": 1,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
}

BUCKET_ALIGN = 256  # every tensor starts at a 256-byte offset inside a flat bucket
DEFAULT_BUCKET_BYTES = 1 << 30  # 1 GiB: large flat buckets reach the link's limit (ENVIRONMENT.md)


def canonical_dtype(dtype: str) -> str:
    """``torch.bfloat16`` / ``bfloat16`` → ``bfloat16``; unknown names raise a clear error."""
    name = str(dtype).removeprefix("torch.")
    if name not in DTYPE_ITEMSIZE:
        raise ValueError(f"dtype {dtype!r} is not supported on the wire; use one of {sorted(DTYPE_ITEMSIZE)}")
    return name


class ParamMeta(BaseModel):
    model_config = ConfigDict(frozen=True)

    name: str = Field(min_length=1)
    dtype: str
    shape: tuple[int, ...]

    @field_validator("dtype")
    @classmethod
    def _dtype(cls, v: str) -> str:
        return canonical_dtype(v)

    @field_validator("shape")
    @classmethod
    def _shape(cls, v: tuple[int, ...]) -> tuple[int, ...]:
        if any(d < 0 for d in v):
            raise ValueError(f"shape {v} has a negative dimension")
        return v

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.numel * DTYPE_ITEMSIZE[self.dtype]


class BucketSlot(BaseModel):
    model_config = ConfigDict(frozen=True)

    index: int  # position in the metadata list
    offset: int  # byte offset inside the bucket
    nbytes: int


class Bucket(BaseModel):
    model_config = ConfigDict(frozen=True)

    nbytes: int
    slots: tuple[BucketSlot, ...]


def _align(n: int) -> int:
    return (n + BUCKET_ALIGN - 1) // BUCKET_ALIGN * BUCKET_ALIGN


def plan_buckets(metadata: list[ParamMeta], bucket_bytes: int = DEFAULT_BUCKET_BYTES) -> list[Bucket]:
    """Pack parameters, in the given order, into flat byte buckets of at most ``bucket_bytes``.

    Both sides compute the same plan from the announced metadata, so only bytes travel on the
    data plane. A tensor larger than ``bucket_bytes`` gets a bucket of its own.
    """
    if bucket_bytes < BUCKET_ALIGN:
        raise ValueError(f"bucket_bytes must be at least {BUCKET_ALIGN}, got {bucket_bytes}")
    buckets: list[Bucket] = []
    slots: list[BucketSlot] = []
    used = 0
    for i, meta in enumerate(metadata):
        size = meta.nbytes
        start = _align(used)
        if slots and start + size > bucket_bytes:
            buckets.append(Bucket(nbytes=used, slots=tuple(slots)))
            slots, start = [], 0
        slots.append(BucketSlot(index=i, offset=start, nbytes=size))
        used = start + size
    if slots:
        buckets.append(Bucket(nbytes=used, slots=tuple(slots)))
    return buckets


_FLOAT_DTYPES = frozenset({"float64", "float32", "float16", "bfloat16", "float8_e4m3fn", "float8_e5m2"})


def check_metadata(metadata: list[ParamMeta], manifest: dict[str, ParamMeta]) -> list[str]:
    """Everything wrong with an announced update against the served model's manifest.

    Run by the server before any byte is received, and by the trainer before it broadcasts.
    Floating dtypes may differ from the served ones (the server casts on receipt, e.g. an fp32
    head next to a bf16 backbone); names and shapes must match.
    """
    problems: list[str] = []
    for m in metadata:
        served = manifest.get(m.name)
        if served is None:
            problems.append(f"unknown parameter {m.name!r}: the served model has no parameter of that name")
            continue
        if tuple(m.shape) != tuple(served.shape):
            problems.append(
                f"parameter {m.name!r} has shape {list(m.shape)}; the served model expects {list(served.shape)}"
            )
        if m.dtype != served.dtype and not (m.dtype in _FLOAT_DTYPES and served.dtype in _FLOAT_DTYPES):
            problems.append(f"parameter {m.name!r} has dtype {m.dtype}; the served model holds {served.dtype}")
    return problems


class InitCommunicatorRequest(BaseModel):
    """Join the trainer's process group. The trainer hosts the TCPStore at host:port and is the
    last rank; this server's workers take ranks ``rank_offset .. rank_offset + world_size_local - 1``."""

    host: str
    port: int = Field(ge=1, le=65535)
    world_size: int = Field(ge=2)
    rank_offset: int = Field(default=0, ge=0)
    backend: Literal["auto", "nccl", "gloo"] = "auto"
    timeout_s: float = Field(default=120.0, gt=0)
    group_id: str | None = Field(default=None, description="Names the group; echoed in errors and logs.")

    @model_validator(mode="after")
    def _rank_fits(self) -> InitCommunicatorRequest:
        if self.rank_offset >= self.world_size - 1:
            raise ValueError(
                f"rank_offset {self.rank_offset} leaves no room in world_size {self.world_size}: the "
                "trainer takes the last rank, servers take ranks before it"
            )
        return self


LAYOUT_ID_PATTERN = r"^[0-9a-f]{16}$"
# Layouts a server (and each of its workers) keeps by id; a trainer alternates a few (full,
# head_only, lora), and an older one is simply announced in full again.
MAX_LAYOUTS = 16


def remember_layout(cache: MutableMapping[str, Any], key: str, value: Any) -> None:
    """Add ``key`` to a workers' layout cache: first in, first out, at most ``MAX_LAYOUTS``. The
    server's control plane mirrors its workers' caches with the same call, so both evict alike."""
    if key not in cache:
        if len(cache) >= MAX_LAYOUTS:
            cache.pop(next(iter(cache)))
        cache[key] = value


def layout_id(metadata: Sequence[ParamMeta], bucket_bytes: int) -> str:
    """Names one push layout (parameters in order, dtypes, shapes, bucket size). A trainer re-sends
    the same layout push after push; once a server has validated it, the trainer refers to it by
    this id instead of re-sending and re-validating hundreds of entries on every push's critical
    path."""
    h = hashlib.blake2b(digest_size=8)
    h.update(f"{bucket_bytes}\n".encode())
    for m in metadata:
        h.update(f"{m.name}\0{m.dtype}\0{','.join(str(d) for d in m.shape)}\n".encode())
    return h.hexdigest()


class UpdateParamBatchRequest(BaseModel):
    """Announce one weight push. The server validates every entry against the served model and
    answers 400 before any byte is broadcast; then it receives ``plan_buckets(metadata, bucket_bytes)``.

    ``layout_id`` without ``metadata`` refers to a layout this server validated before (409 if it
    does not know it: announce the metadata again)."""

    metadata: list[ParamMeta] = Field(default_factory=list)
    layout_id: str | None = Field(
        default=None, pattern=LAYOUT_ID_PATTERN,
        description="layout_id(metadata, bucket_bytes) of an announced layout; with metadata, it must match it",
    )
    training_mode: RewardModelTrainingMode = RewardModelTrainingMode.FULL
    version: int | None = Field(default=None, ge=0)
    bucket_bytes: int = Field(default=DEFAULT_BUCKET_BYTES, ge=BUCKET_ALIGN)
    atomic: bool = Field(
        default=False,
        description="Stage the whole update, then swap under the scoring lock (costs a copy of the "
        "pushed parameters in memory). Otherwise weights are written in place while scoring waits.",
    )
    timeout_s: float = Field(default=600.0, gt=0)

    @model_validator(mode="after")
    def _non_empty_unique(self) -> UpdateParamBatchRequest:
        if not self.metadata:
            if self.layout_id is None:
                raise ValueError(
                    "metadata is empty: announce at least one parameter (or name an announced layout by layout_id)"
                )
            return self
        if self.layout_id is not None and self.layout_id != layout_id(self.metadata, self.bucket_bytes):
            raise ValueError("layout_id does not match the announced metadata and bucket_bytes")
        seen: set[str] = set()
        for m in self.metadata:
            if m.name in seen:
                raise ValueError(f"parameter {m.name!r} is announced twice")
            seen.add(m.name)
        return self


class StatusResponse(BaseModel):
    status: str = "ok"
    detail: Any = None


class BackgroundTasksResponse(BaseModel):
    num_background_tasks: int
    last_error: str | None = None
    # The last finished update's timeline (version, mode, ok, bytes, announced_at and
    # after_announce_ms: event → ms after the announce reached the server; see control_plane).
    # Where a push's time goes, without a profiler.
    last_update: dict[str, Any] | None = None
