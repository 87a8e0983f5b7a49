"""The node's configuration files, rendered from its layout: containerd's ``config.toml``, the CNI
network list and the kubelet's ``KubeletConfiguration``. Pure functions; the node writes them.
"""

from __future__ import annotations

from typing import Any

from rewardplane.localcluster.realnode.layout import (
    BRIDGE,
    CNI_BIN_DIR,
    NODE_IP,
    PAUSE_IMAGE,
    POD_CIDR,
    POD_GATEWAY,
    Layout,
)

CNI_CONFIG_NAME = "10-rewardplane.conflist"


def containerd_config(layout: Layout) -> str:
    """containerd's own root, state and socket under the layout; the CRI plugin with runc, overlayfs
    and the CNI config of :func:`cni_config`."""
    return f"""version = 2
root = "{layout.containerd_root}"
state = "{layout.containerd_state}"
disabled_plugins = ["io.containerd.snapshotter.v1.btrfs", "io.containerd.snapshotter.v1.zfs",
                    "io.containerd.snapshotter.v1.aufs", "io.containerd.snapshotter.v1.devmapper"]
[grpc]
  address = "{layout.containerd_sock}"
[plugins."io.containerd.internal.v1.opt"]
  path = "{layout.containerd_opt}"
[plugins."io.containerd.grpc.v1.cri"]
  sandbox_image = "{PAUSE_IMAGE}"
  stream_server_address = "127.0.0.1"
  # This machine lacks CAP_SYS_RESOURCE: runc cannot lower oom_score_adj below containerd's own
  # (the kubelet asks -998 for sandboxes), and every sandbox would fail with "can't get final
  # child's PID from pipe". Clamp instead.
  restrict_oom_score_adj = true
  [plugins."io.containerd.grpc.v1.cri".containerd]
    snapshotter = "overlayfs"
    default_runtime_name = "runc"
    [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc]
      runtime_type = "io.containerd.runc.v2"
      [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc.options]
        SystemdCgroup = false
  [plugins."io.containerd.grpc.v1.cri".cni]
    bin_dir = "{CNI_BIN_DIR}"
    conf_dir = "{layout.cni_conf}"
"""


def cni_config(layout: Layout) -> dict[str, Any]:
    """The pod network. containerd's CRI adds the loopback plugin itself; bridge + host-local give
    each pod an address on BRIDGE (the host is the gateway), portmap serves hostPort."""
    return {
        "cniVersion": "0.4.0",
        "name": "rewardplane",
        "plugins": [
            {
                "type": "bridge",
                "bridge": BRIDGE,
                "isGateway": True,
                "ipMasq": True,
                "hairpinMode": True,
                "ipam": {
                    "type": "host-local",
                    "ranges": [[{"subnet": POD_CIDR, "gateway": POD_GATEWAY}]],
                    "routes": [{"dst": "0.0.0.0/0"}],
                    "dataDir": str(layout.cni_ipam),
                },
            },
            {"type": "portmap", "capabilities": {"portMappings": True}},
        ],
    }


def kubelet_config(layout: Layout, *, port: int, healthz_port: int) -> dict[str, Any]:
    """The kubelet's configuration (JSON is valid YAML): cgroupfs, webhook-less auth by the node's
    CA, image garbage collection off."""
    return {
        "apiVersion": "kubelet.config.k8s.io/v1beta1",
        "kind": "KubeletConfiguration",
        "cgroupDriver": "cgroupfs",
        "failSwapOn": False,
        "address": NODE_IP,
        "port": port,
        "healthzBindAddress": "127.0.0.1",
        "healthzPort": healthz_port,
        "readOnlyPort": 0,
        "authentication": {
            "anonymous": {"enabled": False},
            "webhook": {"enabled": False},
            "x509": {"clientCAFile": str(layout.pki / "ca.crt")},
        },
        "authorization": {"mode": "AlwaysAllow"},
        "clusterDomain": "cluster.local",
        "resolvConf": "/etc/resolv.conf",
        # This node's images are built here and cannot be pulled again (pullPolicy Never), yet the
        # kubelet deletes every unused image when the disk runs short (pause image included). So:
        # image GC off (100 disables it), and disk-pressure eviction, which reclaims images too,
        # only when the disk is really full.
        "evictionHard": {
            "memory.available": "100Mi",
            "nodefs.available": "500Mi",
            "imagefs.available": "500Mi",
            "nodefs.inodesFree": "1%",
        },
        "imageGCHighThresholdPercent": 100,
        "imageGCLowThresholdPercent": 99,
        "serializeImagePulls": False,
        "podPidsLimit": 4096,
    }
