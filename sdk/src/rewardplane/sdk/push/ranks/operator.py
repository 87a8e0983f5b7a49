"""A push through the operator from every rank of a multi-rank trainer
(``RewardModelHandle.push_weights(..., trainer_group=group)``, called on every rank).

Rank 0 (the leader) does what a one-process trainer does: it checks the layout against the
served manifest, stores it in a ConfigMap, hosts the rendezvous and creates the WeightSync with
``spec.trainer.ranks``; the operator then puts the trainer's ranks last in the replicas' group.
Every rank joins the group and sends its own part once the operator reports every replica ready
(``Transferring``); rank 0 follows the push to its end and tells the others how it ended
(``ranks.trainer.StepChannel``), so every rank returns the same ``PushResult`` or raises alike.
"""

from __future__ import annotations

import dataclasses
import os
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist
from pydantic import BaseModel

from rewardplane.protocol import Bucket, ParamMeta, RewardModelTrainingMode
from rewardplane.protocol.naming import WeightValidationError
from rewardplane.sdk._exceptions import WeightSyncFailed
from rewardplane.sdk.push.options import PushOptions
from rewardplane.sdk.push.plan.layout import local_parts
from rewardplane.sdk.push.plan.slices import agree_on_slices
from rewardplane.sdk.push.ranks.trainer import (
    RankSends,
    SenderStep,
    ShardedLayout,
    StepChannel,
    TrainerRanks,
    follow_leader,
)
from rewardplane.sdk.push.wire.operator import OperatorPush, PushResult
from rewardplane.transport.comm import Communicator, create_store


class OperatorInvite(BaseModel):
    """Rank 0 → every rank: the push's group, once the operator asked the replicas to join it."""

    host: str = ""
    port: int = 0
    world_size: int = 0
    group_id: str = ""
    generation: int = 0
    served: list[str] = []
    agree_slicing: bool = False  # the replicas agree on slicing with every rank (status.agreeSlicing)
    error: str | None = None
    error_type: str | None = None  # WeightValidationError: nothing moved, raise it as such
    reason: str | None = None  # WeightSyncFailed's reason


class RanksState:
    """What a handle keeps between pushes from one trainer group: the ranks (with the push plan
    they agreed on, so an unchanged split costs one flag reduction instead of gathering every
    rank's parts) and the layouts built from it (checked against the served manifest once)."""

    MAX_LAYOUTS = 4  # served name sets × head patterns × bucket sizes a trainer switches between

    def __init__(self, group: dist.ProcessGroup) -> None:
        self.ranks = TrainerRanks(group)
        self._layouts: dict[tuple[frozenset[str], tuple[str, ...], int], ShardedLayout] = {}

    def layout(self, served: set[str], patterns: Sequence[str], bucket_bytes: int) -> ShardedLayout:
        key = (frozenset(served), tuple(patterns), bucket_bytes)
        found = self._layouts.get(key)
        if found is None:
            if len(self._layouts) >= self.MAX_LAYOUTS:
                self._layouts.clear()
            found = self._layouts[key] = ShardedLayout(set(served), patterns, bucket_bytes)
        return found


def ranks_state(previous: RanksState | None, group: dist.ProcessGroup) -> RanksState:
    """``previous`` where it is of ``group``, else a fresh one."""
    if previous is not None and previous.ranks.group is group:
        return previous
    return RanksState(group)


def use_interface(interface: str | None) -> None:
    """The interface this rank gives NCCL and gloo (set before the group forms)."""
    if interface:
        os.environ["NCCL_SOCKET_IFNAME"] = interface
        os.environ["GLOO_SOCKET_IFNAME"] = interface


def _raise_shared(invite: OperatorInvite) -> None:
    if invite.error_type == "WeightValidationError":
        raise WeightValidationError(invite.error or "")
    raise WeightSyncFailed(
        f"trainer rank 0 could not start the push: {invite.error}", invite.reason or "Failed"
    )


def push_from_ranks(
    op: OperatorPush,
    state: RanksState,
    params: Mapping[str, Any],
    version: int,
    mode: RewardModelTrainingMode,
    options: PushOptions,
    *,
    started: float,
) -> PushResult:
    """Every rank of the group calls this with its own ``params`` and the state its handle keeps
    for the group (``ranks_state``); see the module's docstring."""

    ranks = state.ranks
    deadline = started + options.timeout_s
    bucket_bytes, keep_lora, adapter = options.bucket_bytes, options.keep_lora, options.adapter
    tensors, parts = local_parts(params)
    plan = ranks.plan_of(parts)  # the same on every rank; a bad split raises on every rank
    dev = torch.device(options.device) if options.device is not None else next(iter(tensors.values())).device
    patterns = options.head_patterns
    use_interface(options.interface)
    invite: OperatorInvite | None = None
    failure: Exception | None = None  # rank 0's own, raised as it is
    store: Any = None
    layout: tuple[list[tuple[str, str]], list[ParamMeta], list[Bucket], str] | None = None
    if ranks.leader:
        try:
            manifest = op.handle.manifest()
            layout = state.layout(set(manifest), patterns, bucket_bytes).of(
                plan, mode, keep_lora, adapter, manifest
            )
            trainer: dict[str, Any] = {"ranks": ranks.size}
            if options.interface:
                trainer["interface"] = options.interface
            store, host, generation, ws = op.rendezvous(
                layout[1], version, mode, options, deadline=deadline, trainer=trainer
            )
            invite = OperatorInvite(
                host=host,
                port=int(store.port),
                world_size=int(ws["status"]["worldSize"]),
                group_id=str(ws["status"]["groupId"]),
                generation=generation,
                served=sorted(manifest),
                agree_slicing=bool(ws["status"].get("agreeSlicing")),
            )
        except Exception as exc:
            failure = exc
            invite = OperatorInvite(
                error=str(exc), error_type=type(exc).__name__, reason=getattr(exc, "reason", None)
            )
    invite = OperatorInvite.model_validate_json(ranks.share(invite.model_dump_json() if invite else None))
    if failure is not None:
        raise failure
    if invite.error is not None:
        _raise_shared(invite)
    if layout is None:  # the other ranks: the leader's layout, from the served names it shared
        layout = state.layout(set(invite.served), patterns, bucket_bytes).of(
            plan, mode, keep_lora, adapter, None
        )
    if store is None:
        store = create_store(
            invite.host, invite.port, is_master=False, world_size=None, timeout_s=options.timeout_s
        )
    status = {"worldSize": invite.world_size, "groupId": invite.group_id}
    rank = invite.world_size - ranks.size + ranks.rank
    comm = op.join_group(
        store, rank, status, dev, options.backend, invite.generation, deadline, senders=ranks.size
    )
    channel = StepChannel(comm.store, 0, max(1.0, deadline - time.monotonic()) + 30.0)
    try:
        sending = RankSends(comm, ranks.rank, layout, tensors, bucket_bytes)

        def send() -> int:
            # every rank and every worker agree on slicing first, where the replicas take part
            schedule = None
            if invite.agree_slicing:
                schedule = agree_on_slices(
                    comm, sending.layout_id, sending.metadata, sending.buckets, decides=ranks.leader
                )
            return sending.send(schedule)

        if ranks.leader:
            result = _lead(op, send, sending.comm, channel, invite, version, mode, started, deadline)
            channel.wait_heard(ranks.size - 1)  # the store closes below
        else:
            done = follow_leader(channel, lambda _: send(), _failed)
            assert done.detail is not None
            result = PushResult(**done.detail)
        return dataclasses.replace(result, transport=comm.backend)
    finally:
        comm.close()


def _lead(
    op: OperatorPush,
    send: Callable[[], int],
    comm: Communicator,
    channel: StepChannel,
    invite: OperatorInvite,
    version: int,
    mode: RewardModelTrainingMode,
    started: float,
    deadline: float,
) -> PushResult:
    def fail(exc: BaseException) -> None:
        channel.tell(SenderStep(push=0, step="fail", version=version, error=f"{type(exc).__name__}: {exc}"))

    try:
        op.objects.wait_phase(
            invite.generation, {"Transferring", "Completed"}, deadline, "every replica to accept the announce"
        )
    except BaseException as exc:
        comm.abort()
        fail(exc)
        raise
    channel.tell(SenderStep(push=0, step="send", version=version))
    transfer_start = time.monotonic()
    try:
        sent = send()
    except BaseException as exc:
        comm.abort()  # the replicas see the group fail at once instead of waiting for the timeout
        fail(exc)
        raise
    transfer_s = time.monotonic() - transfer_start
    try:
        result = op.finish(
            invite.generation, version, mode, sent, invite.world_size, started, transfer_s, deadline
        )
    except BaseException as exc:
        fail(exc)
        raise
    detail = dataclasses.asdict(result)
    channel.tell(SenderStep(push=0, step="done", version=version, detail=detail))
    return result


def _failed(step: SenderStep) -> BaseException:
    return WeightSyncFailed(f"the push of version {step.version} failed: {step.error}", "Failed")
