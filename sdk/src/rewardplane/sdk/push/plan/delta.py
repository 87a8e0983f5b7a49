"""Delta pushes (docs/weight-sync.md "Delta pushes"): what the replicas acknowledged, and which
tensors of the next push differ from it.

The trainer keeps one fingerprint per pushed tensor (``transport.checksums.device_fingerprint``,
computed where the tensor lives: no copy to the host), never a copy of the weights. The choice of what to send
is pure; only :func:`fingerprints` reads tensors.
"""

from __future__ import annotations

import logging
from collections.abc import Collection, Mapping
from dataclasses import dataclass

import torch

from rewardplane.transport.checksums import device_fingerprint


@dataclass(frozen=True)
class Acknowledged:
    """What every replica committed in the last push: its version, and a fingerprint per tensor
    (the caller's key → digest)."""

    version: int
    prints: Mapping[str, str]


def fingerprints(params: Mapping[str, torch.Tensor]) -> dict[str, str]:
    """The caller's key → an exact fingerprint of the tensor's bytes (dtype and shape included, so a
    cast or a reshape counts as a change)."""
    return {k: f"{t.dtype}:{tuple(t.shape)}:{device_fingerprint(t)}" for k, t in params.items()}


def changed_names(prints: Mapping[str, str], acked: Mapping[str, str]) -> list[str]:
    """The keys whose fingerprint differs from the acknowledged one, or that were never sent, in
    the caller's order."""
    return [k for k, p in prints.items() if acked.get(k) != p]


def smallest_name(sizes: Mapping[str, int]) -> str:
    """The key of the fewest bytes (ties: the first name in order): what a delta push carries when
    nothing changed, since a push carries at least one tensor. Deterministic, so that repeated
    no-change pushes reuse one layout."""
    return min(sorted(sizes), key=lambda k: sizes[k])


def sent_names(changed: Collection[str], sizes: Mapping[str, int]) -> list[str]:
    """What a delta push sends: the ``changed`` keys in ``sizes``' order (``sizes``: every key of
    the push), else the smallest tensor alone."""
    return [k for k in sizes if k in changed] or [smallest_name(sizes)]


def delta_names(prints: Mapping[str, str], acked: Mapping[str, str], sizes: Mapping[str, int]) -> list[str]:
    """What a delta push sends: the changed keys, else the smallest tensor alone."""
    return sent_names(set(changed_names(prints, acked)), sizes)


def warn_refused(log: logging.Logger, version: int, base: int, reason: Exception, tensors: int) -> None:
    """The warning of a refused delta push, before everything is pushed as the same version."""
    log.warning(
        "delta push of version %d on version %d refused (%s); pushing all %d tensors instead",
        version,
        base,
        reason,
        tensors,
    )
