"""A real single-node Kubernetes 1.20 on this machine: etcd, kube-apiserver, controller-manager,
scheduler, containerd, CNI (bridge + host-local + portmap + loopback), kubelet and kube-proxy.

Everything lives under one state directory (default ``~/.cache/rewardplane/realnode``): PKI,
configs, logs, pid files, etcd data, containerd's content store and the kubelet's root. The node
gets an address of its own, ``NODE_IP``, so that the API server (bound there, not on 0.0.0.0) is
reachable from pods through the ``kubernetes`` Service without listening on the machine's real
network (the address sits on ``lo``: these kernels have no dummy links). Pods get addresses from
``POD_CIDR`` on the bridge ``BRIDGE``; the host reaches them directly.

``down`` leaves nothing behind: pods are deleted through the API (so they drain), what remains is
killed through containerd, every process stops by its recorded pid, and then mounts, network
namespaces, links, iptables chains, cgroups, sysctls and host paths that the daemons created are
removed. :func:`leftovers` lists whatever would still be there; the end-to-end suite asserts it is
empty after ``down``.

Only one real node can run on a machine (the bridge, iptables and a few kubelet paths are
machine-wide): ``OWNER_FILE`` records the state dir of the one that runs.

The parts:

- :mod:`.layout`: the node's names, addresses and the paths under its state directory;
- :mod:`.tools`: the binaries it needs, running the machine's tools, :class:`RealNodeError`;
- :mod:`.pki`: certificates, bearer tokens and kubeconfigs;
- :mod:`.configs` and :mod:`.commands`: containerd's, CNI's and the kubelet's configs and every
  component's command line, pure functions of the layout;
- :mod:`.processes`: the daemons as processes (start, pid files, stop);
- :mod:`.containerd`: image import and container cleanup through ``ctr``;
- :mod:`.admin_api`: the few admin calls ``up`` and ``down`` make;
- :mod:`.teardown`: the host cleanup and :func:`leftovers`;
- :mod:`.node`: :class:`RealNode`, which composes them.
"""

from rewardplane.localcluster.realnode.containerd import archive_image_names
from rewardplane.localcluster.realnode.layout import (
    BRIDGE,
    NODE_IP,
    NODE_NAME,
    OWNER_FILE,
    PAUSE_IMAGE,
    POD_CIDR,
    SERVICE_CIDR,
    Layout,
    default_state_dir,
    images_dir,
)
from rewardplane.localcluster.realnode.node import RealNode, running_node
from rewardplane.localcluster.realnode.processes import COMPONENTS
from rewardplane.localcluster.realnode.teardown import leftovers
from rewardplane.localcluster.realnode.tools import RealNodeError

__all__ = [
    "BRIDGE",
    "COMPONENTS",
    "NODE_IP",
    "NODE_NAME",
    "OWNER_FILE",
    "PAUSE_IMAGE",
    "POD_CIDR",
    "SERVICE_CIDR",
    "Layout",
    "RealNode",
    "RealNodeError",
    "archive_image_names",
    "default_state_dir",
    "images_dir",
    "leftovers",
    "running_node",
]
