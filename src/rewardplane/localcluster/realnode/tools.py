"""The programs a real node needs, where they are found, and how the machine's tools are run.

The Kubernetes daemons come from the cache ``scripts/install-k8s-tools.sh`` fills (then ``PATH``);
containerd, runc, ``ctr``, ``ip`` and ``iptables`` come from Debian on ``PATH``, and the CNI
plugins from ``CNI_BIN_DIR``.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

from rewardplane.localcluster.binaries import find_binary
from rewardplane.localcluster.controlplane import ControlPlaneError
from rewardplane.localcluster.realnode.layout import CNI_BIN_DIR

# The daemons built from Kubernetes' and etcd's sources, found by :func:`find_binary`.
KUBE_BINARIES = (
    "etcd",
    "kube-apiserver",
    "kube-controller-manager",
    "kube-scheduler",
    "kubelet",
    "kube-proxy",
)
REQUIRED_TOOLS = ("containerd", "containerd-shim-runc-v2", "runc", "ctr", "iptables", "ip")
CNI_PLUGINS = ("bridge", "host-local", "portmap", "loopback")


class RealNodeError(ControlPlaneError):
    """The real node failed to start or stop; the message says what to look at."""


def run(
    cmd: list[str], *, check: bool = True, timeout: float = 60, input_: bytes | None = None
) -> subprocess.CompletedProcess[str]:
    """Run a tool to completion; with ``check``, a non-zero exit raises RealNodeError with its stderr."""
    done = subprocess.run(
        cmd,
        capture_output=True,
        text=True,
        timeout=timeout,
        input=input_.decode() if input_ is not None else None,
    )
    if check and done.returncode != 0:
        raise RealNodeError(f"`{' '.join(cmd)}` failed ({done.returncode}): {done.stderr.strip()[-2000:]}")
    return done


def node_binaries() -> dict[str, Path]:
    """Component name → binary; raises RealNodeError naming what is missing and how to install it."""
    missing = [t for t in REQUIRED_TOOLS if shutil.which(t) is None]
    if missing:
        raise RealNodeError(
            f"missing on PATH: {', '.join(missing)}; run scripts/install-k8s-tools.sh "
            "(it installs containerd, runc, the CNI plugins and iptables from Debian)"
        )
    for plugin in CNI_PLUGINS:
        if not (CNI_BIN_DIR / plugin).exists():
            raise RealNodeError(
                f"CNI plugin {CNI_BIN_DIR / plugin} missing: apt-get install "
                "containernetworking-plugins (scripts/install-k8s-tools.sh does)"
            )
    out = {n: find_binary(n) for n in KUBE_BINARIES}
    out["containerd"] = Path(shutil.which("containerd") or "containerd")
    return out
