"""The local development cluster: a real kube-apiserver + etcd on loopback and a node agent.

- :mod:`.binaries` finds kube-apiserver, etcd, kubectl and helm.
- :mod:`.controlplane` starts etcd + kube-apiserver (:class:`LocalControlPlane`).
- :mod:`.nodeagent` plays the kubelet: runs Pods bound to its Node as local processes.
- :mod:`.dev` is ``rewardplane dev up|down|status``.
"""

from rewardplane.localcluster.binaries import BinaryNotFoundError, find_binary
from rewardplane.localcluster.controlplane import ControlPlaneError, LocalControlPlane, connect_existing

__all__ = [
    "BinaryNotFoundError",
    "ControlPlaneError",
    "LocalControlPlane",
    "connect_existing",
    "find_binary",
]
