"""The weight-sync control plane and the data plane's bucket layout: parameter metadata,
flat-bucket planning, layout ids, and the join / announce / restore requests."""

from __future__ import annotations

import hashlib
import math
import re
from collections.abc import Mapping, MutableMapping, Sequence
from typing import Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    SerializationInfo,
    SerializerFunctionWrapHandler,
    StrictBool,
    StrictFloat,
    StrictInt,
    field_validator,
    model_serializer,
    model_validator,
)

from .adapters import AdapterConfig, lora_pairs
from .modes import RewardModelTrainingMode

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
DEFAULT_BUCKET_BYTES = (
    1 << 30
)  # 1 GiB: NCCL reaches the link's limit only with large flat buckets (docs/weight-sync.md)


def canonical_dtype(dtype: str) -> str:
    """``torch.bfloat16`` / ``bfloat16`` → ``bfloat16``; unknown names raise a clear error."""
    name = str(dtype).removeprefix("torch.")
    if name not in DTYPE_ITEMSIZE:
        raise ValueError(f"dtype {dtype!r} is not supported on the wire; use one of {sorted(DTYPE_ITEMSIZE)}")
    return name


class Piece(BaseModel):
    """Rows ``start:stop`` along a tensor's ``split_dim``, sent by trainer rank ``sender`` (its
    index among the trainer's sending ranks: an FSDP shard, or a tensor-parallel slice)."""

    model_config = ConfigDict(frozen=True)

    sender: StrictInt = Field(ge=0)
    start: StrictInt = Field(ge=0)
    stop: StrictInt = Field(ge=1)


# What a ParamMeta carries only when a push has several senders: left out of its JSON otherwise,
# so a single-sender layout reads (and hashes) as it always did.
_SHARDING_DEFAULTS: dict[str, Any] = {"sender": 0, "split_dim": None, "pieces": ()}


class ParamMeta(BaseModel):
    """One pushed tensor, whole: name, dtype, full shape. With several trainer ranks sending, who
    sends it: ``sender`` for the whole tensor, or ``pieces`` along ``split_dim`` that cover it."""

    model_config = ConfigDict(frozen=True)

    name: str = Field(min_length=1)
    dtype: str
    shape: tuple[StrictInt, ...]
    sender: StrictInt = Field(default=0, ge=0)
    split_dim: StrictInt | None = None
    pieces: tuple[Piece, ...] = ()

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

    @model_validator(mode="after")
    def _pieces_cover(self) -> ParamMeta:
        if not self.pieces and self.split_dim is None:
            return self
        if self.split_dim is None or not 0 <= self.split_dim < len(self.shape):
            raise ValueError(
                f"parameter {self.name!r}: pieces need a split_dim within its {len(self.shape)} dimensions"
            )
        if self.sender != 0:
            raise ValueError(f"parameter {self.name!r}: give either one sender or pieces, not both")
        if len(self.senders) != len(self.pieces):
            raise ValueError(f"parameter {self.name!r}: a sender sends at most one piece of a tensor")
        at = 0
        for p in self.pieces:
            if p.start != at or p.stop <= p.start:
                raise ValueError(
                    f"parameter {self.name!r}: pieces must cover dimension {self.split_dim} in order without "
                    f"gaps or overlaps; a piece starts at {p.start}, expected {at}"
                )
            at = p.stop
        if at != self.shape[self.split_dim]:
            raise ValueError(
                f"parameter {self.name!r}: pieces cover {at} of the {self.shape[self.split_dim]} rows of "
                f"dimension {self.split_dim}"
            )
        return self

    @model_serializer(mode="wrap")
    def _compact(self, handler: SerializerFunctionWrapHandler, info: SerializationInfo) -> dict[str, Any]:
        out: dict[str, Any] = handler(self)
        for key, default in _SHARDING_DEFAULTS.items():
            if key in out and out[key] in (default, [] if default == () else default):
                del out[key]
        return out

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.numel * DTYPE_ITEMSIZE[self.dtype]

    @property
    def senders(self) -> set[int]:
        """The trainer ranks (sender indexes) that send part of this tensor."""
        return {p.sender for p in self.pieces} if self.pieces else {self.sender}

    def piece_shape(self, piece: Piece) -> tuple[int, ...]:
        assert self.split_dim is not None
        shape = list(self.shape)
        shape[self.split_dim] = piece.stop - piece.start
        return tuple(shape)

    def wire_parts(self) -> list[tuple[int, Piece | None, int]]:
        """(sender, piece or None for the whole tensor, bytes) in the order they travel."""
        if not self.pieces:
            return [(self.sender, None, self.nbytes)]
        item = DTYPE_ITEMSIZE[self.dtype]
        return [(p.sender, p, math.prod(self.piece_shape(p)) * item) for p in self.pieces]


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


# The wire shape of a bucket: one broadcast per tensor, grouped per bucket, so that the trainer
# sends straight from its parameters and a server receives straight into its own (on 4x H100, 7B,
# vLLM, a push took 40.5 ms against 42.1 with one broadcast of a packed bucket, and to two
# replicas 1.03x the time of one against 1.12x).
#
# The first bucket holds at most an eighth of the others' bytes (or one larger tensor). No byte
# moves until both sides have posted a bucket's group, and posting costs each side tens of
# microseconds of Python per tensor: a short first group starts the link while the rest is posted.
# 1 GiB buckets: the embedding table alone goes first. On 4x H100 (7B, vLLM) the first receive was
# posted 0.44 ms after the agreement instead of 1.0 ms (25 tensors), and a push took 39.5 ms
# instead of 40.4 (docs/weight-sync.md).
FIRST_BUCKET_SHARE = 8
# Both sides must plan alike: the wire's shape is part of every layout's id, so a trainer and a
# server of versions with different wires refuse the layout instead of pairing mismatched broadcasts.
WIRE_LAYOUT = f"per-tensor wire, first bucket 1/{FIRST_BUCKET_SHARE}"


def plan_buckets(metadata: list[ParamMeta], bucket_bytes: int = DEFAULT_BUCKET_BYTES) -> list[Bucket]:
    """Pack parameters, in the given order, into flat byte buckets of at most ``bucket_bytes``
    (the first of at most ``bucket_bytes // FIRST_BUCKET_SHARE``).

    Both sides compute the same plan from the announced metadata, so only bytes travel on the
    data plane. A tensor larger than its bucket's limit gets a bucket of its own.
    """
    if bucket_bytes < BUCKET_ALIGN:
        raise ValueError(f"bucket_bytes must be at least {BUCKET_ALIGN}, got {bucket_bytes}")
    buckets: list[Bucket] = []
    slots: list[BucketSlot] = []
    used = 0
    limit = max(BUCKET_ALIGN, bucket_bytes // FIRST_BUCKET_SHARE)
    for i, meta in enumerate(metadata):
        size = meta.nbytes
        start = _align(used)
        if slots and start + size > (limit if not buckets else bucket_bytes):
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
            problems.append(
                f"parameter {m.name!r} has dtype {m.dtype}; the served model holds {served.dtype}"
            )
    return problems


def check_adapter_metadata(
    metadata: Sequence[ParamMeta],
    manifest: Mapping[str, ParamMeta],
    adapter: AdapterConfig,
    *,
    max_rank: int,
) -> list[str]:
    """Everything wrong with an announced adapter push against the served model.

    Run by the server before any byte is received and by the trainer before it broadcasts.
    Each LoRA pair must sit on a served 2-D weight with shapes ``[rank, in]`` / ``[out, rank]``;
    other entries (e.g. a head trained through ``modules_to_save``) must fit like a plain push."""
    problems: list[str] = []
    if adapter.rank > max_rank:
        problems.append(
            f"adapter rank {adapter.rank} exceeds the server's maximum LoRA rank {max_rank}: restart it with a "
            f"larger --max-lora-rank (RewardModel spec.lora.maxRank), or train with a smaller rank"
        )
    by_name = {m.name: m for m in metadata}
    pairs, plain = lora_pairs([m.name for m in metadata])
    unsupported = [n for n in plain if re.search(r"\.lora_(embedding_A|embedding_B|magnitude_vector)", n)]
    if unsupported:
        problems.append(
            f"{unsupported[0]!r}: LoRA on embeddings and DoRA magnitudes are not served as adapters; "
            "push merged weights (sync mode full)"
        )
    if not pairs:
        problems.append(
            "an adapter push carries no LoRA tensors (names ending .lora_A.weight / .lora_B.weight)"
        )
    for module, (a, b) in sorted(pairs.items()):
        base = manifest.get(f"{module}.weight")
        if base is None or len(base.shape) != 2:
            problems.append(f"LoRA on {module!r}: the served model has no 2-D weight {module + '.weight'!r}")
            continue
        if a is None or b is None:
            problems.append(f"LoRA on {module!r} needs both lora_A and lora_B; one is missing")
            continue
        out_f, in_f = base.shape
        want = {a: (adapter.rank, in_f), b: (out_f, adapter.rank)}
        for name, shape in want.items():
            got = tuple(by_name[name].shape)
            if got != shape:
                problems.append(
                    f"{name!r} has shape {list(got)}; rank {adapter.rank} over {module!r} needs {list(shape)}"
                )
    rest = [by_name[n] for n in plain if n not in unsupported]
    problems += check_metadata(rest, dict(manifest))
    return problems


# ---- delta pushes (docs/weight-sync.md "Delta pushes") ---------------------------------------------
# A delta push carries only the tensors that changed since ``base_version``; the rest stays as the
# replica holds it. That is right only where the replica holds exactly what ``base_version`` was
# pushed as, so every replica checks it before any byte moves and refuses with this code otherwise.
STALE_BASE = "stale_base"


def check_delta_base(base_version: int | None, version: int | None, mode: RewardModelTrainingMode) -> None:
    """The request-level rules of ``base_version`` (raises ``ValueError``): full pushes only, and
    older than the version it makes."""
    if base_version is None:
        return
    if mode is not RewardModelTrainingMode.FULL:
        raise ValueError(f"base_version (a delta push) goes with training_mode full only, not {mode.value}")
    if version is not None and base_version >= version:
        raise ValueError(f"base_version {base_version} must be older than the pushed version {version}")


def delta_refusal(base_version: int, *, served: int, state: str, delta_base: int | None) -> str | None:
    """Why a replica cannot take a delta push on ``base_version``, or None. ``delta_base``: the version
    this replica's weights were last committed as by a push, None when anything else wrote them
    since (a start, a restore, a failed update)."""
    if state != "serving":
        return f"this replica is {state}, not serving version {base_version}: a delta push needs every parameter intact"
    if served != base_version:
        return f"this replica serves version {served}, not {base_version} that the delta push builds on"
    if delta_base != base_version:
        return (
            f"this replica's weights of version {served} were not committed by a push in this process (it "
            "restarted or was restored since): a delta push builds only on pushed weights"
        )
    return None


class InitCommunicatorRequest(BaseModel):
    """Join the trainer's process group. The trainer hosts the TCPStore at host:port; its
    ``senders`` ranks take the last ranks (sender i is rank ``world_size - senders + i``); this
    server's workers take ranks ``rank_offset .. rank_offset + world_size_local - 1``."""

    model_config = ConfigDict(extra="forbid")  # a misspelt field is a 422, not a default

    host: str
    port: StrictInt = Field(ge=1, le=65535)
    world_size: StrictInt = Field(ge=2)
    rank_offset: StrictInt = Field(default=0, ge=0)
    senders: StrictInt = Field(
        default=1, ge=1, description="How many trainer ranks send parts of each push (the last ranks)."
    )
    # "ipc": the same-host transport (CUDA IPC on one GPU, shared memory on CPU); "auto" picks it
    # where ranks share a GPU
    backend: Literal["auto", "nccl", "gloo", "ipc"] = "auto"
    # A server waits on one join at a time: until this passes, a second join is answered 409.
    timeout_s: StrictFloat = Field(default=120.0, gt=0)
    group_id: str | None = Field(default=None, description="Names the group; echoed in errors and logs.")

    @model_validator(mode="after")
    def _rank_fits(self) -> InitCommunicatorRequest:
        if self.rank_offset >= self.world_size - self.senders:
            raise ValueError(
                f"rank_offset {self.rank_offset} leaves no room in world_size {self.world_size}: the "
                f"trainer's {self.senders} sending rank(s) take the last ranks, servers take ranks before them"
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
    h.update(f"{WIRE_LAYOUT}\n".encode())  # a receiver of another wire refuses the id
    for m in metadata:
        h.update(f"{m.name}\0{m.dtype}\0{','.join(str(d) for d in m.shape)}\n".encode())
        if m.sender or m.pieces:  # who sends what is part of the wire; one sender hashes as it did
            pieces = ",".join(f"{p.sender}:{p.start}:{p.stop}" for p in m.pieces)
            h.update(f"\1{m.sender}\0{m.split_dim}\0{pieces}\n".encode())
    return h.hexdigest()


class UpdateParamBatchRequest(BaseModel):
    """Announce one weight push. The server validates every entry against the served model and
    answers 400 before any byte is broadcast; then it receives ``plan_buckets(metadata, bucket_bytes)``.

    ``layout_id`` without ``metadata`` refers to a layout this server validated before (409 if it
    does not know it: announce the metadata again)."""

    model_config = ConfigDict(extra="forbid")  # a misspelt field is a 422, not a default

    metadata: list[ParamMeta] = Field(default_factory=list)
    layout_id: str | None = Field(
        default=None,
        pattern=LAYOUT_ID_PATTERN,
        description="layout_id(metadata, bucket_bytes) of an announced layout; with metadata, it must match it",
    )
    training_mode: RewardModelTrainingMode = RewardModelTrainingMode.FULL
    version: StrictInt | None = Field(default=None, ge=0)
    bucket_bytes: StrictInt = Field(default=DEFAULT_BUCKET_BYTES, ge=BUCKET_ALIGN)
    atomic: StrictBool = Field(
        default=False,
        description="Stage the whole update, then swap under the scoring lock (costs a copy of the "
        "pushed parameters in memory). Otherwise weights are written in place while scoring waits.",
    )
    timeout_s: StrictFloat = Field(default=600.0, gt=0)
    adapter: AdapterConfig | None = Field(
        default=None,
        description="training_mode adapter only: the LoRA configuration the pushed A/B tensors belong to",
    )
    base_version: StrictInt | None = Field(
        default=None,
        ge=0,
        description="A delta push: only the tensors that changed since this version, which the replica must "
        "serve as it was pushed (else 409 before any byte moves); training_mode full only",
    )
    agree_slicing: StrictBool = Field(
        default=False,
        description="Before the first bucket, every worker and every trainer rank agree in one reduction "
        "whether the push is sliced (each worker receives only its published slices, protocol.slices): a "
        "worker agrees when it published its places of this layout in this group, the trainer when it "
        "wants it. The trainer joins that reduction too (pushes through the operator).",
    )

    @model_validator(mode="after")
    def _non_empty_unique(self) -> UpdateParamBatchRequest:
        check_delta_base(self.base_version, self.version, self.training_mode)
        if (self.training_mode == RewardModelTrainingMode.ADAPTER) != (self.adapter is not None):
            raise ValueError(
                "training_mode adapter needs adapter {rank, alpha}, and only it takes one: send both or neither"
            )
        if not self.metadata:
            if self.layout_id is None:
                raise ValueError(
                    "metadata is empty: announce at least one parameter (or name an announced layout by layout_id)"
                )
            return self
        if self.layout_id is not None and self.layout_id != layout_id(self.metadata, self.bucket_bytes):
            raise ValueError(
                "layout_id does not match the announced metadata and bucket_bytes (or the trainer and "
                f"this server plan different wires: this server's is {WIRE_LAYOUT!r}; run one rewardplane "
                "version on both)"
            )
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


class RestoreWeightsRequest(BaseModel):
    """Ask a restarted replica to load the weights it saved for ``version`` (the operator sends it)."""

    model_config = ConfigDict(extra="forbid")  # a misspelt field is a 422, not a default

    version: StrictInt = Field(ge=1)
    timeout_s: StrictFloat = Field(default=300.0, gt=0)


class WorkerChecksums(BaseModel):
    """One worker's live parameters: name → [sha256 of the bytes, dtype, shape], under the engine's own
    names (vLLM's are fused and sharded per tensor-parallel rank)."""

    rank: int
    checksums: dict[str, tuple[str, str, list[int]]]


class ParamChecksumsResponse(BaseModel):
    """``GET /param_checksums``: what every worker holds, and the weights version it is."""

    version: int
    workers: list[WorkerChecksums]


class SendWeightsRequest(BaseModel):
    """Ask a replica that serves ``version`` to send its weights to joining peers (peer restore).

    The sender hosts the rendezvous on ``port`` and takes the last rank of a group of
    ``world_size``; the receivers join it with ``/init_communicator`` (host: the sender) and
    accept a full push of the sender's parameter manifest with ``/update_param_batch``.
    """

    model_config = ConfigDict(extra="forbid")  # a misspelt field is a 422, not a default

    port: int = Field(ge=1, le=65535)
    world_size: int = Field(ge=2)
    version: int = Field(ge=1, description="The version the sender must serve; refused (409) otherwise.")
    bucket_bytes: int = Field(default=DEFAULT_BUCKET_BYTES, ge=BUCKET_ALIGN)
    timeout_s: float = Field(default=300.0, gt=0)
    group_id: str | None = None

    @property
    def group(self) -> str:
        """The group's id: ``group_id``, else one named after the version sent."""
        return self.group_id or f"peer-v{self.version}"


# ---- pushes started from the data plane (docs/weight-sync.md) ------------------------------------
# After a layout was announced over HTTP once, a trainer starts a push by writing a header into its
# group's TCPStore (which every server already reaches), not by an HTTP request: each server's
# control plane waits on it, takes the weights lock and tells its workers, which wait on their own
# key; accept or refuse is agreed in a status reduction before any byte moves, the commit in one
# after. Every message is a small JSON document under a key below, in the group's store namespace.
# Rank offsets name the replicas (unique in a group); seq counts the group's data-plane pushes.


class PushHeader(BaseModel):
    """Trainer → every replica's control plane: one push of an announced layout."""

    seq: StrictInt = Field(ge=0)
    version: StrictInt = Field(ge=0)
    layout_id: str = Field(pattern=LAYOUT_ID_PATTERN)
    bucket_bytes: StrictInt = Field(ge=BUCKET_ALIGN)
    training_mode: RewardModelTrainingMode = RewardModelTrainingMode.FULL
    atomic: StrictBool = False
    timeout_s: StrictFloat = Field(default=600.0, gt=0)
    # each receiving rank gets only what it published that it keeps (``protocol.slices``)
    sliced: StrictBool = False
    base_version: StrictInt | None = Field(default=None, ge=0)  # a delta push (UpdateParamBatchRequest's)

    @model_validator(mode="after")
    def _delta_base(self) -> PushHeader:
        check_delta_base(self.base_version, self.version, self.training_mode)
        return self


class PushGo(BaseModel):
    """A replica's control plane → its workers (over the replica's push channel): receive (the
    lock is held) or refuse."""

    seq: StrictInt
    layout_id: str = ""
    bucket_bytes: StrictInt = 0
    apply: StrictBool = True  # False: stage (atomic); the control plane swaps under the lock later
    error: str | None = None  # refused: join the ready reduction with a failure, move nothing
    sliced: StrictBool = False  # receive only this worker's published slices, into its parameters


class PushLoaded(BaseModel):
    """A worker → its control plane (over the push channel): what it received and loaded (or staged)."""

    ok: StrictBool
    partial: StrictBool = False  # some weights were overwritten before the failure
    refused: StrictBool = False  # a rank refused in the ready reduction: nothing moved
    bytes: StrictInt = 0
    in_place_bytes: StrictInt = 0  # of ``bytes``, received straight into parameters (per-tensor wire)
    error: str | None = None
    times: dict[str, float] = Field(default_factory=dict)


class PushVerdict(BaseModel):
    """A replica's control plane → its workers and the trainer: committed, refused or failed."""

    committed: StrictBool
    error: str | None = None
    code: Literal["ok", "refused", "unknown_layout", "stale_base", "failed"] = "ok"


STOP_LISTENING = "stop"  # a header slot holding this value ends a control plane's wait


class PushKeys:
    """Key names in the group's store, between the trainer and the replicas' control planes (one
    definition for both; a control plane and its workers talk over their own push channel)."""

    @staticmethod
    def listening(replica: int) -> str:
        return f"push/listening/{replica}"

    @staticmethod
    def header(seq: int) -> str:
        return f"push/{seq}/header"

    @staticmethod
    def verdict(seq: int, replica: int) -> str:
        return f"push/{seq}/verdict/{replica}"
