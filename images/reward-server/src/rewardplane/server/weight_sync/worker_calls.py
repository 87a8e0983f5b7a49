"""The calls into the weight-sync worker extension (``worker_extension.RewardWeightSyncExtension``)
on every worker of a replica, typed: one method per call, dataclass answers. The only place that
names the extension's methods; the engine's ``WeightSyncPort.call_workers`` carries them (vLLM:
``collective_rpc`` between processes, which is why the workers answer plain data)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from rewardplane.protocol import PushLoaded, SendWeightsRequest, settings
from rewardplane.server.engines.engine import WeightSyncPort
from rewardplane.server.weight_sync.worker.group import GroupJoin

_JOIN = "rp_init_communicator"
_LONG = frozenset({"rp_receive", "rp_apply_staged", "rp_apply_adapter"})


def rpc_timeout(method: str, args: tuple[Any, ...], short_s: float) -> float:
    """How long the vLLM engine waits for ``method`` on every worker (seconds): a backstop, since
    the worker's communicator bounds each collective itself; ``short_s`` for the quick calls."""
    if method == _JOIN and args:
        return float(args[0]["timeout_s"]) + 60.0  # the worker's own rendezvous timeout, plus slack
    if method in _LONG:
        return settings.VLLM_RPC_TIMEOUT_S.get()
    return short_s


@dataclass(frozen=True)
class JoinPoll:
    """One worker's join attempt: running (``done`` False), joined as ``rank``, or failed."""

    done: bool
    rank: int | None = None
    error: str | None = None


@dataclass(frozen=True)
class WorkerReceived:
    """What one worker received of a push (announced over HTTP, or from the data plane)."""

    ok: bool
    partial: bool = False  # some weights were overwritten before it failed
    bytes: int = 0
    in_place_bytes: int = 0  # received straight into the parameters
    error: str | None = None
    times: dict[str, float | None] = field(default_factory=dict)  # monotonic stamps of its steps
    sliced: bool = False  # it received only its slices
    unknown_layout: bool = False  # it lacks the layout: nothing was posted, call again with metadata

    @classmethod
    def of(cls, answer: dict[str, Any]) -> WorkerReceived:
        return cls(**{k: v for k, v in answer.items() if k in _RECEIVED_FIELDS})

    @classmethod
    def reported(cls, loaded: PushLoaded) -> WorkerReceived:
        """A data-plane push's report (``PushLoaded``, sent over the push channel)."""
        return cls.of(loaded.model_dump())


_RECEIVED_FIELDS = frozenset(WorkerReceived.__dataclass_fields__)


@dataclass(frozen=True)
class AdapterApplied:
    path: str | None  # where the adapter was written; None: built in memory
    times: dict[str, float]


class WorkerCalls:
    """Every worker-extension call the server makes, over one engine's port. Each method runs the
    call on every worker holding weights and returns one answer per worker."""

    def __init__(self, port: WeightSyncPort) -> None:
        self.port = port

    # ---- the group ---------------------------------------------------------------------------
    async def join_start(self, attempt: str, join: GroupJoin) -> None:
        await self.port.call_workers("rp_join_start", attempt, asdict(join))

    async def join_poll(self, attempt: str) -> list[JoinPoll]:
        return [JoinPoll(**p) for p in await self.port.call_workers("rp_join_poll", attempt)]

    async def join_abandon(self, attempt: str) -> list[bool]:
        return list(await self.port.call_workers("rp_join_abandon", attempt))

    async def close_communicator(self) -> None:
        await self.port.call_workers("rp_close_communicator")

    async def listen(self, address: str, authkey: bytes) -> list[bool]:
        return [bool(x) for x in await self.port.call_workers("rp_listen", address, authkey)]

    # ---- pushes ------------------------------------------------------------------------------
    async def receive(
        self,
        metadata: list[dict[str, Any]] | None,
        bucket_bytes: int,
        apply: bool,
        layout_id: str,
        agree_slicing: bool,
    ) -> list[WorkerReceived]:
        answers = await self.port.call_workers(
            "rp_receive", metadata, bucket_bytes, apply, layout_id, agree_slicing
        )
        return [WorkerReceived.of(a) for a in answers]

    async def push_outcomes(self, seq: int, timeout_s: float) -> list[PushLoaded]:
        outcomes = await self.port.call_workers("rp_push_outcome", seq, timeout_s)
        return [PushLoaded.model_validate(o) for o in outcomes]

    async def staging_problems(self, nbytes: int) -> list[str]:
        """Why workers cannot stage ``nbytes`` (one entry per worker that cannot)."""
        return [p for p in await self.port.call_workers("rp_staging_problem", nbytes) if p]

    async def cuda_free_bytes(self) -> list[int | None]:
        return list(await self.port.call_workers("rp_cuda_free_bytes"))

    async def apply_staged(self, metadata: list[dict[str, Any]]) -> None:
        await self.port.call_workers("rp_apply_staged", metadata)

    async def drop_staged(self) -> None:
        await self.port.call_workers("rp_drop_staged")

    async def apply_adapter(
        self, metadata: list[dict[str, Any]], adapter: dict[str, Any], adapter_id: int
    ) -> list[AdapterApplied]:
        answers = await self.port.call_workers("rp_apply_adapter", metadata, adapter, adapter_id)
        return [AdapterApplied(a["path"], a["times"]) for a in answers]

    async def clear_adapter(self) -> None:
        await self.port.call_workers("rp_clear_adapter")

    # ---- persistence, restore, reload --------------------------------------------------------
    async def named_parameters(self) -> list[dict[str, Any] | None]:
        """The live parameters under their pushed names (the transformers engine only; else None)."""
        return list(await self.port.call_workers("rp_named_parameters"))

    async def local_ranks(self) -> list[int]:
        return [int(r) for r in await self.port.call_workers("rp_local_rank")]

    async def persist_to(self, directory: str, base: str, ranks: int) -> None:
        await self.port.call_workers("rp_persist_to", directory, base, ranks)

    async def persist(self, version: int) -> list[bool]:
        return [bool(w) for w in await self.port.call_workers("rp_persist", version)]

    async def persist_pending(self) -> list[bool]:
        return [bool(p) for p in await self.port.call_workers("rp_persist_pending")]

    async def restore(self, version: int) -> list[int]:
        """Parameters each worker restored; raises ``LookupError`` where ``version`` is not saved."""
        return [int(c) for c in await self.port.call_workers("rp_restore", version)]

    async def load_checkpoint(self, model_dir: str) -> list[list[str]]:
        return [list(n) for n in await self.port.call_workers("rp_load_checkpoint", model_dir)]

    async def param_checksums(self) -> list[Any]:
        return list(await self.port.call_workers("rp_param_checksums"))

    # ---- peer restore, the sending side ------------------------------------------------------
    async def peer_send_problems(self, names: list[str]) -> list[str | None]:
        return list(await self.port.call_workers("rp_peer_send_problem", names))

    async def peer_send_start(self, metadata: list[dict[str, Any]], send: SendWeightsRequest) -> None:
        await self.port.call_workers("rp_peer_send_start", metadata, send.model_dump(mode="json"))

    async def peer_send_outcomes(self) -> list[tuple[bool, str] | None]:
        return [
            None if o is None else (bool(o[0]), str(o[1]))
            for o in await self.port.call_workers("rp_peer_send_outcome")
        ]
