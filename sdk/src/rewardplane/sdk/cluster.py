"""The trainer's handle on a RewardModel in a cluster: wait for it, score against its ready replicas,
and push new weights through the operator (cluster mode).

A push: prepare the parameters exactly like the publisher (normalise names, validate for the
training mode, check them against the served manifest, so a bad name fails before anything
moves) → store the manifest in a ConfigMap → host the rendezvous (TCPStore) → create or patch the
model's ``WeightSync`` → the operator asks every replica to join (phase Rendezvous) and announces
the update (phase Transferring) → broadcast the buckets as the last rank → agree on success in
one status reduction → wait until the operator reports every replica on the new version
(Completed), or raise with its reason (Failed).

Needs the ``operator`` extra (kubernetes client, for its config loaders) and torch for pushes.
Credentials: in-cluster, or a kubeconfig (argument, ``$KUBECONFIG``, ``~/.kube/config``). The
control-plane token comes from ``REWARDPLANE_TOKEN`` or the model's token Secret (read access to
``secrets`` needed then).
"""

from __future__ import annotations

import base64
import logging
import os
import sys
import threading
import time
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import httpx

from rewardplane.api.names import (
    API_VERSION,
    LABEL_MODEL,
    RM_PLURAL,
    TOKEN_KEY,
    WS_KIND,
    WS_PLURAL,
    core_path,
    custom_path,
    token_secret_name,
)
from rewardplane.api.status import WEIGHTS_LOST, EndpointStatus, RewardModelStatus
from rewardplane.api.weightsync import adapter_spec
from rewardplane.protocol import (
    DEFAULT_BUCKET_BYTES,
    DEFAULT_SLEEP_TIMEOUT_S,
    TOKEN_ENV,
    AdapterConfig,
    Endpoints,
    ParamMeta,
    RewardModelTrainingMode,
    plan_buckets,
)
from rewardplane.protocol.auth import resolve_token
from rewardplane.protocol.naming import DEFAULT_HEAD_PATTERNS

from ._awake import AwakeReplicas
from ._exceptions import ClusterError, RewardplaneTimeout, WeightSyncFailed
from .push_checks import check_fits, names_for_mode

if TYPE_CHECKING:
    import torch

    from rewardplane.api.kube import Kube
    from rewardplane.transport.comm import Backend

    from .client import VLLMRewardClient

log = logging.getLogger(__name__)

POLL_S = 0.02  # status polls during a push (one GET each; a push is short)
CLIENT_WAIT_S = 60.0  # client(): how long to wait for a ready replica when there is no client yet
CLIENT_POLL_S = 0.5


@dataclass(frozen=True)
class ReplicaEndpoint:
    """One replica as ``status.endpoints`` lists it."""

    replica: int
    pod: str
    url: str
    weights_version: int | None
    state: str
    ready: bool
    rank_offset: int = 0
    world_size: int = 1


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


def _crd_path(ns: str, plural: str, name: str | None = None) -> str:
    return custom_path(ns, name, plural)


def _core_path(ns: str, plural: str, name: str | None = None) -> str:
    return core_path(plural, ns, name)


class _ProgressComm:
    """Wraps a Communicator to advance a progress bar by the bytes of each broadcast bucket."""

    def __init__(self, comm: Any, bar: Any) -> None:
        self._comm, self._bar = comm, bar
        self.device = comm.device

    def broadcast(self, tensor: Any, src: int) -> None:
        self._comm.broadcast(tensor, src)
        self._bar.update(int(tensor.numel() * tensor.element_size()))

    def broadcast_group(self, tensors: Any, src: int) -> None:
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


class RewardModelHandle:
    """A RewardModel by name: readiness, endpoints, a scoring client, and cluster-mode pushes.

    Args:
        name, namespace: the RewardModel.
        kubeconfig: path to a kubeconfig; default: in-cluster, else ``$KUBECONFIG`` / ``~/.kube/config``.
        token: control-plane token; default ``REWARDPLANE_TOKEN``, else the model's token Secret.
    """

    def __init__(
        self,
        name: str,
        namespace: str = "default",
        *,
        kubeconfig: str | os.PathLike[str] | None = None,
        token: str | None = None,
        kube: Kube | None = None,
    ) -> None:
        from rewardplane.api.kube import Kube  # credentials from the kubernetes package's loaders

        self.name, self.namespace = name, namespace
        self._kube = kube or Kube.from_environment(str(kubeconfig) if kubeconfig is not None else None)
        self._token = token
        self._client: VLLMRewardClient | None = None
        self._client_urls: tuple[str, ...] = ()
        self._lock = threading.Lock()

    # ---------------------------------------------------------------- reading

    def get(self) -> dict[str, Any]:
        """The RewardModel object (raises ClusterError when it does not exist)."""
        rm = self._kube.get(_crd_path(self.namespace, RM_PLURAL, self.name))
        if rm is None:
            raise ClusterError(
                f"RewardModel {self.namespace}/{self.name} does not exist; `kubectl get rm -n "
                f"{self.namespace}` lists the models"
            )
        return rm

    def get_status(self) -> RewardModelStatus:
        """The RewardModel's status, typed (one GET)."""
        return RewardModelStatus.model_validate(self.get().get("status") or {})

    def get_weights_version(self) -> int:
        """The weights version the operator reports for the model (one GET)."""
        return self.get_status().weights_version

    def get_all_endpoints(self) -> list[ReplicaEndpoint]:
        """Every replica the status lists, ready or not (one GET)."""
        return [_replica(e) for e in self.get_status().endpoints]

    def get_endpoints(self) -> list[ReplicaEndpoint]:
        """The ready replicas (healthy, on the model's weights version), in replica order (one GET)."""
        return _ready(self.get_all_endpoints())

    def get_urls(self) -> list[str]:
        """The ready replicas' base URLs, in replica order (one GET)."""
        return [e.url for e in self.get_endpoints()]

    # Earlier names: properties that read the cluster on every access. Kept working; they warn
    # because an attribute read that does network I/O (and can fail) surprises callers.
    @property
    def status(self) -> dict[str, Any]:
        _deprecated("status", "get_status()")
        return dict(self.get().get("status") or {})

    @property
    def weights_version(self) -> int:
        _deprecated("weights_version", "get_weights_version()")
        return self.get_weights_version()

    def all_endpoints(self) -> list[ReplicaEndpoint]:
        return self.get_all_endpoints()

    @property
    def endpoints(self) -> list[ReplicaEndpoint]:
        _deprecated("endpoints", "get_endpoints()")
        return self.get_endpoints()

    @property
    def urls(self) -> list[str]:
        _deprecated("urls", "get_urls()")
        return self.get_urls()

    def wait_ready(self, timeout_s: float = 300.0, *, min_replicas: int | None = None) -> RewardModelStatus:
        """Wait until every desired replica (or ``min_replicas``) is ready; returns the status.
        Raises RewardplaneTimeout (a TimeoutError) with the phase and message when it is not, and
        ClusterError at once when the operator reports the weights lost (only a push helps)."""
        deadline = time.monotonic() + timeout_s
        while True:
            rm = self.get()
            status = RewardModelStatus.model_validate(rm.get("status") or {})
            desired = int((rm.get("spec") or {}).get("replicas", 1))
            want = desired if min_replicas is None else min_replicas
            ready = len([e for e in status.endpoints if e.ready])
            # Sleeping: every replica ready and asleep (awake() wakes them)
            if ready >= want and (min_replicas is not None or status.phase in ("Ready", "Sleeping")):
                return status
            if status.reason == WEIGHTS_LOST:
                raise ClusterError(
                    f"RewardModel {self.namespace}/{self.name} will not become ready by itself: "
                    f"{status.message}"
                )
            if time.monotonic() > deadline:
                raise RewardplaneTimeout(
                    f"RewardModel {self.namespace}/{self.name} not ready after {timeout_s:.0f}s: phase "
                    f"{status.phase!r}, {ready}/{want} replicas ready ({status.message or 'no message'}); "
                    "see `kubectl describe rm` and the pods' logs"
                )
            time.sleep(0.2)

    def client(self, *, wait_s: float = CLIENT_WAIT_S, **kwargs: Any) -> VLLMRewardClient:
        """A scoring client over the ready replicas; a new one when the set of ready replicas changed
        since the last call (the old one is closed). ``kwargs`` go to VLLMRewardClient.

        While no replica is ready (a readiness blip: a kubelet restart resets every Pod's
        readiness for a few seconds), the client of the last call is returned as it is: its
        replicas most likely still serve, and its retries ride out the rest. Without one, this
        waits up to ``wait_s`` seconds for a ready replica, then raises ClusterError."""
        from .client import VLLMRewardClient

        urls = tuple(self.get_urls())
        if not urls:
            with self._lock:
                if self._client is not None and not kwargs:
                    return self._client
            deadline = time.monotonic() + wait_s
            while not urls:
                if time.monotonic() >= deadline:
                    raise ClusterError(
                        f"RewardModel {self.namespace}/{self.name} has no ready replica after {wait_s:.0f}s "
                        f"({self.get_status().message or 'no message'}); wait_ready() first, or see "
                        "`kubectl describe rm`"
                    )
                time.sleep(CLIENT_POLL_S)
                urls = tuple(self.get_urls())
        with self._lock:
            if self._client is None or urls != self._client_urls or kwargs:
                old, self._client = self._client, None
                if old is not None:
                    old.close()
                kwargs.setdefault("check_server", False)
                self._client = VLLMRewardClient(endpoints=list(urls), token=self._token, **kwargs)
                self._client_urls = urls
            return self._client

    def token(self) -> str:
        """The control-plane token: explicit, ``REWARDPLANE_TOKEN``, or the model's Secret."""
        if self._token:
            return self._token
        found = resolve_token(None, None)
        if found:
            return found
        secret = self._kube.get(_core_path(self.namespace, "secrets", token_secret_name(self.name)))
        raw = ((secret or {}).get("data") or {}).get(TOKEN_KEY)
        if not raw:
            raise ClusterError(
                f"no control-plane token: set {TOKEN_ENV}, or allow reading Secret "
                f"{self.namespace}/{token_secret_name(self.name)}"
            )
        self._token = base64.b64decode(raw).decode()
        return self._token

    def max_lora_rank(self) -> int:
        """The largest adapter rank the model serves: ``spec.lora.maxRank`` where ``spec.lora.enabled``,
        else 0 (then sync mode ``auto`` resolves to ``full``)."""
        lora = (self.get().get("spec") or {}).get("lora") or {}
        return int(lora.get("maxRank", 16)) if lora.get("enabled") else 0

    def manifest(self) -> dict[str, ParamMeta]:
        """The served parameters (names, dtypes, shapes) from the first ready replica."""
        urls = self._push_urls()
        if not urls:
            raise ClusterError(
                f"RewardModel {self.namespace}/{self.name} has no replica to read the manifest from"
            )
        resp = httpx.get(
            urls[0] + Endpoints.PARAM_MANIFEST,
            headers={"Authorization": f"Bearer {self.token()}"},
            timeout=30,
        )
        if resp.status_code != 200:
            raise ClusterError(
                f"{urls[0]}{Endpoints.PARAM_MANIFEST} answered {resp.status_code}: {resp.text[:300]}"
            )
        return {m["name"]: ParamMeta(**m) for m in resp.json()}

    def awake(self, level: int = 1, *, timeout_s: float = DEFAULT_SLEEP_TIMEOUT_S) -> AwakeReplicas:
        """``async with handle.awake():`` (or ``with``) — every replica awake for the block: woken on
        enter, back to sleep at ``level`` on exit, also when the block raised. Score and push inside
        it; a push to a sleeping replica is refused (409). Needs the control-plane token."""
        return AwakeReplicas(self._push_urls, self.token, level=level, timeout_s=timeout_s)

    def sleep(self, level: int = 1, *, timeout_s: float = DEFAULT_SLEEP_TIMEOUT_S) -> None:
        """Put every replica to sleep now (``awake()`` is the block form)."""
        from ._client import RewardClient

        with RewardClient(self._push_urls(), token=self.token()) as client:
            client.sleep(level, timeout_s=timeout_s)

    def wake(self, *, timeout_s: float = DEFAULT_SLEEP_TIMEOUT_S) -> None:
        """Wake every replica now."""
        from ._client import RewardClient

        with RewardClient(self._push_urls(), token=self.token()) as client:
            client.wake(timeout_s=timeout_s)

    def _push_urls(self) -> list[str]:
        """Ready replicas, else any replica with a URL (a push also restores stale ones)."""
        endpoints = self.get_all_endpoints()
        return [e.url for e in _ready(endpoints)] or [e.url for e in endpoints if e.url]

    def weightsync(self) -> dict[str, Any] | None:
        return self._kube.get(_crd_path(self.namespace, WS_PLURAL, self.name))

    # ---------------------------------------------------------------- pushing

    def prepare(
        self,
        params: Mapping[str, torch.Tensor],
        training_mode: RewardModelTrainingMode | str,
        *,
        keep_lora: bool = False,
        head_name_patterns: Sequence[str] | None = None,
        adapter: AdapterConfig | None = None,
    ) -> tuple[list[ParamMeta], dict[str, torch.Tensor]]:
        """Normalised, validated, deterministic-ordered parameters and their metadata (no I/O but the
        manifest read); raises WeightValidationError before anything moves."""
        from rewardplane.transport.buckets import meta_of

        mode = RewardModelTrainingMode(training_mode)
        manifest = self.manifest()
        clean = names_for_mode(
            params,
            mode,
            served=set(manifest),
            keep_lora=keep_lora,
            head_patterns=head_name_patterns or DEFAULT_HEAD_PATTERNS,
            adapter=adapter,
        )
        names = sorted(clean)
        tensors = {n: clean[n].detach() for n in names}
        metadata = [meta_of(n, tensors[n]) for n in names]
        check_fits(metadata, manifest, mode, adapter)
        return metadata, tensors

    def _owner_references(self) -> list[dict[str, Any]]:
        """The RewardModel as owner: garbage collection deletes the push objects with the model."""
        meta = self.get()["metadata"]
        return [{"apiVersion": API_VERSION, "kind": "RewardModel", "name": meta["name"], "uid": meta["uid"]}]

    def _store_manifest(self, metadata: list[ParamMeta]) -> tuple[str, str, str]:
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
                "ownerReferences": self._owner_references(),
            },
            field: data,
        }
        if self._kube.create(_core_path(self.namespace, "configmaps"), body) is None:
            other = "data" if field == "binaryData" else "binaryData"
            self._kube.merge_patch(_core_path(self.namespace, "configmaps", name), {field: data, other: None})
        return name, key, sha

    def _request_push(self, spec: dict[str, Any]) -> int:
        """Create or patch the model's WeightSync; returns the generation the operator must handle."""
        path = _crd_path(self.namespace, WS_PLURAL, self.name)
        body = {
            "apiVersion": API_VERSION,
            "kind": WS_KIND,
            "metadata": {
                "name": self.name,
                "namespace": self.namespace,
                "labels": {LABEL_MODEL: self.name},
                "ownerReferences": self._owner_references(),
            },
            "spec": spec,
        }
        created = self._kube.create(_crd_path(self.namespace, WS_PLURAL), body)
        if created is not None:
            return int(created["metadata"].get("generation") or 1)
        # a merge patch keeps fields it does not name: clear an earlier push's adapter explicitly
        patched = self._kube.merge_patch(path, {"spec": {"adapter": None, **spec}})
        return int(patched["metadata"]["generation"])

    def _wait_phase(self, generation: int, phases: set[str], deadline: float, what: str) -> dict[str, Any]:
        while True:
            ws = self.weightsync() or {}
            status = ws.get("status") or {}
            if status.get("observedGeneration") == generation:
                if status.get("phase") == "Failed":
                    raise WeightSyncFailed(
                        f"the operator failed the push of version {status.get('version')}: "
                        f"{status.get('reason')}: {status.get('message')}",
                        status.get("reason"),
                        status,
                    )
                if status.get("phase") in phases:
                    return ws
            if time.monotonic() > deadline:
                raise WeightSyncFailed(
                    f"timed out waiting for {what} (WeightSync {self.namespace}/{self.name} is in phase "
                    f"{status.get('phase')!r} for generation {status.get('observedGeneration')}, want {generation}); "
                    "is the operator running? see its log",
                    "Timeout",
                    status,
                )
            time.sleep(POLL_S)

    def push_weights(
        self,
        params: Mapping[str, torch.Tensor],
        version: int,
        training_mode: RewardModelTrainingMode | str = RewardModelTrainingMode.FULL,
        *,
        trainer_host: str | None = None,
        timeout_s: float = 600.0,
        bucket_bytes: int = DEFAULT_BUCKET_BYTES,
        device: torch.device | str | None = None,
        backend: Backend = "auto",
        keep_lora: bool = False,
        head_name_patterns: Sequence[str] | None = None,
        progress: bool | None = None,
        adapter: AdapterConfig | None = None,
    ) -> PushResult:
        """Push ``params`` as ``version`` into every replica through the operator; returns when the
        operator reports every replica serving it. Raises WeightValidationError (nothing moved),
        WeightSyncFailed (the operator's reason), or TimeoutError-like WeightSyncFailed("Timeout")."""
        import torch

        from rewardplane.transport.comm import Communicator, create_store
        from rewardplane.transport.transfer import send_buckets

        from .publisher import local_address_towards

        started = time.monotonic()
        deadline = started + timeout_s
        mode = RewardModelTrainingMode(training_mode)
        metadata, tensors = self.prepare(
            params, mode, keep_lora=keep_lora, head_name_patterns=head_name_patterns, adapter=adapter
        )
        first = next(iter(tensors.values()))
        dev = torch.device(device) if device is not None else first.device
        config_map, key, sha = self._store_manifest(metadata)

        urls = self._push_urls()
        host = trainer_host or local_address_towards(urls[0])
        # world_size None: the operator decides it from the ready replicas (status.worldSize).
        store = create_store(host, 0, is_master=True, world_size=None, timeout_s=timeout_s)
        generation = self._request_push(
            {
                "rewardModelRef": self.name,
                "version": int(version),
                "trainingMode": mode.value,
                "rendezvous": {"address": host, "port": int(store.port)},
                "manifestRef": {"configMapName": config_map, "key": key, "sha256": sha},
                "bucketBytes": int(bucket_bytes),
                "timeoutSeconds": max(1, int(timeout_s)),
                **({"adapter": adapter_spec(adapter)} if adapter is not None else {}),
            }
        )
        ws = self._wait_phase(
            generation, {"Rendezvous", "Transferring", "Completed"}, deadline, "the rendezvous"
        )
        status = ws["status"]
        world = int(status["worldSize"])
        comm_box: dict[str, Any] = {}

        def join() -> None:
            try:
                comm_box["comm"] = Communicator(
                    store,
                    rank=world - 1,
                    world_size=world,
                    device=dev,
                    backend=backend,
                    timeout_s=max(1.0, deadline - time.monotonic()),
                    group_id=status["groupId"],
                )
            except Exception as exc:
                comm_box["error"] = exc

        joiner = threading.Thread(target=join, name="rewardplane-join", daemon=True)
        joiner.start()
        while joiner.is_alive():  # watch the operator meanwhile: a failed rendezvous must not hang us
            joiner.join(POLL_S)
            if joiner.is_alive():
                self._raise_if_failed(generation, deadline)
        if "error" in comm_box:
            self._raise_if_failed(generation, deadline)
            raise WeightSyncFailed(
                f"joining the replicas' group failed: {comm_box['error']}", "RendezvousFailed"
            )
        comm = comm_box["comm"]
        try:
            self._wait_phase(
                generation, {"Transferring", "Completed"}, deadline, "every replica to accept the announce"
            )
            transfer_start = time.monotonic()
            total = sum(b.nbytes for b in plan_buckets(metadata, bucket_bytes))
            bar = _progress_bar(total, progress, f"push v{version}")
            try:
                sender = _ProgressComm(comm, bar) if bar is not None else comm
                sent = send_buckets(sender, metadata, tensors, bucket_bytes, world - 1)
                failed = comm.max_flag(0)
            finally:
                if bar is not None:
                    bar.close()
            transfer_s = time.monotonic() - transfer_start
        except BaseException:
            comm.abort()  # replicas see the group fail at once instead of waiting for the timeout
            raise
        comm.close()
        done = self._wait_phase(
            generation, {"Completed"}, deadline, f"every replica to serve version {version}"
        )
        if failed:
            log.warning("the status reduction reported a failure, but the operator reported Completed")
        self._wait_model_version(int(version), min(deadline, time.monotonic() + 30))
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

    def _raise_if_failed(self, generation: int, deadline: float) -> None:
        status = (self.weightsync() or {}).get("status") or {}
        if status.get("observedGeneration") == generation and status.get("phase") == "Failed":
            raise WeightSyncFailed(
                f"the operator failed the push of version {status.get('version')}: "
                f"{status.get('reason')}: {status.get('message')}",
                status.get("reason"),
                status,
            )
        if time.monotonic() > deadline:
            raise WeightSyncFailed(
                "timed out joining the replicas' process group; see the operator's log", "Timeout"
            )

    def _wait_model_version(self, version: int, deadline: float) -> None:
        """Until the RewardModel's status (and so ``endpoints``) shows the new version; best effort."""
        while time.monotonic() < deadline:
            status = self.get_status()
            if status.weights_version >= version and any(e.ready for e in status.endpoints):
                return
            time.sleep(POLL_S)
        log.warning(
            "RewardModel %s/%s status does not show version %d yet", self.namespace, self.name, version
        )

    def close(self) -> None:
        if self._client is not None:
            self._client.close()
            self._client = None
        self._kube.close()

    def __enter__(self) -> RewardModelHandle:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _replica(e: EndpointStatus) -> ReplicaEndpoint:
    return ReplicaEndpoint(
        replica=e.replica,
        pod=e.pod,
        url=e.url,
        weights_version=e.weights_version,
        state=e.state,
        ready=e.ready,
        rank_offset=e.rank_offset,
        world_size=e.world_size,
    )


def _ready(endpoints: Sequence[ReplicaEndpoint]) -> list[ReplicaEndpoint]:
    return sorted((e for e in endpoints if e.ready and e.url), key=lambda e: e.replica)


def _deprecated(name: str, instead: str) -> None:
    warnings.warn(
        f"RewardModelHandle.{name} reads the cluster on every access and is deprecated; call "
        f"{instead} instead",
        DeprecationWarning,
        stacklevel=3,
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
