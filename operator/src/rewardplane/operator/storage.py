"""Where a replica's model comes from, the way clusters deliver models (KServe's ``storageUri``).

``spec.model.source`` is one of:

- ``pvc://<claim>[/<path>]``: a PersistentVolumeClaim, mounted read-only at ``MODEL_MOUNT_DIR``;
- ``file:///<path>`` or ``/<path>``: a directory on the node (hostPath), mounted read-only;
- ``hf://<org>/<name>`` or ``<org>/<name>``: a Hugging Face hub id, downloaded by the server into
  a cache volume (an emptyDir) at ``HF_CACHE_DIR``. That needs the hub to be reachable from the
  pod; where it is not, the server stops at once with an error saying so (no slow retries).

Pure: the source string → the volume, the mount and the ``--model`` argument of the server.
"""

from __future__ import annotations

import posixpath
from dataclasses import dataclass
from typing import Any

MODEL_VOLUME = "model"
MODEL_MOUNT_DIR = "/mnt/models"
HF_CACHE_VOLUME = "hf-cache"
HF_CACHE_DIR = "/var/cache/huggingface"


class InvalidSourceError(ValueError):
    """spec.model.source cannot be delivered; the message says what to write instead."""


@dataclass(frozen=True)
class ModelDelivery:
    model_arg: str
    volume: dict[str, Any]
    mount: dict[str, Any]
    env: tuple[tuple[str, str], ...] = ()
    is_hub: bool = False


def delivery(source: str) -> ModelDelivery:
    """How a replica gets the model named by ``source`` (raises InvalidSourceError)."""
    if source.startswith("pvc://"):
        rest = source[len("pvc://") :].strip("/")
        claim, _, sub = rest.partition("/")
        if not claim:
            raise InvalidSourceError(
                f"spec.model.source {source!r}: name the claim, e.g. pvc://models/tiny-rm"
            )
        sub = posixpath.normpath(sub) if sub else ""
        if sub.startswith(".."):
            raise InvalidSourceError(
                f"spec.model.source {source!r}: the path inside the claim may not leave it"
            )
        return ModelDelivery(
            model_arg=posixpath.join(MODEL_MOUNT_DIR, sub) if sub else MODEL_MOUNT_DIR,
            volume={"name": MODEL_VOLUME, "persistentVolumeClaim": {"claimName": claim, "readOnly": True}},
            mount={"name": MODEL_VOLUME, "mountPath": MODEL_MOUNT_DIR, "readOnly": True},
        )
    if source.startswith("file://") or source.startswith("/"):
        path = source[len("file://") :] if source.startswith("file://") else source
        if not path.startswith("/"):
            raise InvalidSourceError(
                f"spec.model.source {source!r}: file:// needs an absolute path (file:///models/x)"
            )
        return ModelDelivery(
            model_arg=MODEL_MOUNT_DIR,
            volume={
                "name": MODEL_VOLUME,
                "hostPath": {"path": posixpath.normpath(path), "type": "Directory"},
            },
            mount={"name": MODEL_VOLUME, "mountPath": MODEL_MOUNT_DIR, "readOnly": True},
        )
    hub_id = source[len("hf://") :] if source.startswith("hf://") else source
    if "://" in hub_id or not hub_id or hub_id.count("/") > 1:
        raise InvalidSourceError(
            f"spec.model.source {source!r} is not a model source: use pvc://<claim>/<path>, "
            "file:///<path on the node>, or hf://<org>/<name>"
        )
    return ModelDelivery(
        model_arg=hub_id,
        volume={"name": HF_CACHE_VOLUME, "emptyDir": {}},
        mount={"name": HF_CACHE_VOLUME, "mountPath": HF_CACHE_DIR},
        env=(("HF_HOME", HF_CACHE_DIR),),
        is_hub=True,
    )
