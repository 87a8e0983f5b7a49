"""A push through the operator (cluster mode), the work behind ``RewardModelHandle.push_weights``.

Prepare the parameters exactly like the publisher (normalise names, validate for the training
mode, check them against the served manifest, so a bad name fails before anything moves) → store
the manifest in a ConfigMap → host the rendezvous (TCPStore) → create or patch the model's
``WeightSync`` → the operator asks every replica to join (phase Rendezvous) and announces the
update (phase Transferring) → broadcast the buckets as the last rank → agree on success in one
status reduction → wait until the operator reports every replica on the new version (Completed),
or raise with its reason (Failed).

The objects written for the operator and what it answers through them are ``objects.PushObjects``'s.
torch is imported when a push runs, not with this module.
"""

from __future__ import annotations

import dataclasses
import logging
import sys
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from rewardplane.protocol import ParamMeta, RewardModelTrainingMode, plan_buckets
from rewardplane.sdk._cluster_status import wait_for_version
from rewardplane.sdk._exceptions import WeightSyncFailed
from rewardplane.sdk.push.wire.objects import POLL_S, WEIGHTSYNC_GONE, PushObjects, WeightSyncLost

if TYPE_CHECKING:
    import torch

    from rewardplane.api.kube import Kube
    from rewardplane.api.status import RewardModelStatus
    from rewardplane.sdk._cluster_status import ReplicaEndpoint
    from rewardplane.sdk.push.options import PushOptions
    from rewardplane.transport.comm import Backend, Communicator

log = logging.getLogger("rewardplane.sdk.cluster")

# The WeightSync went after the weights were sent: how long the replicas are given to commit them.
COMMIT_WAIT_S = 30.0
SERVED_POLL_S = 0.2


@dataclass(frozen=True)
class PushResult:
    version: int
    training_mode: str
    bytes: int
    world_size: int
    replicas: int
    duration_s: float
    """From the call until the operator reported Completed."""
    transfer_s: float
    """The broadcast and the status reduction, on the trainer."""
    weightsync: dict[str, Any]
    transport: str = ""
    """What the group formed over: ``nccl``, ``gloo`` or ``ipc`` (the same-host transport)."""


class _ProgressComm:
    """Wraps a Communicator to advance a progress bar by the bytes of each broadcast bucket."""

    def __init__(self, comm: Any, bar: Any) -> None:
        self._comm, self._bar = comm, bar
        self.device = comm.device

    def broadcast(self, tensor: Any, src: int) -> None:
        self._comm.broadcast(tensor, src)
        self._bar.update(int(tensor.numel() * tensor.element_size()))

    def broadcast_group(self, tensors: Any, src: Any) -> None:
        self._comm.broadcast_group(tensors, src)
        self._bar.update(sum(int(t.numel() * t.element_size()) for t in tensors))

    def wait_event(self, done: Any) -> None:
        self._comm.wait_event(done)

    def synchronize(self) -> None:
        self._comm.synchronize()

    def max_flag(self, value: int) -> int:
        return int(self._comm.max_flag(value))

    def close(self) -> None:
        self._comm.close()


class PushTarget(Protocol):
    """What a push through the operator reads of its RewardModel (``RewardModelHandle`` is one).
    A protocol, so that the push does not import the handle that calls it: no import circle."""

    name: str
    namespace: str
    _kube: Kube

    def get(self) -> dict[str, Any]: ...

    def get_status(self) -> RewardModelStatus: ...

    def get_all_endpoints(self) -> list[ReplicaEndpoint]: ...

    def manifest(self) -> dict[str, ParamMeta]: ...

    def weightsync(self) -> dict[str, Any] | None: ...

    def _push_urls(self) -> list[str]: ...


class OperatorPush:
    """The pushes of one RewardModel through its ``WeightSync`` object and the operator."""

    def __init__(self, handle: PushTarget) -> None:
        self.handle = handle
        self.label = f"{handle.namespace}/{handle.name}"
        # the ConfigMap and WeightSync written for the operator, and what it answers through them
        self.objects = PushObjects(handle._kube, handle.namespace, handle.name, handle.get, handle.weightsync)

    def rendezvous(
        self,
        metadata: list[ParamMeta],
        version: int,
        mode: RewardModelTrainingMode,
        options: PushOptions,
        *,
        deadline: float,
        trainer: Mapping[str, Any] | None = None,
        base_version: int | None = None,
    ) -> tuple[Any, str, int, dict[str, Any]]:
        """Store the manifest, host the push group's store, ask the operator for the push and wait
        for its rendezvous: (the store, its host, the generation to follow, the WeightSync)."""
        from rewardplane.sdk.push.wire.http import local_address_towards
        from rewardplane.transport.comm import create_store

        manifest = self.objects.store_manifest(metadata)
        host = options.trainer_host or local_address_towards(self.handle._push_urls()[0])
        # world_size None: the operator decides it from the ready replicas (status.worldSize).
        store = create_store(host, 0, is_master=True, world_size=None, timeout_s=options.timeout_s)
        generation = self.objects.request_push(
            self.objects.push_spec(
                version,
                mode,
                host=host,
                port=int(store.port),
                manifest=manifest,
                bucket_bytes=options.bucket_bytes,
                timeout_s=options.timeout_s,
                adapter=options.adapter,
                trainer=trainer,
                base_version=base_version,
            )
        )
        ws = self.objects.wait_phase(
            generation, {"Rendezvous", "Transferring", "Completed"}, deadline, "the rendezvous"
        )
        return store, host, generation, ws

    def push(
        self,
        metadata: list[ParamMeta],
        tensors: Mapping[str, torch.Tensor],
        version: int,
        mode: RewardModelTrainingMode,
        options: PushOptions,
        *,
        started: float,
        base_version: int | None = None,
    ) -> PushResult:
        """Push prepared parameters (``RewardModelHandle.prepare``) as ``version``, within
        ``timeout_s`` of ``started``; returns when the operator reports every replica serving it.
        ``base_version``: a delta push of the tensors changed since that version."""
        import torch

        deadline = started + options.timeout_s
        first = next(iter(tensors.values()))
        dev = torch.device(options.device) if options.device is not None else first.device
        try:
            store, _, generation, ws = self.rendezvous(
                metadata, version, mode, options, deadline=deadline, base_version=base_version
            )
            status = ws["status"]
            world = int(status["worldSize"])
            comm = self.join_group(store, world - 1, status, dev, options.backend, generation, deadline)
            try:
                self.objects.wait_phase(
                    generation,
                    {"Transferring", "Completed"},
                    deadline,
                    "every replica to accept the announce",
                )
                transfer_start = time.monotonic()
                sent, failed = _broadcast(comm, metadata, tensors, options, status, version)
                transfer_s = time.monotonic() - transfer_start
            except BaseException:
                comm.abort()  # replicas see the group fail at once instead of waiting for the timeout
                raise
            comm.close()
            result = self.finish(generation, version, mode, sent, world, started, transfer_s, deadline)
        except WeightSyncLost as lost:
            # before any weight moved (the rendezvous, the join): nothing to wait for (``finish``
            # answers for a WeightSync lost after the weights were sent)
            raise self.lost_push(lost, version, moved=False) from None
        if failed:
            log.warning("the status reduction reported a failure, but the operator reported Completed")
        return dataclasses.replace(result, transport=comm.backend)

    def finish(
        self,
        generation: int,
        version: int,
        mode: RewardModelTrainingMode,
        sent: int,
        world: int,
        started: float,
        transfer_s: float,
        deadline: float,
    ) -> PushResult:
        """Wait until the operator reports every replica serving ``version`` (or raise its reason).
        The weights were sent: a WeightSync deleted or replaced meanwhile no longer says how the push
        ended, so the replicas are asked; a push they committed is not reported as failed."""
        try:
            done = self.objects.wait_phase(
                generation, {"Completed"}, deadline, f"every replica to serve version {version}"
            )
        except WeightSyncLost as lost:
            served = self.served_versions(version, min(deadline, time.monotonic() + COMMIT_WAIT_S))
            if served and min(served.values()) >= version:
                log.warning("%s; every replica serves version %d: the push committed", lost, version)
                return PushResult(
                    version=int(version),
                    training_mode=mode.value,
                    bytes=int(sent),
                    world_size=world,
                    replicas=len(served),
                    duration_s=time.monotonic() - started,
                    transfer_s=transfer_s,
                    weightsync=lost.status,
                )
            raise self.lost_push(lost, version, moved=True, served=served) from None
        wait_for_version(
            self.handle.get_status, self.label, int(version), min(deadline, time.monotonic() + 30)
        )
        s = done["status"]
        return PushResult(
            version=int(version),
            training_mode=mode.value,
            bytes=int(sent),
            world_size=world,
            replicas=len(s.get("replicas") or []),
            duration_s=time.monotonic() - started,
            transfer_s=transfer_s,
            weightsync=done,
        )

    def join_group(
        self,
        store: Any,
        rank: int,
        status: Mapping[str, Any],
        device: torch.device,
        backend: Backend,
        generation: int,
        deadline: float,
        senders: int = 1,
    ) -> Communicator:
        """Join the replicas' group at ``rank``, watching the operator meanwhile: a failed
        rendezvous must not leave the trainer waiting until the deadline."""
        from rewardplane.transport.group import open_group

        box: dict[str, Any] = {}

        def join() -> None:
            try:
                box["comm"] = open_group(
                    store,
                    rank=rank,
                    world_size=int(status["worldSize"]),
                    device=device,
                    backend=backend,
                    timeout_s=max(1.0, deadline - time.monotonic()),
                    group_id=status["groupId"],
                    senders=senders,
                )
            except Exception as exc:
                box["error"] = exc

        joiner = threading.Thread(target=join, name="rewardplane-join", daemon=True)
        joiner.start()
        while joiner.is_alive():
            joiner.join(POLL_S)
            if joiner.is_alive():
                self.objects.raise_if_failed(generation, deadline)
        if "error" in box:
            self.objects.raise_if_failed(generation, deadline)
            raise WeightSyncFailed(f"joining the replicas' group failed: {box['error']}", "RendezvousFailed")
        comm: Communicator = box["comm"]
        return comm

    def served_versions(self, version: int, until: float) -> dict[str, int]:
        """Replica URL → the weights version it serves (``/runtime_version``), asked until every
        replica serves ``version`` or ``until``; replicas that do not answer are left out."""
        from rewardplane.sdk.client import RewardClient

        served: dict[str, int] = {}
        while True:
            urls = [e.url for e in self.handle.get_all_endpoints() if e.url]
            try:
                with RewardClient(urls, request_timeout_s=5.0) as client:
                    answers = client.get_runtime_versions()
                served = {u: a.version for u, a in answers.items() if a.state != "broken"}
            except Exception as exc:  # a replica restarting: asked again until ``until``
                log.info("asking the replicas for their version: %s", exc)
            if (served and min(served.values()) >= version) or time.monotonic() >= until:
                return served
            time.sleep(SERVED_POLL_S)

    def lost_push(
        self, lost: WeightSyncLost, version: int, *, moved: bool, served: Mapping[str, int] | None = None
    ) -> WeightSyncFailed:
        """The error for a push whose WeightSync went: what happened and what the replicas serve."""
        if served is None:
            served = self.served_versions(version, time.monotonic())
        serving = (
            ", ".join(f"{u} serves version {v}" for u, v in sorted(served.items()))
            if served
            else "no replica answered /runtime_version"
        )
        then = (
            f"the weights were sent but not every replica committed version {version} within "
            f"{COMMIT_WAIT_S:.0f} s"
            if moved
            else "the push was given up before any weight moved"
        )
        return WeightSyncFailed(
            f"{lost}: {then}; {serving}. Push again with a version above the one served",
            WEIGHTSYNC_GONE,
            lost.status,
        )


def _broadcast(
    comm: Communicator,
    metadata: list[ParamMeta],
    tensors: Mapping[str, torch.Tensor],
    options: PushOptions,
    status: Mapping[str, Any],
    version: int,
) -> tuple[int, int]:
    """Send the weights as the group's last rank (sliced, where the replicas agree on slicing),
    then the status reduction: (the bytes sent, the reduced failure flag)."""
    from rewardplane.protocol import layout_id
    from rewardplane.sdk.push.plan.slices import agree_on_slices
    from rewardplane.transport.slices import send_slices
    from rewardplane.transport.transfer import send_buckets

    bucket_bytes = options.bucket_bytes
    plan = plan_buckets(metadata, bucket_bytes)
    schedule = None
    if status.get("agreeSlicing"):  # the replicas agree on slicing: so does this trainer
        schedule = agree_on_slices(comm, layout_id(metadata, bucket_bytes), metadata, plan, decides=True)
    total = sum(b.nbytes for b in plan)
    bar = _progress_bar(total, options.progress, f"push v{version}")
    try:
        if schedule is not None:
            sent = send_slices(comm, metadata, dict(tensors), schedule)
            if bar is not None:
                bar.update(total)
        else:
            sender = _ProgressComm(comm, bar) if bar is not None else comm
            world = int(status["worldSize"])
            sent = send_buckets(sender, metadata, tensors, bucket_bytes, world - 1, plan=plan)
        return sent, comm.max_flag(0)
    finally:
        if bar is not None:
            bar.close()


def _progress_bar(total: int, progress: bool | None, desc: str) -> Any:
    """A tqdm bar over the bytes of a push, only when asked or when stderr is a terminal."""
    if progress is None:
        progress = sys.stderr.isatty()
    if not progress:
        return None
    try:
        from tqdm import tqdm
    except ImportError:
        return None
    return tqdm(total=total, unit="B", unit_scale=True, unit_divisor=1024, desc=desc, leave=False)
