"""A push's ``WeightSync`` as the trainer sees it: the manifest ConfigMap and the WeightSync it
writes for the operator (owned by the RewardModel, so garbage collection deletes them with it), and
what it reads back while the operator runs the push: the phase it waits for, or why the push
failed, was lost, or is not taken up. ``operator.OperatorPush`` owns one for its model."""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any

from rewardplane.api.heartbeat import CONFIRMED_AT, unconfirmed
from rewardplane.api.names import API_VERSION, LABEL_MODEL, WS_KIND, WS_PLURAL, core_path, custom_path
from rewardplane.api.weightsync import adapter_spec
from rewardplane.protocol import AdapterConfig, ParamMeta, RewardModelTrainingMode, settings
from rewardplane.sdk._exceptions import WeightSyncFailed

if TYPE_CHECKING:
    from rewardplane.api.kube import Kube

POLL_S = 0.02  # WeightSync status polls during a push (one GET each; a push is short)
# A push the operator has not taken up this long: is any operator confirming the model's status?
UNTAKEN_CHECK_S = 3.0
OPERATOR_ABSENT = "OperatorNotConfirming"  # WeightSyncFailed.reason: no operator confirms the model
WEIGHTSYNC_GONE = "WeightSyncGone"  # WeightSyncFailed.reason: the push's WeightSync was deleted or replaced


class PushObjects:
    """The push objects of one RewardModel. ``model()`` reads the RewardModel, ``weightsync()`` its
    WeightSync (None when there is none)."""

    def __init__(
        self,
        kube: Kube,
        namespace: str,
        name: str,
        model: Callable[[], dict[str, Any]],
        weightsync: Callable[[], dict[str, Any] | None],
    ) -> None:
        self._kube = kube
        self.namespace, self.name = namespace, name
        self.label = f"{namespace}/{name}"
        self._model, self._weightsync = model, weightsync
        self._uid = ""  # the WeightSync this push created or patched: another one is not followed

    def owner_references(self) -> list[dict[str, Any]]:
        """The RewardModel as owner: garbage collection deletes the push objects with the model."""
        meta = self._model()["metadata"]
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

    def _read(self, generation: int) -> dict[str, Any]:
        """The WeightSync of this push; raises WeightSyncLost when it was deleted or replaced (by
        another object of the name, or a newer spec): the operator no longer follows this push."""
        ws = self._weightsync()
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
                model_status = self._model().get("status") or {}
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
