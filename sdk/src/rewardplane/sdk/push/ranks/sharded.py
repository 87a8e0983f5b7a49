"""Pushes from every rank of a multi-rank trainer in direct mode: a collective, like FSDP's own
state-dict calls.

Rank 0 of the trainer's process group (the leader) talks to the servers over HTTP, hosts the
push group's store and decides each push's path, exactly as a one-process trainer does; every
rank (the leader too) sends its own part of the bytes, from its own GPU, into the same push group,
where the trainer's ranks are the last ranks. Nothing is gathered.

The other ranks follow the leader's steps (``ranks.trainer.StepChannel``): ``ready`` (a data-plane
push: join the ready reduction, then send and join the commit reduction), ``send`` (a push
announced over HTTP: send, then join the commit reduction), and exactly one final step.

Delta pushes (``delta=True``, full training mode): each rank fingerprints its own parts; a tensor
is sent when any rank's part of it changed since the last push every replica committed (the ranks
agree on the union), else the smallest tensor alone. A replica that does not hold that version
refuses before any byte moves, and every rank pushes everything instead, as the same version.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch
import torch.distributed as dist
from pydantic import BaseModel

from rewardplane.protocol import (
    AdapterConfig,
    Bucket,
    ParamMeta,
    RewardModelTrainingMode,
)
from rewardplane.protocol.naming import WeightValidationError
from rewardplane.sdk._exceptions import DeltaRefused, WeightSyncError
from rewardplane.sdk.push.options import PushOptions
from rewardplane.sdk.push.plan.delta import (
    Acknowledged,
    changed_names,
    fingerprints,
    sent_names,
    warn_refused,
)
from rewardplane.sdk.push.plan.layout import PartsBook, PushPlan
from rewardplane.sdk.push.plan.slices import SliceBook, slicing_of
from rewardplane.sdk.push.ranks.trainer import (
    RankSends,
    SenderStep,
    ShardedLayout,
    StepChannel,
    StepName,
    TrainerRanks,
    follow_leader,
)
from rewardplane.sdk.push.wire.data_plane import DataPlaneStarter
from rewardplane.sdk.push.wire.http import HTTPControlPlane, RewardModelPublisher, local_address_towards
from rewardplane.sdk.retry import RewardServerError
from rewardplane.transport.comm import Communicator, create_store
from rewardplane.transport.group import open_group
from rewardplane.transport.signals import StoreClosed

log = logging.getLogger(__name__)


class GroupInvite(BaseModel):
    """The leader → the other ranks, once per push group: how to join it, and the served names."""

    host: str = ""
    port: int = 0
    group_id: str = ""
    world_size: int = 0
    served: list[str] | None = None
    error: str | None = None


@dataclass(frozen=True)
class RankPush:
    """One push as every rank runs it: this rank's tensors, the plan the ranks agreed on, the
    version (None: the next), the mode and the LoRA choices, and the version a delta push is over
    (None: a whole push)."""

    tensors: dict[str, torch.Tensor]
    plan: PushPlan
    version: int | None
    mode: RewardModelTrainingMode
    keep_lora: bool
    adapter: AdapterConfig | None
    base_version: int | None = None


class _LeaderPublisher(RewardModelPublisher):
    """Rank 0's publisher: the one-process path, with the other ranks told of each phase."""

    def __init__(self, *args: Any, layout: ShardedLayout, **kw: Any) -> None:
        super().__init__(*args, **kw)
        self.sharded_layout = layout
        self.plan: PushPlan | None = None
        self.tell: Any = None

    def _layout(
        self,
        state_dict: Mapping[str, torch.Tensor],
        mode: RewardModelTrainingMode,
        keep_lora: bool,
        adapter: AdapterConfig | None = None,
        partial: bool = False,
    ) -> tuple[list[tuple[str, str]], list[ParamMeta], list[Bucket], str]:
        assert self.plan is not None
        return self.sharded_layout.of(self.plan, mode, keep_lora, adapter, self.control.manifest(), partial)

    def _phase(self, step: str, *, sliced: bool = False) -> None:
        if self.tell is not None:
            self.tell(step, sliced=sliced)


class ShardedPusher:
    """Every rank of ``group`` calls :meth:`push` with its own state dict (FSDP2 ``DTensor``s,
    ``TensorPiece`` slices, or plain tensors every rank holds alike); each sends its part."""

    def __init__(
        self,
        group: dist.ProcessGroup,
        urls: Sequence[str],
        *,
        group_port: int,
        token: str | None,
        token_file: str | None,
        options: PushOptions,
    ) -> None:
        self.ranks = TrainerRanks(group)
        self.rank = self.ranks.rank
        self.senders = self.ranks.size
        self.urls = list(urls)
        self.group_port = group_port
        # the pusher's; each push's own keep_lora, adapter and delta come with it (push)
        self.options = options
        assert isinstance(options.device, torch.device)  # resolved by the pusher: this rank's
        self.device = options.device
        # the leader alone talks to the servers
        self.control = (
            HTTPControlPlane(self.urls, token=token, token_file=token_file, timeout_s=options.timeout_s)
            if self.rank == 0
            else None
        )
        self.comm: Communicator | None = None
        self._publisher: _LeaderPublisher | None = None
        self._layout: ShardedLayout | None = None
        self._pushes = 0
        self._slice_book: SliceBook | None = None
        self._led: StepChannel | None = None  # the leader's last push: heard by all before the store goes
        self._parts_book = PartsBook()
        # the last push's phases on this rank: the leader's publisher's, and those around them
        # (parts_s: describing this rank's parts; plan_s: the ranks agreeing on the plan; done_s:
        # telling the other ranks the push ended; push_s: the whole call)
        self.last_stats: dict[str, float] = {}
        # this rank's fingerprints of what every replica committed in the last delta-enabled push
        self._acked: Acknowledged | None = None

    # ---- the group --------------------------------------------------------------------------
    def _share(self, invite: GroupInvite | None) -> GroupInvite:
        shared = self.ranks.share(invite.model_dump_json() if invite is not None else None)
        return GroupInvite.model_validate_json(shared)

    def open(self) -> Communicator:
        """Form the push group (a collective: every rank calls it; once, until a failure)."""
        if self.comm is not None:
            return self.comm
        invite: GroupInvite | None = None
        store: dist.TCPStore | None = None
        if self.rank == 0:
            assert self.control is not None
            try:
                host = self.options.trainer_host or local_address_towards(self.urls[0])
                world = sum(self.control.world_sizes()) + self.senders
                store = create_store(
                    host,
                    self.group_port,
                    is_master=True,
                    world_size=world,
                    timeout_s=self.options.connect_timeout_s,
                )
                group_id = uuid.uuid4().hex[:12]
                self.control.init_communicator(
                    host,
                    self.group_port,
                    backend=self.options.backend,
                    timeout_s=self.options.connect_timeout_s,
                    group_id=group_id,
                    senders=self.senders,
                )
                manifest = self.control.manifest()
                invite = GroupInvite(
                    host=host,
                    port=self.group_port,
                    group_id=group_id,
                    world_size=world,
                    served=sorted(manifest) if manifest else None,
                )
            except Exception as exc:
                invite = GroupInvite(error=f"{type(exc).__name__}: {exc}")
        invite = self._share(invite)
        if invite.error is not None:
            raise WeightSyncError(f"forming the push group on trainer rank 0 failed: {invite.error}")
        if store is None:
            store = create_store(
                invite.host,
                invite.port,
                is_master=False,
                world_size=invite.world_size,
                timeout_s=self.options.connect_timeout_s,
            )
        self.comm = open_group(
            store,
            rank=invite.world_size - self.senders + self.rank,
            world_size=invite.world_size,
            device=self.device,
            backend=self.options.backend,
            timeout_s=self.options.timeout_s,
            group_id=invite.group_id,
            senders=self.senders,
        )
        self._layout = ShardedLayout(
            set(invite.served) if invite.served is not None else None,
            self.options.head_patterns,
            self.options.bucket_bytes,
        )
        if self.rank == 0:
            assert self.control is not None
            offsets = self.control.rank_offsets()
            starter = DataPlaneStarter.for_group(self.comm, offsets) if self.options.data_plane else None
            self._publisher = _LeaderPublisher(
                self.control,
                self.comm,
                self.comm.first_sender,
                self.options,
                layout=self._layout,
                data_plane=starter,
            )
        return self.comm

    # ---- a push -------------------------------------------------------------------------------
    def push(
        self,
        params: Mapping[str, Any],
        version: int | None,
        training_mode: RewardModelTrainingMode,
        options: PushOptions,
    ) -> int:
        """One push from every rank (a collective); ``options``: the pusher's, with this push's own
        ``keep_lora``, ``adapter`` and ``delta``."""
        start = time.perf_counter()
        tensors, parts, digest = self._parts_book.describe(params)
        described = time.perf_counter()
        # the same on every rank; a bad split raises on every rank
        plan = self.ranks.plan_of(parts, digest)
        planned = time.perf_counter()
        self.last_stats = {}
        v = self._push_planned(
            tensors, plan, version, training_mode, options.keep_lora, options.adapter, options.delta
        )
        self.last_stats = {
            **self.last_stats,
            "parts_s": described - start,
            "plan_s": planned - described,
            "push_s": time.perf_counter() - start,
        }
        return v

    def _push_planned(
        self,
        tensors: dict[str, torch.Tensor],
        plan: PushPlan,
        version: int | None,
        training_mode: RewardModelTrainingMode,
        keep_lora: bool,
        adapter: AdapterConfig | None,
        delta: bool,
    ) -> int:
        # cleared while the push runs: after any failure the next delta-enabled push sends everything
        acked, self._acked = self._acked, None
        whole = RankPush(tensors, plan, version, training_mode, keep_lora, adapter)
        if not delta or training_mode is not RewardModelTrainingMode.FULL:
            return self._push(whole)
        prints = fingerprints(tensors)
        if acked is not None:
            if version is None:  # a refused delta is pushed again whole as the same version
                version = int(self.ranks.share(str(self._next_version()) if self.rank == 0 else None))
            changed = self.ranks.union(changed_names(prints, acked.prints))
            keys = sent_names(changed, {k: m.nbytes for k, m in plan.metas.items()})
            try:
                v = self._push(
                    RankPush(
                        {k: tensors[k] for k in keys},
                        plan.only(keys),  # the same senders: no collective, the same on every rank
                        version,
                        training_mode,
                        keep_lora,
                        None,
                        base_version=acked.version,
                    )
                )
                self._acked = Acknowledged(v, prints)
                return v
            except DeltaRefused as exc:  # nothing moved, on every rank alike
                if self.rank == 0:
                    warn_refused(log, version, acked.version, exc, len(tensors))
        v = self._push(replace(whole, version=version, adapter=None))
        self._acked = Acknowledged(v, prints)
        return v

    def _next_version(self) -> int:
        assert self.control is not None
        return max(self.control.versions()) + 1

    def _push(self, job: RankPush) -> int:
        comm = self.open()
        push = self._pushes
        self._pushes += 1
        if self.rank == 0:
            return self._lead(push, job)
        return self._follow(push, comm, job)

    def _lead(self, push: int, job: RankPush) -> int:
        publisher = self._publisher
        assert publisher is not None and self.control is not None and self.comm is not None
        channel = self._led = StepChannel(self.comm.store, push, self.options.timeout_s + 60.0)
        v = -1

        def tell(
            step: StepName,
            error: str | None = None,
            regroup: bool = False,
            sliced: bool = False,
            delta_refused: bool = False,
        ) -> None:
            channel.tell(
                SenderStep(
                    push=push,
                    step=step,
                    version=v,
                    error=error,
                    regroup=regroup,
                    sliced=sliced,
                    delta_refused=delta_refused,
                )
            )

        publisher.plan = job.plan
        publisher.tell = tell
        try:
            v = self._next_version() if job.version is None else job.version
            publisher.publish(
                job.tensors,
                v,
                training_mode=job.mode,
                keep_lora=job.keep_lora,
                adapter=job.adapter,
                base_version=job.base_version,
            )
        except BaseException as exc:
            self._tell_failure(tell, exc)
            if isinstance(exc, WeightSyncError | WeightValidationError | RewardServerError) or not isinstance(
                exc, Exception
            ):
                raise
            raise WeightSyncError(f"the push of version {v} failed: {type(exc).__name__}: {exc}") from exc
        finally:
            publisher.tell = None
        published = time.perf_counter()
        tell("done")
        self.last_stats = {**publisher.last_stats, "done_s": time.perf_counter() - published}
        return v

    def _tell_failure(self, tell: Any, exc: BaseException) -> None:
        # as a one-process trainer does: a push refused before any byte moved keeps the group
        refused = isinstance(exc, DeltaRefused)
        keep = (
            refused
            or isinstance(exc, WeightValidationError)
            or (isinstance(exc, RewardServerError) and not exc.retryable)
        )
        try:
            tell("fail", f"{type(exc).__name__}: {exc}", regroup=not keep, delta_refused=refused)
        except StoreClosed:
            pass  # the store is this process's: gone only at exit
        if not keep:
            self.reset()  # every rank forms the group again on the next push

    def _follow(self, push: int, comm: Communicator, job: RankPush) -> int:
        assert self._layout is not None
        partial = job.base_version is not None  # a delta push's subset
        layout = self._layout.of(job.plan, job.mode, job.keep_lora, job.adapter, None, partial)
        sending = RankSends(comm, self.rank, layout, job.tensors, self.options.bucket_bytes)

        def take(step: SenderStep) -> None:
            if step.step == "ready" and comm.max_flag(0) != 0:
                return  # a replica refused: nothing moved, the leader says what next
            schedule = None
            if step.sliced:  # the leader found every receiver's places published: the same ones here
                schedule = self._slices(comm).schedule(sending.layout_id, sending.metadata, sending.buckets)
                if schedule is None:
                    raise WeightSyncError(
                        f"layout {sending.layout_id}: the receivers' places were taken back"
                    )
            sending.send(schedule)

        def failed(step: SenderStep) -> BaseException:
            if step.regroup:  # every rank alike: forming the group again is a collective
                self.reset()
            if step.delta_refused:
                return DeltaRefused(str(step.error))
            return WeightSyncError(f"the push of version {step.version} failed: {step.error}")

        channel = StepChannel(comm.store, push, self.options.timeout_s + 60.0)
        return follow_leader(channel, take, failed, lost=self.reset).version

    def _slices(self, comm: Communicator) -> SliceBook:
        """A following rank's view of what the receivers published (the leader decided to slice)."""
        if self._slice_book is None or self._slice_book.store is not comm.store:
            self._slice_book = SliceBook(comm.store, comm.first_sender, slicing_of(comm, "always"))
        return self._slice_book

    # ---- upkeep -------------------------------------------------------------------------------
    def reset(self) -> None:
        if self._led is not None:
            self._led.wait_heard(self.senders - 1)
        self._led = None
        if self.comm is not None:
            try:
                self.comm.close()
            finally:
                self.comm = None
                self._publisher = None

    def close(self) -> None:
        if self.comm is not None and self.control is not None:
            self.control.close_communicator()
        self.reset()
        if self.control is not None:
            self.control.close()
