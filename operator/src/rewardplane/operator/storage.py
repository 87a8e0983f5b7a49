"""How a replica gets its model (``spec.model.source``, parsed by
:mod:`rewardplane.protocol.model_sources`): the volumes, the mounts, the ``--model`` argument of
the server and, for a source that is downloaded, the init container that fetches it.

- ``pvc://`` and ``file://`` (or a path) are mounted read-only; nothing is downloaded.
- ``s3://``, ``https://`` and ``hf://`` (or ``<org>/<name>``) are downloaded before the server
  starts, by ``python -m rewardplane.modelfetch`` in an init container of the same image, into the
  node's model cache (a hostPath shared by every replica and restart on the node) or, without a
  cache directory, into the Pod's own emptyDir. The server mounts the cache read-only.

Pure: the spec and the operator's cache settings → parts of a Pod.
"""

from __future__ import annotations

import posixpath
from dataclasses import dataclass
from typing import Any

from rewardplane.api.spec import ModelSpec
from rewardplane.protocol import settings
from rewardplane.protocol.model_sources import (
    FETCH_CONTAINER,
    FETCH_MODULE,
    InvalidSourceError,
    ModelSource,
    SourceKind,
    cache_key,
    parse_source,
)

MODEL_VOLUME = "model"
MODEL_MOUNT_DIR = "/mnt/models"
CACHE_VOLUME = "model-cache"
CACHE_MOUNT_DIR = "/mnt/model-cache"

__all__ = ["InvalidSourceError", "ModelCache", "ModelDelivery", "delivery", "parse_model_source"]


DEFAULT_VERIFY = "sha256"


@dataclass(frozen=True)
class ModelCache:
    """The operator's node cache for downloaded models (``--model-cache-dir``, ``--model-cache-size``,
    ``--model-cache-verify``)."""

    host_path: str = ""
    """Directory on every node; empty: each Pod downloads into its own emptyDir."""
    max_bytes: int = 0
    """Kept under this after each download (least recently used first); 0: no limit."""
    verify: str = DEFAULT_VERIFY
    """How the fetcher checks a model it finds in the cache: every file's sha256, or sizes only."""

    def __post_init__(self) -> None:
        if self.verify not in settings.MODEL_CACHE_VERIFIES:
            raise ValueError(
                f"model cache verify {self.verify!r} is not one of {', '.join(settings.MODEL_CACHE_VERIFIES)}"
            )


@dataclass(frozen=True)
class ModelDelivery:
    model_arg: str
    volume: dict[str, Any]
    mount: dict[str, Any]
    fetch: dict[str, Any] | None = None
    """The init container that downloads the model (None: the source is mounted)."""


def parse_model_source(model: ModelSpec) -> ModelSource:
    """spec.model → its source, checked against the fields that only some sources take."""
    source = parse_source(model.source, model.revision)
    if not source.downloaded and (model.source_secret or model.source_endpoint):
        raise InvalidSourceError(
            f"spec.model.sourceSecret and sourceEndpoint apply to s3://, https:// and hf:// sources, "
            f"not to {model.source!r} (mounted from the cluster); remove them"
        )
    if model.source_endpoint and source.kind is SourceKind.HTTPS:
        raise InvalidSourceError(
            "spec.model.sourceEndpoint is for S3-compatible stores and hub mirrors; an https:// source "
            "names its server itself: remove sourceEndpoint"
        )
    if model.source_endpoint and not model.source_endpoint.startswith(("http://", "https://")):
        raise InvalidSourceError(
            f"spec.model.sourceEndpoint {model.source_endpoint!r} must be a URL, e.g. http://minio.storage:9000"
        )
    return source


def delivery(model: ModelSpec, image: str = "", cache: ModelCache | None = None) -> ModelDelivery:
    """How a replica gets ``model`` (raises InvalidSourceError). ``image`` runs the download."""
    source = parse_model_source(model)
    if source.kind is SourceKind.PVC:
        return ModelDelivery(
            model_arg=posixpath.join(MODEL_MOUNT_DIR, source.path) if source.path else MODEL_MOUNT_DIR,
            volume={
                "name": MODEL_VOLUME,
                "persistentVolumeClaim": {"claimName": source.location, "readOnly": True},
            },
            mount={"name": MODEL_VOLUME, "mountPath": MODEL_MOUNT_DIR, "readOnly": True},
        )
    if source.kind is SourceKind.FILE:
        return ModelDelivery(
            model_arg=MODEL_MOUNT_DIR,
            volume={"name": MODEL_VOLUME, "hostPath": {"path": source.location, "type": "Directory"}},
            mount={"name": MODEL_VOLUME, "mountPath": MODEL_MOUNT_DIR, "readOnly": True},
        )
    cache = cache or ModelCache()
    key = cache_key(source, model.source_endpoint)
    volume: dict[str, Any] = (
        {"name": CACHE_VOLUME, "hostPath": {"path": cache.host_path, "type": "DirectoryOrCreate"}}
        if cache.host_path
        else {"name": CACHE_VOLUME, "emptyDir": {}}
    )
    args = ["--source", model.source, "--cache-dir", CACHE_MOUNT_DIR, "--key", key]
    if cache.verify != DEFAULT_VERIFY:  # the fetcher's default: Pods rendered before stay the same
        args += ["--verify", cache.verify]
    if source.revision:
        args += ["--revision", source.revision]
    if model.source_endpoint:
        args += ["--endpoint", model.source_endpoint]
    if cache.host_path and cache.max_bytes:
        args += ["--max-cache-bytes", str(cache.max_bytes)]
    fetch: dict[str, Any] = {
        "name": FETCH_CONTAINER,
        "image": image,
        "command": ["python", "-m", FETCH_MODULE],
        "args": args,
        "volumeMounts": [{"name": CACHE_VOLUME, "mountPath": CACHE_MOUNT_DIR}],
        "securityContext": {
            "allowPrivilegeEscalation": False,
            "readOnlyRootFilesystem": True,
            "seccompProfile": {"type": "RuntimeDefault"},
            # The kubelet creates the hostPath owned by root, and it may hold another uid's files:
            # root with DAC_OVERRIDE alone writes there (and nothing else).
            "runAsUser": 0,
            "runAsGroup": 0,
            "capabilities": {"drop": ["ALL"], "add": ["DAC_OVERRIDE"]},
        },
        # The fetcher writes what went wrong there (a bad source, refused credentials); the
        # operator puts it in the status.
        "terminationMessagePolicy": "FallbackToLogsOnError",
    }
    if model.source_secret:
        # Only the download sees the credentials, not the server.
        fetch["envFrom"] = [{"secretRef": {"name": model.source_secret}}]
    return ModelDelivery(
        model_arg=f"{CACHE_MOUNT_DIR}/{key}/model",
        volume=volume,
        mount={"name": CACHE_VOLUME, "mountPath": CACHE_MOUNT_DIR, "readOnly": True},
        fetch=fetch,
    )
