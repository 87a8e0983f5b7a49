"""Direct mode (no operator): the trainer drives the servers' control plane itself.

One process group spans every server (one broadcast serves them all), or, as an option, one group
per server on the derived ports ``group_port + i``. :class:`WeightPusher` is the public name
(``rewardplane.sdk.WeightPusher``).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence

import torch
import torch.distributed as dist

from rewardplane.protocol import (
    DEFAULT_BUCKET_BYTES,
    AdapterConfig,
    RewardModelTrainingMode,
    replica_group_ports,
)
from rewardplane.protocol.auth import resolve_token
from rewardplane.protocol.naming import WeightValidationError
from rewardplane.protocol.sleep import DEFAULT_SLEEP_TIMEOUT_S
from rewardplane.sdk._awake import AwakeReplicas
from rewardplane.sdk._exceptions import DeltaRefused, WeightSyncError
from rewardplane.sdk.push.options import PushOptions
from rewardplane.sdk.push.plan.delta import Acknowledged, delta_names, fingerprints, warn_refused
from rewardplane.sdk.push.ranks.sharded import ShardedPusher
from rewardplane.sdk.push.wire.data_plane import DataPlaneStarter
from rewardplane.sdk.push.wire.http import (
    HTTPControlPlane,
    RewardModelPublisher,
    local_address_towards,
    open_trainer_group,
)
from rewardplane.sdk.retry import RewardServerError
from rewardplane.transport.comm import Backend, Communicator, default_device

log = logging.getLogger(__name__)


class FanOutCommunicator:
    """Several groups (one per server), each with the trainer as its last rank."""

    def __init__(self, comms: Sequence[Communicator]) -> None:
        self.comms = list(comms)
        self.device = self.comms[0].device

    def broadcast(self, tensor: torch.Tensor, src: int) -> None:
        for c in self.comms:
            c.broadcast(tensor, c.world_size - 1)

    def broadcast_group(self, tensors: Sequence[torch.Tensor], src: int | Sequence[int]) -> None:
        for c in self.comms:
            c.broadcast_group(tensors, c.world_size - 1)

    def synchronize(self) -> None:
        for c in self.comms:
            c.synchronize()

    def wait_event(self, done: torch.cuda.Event) -> None:
        try:  # one CUDA event, whichever group's bounded wait watches it
            self.comms[0].wait_event(done)
        except BaseException:
            self.abort()
            raise

    def abort(self) -> None:
        for c in self.comms:
            c.abort()

    def max_flag(self, value: int) -> int:
        return max(c.max_flag(value) for c in self.comms)

    def close(self) -> None:
        for c in self.comms:
            c.close()


class WeightPusher:
    """Pushes reward-model weights into running servers (direct mode, no operator).

    Args:
        urls: the servers' base URLs.
        group_port: the process group's port (one group spanning every server); with
            ``per_server_groups`` server ``i`` uses ``group_ports[i]`` (default ``group_port + i``).
        token, token_file: the control-plane token the servers were started with
            (default ``REWARDPLANE_TOKEN``).
        trainer_host: this trainer's address as the servers reach it (default: the local address
            on the route to the first server).
        device: the trainer's device (an int is a CUDA index; default CUDA if available, else CPU).
        backend: ``nccl``, ``gloo`` or ``auto`` (by device).
        timeout_s: bound of one push; connect_timeout_s: bound of forming the group.
        bucket_bytes: size of the flat buckets a push broadcasts.
        atomic: servers stage a whole push and swap it in under the scoring lock (costs a copy
            of the pushed parameters on each server; scoring continues during the transfer).
        head_name_patterns: what counts as the head for head-only pushes.
        data_plane: once every server accepted a layout over HTTP, start its later pushes from
            the data plane (a header in the group's store, no HTTP request; one group only).
        trainer_group: the trainer's own process group (e.g. FSDP's) when it has several ranks:
            :meth:`push` and :meth:`close` become collectives that every rank calls with its own
            state dict (FSDP2 ``DTensor``s, ``TensorPiece`` slices, or tensors every rank holds
            alike). Each rank sends its own part from its own device; nothing is gathered. Rank 0
            talks to the servers and hosts the group on ``group_port``; ``device`` is each rank's.
        delta: the default of :meth:`push`'s ``delta`` (send only the tensors that changed since
            the last push every server committed; docs/weight-sync.md "Delta pushes").

    The group is formed on the first push (or :meth:`open`) and kept for the next ones; a failed
    transfer drops it and the next push forms it again.
    """

    def __init__(
        self,
        urls: Sequence[str],
        *,
        group_port: int,
        group_ports: Sequence[int] | None = None,
        token: str | None = None,
        token_file: str | None = None,
        trainer_host: str | None = None,
        device: torch.device | str | int | None = None,
        backend: Backend = "auto",
        timeout_s: float = 600.0,
        connect_timeout_s: float = 120.0,
        bucket_bytes: int = DEFAULT_BUCKET_BYTES,
        atomic: bool = False,
        per_server_groups: bool = False,
        head_name_patterns: Sequence[str] | None = None,
        data_plane: bool = True,
        trainer_group: dist.ProcessGroup | None = None,
        delta: bool = False,
    ) -> None:
        self.urls = list(urls)
        # every push's settings, built here from the keywords, read from here by every part
        self.options = PushOptions(
            trainer_host=trainer_host,
            device=_device(device),
            backend=backend,
            timeout_s=timeout_s,
            connect_timeout_s=connect_timeout_s,
            bucket_bytes=bucket_bytes,
            atomic=atomic,
            head_name_patterns=tuple(head_name_patterns) if head_name_patterns is not None else None,
            data_plane=data_plane,
            delta=delta,
        )
        # What every server committed in the last push, where it was a delta-enabled full push:
        # fingerprints only. None: the next delta-enabled push sends everything.
        self._acked: Acknowledged | None = None
        self.group_port = group_port
        self.group_ports = (
            list(group_ports) if group_ports else replica_group_ports(group_port, len(self.urls))
        )
        if len(self.group_ports) != len(self.urls):
            raise ValueError(
                f"{len(self.urls)} servers but {len(self.group_ports)} group ports: give one per server"
            )
        self.token, self.token_file = token, token_file
        self.per_server_groups = per_server_groups
        self._publisher: RewardModelPublisher | None = None
        self.sharded: ShardedPusher | None = None
        if trainer_group is not None and dist.get_world_size(trainer_group) > 1:
            if per_server_groups:
                raise ValueError("per_server_groups and a multi-rank trainer_group do not go together")
            self.sharded = ShardedPusher(
                trainer_group,
                self.urls,
                group_port=group_port,
                token=token,
                token_file=token_file,
                options=self.options,
            )
            self._control = self.sharded.control  # rank 0's; None on the other ranks
        else:
            self._control = HTTPControlPlane(
                self.urls, token=token, token_file=token_file, timeout_s=timeout_s
            )

    @property
    def device(self) -> torch.device:
        """The trainer's device (each rank's own with a multi-rank ``trainer_group``)."""
        assert isinstance(self.options.device, torch.device)  # resolved in __init__
        return self.options.device

    @property
    def control(self) -> HTTPControlPlane:
        """The servers' control plane (with a multi-rank ``trainer_group``: rank 0's only)."""
        if self._control is None:
            raise WeightSyncError(
                "only rank 0 of the trainer group talks to the reward servers; call this on rank 0"
            )
        return self._control

    def _control_for(self, urls: Sequence[str]) -> HTTPControlPlane:
        return HTTPControlPlane(
            urls, token=self.token, token_file=self.token_file, timeout_s=self.options.timeout_s
        )

    def open(self) -> RewardModelPublisher:
        """Form the process group (once) and return the publisher that pushes over it. With a
        multi-rank ``trainer_group`` the group forms in :meth:`push` or :meth:`open_group`."""
        if self.sharded is not None:
            raise WeightSyncError(
                "with a multi-rank trainer_group, call open_group() on every rank (or just push)"
            )
        if self._publisher is not None:
            return self._publisher
        opts = self.options
        host = opts.trainer_host or local_address_towards(self.urls[0])
        comm: Communicator | FanOutCommunicator
        if self.per_server_groups:
            comms = []
            for url, port in zip(self.urls, self.group_ports, strict=True):
                ctl = self._control_for([url])
                try:
                    comms.append(
                        open_trainer_group(
                            ctl,
                            host=host,
                            port=port,
                            device=self.device,
                            backend=opts.backend,
                            timeout_s=opts.connect_timeout_s,
                        )
                    )
                finally:
                    ctl.close()
            comm, src = FanOutCommunicator(comms), -1
        else:
            comm = open_trainer_group(
                self.control,
                host=host,
                port=self.group_port,
                device=self.device,
                backend=opts.backend,
                timeout_s=opts.connect_timeout_s,
            )
            src = comm.world_size - 1
        starter = (  # one group only: the header is written into its store
            DataPlaneStarter.for_group(comm, self.control.rank_offsets())
            if opts.data_plane and isinstance(comm, Communicator)
            else None
        )
        self._publisher = RewardModelPublisher(self.control, comm, src, opts, data_plane=starter)
        return self._publisher

    def awake(
        self, level: int = 1, *, timeout_s: float = DEFAULT_SLEEP_TIMEOUT_S, reload: bool = True
    ) -> AwakeReplicas:
        """The colocated cycle without the operator: ``with pusher.awake(2, reload=False):`` wakes
        every server, then push and score inside the block; on exit they sleep at ``level`` again
        (``AwakeReplicas``; ``reload`` False: a level-2 wake reads nothing from disk, the block's
        first push must be a full one)."""
        token = resolve_token(self.token, self.token_file)
        return AwakeReplicas(
            lambda: self.urls, lambda: token, level=level, timeout_s=timeout_s, reload=reload
        )

    def open_group(self) -> None:
        """Form the push group ahead of the first push (a collective with a multi-rank
        ``trainer_group``: every rank calls it)."""
        if self.sharded is not None:
            self.sharded.open()
        else:
            self.open()

    def max_lora_rank(self) -> int:
        """The largest LoRA rank every server serves as an adapter; 0 where any serves none (then
        sync mode ``auto`` resolves to ``full``)."""
        return self.control.max_lora_rank()

    def next_version(self) -> int:
        """The highest version any server serves, plus one."""
        return max(self.control.versions()) + 1

    def push(
        self,
        params: Mapping[str, torch.Tensor],
        *,
        version: int | None = None,
        training_mode: RewardModelTrainingMode | str = RewardModelTrainingMode.FULL,
        keep_lora: bool = False,
        adapter: AdapterConfig | None = None,
        delta: bool | None = None,
    ) -> int:
        """Push ``params`` as ``version`` (default :meth:`next_version`) into every server and wait
        until all serve it; returns the version. Raises WeightValidationError before any byte
        moves when the parameters do not fit, WeightSyncError when the transfer fails.

        ``training_mode="adapter"`` pushes only LoRA A/B tensors (plus e.g. the head), with their
        ``adapter`` configuration; the servers serve them as a LoRA adapter over untouched base
        weights (``rewardplane.sdk.LoraSync`` picks the mode and falls back to merged pushes).

        ``delta`` (default: the pusher's ``delta``): a full push sends only the tensors whose bytes
        changed since the last push every server committed (one fingerprint pass over ``params``);
        where a server no longer holds that version as pushed, everything is sent instead, as the
        same version. With a multi-rank ``trainer_group`` each rank fingerprints its own parts and
        a tensor is sent when any rank's part changed. Other training modes send everything."""
        mode = RewardModelTrainingMode(training_mode)
        opts = self.options.for_push(keep_lora=keep_lora, adapter=adapter, delta=delta)
        if self.sharded is not None:
            return self.sharded.push(params, version, mode, opts)
        publisher = self.open()
        v = self.next_version() if version is None else version
        # cleared while the push runs: after any failure the next delta-enabled push sends everything
        acked, self._acked = self._acked, None
        try:
            if opts.delta and mode is RewardModelTrainingMode.FULL:
                self._acked = self._push_delta(publisher, params, v, keep_lora, acked)
                return v
            return publisher.publish(params, v, training_mode=mode, keep_lora=keep_lora, adapter=adapter)
        except (WeightValidationError, RewardServerError) as exc:
            if isinstance(exc, RewardServerError) and exc.retryable:
                self.reset()
            raise  # rejected before any byte moved: the group is intact
        except Exception:
            # A failed transfer leaves the group unusable on the servers; the next push re-forms it.
            self.reset()
            raise

    @staticmethod
    def _push_delta(
        publisher: RewardModelPublisher,
        params: Mapping[str, torch.Tensor],
        version: int,
        keep_lora: bool,
        acked: Acknowledged | None,
    ) -> Acknowledged:
        """Push what changed since ``acked`` (everything without it, or where a server refuses the
        delta); returns what the servers hold now."""
        full = RewardModelTrainingMode.FULL
        prints = fingerprints(params)
        if acked is not None:
            sizes = {k: t.numel() * t.element_size() for k, t in params.items()}
            names = delta_names(prints, acked.prints, sizes)
            try:
                subset = {k: params[k] for k in names}
                publisher.publish(
                    subset, version, training_mode=full, keep_lora=keep_lora, base_version=acked.version
                )
                return Acknowledged(version, prints)
            except DeltaRefused as exc:  # nothing moved: the same version, in full
                warn_refused(log, version, acked.version, exc, len(params))
        publisher.publish(params, version, training_mode=full, keep_lora=keep_lora)
        return Acknowledged(version, prints)

    def reset(self) -> None:
        self._acked = None  # a new group may mean restarted servers
        if self._publisher is not None:
            try:
                self._publisher.comm.close()
            finally:
                self._publisher = None

    def close(self) -> None:
        """Tell the servers to leave the group, then release it and the HTTP clients."""
        if self.sharded is not None:
            self.sharded.close()
            return
        if self._publisher is not None:
            self.control.close_communicator()
        self.reset()
        self.control.close()

    def __enter__(self) -> WeightPusher:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _device(device: torch.device | str | int | None) -> torch.device:
    """The trainer's device: an int is a CUDA index; None is CUDA where there is one, else the CPU."""
    if device is None:
        return default_device()
    if isinstance(device, int):
        return torch.device("cuda", device)
    return torch.device(device)
