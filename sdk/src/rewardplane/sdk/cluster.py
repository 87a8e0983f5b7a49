"""The trainer's handle on a RewardModel in a cluster: wait for it, score against its ready replicas,
and push new weights through the operator (cluster mode: ``push.wire.operator``).

The handle reads the cluster only in methods, never in attribute access; what it reads from the
status and how it waits on it is ``_cluster_status``.

Needs the ``cluster`` extra (kubernetes client, for its config loaders) and torch for pushes.
Credentials: in-cluster, or a kubeconfig (argument, ``$KUBECONFIG``, ``~/.kube/config``). The
control-plane token comes from ``REWARDPLANE_TOKEN`` or the model's token Secret (read access to
``secrets`` needed then).
"""

from __future__ import annotations

import base64
import functools
import logging
import os
import threading
import time
import traceback
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import httpx

from rewardplane.api.names import RM_PLURAL, TOKEN_KEY, WS_PLURAL, core_path, custom_path, token_secret_name
from rewardplane.api.status import RewardModelStatus
from rewardplane.protocol import (
    DEFAULT_BUCKET_BYTES,
    DEFAULT_SLEEP_TIMEOUT_S,
    TOKEN_ENV,
    AdapterConfig,
    Endpoints,
    ParamMeta,
    RewardModelTrainingMode,
)
from rewardplane.protocol.auth import resolve_token
from rewardplane.protocol.naming import DEFAULT_HEAD_PATTERNS

from ._awake import AwakeReplicas
from ._cluster_status import (
    ReplicaEndpoint,
    ready_replicas,
    replica_of,
    wait_for_urls,
    wait_until_ready,
)
from ._exceptions import ClusterError, WeightSyncFailed
from .push.options import PushOptions
from .push.plan.checks import check_fits, names_for_mode
from .push.wire.operator import OperatorPush, PushResult

if TYPE_CHECKING:
    import torch

    from rewardplane.api.kube import Kube
    from rewardplane.transport.comm import Backend

    from .client import RewardClient
    from .push.plan.delta import Acknowledged
    from .push.ranks.operator import RanksState

__all__ = ["PushResult", "ReplicaEndpoint", "RewardModelHandle"]

log = logging.getLogger(__name__)

CLIENT_WAIT_S = 60.0  # client(): how long to wait for a ready replica when there is no client yet


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
        self._client: RewardClient | None = None
        self._client_urls: tuple[str, ...] = ()
        # what every replica committed in the last push_weights(delta=True): what a delta builds on
        self._acked: Acknowledged | None = None
        # a multi-rank trainer's ranks and layouts, kept from one push to the next (push.ranks.operator)
        self._ranks_state: RanksState | None = None
        self._lock = threading.Lock()

    @property
    def _label(self) -> str:
        return f"{self.namespace}/{self.name}"

    # ---------------------------------------------------------------- reading

    def get(self) -> dict[str, Any]:
        """The RewardModel object (raises ClusterError when it does not exist)."""
        rm = self._kube.get(custom_path(self.namespace, self.name, RM_PLURAL))
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
        return [replica_of(e) for e in self.get_status().endpoints]

    def get_endpoints(self) -> list[ReplicaEndpoint]:
        """The ready replicas (healthy, on the model's weights version), in replica order (one GET)."""
        return ready_replicas(self.get_all_endpoints())

    def get_urls(self) -> list[str]:
        """The ready replicas' base URLs, in replica order (one GET)."""
        return [e.url for e in self.get_endpoints()]

    def wait_ready(self, timeout_s: float = 300.0, *, min_replicas: int | None = None) -> RewardModelStatus:
        """Wait until every desired replica (or ``min_replicas``) is ready; returns the status.
        Raises RewardplaneTimeout (a TimeoutError) with the phase and message when it is not, and
        ClusterError at once when the operator reports the weights lost (only a push helps)."""
        return wait_until_ready(self.get, self._label, timeout_s, min_replicas)

    def client(self, *, wait_s: float = CLIENT_WAIT_S, **kwargs: Any) -> RewardClient:
        """A scoring client (:class:`~rewardplane.sdk.RewardClient`) over the ready replicas; a new
        one when the set of ready replicas changed since the last call (the old one is closed).
        ``kwargs`` go to RewardClient (``retry``, ``request_timeout_s``, ...).

        While no replica is ready (a readiness blip: a kubelet restart resets every Pod's
        readiness for a few seconds), the client of the last call is returned as it is: its
        replicas most likely still serve, and its retries ride out the rest. Without one, this
        waits up to ``wait_s`` seconds for a ready replica, then raises ClusterError."""
        from .client import RewardClient

        urls = tuple(self.get_urls())
        if not urls:
            with self._lock:
                if self._client is not None and not kwargs:
                    return self._client
            urls = wait_for_urls(self.get_urls, lambda: self.get_status().message, self._label, wait_s)
        with self._lock:
            if self._client is None or urls != self._client_urls or kwargs:
                old, self._client = self._client, None
                if old is not None:
                    old.close()
                self._client = RewardClient(list(urls), token=self._token, **kwargs)
                self._client_urls = urls
            return self._client

    def token(self) -> str:
        """The control-plane token: explicit, ``REWARDPLANE_TOKEN``, or the model's Secret."""
        if self._token:
            return self._token
        found = resolve_token(None, None)
        if found:
            return found
        secret = self._kube.get(core_path("secrets", self.namespace, token_secret_name(self.name)))
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

    def awake(
        self, level: int = 1, *, timeout_s: float = DEFAULT_SLEEP_TIMEOUT_S, reload: bool = True
    ) -> AwakeReplicas:
        """``async with handle.awake():`` (or ``with``) — every replica awake for the block: woken on
        enter, back to sleep at ``level`` on exit, also when the block raised. Score and push inside
        it; a push to a sleeping replica is refused (409). Needs the control-plane token. ``reload``
        False (with ``level=2``): a wake reads nothing from disk; push the full weights first."""
        return AwakeReplicas(self._push_urls, self.token, level=level, timeout_s=timeout_s, reload=reload)

    def sleep(self, level: int = 1, *, timeout_s: float = DEFAULT_SLEEP_TIMEOUT_S) -> None:
        """Put every replica to sleep now (``awake()`` is the block form)."""
        from .client import RewardClient

        with RewardClient(self._push_urls(), token=self.token()) as client:
            client.sleep(level, timeout_s=timeout_s)

    def wake(self, *, timeout_s: float = DEFAULT_SLEEP_TIMEOUT_S) -> None:
        """Wake every replica now."""
        from .client import RewardClient

        with RewardClient(self._push_urls(), token=self.token()) as client:
            client.wake(timeout_s=timeout_s)

    def _push_urls(self) -> list[str]:
        """Ready replicas, else any replica with a URL (a push also restores stale ones)."""
        endpoints = self.get_all_endpoints()
        return [e.url for e in ready_replicas(endpoints)] or [e.url for e in endpoints if e.url]

    def weightsync(self) -> dict[str, Any] | None:
        return self._kube.get(custom_path(self.namespace, self.name, WS_PLURAL))

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
        trainer_group: Any = None,
        interface: str | None = None,
        delta: bool = False,
    ) -> PushResult:
        """Push ``params`` as ``version`` into every replica through the operator; returns when the
        operator reports every replica serving it. Raises WeightValidationError (nothing moved),
        WeightSyncFailed (the operator's reason), or TimeoutError-like WeightSyncFailed("Timeout").

        ``trainer_group``: the trainer's own process group when it has several ranks (FSDP,
        Megatron): a collective that every rank calls with its own ``params`` (FSDP2 ``DTensor``s,
        ``TensorPiece`` slices, or tensors every rank holds alike); each rank sends its own part from
        its own device, and every rank returns the same result or raises alike. ``interface``: the
        network interface this trainer's ranks give NCCL and gloo (a multi-rank push records it in
        the WeightSync's spec.trainer).

        ``delta`` (training mode full, one trainer process): send only the tensors whose bytes
        changed since the last ``push_weights(delta=True)`` every replica committed (the first sends
        everything). A replica that does not hold that version as pushed (restarted, restored,
        broken) refuses before anything moves, and everything is pushed as the same version."""
        started = time.monotonic()
        mode = RewardModelTrainingMode(training_mode)
        # the keywords above, once: every part of the push reads them from here
        options = PushOptions(
            trainer_host=trainer_host,
            device=device,
            backend=backend,
            timeout_s=timeout_s,
            bucket_bytes=bucket_bytes,
            head_name_patterns=tuple(head_name_patterns) if head_name_patterns is not None else None,
            delta=delta,
            keep_lora=keep_lora,
            adapter=adapter,
            progress=progress,
            interface=interface,
        )
        # cleared while the push runs: after any failure the next delta push sends everything
        acked, self._acked = self._acked, None
        if trainer_group is not None:
            import torch.distributed as dist

            if dist.get_world_size(trainer_group) > 1:
                if delta:
                    raise ValueError(
                        "delta pushes through the operator are for one trainer process; from a "
                        "multi-rank trainer push without delta, or use WeightPusher(trainer_group=..., "
                        "delta=True) against the replicas' URLs"
                    )
                from .push.ranks.operator import push_from_ranks, ranks_state

                self._ranks_state = ranks_state(self._ranks_state, trainer_group)
                return push_from_ranks(
                    OperatorPush(self), self._ranks_state, params, version, mode, options, started=started
                )
        return self._push_from_one_process(params, version, mode, options, acked, started)

    def _push_from_one_process(
        self,
        params: Mapping[str, torch.Tensor],
        version: int,
        mode: RewardModelTrainingMode,
        options: PushOptions,
        acked: Acknowledged | None,
        started: float,
    ) -> PushResult:
        """``push_weights`` from one trainer process: a delta push against ``acked`` (the version
        every replica last committed from a delta push) where asked, else everything."""
        if options.interface:
            from .push.ranks.operator import use_interface

            use_interface(options.interface)
        metadata, tensors = self.prepare(
            params,
            mode,
            keep_lora=options.keep_lora,
            head_name_patterns=options.head_patterns,
            adapter=options.adapter,
        )
        push = functools.partial(
            OperatorPush(self).push, version=version, mode=mode, options=options, started=started
        )
        from rewardplane.api.weightsync import DELTA_REFUSED

        from .push.plan.delta import Acknowledged, delta_names, fingerprints, warn_refused

        delta = options.delta and mode is RewardModelTrainingMode.FULL
        try:
            prints = fingerprints(tensors) if delta else {}
            if delta and acked is not None:
                keys = set(delta_names(prints, acked.prints, {m.name: m.nbytes for m in metadata}))
                try:
                    result = push(
                        [m for m in metadata if m.name in keys],
                        {k: t for k, t in tensors.items() if k in keys},
                        base_version=acked.version,
                    )
                except WeightSyncFailed as exc:
                    if exc.reason != DELTA_REFUSED:
                        raise
                    warn_refused(log, version, acked.version, exc, len(tensors))
                else:
                    self._acked = Acknowledged(version, prints)
                    return result
            result = push(metadata, tensors)
            if delta:
                self._acked = Acknowledged(version, prints)
            return result
        except BaseException as exc:
            # The failed push's frames hold its rendezvous store and process group for as long as
            # the exception lives (a trainer that pushes again in its ``except`` block). A gloo
            # group cannot be aborted: replicas that accepted the update would wait out its
            # timeout before they take the next push. Released here, so they see the trainer gone.
            if exc.__traceback__ is not None:
                traceback.clear_frames(exc.__traceback__.tb_next)
            raise

    def close(self) -> None:
        if self._client is not None:
            self._client.close()
            self._client = None
        self._kube.close()

    def __enter__(self) -> RewardModelHandle:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
