"""Locate the Kubernetes binaries the local cluster needs.

Search order: the cache that ``scripts/install-k8s-tools.sh`` fills
(``$REWARDPLANE_CACHE/bin``, default ``~/.cache/rewardplane/bin``), then ``PATH``. The cache
wins so that a kube-apiserver built by the script is used even when another one is on PATH.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from rewardplane.protocol import settings

INSTALL_SCRIPT = "scripts/install-k8s-tools.sh"
KNOWN_BINARIES = ("kube-apiserver", "etcd", "kubectl", "helm")


class BinaryNotFoundError(FileNotFoundError):
    """A Kubernetes binary is missing; the message says how to install it."""


def cache_dir() -> Path:
    """Root of rewardplane's cache (``$REWARDPLANE_CACHE`` or ``~/.cache/rewardplane``)."""
    return settings.cache_root()


def bin_dir() -> Path:
    return cache_dir() / "bin"


def find_binary(name: str) -> Path:
    """Return the path of ``name`` (cache dir first, then PATH) or raise BinaryNotFoundError."""
    cached = bin_dir() / name
    if cached.is_file() and os.access(cached, os.X_OK):
        return cached
    on_path = shutil.which(name)
    if on_path:
        return Path(on_path)
    raise BinaryNotFoundError(
        f"{name} not found in {bin_dir()} or on PATH. Install the local cluster's binaries with "
        f"`{INSTALL_SCRIPT}` (from the repository root, as root or a user with sudo; it builds "
        f"kube-apiserver once, ~5-7 min on 2 cores), "
        f"or set REWARDPLANE_CACHE to the cache that holds bin/{name}."
    )


def missing_binaries(names: tuple[str, ...] = ("kube-apiserver", "etcd")) -> list[str]:
    """Names from ``names`` that cannot be found (empty when all are there)."""
    missing = []
    for name in names:
        try:
            find_binary(name)
        except BinaryNotFoundError:
            missing.append(name)
    return missing
