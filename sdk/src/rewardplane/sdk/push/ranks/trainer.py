"""What the ranks of a multi-rank trainer share during a push, in direct and operator mode alike.

- ``TrainerRanks``: the trainer's own process group: rank 0's small messages to every rank (how to
  join the push group), and the push layout agreed from every rank's parts.
- ``StepChannel``: rank 0 (the leader) → the other sending ranks, through the push group's store:
  the step to take next, and exactly one final step (``done`` or ``fail`` with the reason), so that
  every rank returns or raises alike. A leader that dies takes its store with it: the others learn
  it at once instead of waiting for a timeout; a leader that closes its store after ``done`` first
  waits until the others heard it (``wait_heard``), so that none of them takes a committed push for
  a lost leader.
- ``ShardedLayout``: the servers' names and order for every rank's parts (the same on every rank).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Literal

import torch
import torch.distributed as dist
from pydantic import BaseModel

from rewardplane.protocol import (
    AdapterConfig,
    Bucket,
    ParamMeta,
    RewardModelTrainingMode,
    layout_id,
    plan_buckets,
)
from rewardplane.protocol.slices import Transfer
from rewardplane.sdk._exceptions import WeightSyncError
from rewardplane.sdk.push.plan.checks import check_fits, names_for_mode
from rewardplane.sdk.push.plan.layout import LocalPart, PushPlan, parts_digest, plan_senders
from rewardplane.transport.comm import Communicator
from rewardplane.transport.signals import StoreClosed, put, wait_value
from rewardplane.transport.slices import send_slices
from rewardplane.transport.transfer import send_buckets

StepName = Literal["ready", "send", "done", "fail"]

# How long a leader waits, before closing its store, for the other ranks to hear ``done``: they took
# part in the commit, so they are alive and hear it at once; the bound guards a rank killed since.
HEARD_WAIT_S = 30.0


class SenderStep(BaseModel):
    """The leader → the other sending ranks: what to do next in push ``push``."""

    push: int
    step: StepName
    version: int
    error: str | None = None
    # the push group is dropped (a transfer failed): every rank forms it again on the next push
    regroup: bool = False
    # ready: each receiving rank gets only what it keeps (the leader found them all published)
    sliced: bool = False
    # done: what the leader learned of the push, for every rank's return value
    detail: dict[str, Any] | None = None
    # fail: a replica does not hold the version a delta push builds on; nothing moved, and every
    # rank pushes everything instead, as the same version
    delta_refused: bool = False


class StepChannel:
    """The steps of one push (``push`` numbers the pushes of one group), in order."""

    def __init__(self, store: dist.Store, push: int, timeout_s: float) -> None:
        self.store = store
        self.push = push
        self.timeout_s = timeout_s
        self._n = 0
        self.done = False  # the leader told ``done``: ``wait_heard`` waits for the others to hear it

    def _key(self) -> str:
        key = f"trainers/{self.push}/{self._n}"
        self._n += 1
        return key

    def tell(self, step: SenderStep) -> None:
        put(self.store, self._key(), step)
        self.done = step.step == "done"

    def _heard_key(self) -> str:
        return f"trainers/{self.push}/heard"

    def hear(self) -> SenderStep:
        """The leader's next step; raises ``WeightSyncError`` when the leader is gone or silent.
        Hearing the final step is counted for the leader (``wait_heard``)."""
        try:
            raw = wait_value(self.store, self._key(), self.timeout_s)
        except (StoreClosed, TimeoutError) as exc:
            raise WeightSyncError(f"trainer rank 0 stopped leading push {self.push}: {exc}") from exc
        assert raw is not None  # no stop event: a value or an exception
        step = SenderStep.model_validate_json(raw)
        if step.step in ("done", "fail"):
            try:
                self.store.add(self._heard_key(), 1)
            except dist.DistError:
                pass  # the leader is gone already: it waits for no one
        return step

    def wait_heard(self, followers: int, timeout_s: float = HEARD_WAIT_S) -> None:
        """The leader, before its store goes, after it told ``done``: until ``followers`` ranks heard
        it, or ``timeout_s`` passed (a rank that died meanwhile is not waited for longer). After
        ``fail`` it returns at once: a failed push's ranks may be gone."""
        if not self.done:
            return
        deadline = time.monotonic() + timeout_s
        try:
            while self.store.add(self._heard_key(), 0) < followers and time.monotonic() < deadline:
                time.sleep(0.005)
        except dist.DistError:
            pass  # the store is gone: there is nothing left to hear


class RankSends:
    """One rank's part of a push: its tensors under the servers' names, and how to send them."""

    def __init__(
        self,
        comm: Communicator,
        sender: int,
        layout: tuple[list[tuple[str, str]], list[ParamMeta], list[Bucket], str],
        tensors: Mapping[str, torch.Tensor],
        bucket_bytes: int,
    ) -> None:
        self.comm = comm
        self.sender = sender
        order, self.metadata, self.buckets, self.layout_id = layout
        self.mine = {server: tensors[key] for server, key in order}
        self.bucket_bytes = bucket_bytes

    def send(self, schedule: list[list[Transfer]] | None = None) -> int:
        """This rank's bytes (broadcast, or ``schedule``'s sliced transfers), then the commit
        reduction (every replica and every sender)."""
        comm = self.comm
        if schedule is None:
            sent = send_buckets(
                comm,
                self.metadata,
                self.mine,
                self.bucket_bytes,
                comm.first_sender,
                plan=self.buckets,
                sender=self.sender,
            )
        else:
            sent = send_slices(comm, self.metadata, self.mine, schedule, sender=self.sender)
        comm.max_flag(0)  # the leader reads its outcome
        return sent


def follow_leader(
    channel: StepChannel,
    take: Callable[[SenderStep], object],
    failed: Callable[[SenderStep], BaseException],
    lost: Callable[[], None] | None = None,
) -> SenderStep:
    """A following rank's side of one push: ``take`` each step the leader tells (this rank's part
    of it) until the final one; returns the ``done`` step, raises ``failed(step)`` on ``fail``.
    A step this rank could not take is remembered, not raised: the leader learns of the failure
    through the group and says how the push ended; a ``done`` then still raises here. ``lost``:
    called before raising when the leader is gone or silent."""
    broken: BaseException | None = None
    while True:
        try:
            step = channel.hear()
        except WeightSyncError:
            if lost is not None:
                lost()
            raise
        if step.step == "done":
            if broken is not None:
                raise WeightSyncError(f"version {step.version} committed, but this rank failed: {broken}")
            return step
        if step.step == "fail":
            raise failed(step)
        if broken is None:
            try:
                take(step)
            except Exception as exc:  # the group failed; the leader learns it too and says so
                broken = exc


class TrainerRanks:
    """The trainer's process group as the push sees it: rank, size, and what the ranks agree on."""

    def __init__(self, group: dist.ProcessGroup) -> None:
        self.group = group
        self.rank = dist.get_rank(group)
        self.size = dist.get_world_size(group)
        self._plan: tuple[str, PushPlan] | None = None  # (this rank's parts' digest, the plan)

    @property
    def leader(self) -> bool:
        return self.rank == 0

    def share(self, message: str | None) -> str:
        """Rank 0's ``message`` (a JSON document) on every rank; the others pass None."""
        box: list[Any] = [message]
        dist.broadcast_object_list(box, src=dist.get_global_rank(self.group, 0), group=self.group)
        return str(box[0])

    def union(self, keys: Sequence[str]) -> set[str]:
        """Every rank's ``keys``, together (one small collective)."""
        everyone: list[Any] = [None] * self.size
        dist.all_gather_object(everyone, list(keys), group=self.group)
        return {k for ks in everyone for k in ks}

    def plan_of(self, parts: list[LocalPart], digest: str | None = None) -> PushPlan:
        """Every rank's parts → who sends what (the same on every rank; a bad split raises on every
        rank). Each push costs one reduction of a flag (did any rank's parts change?); the parts
        travel only when one did. ``digest``: ``parts_digest(parts)``, when the caller has it."""
        if digest is None:
            digest = parts_digest(parts)
        if self._any(self._plan is None or self._plan[0] != digest):
            everyone: list[Any] = [None] * self.size
            dist.all_gather_object(everyone, parts, group=self.group)
            self._plan = (digest, plan_senders(everyone))
        assert self._plan is not None
        return self._plan[1]

    def _any(self, flag: bool) -> bool:
        """Whether ``flag`` holds on any rank (one reduction of a 4-byte tensor)."""
        t = torch.tensor([int(flag)], dtype=torch.int32, device=self._device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.group)
        return bool(t.item())

    @property
    def _device(self) -> torch.device:
        # gloo reduces CPU tensors; a group that is NCCL alone needs one on this rank's GPU
        if "gloo" in str(dist.get_backend(self.group)) or not torch.cuda.is_available():
            return torch.device("cpu")
        return torch.device("cuda", torch.cuda.current_device())


class ShardedLayout:
    """The servers' names and order for a push of every rank's parts (identical on every rank)."""

    def __init__(self, served: set[str] | None, head_patterns: Sequence[str], bucket_bytes: int) -> None:
        self.served = served
        self.head_patterns = tuple(head_patterns)
        self.bucket_bytes = bucket_bytes
        self._cache: tuple[Any, list[tuple[str, str]], list[ParamMeta], list[Bucket], str] | None = None

    def of(
        self,
        plan: PushPlan,
        mode: RewardModelTrainingMode,
        keep_lora: bool,
        adapter: AdapterConfig | None,
        manifest: Mapping[str, ParamMeta] | None,
        partial: bool = False,
    ) -> tuple[list[tuple[str, str]], list[ParamMeta], list[Bucket], str]:
        """(server name, the rank's key) in push order, the metadata, its buckets, its layout id.
        With the served ``manifest`` (rank 0), checked against it first. ``partial``: a delta
        push's subset (the mode's rules held for the whole push it is a delta of)."""
        # the plan itself, not its id: a delta push's plan lives for one push, and a later one can
        # be allocated where it was (same id, other tensors); held here, it cannot be
        key = (plan, mode, keep_lora, adapter, partial)
        cached = self._cache
        if cached is None or cached[0][0] is not plan or cached[0][1:] != key[1:]:
            cached = self._cache = self._build(key)
        if manifest:  # every push: the served model can change under a kept layout
            check_fits(cached[2], manifest, mode, adapter)
        return cached[1:]

    def _build(
        self, key: tuple[PushPlan, RewardModelTrainingMode, bool, AdapterConfig | None, bool]
    ) -> tuple[Any, list[tuple[str, str]], list[ParamMeta], list[Bucket], str]:
        plan, mode, keep_lora, adapter, partial = key
        renamed = names_for_mode(
            {k: k for k in plan.metas},
            mode,
            served=self.served,
            keep_lora=keep_lora,
            head_patterns=self.head_patterns,
            adapter=adapter,
            check_mode=not partial,
        )
        order = [(server, renamed[server]) for server in sorted(renamed)]
        metadata = [plan.metas[k].model_copy(update={"name": server}) for server, k in order]
        buckets = plan_buckets(metadata, self.bucket_bytes)
        return key, order, metadata, buckets, layout_id(metadata, self.bucket_bytes)
