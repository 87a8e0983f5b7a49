"""The WeightSync resource: its phases, failure reasons, and the parameter-manifest ConfigMap codec.

A push: Pending (checked: the version must be newer than the model's) → Rendezvous (every target
replica asked to join the trainer's group) → Transferring (every replica accepted the announce;
the trainer broadcasts) → Completed | Failed. The trainer writes the manifest (names, dtypes,
shapes) into a ConfigMap; the operator reads it back, checked against its SHA-256.
"""

from __future__ import annotations

import base64
import gzip
import hashlib
import json
from collections.abc import Mapping, Sequence
from typing import Any

from pydantic import ValidationError

from rewardplane.protocol import AdapterConfig, ParamMeta

from .names import WS_KIND, WS_PLURAL

__all__ = ["WS_KIND", "WS_PLURAL"]

PENDING = "Pending"
RENDEZVOUS = "Rendezvous"
TRANSFERRING = "Transferring"
COMPLETED = "Completed"
FAILED = "Failed"
TERMINAL = frozenset({COMPLETED, FAILED})

HISTORY_LIMIT = 10
DEFAULT_MANIFEST_KEY = "manifest.json"
GZIP_SUFFIX = ".gz"

# Failure reasons (CamelCase, for status.reason and Events).
STALE_VERSION = "StaleVersion"
MODEL_NOT_FOUND = "RewardModelNotFound"
SYNC_DISABLED = "WeightSyncDisabled"
INVALID_SPEC = "InvalidSpec"
MANIFEST_INVALID = "ManifestInvalid"
NO_REPLICAS = "NoReadyReplicas"
REPLICA_REFUSED = "ReplicaRefused"
# a replica does not hold spec.baseVersion as pushed (restarted, restored, broken, another version):
# nothing moved; push every tensor instead (the SDK does so by itself)
DELTA_REFUSED = "DeltaRefused"
REPLICA_FAILED = "ReplicaFailed"
TIMEOUT = "Timeout"
OPERATOR_RESTARTED = "OperatorRestarted"
OPERATOR_ERROR = "OperatorError"
SUPERSEDED = "Superseded"
# no trainer joined the push's group before its timeout: nothing moved
TRAINER_NOT_JOINED = "TrainerNotJoined"
# another WeightSync of the same model is pushing: one push per model at a time
PUSH_IN_PROGRESS = "PushInProgress"


class WeightSyncRefused(ValueError):
    """The push cannot go ahead; ``reason`` is the CamelCase status reason."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


# --------------------------------------------------------------------------------------------
# Adapter (trainingMode adapter)
# --------------------------------------------------------------------------------------------


def adapter_spec(adapter: AdapterConfig) -> dict[str, Any]:
    """``spec.adapter`` of a WeightSync for an adapter-only push."""
    return {"rank": adapter.rank, "alpha": adapter.alpha, "useRslora": adapter.use_rslora}


def parse_adapter(raw: Any) -> AdapterConfig:
    """``spec.adapter`` back into the announce's ``AdapterConfig``; raises WeightSyncRefused."""
    if not isinstance(raw, Mapping):
        raise WeightSyncRefused(
            INVALID_SPEC,
            "spec.adapter {rank, alpha} is required with trainingMode adapter (the LoRA configuration)",
        )
    try:
        return AdapterConfig(
            rank=raw.get("rank"), alpha=raw.get("alpha"), use_rslora=bool(raw.get("useRslora", False))
        )
    except ValidationError as exc:
        problems = "; ".join(f"spec.adapter.{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in exc.errors())
        raise WeightSyncRefused(INVALID_SPEC, problems) from None


# --------------------------------------------------------------------------------------------
# Manifest
# --------------------------------------------------------------------------------------------


def encode_manifest(
    metadata: Sequence[ParamMeta], *, compress_over: int = 512 * 1024
) -> tuple[dict[str, str], str, str]:
    """ConfigMap ``data`` or ``binaryData`` for a manifest, the key, and its SHA-256 (of the JSON).

    Plain JSON fits etcd's object limit (~1.5 MiB) up to roughly 15,000 parameters; above
    ``compress_over`` bytes it is gzipped into ``binaryData`` (key ``manifest.json.gz``).
    """
    text = json.dumps([m.model_dump(mode="json") for m in metadata], separators=(",", ":"))
    sha = hashlib.sha256(text.encode()).hexdigest()
    if len(text) <= compress_over:
        return {DEFAULT_MANIFEST_KEY: text}, DEFAULT_MANIFEST_KEY, sha
    packed = base64.b64encode(gzip.compress(text.encode(), mtime=0)).decode()
    return {DEFAULT_MANIFEST_KEY + GZIP_SUFFIX: packed}, DEFAULT_MANIFEST_KEY + GZIP_SUFFIX, sha


def decode_manifest(config_map: Mapping[str, Any], key: str, sha256: str | None) -> list[ParamMeta]:
    """The manifest in a ConfigMap, checked against its SHA-256; raises WeightSyncRefused."""
    name = (config_map.get("metadata") or {}).get("name", "?")
    if key.endswith(GZIP_SUFFIX):
        raw = (config_map.get("binaryData") or {}).get(key)
        text = gzip.decompress(base64.b64decode(raw)).decode() if raw else None
    else:
        text = (config_map.get("data") or {}).get(key)
    if text is None:
        raise WeightSyncRefused(
            MANIFEST_INVALID, f"ConfigMap {name} has no key {key!r}; the trainer writes it first"
        )
    if sha256 and hashlib.sha256(text.encode()).hexdigest() != sha256:
        raise WeightSyncRefused(
            MANIFEST_INVALID,
            f"ConfigMap {name} key {key!r} does not match spec.manifestRef.sha256; the manifest "
            "changed after the push was requested: push again",
        )
    try:
        return [ParamMeta(**m) for m in json.loads(text)]
    except (ValueError, TypeError) as exc:
        raise WeightSyncRefused(
            MANIFEST_INVALID, f"ConfigMap {name} key {key!r} is not a parameter manifest: {exc}"
        ) from exc
