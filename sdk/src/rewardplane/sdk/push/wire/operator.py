"""A push through the operator (cluster mode), the work behind ``RewardModelHandle.push_weights``.

Prepare the parameters exactly like the publisher (normalise names, validate for the training
mode, check them against the served manifest, so a bad name fails before anything moves) → store
the manifest in a ConfigMap → host the rendezvous (TCPStore) → create or patch the model's
``WeightSync`` → the operator asks every replica to join (phase Rendezvous) and announces the
update (phase Transferring) → broadcast the buckets as the last rank → agree on success in one
status reduction → wait until the operator reports every replica on the new version (Completed),
or raise with its reason (Failed).

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
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any, Protocol

from rewardplane.api.heartbeat import CONFIRMED_AT, unconfirmed
from rewardplane.api.names import API_VERSION, LABEL_MODEL, WS_KIND, WS_PLURAL, core_path, custom_path
from rewardplane.api.weightsync import adapter_spec
from rewardplane.protocol import (
    AdapterConfig,
    ParamMeta,
    RewardModelTrainingMode,
    plan_buckets,
    settings,
)
from rewardplane.sdk._cluster_status import wait_for_version
from rewardplane.sdk._exceptions import WeightSyncFailed

if TYPE_CHECKING:
    import torch

    from rewardplane.api.kube import Kube
    from rewardplane.api.status import RewardModelStatus
    from rewardplane.sdk._cluster_status import ReplicaEndpoint
    from rewardplane.sdk.push.options import PushOptions
    from rewardplane.transport.comm import Backend, Communicator

log = logging.getLogger("rewardplane.sdk.cluster")

POLL_S = 0.02  # WeightSync status polls during a push (one GET each; a push is short)
# The WeightSync went after the weights were sent: how long the replicas are given to commit them.
COMMIT_WAIT_S = 30.0
SERVED_POLL_S = 0.2
# A push the operator has not taken up this long: is any operator confirming the model's status?
UNTAKEN_CHECK_S = 3.0
OPERATOR_ABSENT = "OperatorNotConfirming"  # WeightSyncFailed.reason: no operator confirms the model
WEIGHTSYNC_GONE = "WeightSyncGone"  # WeightSyncFailed.reason: the push's WeightSync was deleted or replaced


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
        self.name, self.namespace = handle.name, handle.namespace
        self.label = f"{handle.namespace}/{handle.name}"
        self._kube = handle._kube
        self._uid = ""  # the WeightSync this push created or patched: another one is not followed

    def owner_references(self) -> list[dict[str, Any]]:
        """The RewardModel as owner: garbage collection deletes the push objects with the model."""
        meta = self.handle.get()["metadata"]
        return [{"apiVersion": API_VERSION, "kind": "RewardModel", "name": meta["name"], "uid": meta["uid"]}]

    def store_manifest(self, metadata: list[ParamMeta]) -> tuple[str, str, str]:
        from rewardplane.api.weightsync import encode_manifest

        data, key, sha = encode_manifest(metadata)
        name = f"{self.name}-weightsync-manifest"
        field = "binaryData" if key.endswith(".gz") else "data"
        body = {
            "apiVersion": "v1",
            "kind": "ConfigMap",
            "metadata": {
                "name": name,
                "namespace": self.namespace,
                "labels": {LABEL_MODEL: self.name},
                "ownerReferences": self.owner_references(),
            },
            field: data,
        }
        if self._kube.create(core_path("configmaps", self.namespace), body) is None:
            other = "data" if field == "binaryData" else "binaryData"
            self._kube.merge_patch(core_path("configmaps", self.namespace, name), {field: data, other: None})
        return name, key, sha

    def request_push(self, spec: dict[str, Any]) -> int:
        """Create or patch the model's WeightSync; returns the generation the operator must handle."""
        path = custom_path(self.namespace, self.name, WS_PLURAL)
        owners = self.owner_references()
        body = {
            "apiVersion": API_VERSION,
            "kind": WS_KIND,
            "metadata": {
                "name": self.name,
                "namespace": self.namespace,
                "labels": {LABEL_MODEL: self.name},
                "ownerReferences": owners,
            },
            "spec": spec,
        }
        created = self._kube.create(custom_path(self.namespace, None, WS_PLURAL), body)
        if created is None and _owner_uids(self._kube.get(path)) not in ([], [owners[0]["uid"]]):
            # an earlier RewardModel of this name owns it: its history is not this model's
            self._kube.delete(path)
            created = self._kube.create(custom_path(self.namespace, None, WS_PLURAL), body)
        if created is not None:
            self._uid = str(created["metadata"].get("uid") or "")
            return int(created["metadata"].get("generation") or 1)
        # a merge patch keeps fields it does not name: clear an earlier push's adapter, base and
        # trainer fields explicitly (a one-rank push after a multi-rank one must not wait for absent
        # ranks; spec.trainer.ranks is always given)
        trainer = {"interface": None, **(spec.get("trainer") or {})}
        patched = self._kube.merge_patch(
            path, {"spec": {"adapter": None, "baseVersion": None, **spec, "trainer": trainer}}
        )
        self._uid = str(patched["metadata"].get("uid") or "")
        return int(patched["metadata"]["generation"])

    def _read(self, generation: int) -> dict[str, Any]:
        """The WeightSync of this push; raises WeightSyncLost when it was deleted or replaced (by
        another object of the name, or a newer spec): the operator no longer follows this push."""
        ws = self.handle.weightsync()
        meta = (ws or {}).get("metadata") or {}
        if ws is None:
            raise WeightSyncLost(f"WeightSync {self.label} was deleted", {})
        if self._uid and meta.get("uid") != self._uid:
            raise WeightSyncLost(f"WeightSync {self.label} was deleted and created again", {})
        if int(meta.get("generation") or 0) > generation:
            raise WeightSyncLost(
                f"WeightSync {self.label} was changed to another push (generation {meta.get('generation')}, "
                f"version {(ws.get('spec') or {}).get('version')})",
                ws.get("status") or {},
            )
        return ws

    def wait_phase(self, generation: int, phases: set[str], deadline: float, what: str) -> dict[str, Any]:
        untaken_since, checked = time.monotonic(), 0.0
        while True:
            ws = self._read(generation)
            status = ws.get("status") or {}
            if status.get("observedGeneration") == generation:
                if status.get("phase") == "Failed":
                    raise _operator_failed(status)
                if status.get("phase") in phases:
                    return ws
            elif time.monotonic() - max(untaken_since, checked) > UNTAKEN_CHECK_S:
                # not taken up yet: an operator that confirms no status will not take it up either
                checked = time.monotonic()
                model_status = self.handle.get().get("status") or {}
                doubt = unconfirmed(model_status, datetime.now(UTC))
                if doubt and CONFIRMED_AT in model_status:  # an older operator writes no heartbeat
                    raise WeightSyncFailed(
                        f"WeightSync {self.label} (version {(ws.get('spec') or {}).get('version')}) "
                        f"is not taken up: {doubt}",
                        OPERATOR_ABSENT,
                        status,
                    )
            if time.monotonic() > deadline:
                raise WeightSyncFailed(
                    f"timed out waiting for {what} (WeightSync {self.namespace}/{self.name} is in phase "
                    f"{status.get('phase')!r} for generation {status.get('observedGeneration')}, want {generation}); "
                    "is the operator running? see its log",
                    "Timeout",
                    status,
                )
            time.sleep(POLL_S)

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

        manifest = self.store_manifest(metadata)
        host = options.trainer_host or local_address_towards(self.handle._push_urls()[0])
        # world_size None: the operator decides it from the ready replicas (status.worldSize).
        store = create_store(host, 0, is_master=True, world_size=None, timeout_s=options.timeout_s)
        generation = self.request_push(
            self.push_spec(
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
        ws = self.wait_phase(
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
            return self._push(metadata, tensors, version, mode, options, dev, started, deadline, base_version)
        except WeightSyncLost as lost:
            # before any weight moved (the rendezvous, the join): nothing to wait for
            raise self.lost_push(lost, version, moved=False) from None

    def _push(
        self,
        metadata: list[ParamMeta],
        tensors: Mapping[str, torch.Tensor],
        version: int,
        mode: RewardModelTrainingMode,
        options: PushOptions,
        dev: torch.device,
        started: float,
        deadline: float,
        base_version: int | None,
    ) -> PushResult:
        from rewardplane.protocol import layout_id
        from rewardplane.sdk.push.plan.slices import agree_on_slices
        from rewardplane.transport.slices import send_slices
        from rewardplane.transport.transfer import send_buckets

        bucket_bytes = options.bucket_bytes
        store, _, generation, ws = self.rendezvous(
            metadata, version, mode, options, deadline=deadline, base_version=base_version
        )
        status = ws["status"]
        world = int(status["worldSize"])
        comm = self.join_group(store, world - 1, status, dev, options.backend, generation, deadline)
        try:
            self.wait_phase(
                generation, {"Transferring", "Completed"}, deadline, "every replica to accept the announce"
            )
            transfer_start = time.monotonic()
            plan = plan_buckets(metadata, bucket_bytes)
            schedule = None
            if status.get("agreeSlicing"):  # the replicas agree on slicing: so does this trainer
                lid = layout_id(metadata, bucket_bytes)
                schedule = agree_on_slices(comm, lid, metadata, plan, decides=True)
            total = sum(b.nbytes for b in plan)
            bar = _progress_bar(total, options.progress, f"push v{version}")
            try:
                if schedule is not None:
                    sent = send_slices(comm, metadata, dict(tensors), schedule)
                    if bar is not None:
                        bar.update(total)
                else:
                    sender = _ProgressComm(comm, bar) if bar is not None else comm
                    sent = send_buckets(sender, metadata, tensors, bucket_bytes, world - 1, plan=plan)
                failed = comm.max_flag(0)
            finally:
                if bar is not None:
                    bar.close()
            transfer_s = time.monotonic() - transfer_start
        except BaseException:
            comm.abort()  # replicas see the group fail at once instead of waiting for the timeout
            raise
        comm.close()
        result = self.finish(generation, version, mode, sent, world, started, transfer_s, deadline)
        result = dataclasses.replace(result, transport=comm.backend)
        if failed:
            log.warning("the status reduction reported a failure, but the operator reported Completed")
        return result

    def push_spec(
        self,
        version: int,
        mode: RewardModelTrainingMode,
        *,
        host: str,
        port: int,
        manifest: tuple[str, str, str],
        bucket_bytes: int,
        timeout_s: float,
        adapter: AdapterConfig | None,
        trainer: Mapping[str, Any] | None = None,
        base_version: int | None = None,
    ) -> dict[str, Any]:
        """The WeightSync's spec for one push (``trainer``: a multi-rank trainer's ranks;
        ``base_version``: a delta push's)."""
        config_map, key, sha = manifest
        # not when this trainer never slices: the agreement would cost a reduction for nothing
        ranks = {"ranks": 1, **(trainer or {}), "agreeSlicing": settings.PUSH_SLICING.get() != "never"}
        return {
            "rewardModelRef": self.name,
            "version": int(version),
            "trainingMode": mode.value,
            "rendezvous": {"address": host, "port": port},
            "manifestRef": {"configMapName": config_map, "key": key, "sha256": sha},
            "bucketBytes": int(bucket_bytes),
            "timeoutSeconds": max(1, int(timeout_s)),
            **({"adapter": adapter_spec(adapter)} if adapter is not None else {}),
            "trainer": ranks,
            **({"baseVersion": int(base_version)} if base_version is not None else {}),
        }

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
            done = self.wait_phase(
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
                self.raise_if_failed(generation, deadline)
        if "error" in box:
            self.raise_if_failed(generation, deadline)
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

    def raise_if_failed(self, generation: int, deadline: float) -> None:
        status = self._read(generation).get("status") or {}
        if status.get("observedGeneration") == generation and status.get("phase") == "Failed":
            raise _operator_failed(status)
        if time.monotonic() > deadline:
            raise WeightSyncFailed(
                "timed out joining the replicas' process group; see the operator's log", "Timeout"
            )


class WeightSyncLost(WeightSyncFailed):
    """The WeightSync of a running push was deleted or replaced (``status``: what it said last)."""

    def __init__(self, message: str, status: Mapping[str, Any]) -> None:
        super().__init__(message, WEIGHTSYNC_GONE, status)


def _owner_uids(ws: Mapping[str, Any] | None) -> list[str]:
    return [str(r.get("uid")) for r in ((ws or {}).get("metadata") or {}).get("ownerReferences") or []]


def _operator_failed(status: Mapping[str, Any]) -> WeightSyncFailed:
    return WeightSyncFailed(
        f"the operator failed the push of version {status.get('version')}: "
        f"{status.get('reason')}: {status.get('message')}",
        status.get("reason"),
        status,
    )


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
