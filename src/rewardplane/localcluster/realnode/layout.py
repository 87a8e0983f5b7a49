"""Where a real node lives: its fixed names and addresses, and the paths under its state directory.

Everything a node makes on disk sits under one state directory (:class:`Layout`); the only paths
outside it are the machine-wide ones the daemons hard-code (:mod:`.teardown` lists them).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import overload

from rewardplane.localcluster.binaries import cache_dir

NODE_NAME = "rewardplane-node"
NODE_LINK = "lo"  # the node's address is an extra one on loopback: local, and reachable from pods
NODE_IP = "10.250.0.1"
BRIDGE = "rpcni0"
POD_CIDR = "10.244.0.0/24"
POD_GATEWAY = "10.244.0.1"
SERVICE_CIDR = "10.96.0.0/16"
KUBERNETES_SERVICE_IP = "10.96.0.1"
PAUSE_IMAGE = "localhost/rewardplane/pause:3.4.1"
CNI_BIN_DIR = Path("/usr/lib/cni")
OWNER_FILE = Path("/run/rewardplane-realnode.owner")
K8S_NAMESPACE = "k8s.io"  # containerd namespace the CRI plugin uses


def default_state_dir() -> Path:
    return cache_dir() / "realnode"


def images_dir() -> Path:
    """Where ``scripts/build-images.sh`` leaves docker-archive tarballs of the images."""
    return cache_dir() / "images"


class _Under:
    """A path under the layout's root, read as an attribute (``layout.pki``)."""

    def __init__(self, *parts: str) -> None:
        self.parts = parts

    @overload
    def __get__(self, layout: None, owner: type[Layout]) -> _Under: ...
    @overload
    def __get__(self, layout: Layout, owner: type[Layout]) -> Path: ...
    def __get__(self, layout: Layout | None, owner: type[Layout]) -> Path | _Under:
        return self if layout is None else layout.root.joinpath(*self.parts)


@dataclass(frozen=True)
class Layout:
    root: Path

    pki = _Under("pki")
    logs = _Under("logs")
    pids = _Under("pids")
    run = _Under("run")
    etcd_data = _Under("etcd")
    kubelet_root = _Under("kubelet")
    kubelet_pki = _Under("kubelet-pki")
    # Content store and snapshots: kept across down/up, so images are imported once.
    containerd_root = _Under("containerd", "root")
    containerd_state = _Under("containerd", "state")
    containerd_opt = _Under("containerd", "opt")
    containerd_sock = _Under("run", "containerd.sock")
    containerd_config = _Under("containerd.toml")
    cni_conf = _Under("cni", "net.d")
    cni_ipam = _Under("cni", "ipam")
    kubelet_config = _Under("kubelet.yaml")
    kubeconfig = _Under("kubeconfig")  # the admin kubeconfig (what ``dev up`` exports)
    cluster_json = _Under("cluster.json")
    # What the machine looked like before ``up`` (sysctls, host paths), for ``down``.
    before_json = _Under("before-up.json")
    imported_json = _Under("imported.json")  # the image tarballs imported so far (size, mtime)

    def pid_file(self, name: str) -> Path:
        return self.pids / f"{name}.pid"

    def log_file(self, name: str) -> Path:
        return self.logs / f"{name}.log"

    def certs_dir(self, component: str) -> Path:
        """Where ``component`` (apiserver, controller-manager, scheduler) keeps its serving certs."""
        return self.root / f"{component}-certs"
