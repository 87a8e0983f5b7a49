"""Pure WeightSync decisions: what a push may do, which replicas join it at which ranks, how each
replica's answers read, and what the status says. The driver (``weightsync_driver``) does the I/O.

A push: Pending (checked: the version must be newer than the model's) → Rendezvous (every target
replica asked to join the trainer's group) → Transferring (every replica accepted the announce;
the trainer broadcasts) → Completed | Failed.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from rewardplane.api.weightsync import (
    COMPLETED,
    DEFAULT_MANIFEST_KEY,
    FAILED,
    HISTORY_LIMIT,
    INVALID_SPEC,
    NO_REPLICAS,
    PENDING,
    REPLICA_FAILED,
    STALE_VERSION,
    TERMINAL,
    TIMEOUT,
    TRANSFERRING,
    WeightSyncRefused,
    parse_adapter,
)
from rewardplane.protocol import AdapterConfig, ParamMeta, RewardModelTrainingMode, plan_buckets


@dataclass(frozen=True)
class PushRequest:
    """A WeightSync's spec, with the RewardModel's defaults applied."""

    namespace: str
    name: str
    generation: int
    model: str
    version: int
    training_mode: RewardModelTrainingMode
    address: str
    port: int
    config_map: str | None
    manifest_key: str
    manifest_sha256: str | None
    bucket_bytes: int
    timeout_s: float
    adapter: AdapterConfig | None = None  # trainingMode adapter: the LoRA configuration
    senders: int = 1  # the trainer's sending ranks: the last ranks of the group
    base_version: int | None = None  # a delta push: only the tensors changed since this version
    # the trainer joins the agreement on slicing (UpdateParamBatchRequest.agree_slicing)
    agree_slicing: bool = False

    @property
    def group_id(self) -> str:
        """Names the push's process group on every rank (the trainer reads it from status)."""
        return f"{self.name}-g{self.generation}"


def parse_push(ws: Mapping[str, Any], rm_spec: Mapping[str, Any] | None) -> PushRequest:
    """The push a WeightSync asks for; raises WeightSyncRefused naming the field to fix."""
    meta, spec = ws.get("metadata") or {}, ws.get("spec") or {}
    sync = (rm_spec or {}).get("weightSync") or {}
    rendezvous = spec.get("rendezvous") or {}
    manifest = spec.get("manifestRef") or {}
    problems = []
    if not isinstance(spec.get("version"), int) or spec["version"] < 1:
        problems.append(f"spec.version must be an integer >= 1 (got {spec.get('version')!r})")
    if not rendezvous.get("address") or not isinstance(rendezvous.get("port"), int):
        problems.append("spec.rendezvous needs address and port: where the trainer hosts the TCPStore")
    if not manifest.get("configMapName"):
        problems.append(
            "spec.manifestRef.configMapName is missing: the ConfigMap with the parameter manifest"
        )
    mode_name = spec.get("trainingMode") or sync.get("defaultTrainingMode") or "full"
    try:
        mode = RewardModelTrainingMode(mode_name)
    except ValueError:
        problems.append(f"spec.trainingMode {mode_name!r} is not one of head_only, lora, full, adapter")
        mode = RewardModelTrainingMode.FULL
    adapter = None
    if mode is RewardModelTrainingMode.ADAPTER:
        if not ((rm_spec or {}).get("lora") or {}).get("enabled"):
            problems.append(
                "spec.trainingMode adapter needs LoRA enabled on the RewardModel (spec.lora.enabled: true; the "
                "replicas restart with it), or push merged weights (trainingMode lora)"
            )
        try:
            adapter = parse_adapter(spec.get("adapter"))
        except WeightSyncRefused as exc:
            problems.append(str(exc))
    elif spec.get("adapter") is not None:
        problems.append(f"spec.adapter goes with trainingMode adapter only, not {mode.value}")
    senders = (spec.get("trainer") or {}).get("ranks", 1)
    if not isinstance(senders, int) or isinstance(senders, bool) or senders < 1:
        problems.append(f"spec.trainer.ranks must be an integer >= 1 (got {senders!r})")
        senders = 1
    base = spec.get("baseVersion")
    if base is not None:
        if not isinstance(base, int) or isinstance(base, bool) or base < 0:
            problems.append(f"spec.baseVersion must be an integer >= 0 (got {base!r})")
        elif isinstance(spec.get("version"), int) and base >= spec["version"]:
            problems.append(f"spec.baseVersion {base} must be older than spec.version {spec['version']}")
        if mode is not RewardModelTrainingMode.FULL:
            problems.append(
                f"spec.baseVersion (a delta push) goes with trainingMode full only, not {mode.value}"
            )
    # under spec.trainer: an SDK that predates it clears spec.trainer in its merge patch, so a
    # flag left by a newer one can never make the replicas wait for an agreement nobody joins
    agree = (spec.get("trainer") or {}).get("agreeSlicing", False)
    if not isinstance(agree, bool):
        problems.append(f"spec.trainer.agreeSlicing must be true or false (got {agree!r})")
    if problems:
        raise WeightSyncRefused(INVALID_SPEC, "; ".join(problems))
    return PushRequest(
        namespace=meta.get("namespace", "default"),
        name=meta["name"],
        generation=int(meta.get("generation") or 1),
        model=str(spec["rewardModelRef"]),
        version=int(spec["version"]),
        training_mode=mode,
        address=str(rendezvous["address"]),
        port=int(rendezvous["port"]),
        config_map=manifest.get("configMapName"),
        manifest_key=manifest.get("key") or DEFAULT_MANIFEST_KEY,
        manifest_sha256=manifest.get("sha256"),
        bucket_bytes=int(spec.get("bucketBytes") or 1 << 30),
        timeout_s=float(spec.get("timeoutSeconds") or sync.get("timeoutSeconds") or 600),
        adapter=adapter,
        senders=senders,
        base_version=base,
        agree_slicing=agree is True,
    )


def needs_push(ws: Mapping[str, Any]) -> bool:
    """True when the WeightSync's current generation has not been handled yet."""
    status = ws.get("status") or {}
    return status.get("observedGeneration") != (ws.get("metadata") or {}).get("generation")


def interrupted(ws: Mapping[str, Any]) -> bool:
    """The current generation was started but never finished (the operator restarted mid-push)."""
    status = ws.get("status") or {}
    return not needs_push(ws) and bool(status.get("phase")) and status.get("phase") not in TERMINAL


def resumable_transfer(ws: Mapping[str, Any], now: float, elapsed_s: float) -> Transfer | None:
    """The transfer an operator that restarted mid-push can follow to its end, or None.

    Once a push is Transferring, every target accepted the announce and the trainer broadcasts to
    them directly: the operator's part is only to watch the replicas reach the version, which a
    new operator can do from the status (targets, timeout, start time). Earlier phases cannot be
    resumed: the trainer's group needs the announces the dead operator never sent.
    """
    status, spec = ws.get("status") or {}, ws.get("spec") or {}
    if not interrupted(ws) or status.get("phase") != TRANSFERRING:
        return None
    targets = []
    for r in status.get("replicas") or []:
        try:
            targets.append(
                Target(
                    int(r["replica"]), str(r["pod"]), str(r["url"]), int(r["worldSize"]), int(r["rankOffset"])
                )
            )
        except (KeyError, TypeError, ValueError):
            return None
    version = status.get("version") or spec.get("version")
    if not targets or not isinstance(version, int):
        return None
    timeout_s = float(spec.get("timeoutSeconds") or 600)
    return Transfer(
        version=version,
        timeout_s=timeout_s,
        nbytes=int(status.get("bytes") or 0),
        targets=tuple(targets),
        announced=now - elapsed_s,
        deadline=now - elapsed_s + timeout_s,
    )


def current_version(rm: Mapping[str, Any], weightsyncs: Sequence[Mapping[str, Any]]) -> int:
    """The newest weights version the model is known to serve: its status, or a completed push."""
    status_version = int((rm.get("status") or {}).get("weightsVersion") or 0)
    return max(
        status_version, completed_version(weightsyncs, (rm.get("metadata") or {}).get("name", "")) or 0
    )


def completed_version(weightsyncs: Sequence[Mapping[str, Any]], model: str) -> int | None:
    """Newest version a WeightSync of ``model`` completed (status or history); None if none did."""
    versions: list[int] = []
    for ws in weightsyncs:
        if (ws.get("spec") or {}).get("rewardModelRef") != model:
            continue
        status = ws.get("status") or {}
        if status.get("phase") == COMPLETED and isinstance(status.get("version"), int):
            versions.append(status["version"])
        versions += [
            h["version"]
            for h in status.get("history") or []
            if h.get("phase") == COMPLETED and isinstance(h.get("version"), int)
        ]
    return max(versions) if versions else None


def check_version(version: int, current: int) -> None:
    """Versions must increase: a stale or duplicate one is refused before anything moves."""
    if version <= current:
        raise WeightSyncRefused(
            STALE_VERSION,
            f"version {version} is not newer than the version the model serves ({current}); versions must "
            f"increase: push version {current + 1} or higher",
        )


def push_in_progress(ws: Mapping[str, Any], other: Mapping[str, Any]) -> str:
    """Why ``ws`` is refused while WeightSync ``other`` pushes to the same model."""
    spec, theirs = ws.get("spec") or {}, other.get("spec") or {}
    status = other.get("status") or {}
    name = (other.get("metadata") or {}).get("name", "?")
    return (
        f"WeightSync {name} is pushing version {status.get('version', theirs.get('version'))} to RewardModel "
        f"{spec.get('rewardModelRef')} now (phase {status.get('phase') or 'Pending'}); one push per model "
        f"at a time: apply this one again once {name} has ended (kubectl get weightsync {name}), or delete "
        f"{name} if nothing is pushing it"
    )


def trainer_absent(req: PushRequest) -> str:
    """Why a push whose trainer never joined the group failed."""
    return (
        f"no trainer joined the push's group at {req.address}:{req.port} (spec.rendezvous) within "
        f"{req.timeout_s:.0f} s; the replicas waited for it and are unchanged. The trainer hosts that "
        "address and joins right after creating the WeightSync (RewardModelHandle.push_weights does "
        "both): check that it runs and that the replicas reach it, then push again"
    )


def push_bytes(metadata: Sequence[ParamMeta], bucket_bytes: int) -> int:
    """Bytes every replica receives (the flat buckets, padding included)."""
    return sum(b.nbytes for b in plan_buckets(list(metadata), bucket_bytes))


# --------------------------------------------------------------------------------------------
# The group: which replicas join, at which ranks
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Candidate:
    """A replica that may join a push: its server answered /runtime_version and /get_world_size."""

    replica: int
    pod: str
    url: str
    world_size: int
    version: int
    state: str
    stale: bool = False  # restarted onto older weights, waiting for a restore
    agrees_slicing: bool = False  # its server joins an agreement on slicing (RuntimeVersionResponse)


@dataclass(frozen=True)
class Target:
    replica: int
    pod: str
    url: str
    world_size: int
    rank_offset: int


@dataclass(frozen=True)
class GroupPlan:
    targets: tuple[Target, ...]
    world_size: int
    skipped: tuple[str, ...] = field(default_factory=tuple)
    """Human-readable "pod: why" for replicas left out."""
    agrees_slicing: bool = False
    """Every target's server joins an agreement on slicing: a push may ask for one."""


def plan_group(
    candidates: Sequence[Candidate], current: int, mode: RewardModelTrainingMode, senders: int = 1
) -> GroupPlan:
    """Targets in replica order; replica i's workers start at Σ world sizes of the targets before it,
    the trainer's ``senders`` ranks are the last ranks. A replica on older weights than ``current`` (restarted, not yet
    restored) joins only a full push, which replaces every weight; otherwise it would mix versions."""
    targets: list[Target] = []
    skipped: list[str] = []
    offset = 0
    agree = True
    for c in sorted(candidates, key=lambda c: c.replica):
        behind = c.state != "broken" and (c.stale or c.version < current)
        if behind and mode is not RewardModelTrainingMode.FULL:
            skipped.append(
                f"{c.pod}: serves version {c.version} < {current} (restarted); it is restored, not pushed"
            )
            continue
        targets.append(Target(c.replica, c.pod, c.url, c.world_size, offset))
        offset += c.world_size
        agree = agree and c.agrees_slicing
    if not targets:
        raise WeightSyncRefused(
            NO_REPLICAS,
            "no replica of the model can take the push"
            + (
                f": {'; '.join(skipped)}; the operator restores them from saved weights or a healthy "
                "peer, or push the full weights (trainingMode full) now: a full push is always accepted"
                if skipped
                else " (none is running and answering); wait until the RewardModel is Ready and push again"
            ),
        )
    return GroupPlan(tuple(targets), offset + senders, tuple(skipped), agree)


# --------------------------------------------------------------------------------------------
# Following each replica
# --------------------------------------------------------------------------------------------


def replica_outcome(
    version: int, runtime: Mapping[str, Any] | None, tasks: Mapping[str, Any] | None
) -> tuple[str | None, str | None]:
    """(Completed | Failed | None while in progress, message) from a replica's /runtime_version and
    /get_num_background_tasks answers."""
    if (
        runtime is not None
        and int(runtime.get("version", -1)) >= version
        and runtime.get("state") == "serving"
    ):
        return COMPLETED, None
    if tasks is not None and int(tasks.get("num_background_tasks", 1)) == 0 and tasks.get("last_error"):
        return FAILED, str(tasks["last_error"])
    if (
        runtime is not None
        and runtime.get("state") == "broken"
        and tasks is not None
        and not tasks.get("num_background_tasks")
    ):
        return FAILED, str(runtime.get("detail") or "the replica reports broken weights")
    return None, None


@dataclass(frozen=True)
class Observation:
    """One poll of a replica during the transfer: its /runtime_version and (while it is behind)
    /get_num_background_tasks answers; None where it did not answer."""

    runtime: Mapping[str, Any] | None = None
    tasks: Mapping[str, Any] | None = None


@dataclass(frozen=True)
class Transfer:
    """What is known of a push after every target accepted the announce."""

    version: int
    timeout_s: float
    nbytes: int
    targets: tuple[Target, ...]
    announced: float
    """Monotonic time of the announce; replica durations count from it."""
    deadline: float
    entries: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)
    """Pod → final status entry, for the targets that finished."""
    failures: tuple[str, ...] = ()

    @property
    def pending(self) -> tuple[Target, ...]:
        return tuple(t for t in self.targets if t.pod not in self.entries)


@dataclass(frozen=True)
class Outcome:
    """How a push ended: the closing status of the WeightSync."""

    phase: str
    message: str
    replicas: list[dict[str, Any]]
    bytes: int
    reason: str | None = None


def step(
    transfer: Transfer, observations: Mapping[str, Observation], now: float
) -> tuple[Transfer, tuple[Target, ...], Outcome | None]:
    """One turn of following a transfer: read the observations → (new state, the replicas to poll
    next, the outcome once every replica finished or the deadline passed)."""
    entries = dict(transfer.entries)
    failures = list(transfer.failures)
    took = round(now - transfer.announced, 4)
    for t in transfer.pending:
        seen = observations.get(t.pod)
        if seen is None:
            continue
        outcome, message = replica_outcome(transfer.version, seen.runtime, seen.tasks)
        if outcome == COMPLETED:
            entries[t.pod] = replica_entry(
                t, COMPLETED, version=transfer.version, bytes=transfer.nbytes, durationSeconds=took
            )
        elif outcome == FAILED:
            failures.append(f"{t.pod}: {message}")
            entries[t.pod] = replica_entry(
                t,
                FAILED,
                durationSeconds=took,
                message=(message or "")[:1000],
                version=int(seen.runtime["version"]) if seen.runtime else None,
            )
    state = Transfer(
        transfer.version,
        transfer.timeout_s,
        transfer.nbytes,
        transfer.targets,
        transfer.announced,
        transfer.deadline,
        entries,
        tuple(failures),
    )
    pending = state.pending
    if pending and now < transfer.deadline:
        return state, pending, None
    timed_out = [t.pod for t in pending]
    for t in pending:
        failures.append(f"{t.pod}: did not serve version {transfer.version} within {transfer.timeout_s:.0f}s")
        entries[t.pod] = replica_entry(t, FAILED, message="timed out")
    replicas = [dict(entries[t.pod]) for t in transfer.targets]
    if failures:
        # Timeout only when waiting ran out for every failed replica; an answer that says what
        # failed is the better reason.
        reason = TIMEOUT if len(timed_out) == len(failures) else REPLICA_FAILED
        message = (
            f"version {transfer.version} failed on {len(failures)} replica(s): "
            + "; ".join(failures)
            + " (the trainer may have died or timed out; push again)"
        )
        return state, (), Outcome(FAILED, message, replicas, 0, reason)
    return (
        state,
        (),
        Outcome(
            COMPLETED,
            f"{len(replicas)} replica(s) serve version {transfer.version}",
            replicas,
            transfer.nbytes,
        ),
    )


# --------------------------------------------------------------------------------------------
# Status
# --------------------------------------------------------------------------------------------

_RESET = (
    "reason",
    "message",
    "completedAt",
    "durationSeconds",
    "bytes",
    "worldSize",
    "replicas",
    "agreeSlicing",
)


def seconds_since(timestamp: str | None, now: datetime) -> float:
    """Seconds from an RFC 3339 status timestamp (``startedAt``) to ``now``; 0 when it is missing or
    unreadable. A push's duration survives an operator restart this way: the monotonic clock
    does not."""
    if not timestamp:
        return 0.0
    try:
        started = datetime.fromisoformat(timestamp.replace("Z", "+00:00"))
    except ValueError:
        return 0.0
    return max(0.0, (now - started).total_seconds())


def start_status(req: PushRequest, now: str) -> dict[str, Any]:
    """The status patch that opens a push (earlier results are cleared with nulls: merge patch)."""
    return {
        **dict.fromkeys(_RESET),
        "phase": PENDING,
        "observedGeneration": req.generation,
        "version": req.version,
        "trainingMode": req.training_mode.value,
        "groupId": req.group_id,
        "startedAt": now,
    }


def replica_entry(t: Target, phase: str, **extra: Any) -> dict[str, Any]:
    entry = {
        "replica": t.replica,
        "pod": t.pod,
        "url": t.url,
        "rankOffset": t.rank_offset,
        "worldSize": t.world_size,
        "phase": phase,
        **extra,
    }
    return {k: v for k, v in entry.items() if v is not None and v != ""}


def finish_status(
    previous: Mapping[str, Any],
    phase: str,
    now: str,
    duration_s: float,
    *,
    reason: str | None = None,
    message: str | None = None,
    replicas: list[dict[str, Any]] | None = None,
    bytes_: int | None = None,
) -> dict[str, Any]:
    """The closing patch: phase, reason, duration and the history entry (at most HISTORY_LIMIT kept)."""
    patch: dict[str, Any] = {"phase": phase, "completedAt": now, "durationSeconds": round(duration_s, 4)}
    if reason:
        patch["reason"] = reason
    if message:
        patch["message"] = message[:2048]
    if replicas is not None:
        patch["replicas"] = replicas
    if bytes_ is not None:
        patch["bytes"] = bytes_
    merged = {**previous, **patch}
    entry = {
        k: merged.get(k)
        for k in (
            "version",
            "trainingMode",
            "phase",
            "reason",
            "worldSize",
            "bytes",
            "durationSeconds",
            "completedAt",
        )
    }
    entry["message"] = (merged.get("message") or "")[:300]
    entry["replicas"] = len(merged.get("replicas") or [])
    entry = {k: v for k, v in entry.items() if v is not None and v != ""}
    patch["history"] = append_history(previous.get("history") or [], entry)
    return patch


def append_history(
    history: Sequence[Mapping[str, Any]], entry: Mapping[str, Any], limit: int = HISTORY_LIMIT
) -> list[dict[str, Any]]:
    return [dict(h) for h in [*history, entry]][-limit:]
