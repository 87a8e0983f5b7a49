"""The command line of each node component: pure functions of the binaries, the layout and the
ports chosen for this ``up``.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

from rewardplane.localcluster.realnode.layout import NODE_IP, NODE_NAME, POD_CIDR, SERVICE_CIDR, Layout

Binaries = Mapping[str, Path]  # component name → its binary


def containerd(bins: Binaries, layout: Layout) -> list[str]:
    return [str(bins["containerd"]), "--config", str(layout.containerd_config)]


def etcd(bins: Binaries, layout: Layout, *, client_port: int, peer_port: int) -> list[str]:
    client, peer = f"http://127.0.0.1:{client_port}", f"http://127.0.0.1:{peer_port}"
    return [
        str(bins["etcd"]),
        "--name",
        NODE_NAME,
        "--data-dir",
        str(layout.etcd_data),
        "--listen-client-urls",
        client,
        "--advertise-client-urls",
        client,
        "--listen-peer-urls",
        peer,
        "--initial-advertise-peer-urls",
        peer,
        "--initial-cluster",
        f"{NODE_NAME}={peer}",
        "--auto-compaction-retention",
        "1",
    ]


def apiserver(bins: Binaries, layout: Layout, *, etcd_port: int, port: int) -> list[str]:
    pki = layout.pki
    return [
        str(bins["kube-apiserver"]),
        f"--etcd-servers=http://127.0.0.1:{etcd_port}",
        f"--bind-address={NODE_IP}",
        f"--advertise-address={NODE_IP}",
        f"--secure-port={port}",
        "--insecure-port=0",
        f"--tls-cert-file={pki / 'apiserver.crt'}",
        f"--tls-private-key-file={pki / 'apiserver.key'}",
        f"--client-ca-file={pki / 'ca.crt'}",
        # The node's name does not resolve; the apiserver reaches the kubelet by its address.
        "--kubelet-preferred-address-types=InternalIP,Hostname",
        f"--kubelet-client-certificate={pki / 'apiserver-kubelet-client.crt'}",
        f"--kubelet-client-key={pki / 'apiserver-kubelet-client.key'}",
        f"--token-auth-file={pki / 'tokens.csv'}",
        "--authorization-mode=Node,RBAC",
        "--service-account-issuer=https://kubernetes.default.svc.cluster.local",
        f"--service-account-key-file={pki / 'sa.pub'}",
        f"--service-account-signing-key-file={pki / 'sa.key'}",
        f"--service-cluster-ip-range={SERVICE_CIDR}",
        "--enable-admission-plugins=NodeRestriction",
        "--allow-privileged=true",
        f"--cert-dir={layout.certs_dir('apiserver')}",
    ]


def _controller(binary: Path, layout: Layout, name: str, secure_port: int) -> list[str]:
    """The flags the controller-manager and the scheduler share: their kubeconfig for everything,
    no leader election, HTTPS on loopback only."""
    kc = layout.pki / f"{name}.kubeconfig"
    return [
        str(binary),
        f"--kubeconfig={kc}",
        f"--authentication-kubeconfig={kc}",
        f"--authorization-kubeconfig={kc}",
        "--leader-elect=false",
        "--port=0",
        "--bind-address=127.0.0.1",
        f"--secure-port={secure_port}",
        f"--cert-dir={layout.certs_dir(name)}",
    ]


def controller_manager(bins: Binaries, layout: Layout, *, secure_port: int) -> list[str]:
    pki = layout.pki
    return [
        *_controller(bins["kube-controller-manager"], layout, "controller-manager", secure_port),
        "--use-service-account-credentials=true",
        f"--service-account-private-key-file={pki / 'sa.key'}",
        f"--root-ca-file={pki / 'ca.crt'}",
    ]


def scheduler(bins: Binaries, layout: Layout, *, secure_port: int) -> list[str]:
    return _controller(bins["kube-scheduler"], layout, "scheduler", secure_port)


def kubelet(bins: Binaries, layout: Layout) -> list[str]:
    return [
        str(bins["kubelet"]),
        f"--config={layout.kubelet_config}",
        f"--kubeconfig={layout.pki / 'kubelet.kubeconfig'}",
        f"--hostname-override={NODE_NAME}",
        f"--node-ip={NODE_IP}",
        f"--root-dir={layout.kubelet_root}",
        f"--cert-dir={layout.kubelet_pki}",
        "--container-runtime=remote",
        f"--container-runtime-endpoint=unix://{layout.containerd_sock}",
        "--runtime-request-timeout=10m",
        "--v=1",
    ]


def kube_proxy(bins: Binaries, layout: Layout, *, metrics_port: int, healthz_port: int) -> list[str]:
    return [
        str(bins["kube-proxy"]),
        f"--kubeconfig={layout.pki / 'kube-proxy.kubeconfig'}",
        f"--hostname-override={NODE_NAME}",
        f"--cluster-cidr={POD_CIDR}",
        "--proxy-mode=iptables",
        f"--metrics-bind-address=127.0.0.1:{metrics_port}",
        f"--healthz-bind-address=127.0.0.1:{healthz_port}",
    ]
