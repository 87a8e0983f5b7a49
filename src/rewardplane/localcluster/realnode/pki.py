"""The node's certificates, bearer tokens and kubeconfigs.

One CA signs the API server's serving certificate and its client certificate for the kubelet;
a key pair signs service-account tokens. The admin and every component authenticate with a
static bearer token (``tokens.csv``); each component gets a kubeconfig with its token. The PKI is
made once per state directory and kept across down/up; the kubeconfigs are written at each ``up``
(the API server's port changes).
"""

from __future__ import annotations

import os

from rewardplane.localcluster.controlplane import write_kubeconfig
from rewardplane.localcluster.realnode.layout import KUBERNETES_SERVICE_IP, NODE_IP, NODE_NAME, Layout
from rewardplane.localcluster.realnode.tools import run

# token file name → (user, group) in the API server's static token file
TOKEN_USERS = {
    "admin": ("admin", "system:masters"),
    "controller-manager": ("system:kube-controller-manager", ""),
    "scheduler": ("system:kube-scheduler", ""),
    "kubelet": (f"system:node:{NODE_NAME}", "system:nodes"),
    "kube-proxy": ("system:kube-proxy", ""),
}
COMPONENT_KUBECONFIGS = ("controller-manager", "scheduler", "kubelet", "kube-proxy")
API_SERVER_SANS = (
    f"subjectAltName=IP:{NODE_IP},IP:127.0.0.1,IP:{KUBERNETES_SERVICE_IP},DNS:localhost,"
    "DNS:kubernetes,DNS:kubernetes.default,DNS:kubernetes.default.svc,"
    "DNS:kubernetes.default.svc.cluster.local\nextendedKeyUsage=serverAuth\n"
)
# certificate name → (subject, extensions), each signed by the node's CA
SIGNED_CERTS = {
    "apiserver": ("/CN=kube-apiserver", API_SERVER_SANS),
    "apiserver-kubelet-client": (
        "/O=system:masters/CN=kube-apiserver-kubelet-client",
        "extendedKeyUsage=clientAuth\n",
    ),
}


def token_line(token: str, user: str, groups: str) -> str:
    """One line of the API server's ``--token-auth-file``: token,user,uid[,"groups"]."""
    return f"{token},{user},{user}" + (f',"{groups}"' if groups else "")


def make_pki(layout: Layout) -> None:
    """Make the CA, the signed certificates, the service-account keys and the tokens (once)."""
    pki = layout.pki
    if (pki / "done").exists():
        return
    pki.mkdir(parents=True, exist_ok=True)

    def ossl(*args: str) -> None:
        run(["openssl", *args], timeout=60)

    ossl("genrsa", "-out", str(pki / "ca.key"), "2048")
    ossl(
        "req",
        "-x509",
        "-new",
        "-key",
        str(pki / "ca.key"),
        "-subj",
        "/CN=rewardplane-realnode-ca",
        "-days",
        "3650",
        "-out",
        str(pki / "ca.crt"),
    )
    for name, (subject, ext) in SIGNED_CERTS.items():
        (pki / f"{name}.ext").write_text(ext)
        ossl("genrsa", "-out", str(pki / f"{name}.key"), "2048")
        ossl(
            "req",
            "-new",
            "-key",
            str(pki / f"{name}.key"),
            "-subj",
            subject,
            "-out",
            str(pki / f"{name}.csr"),
        )
        ossl(
            "x509",
            "-req",
            "-in",
            str(pki / f"{name}.csr"),
            "-CA",
            str(pki / "ca.crt"),
            "-CAkey",
            str(pki / "ca.key"),
            "-CAcreateserial",
            "-days",
            "3650",
            "-extfile",
            str(pki / f"{name}.ext"),
            "-out",
            str(pki / f"{name}.crt"),
        )
    ossl("genrsa", "-out", str(pki / "sa.key"), "2048")
    ossl("rsa", "-in", str(pki / "sa.key"), "-pubout", "-out", str(pki / "sa.pub"))
    lines = []
    for who, (user, groups) in TOKEN_USERS.items():
        token = os.urandom(24).hex()
        (pki / f"{who}.token").write_text(token)
        lines.append(token_line(token, user, groups))
    (pki / "tokens.csv").write_text("\n".join(lines) + "\n")
    for f in pki.iterdir():
        f.chmod(0o600)
    (pki / "done").write_text("")


def token(layout: Layout, who: str) -> str:
    """The bearer token of ``who`` (a key of ``TOKEN_USERS``)."""
    return (layout.pki / f"{who}.token").read_text().strip()


def write_kubeconfigs(layout: Layout, server: str) -> None:
    """A kubeconfig per component (under the PKI dir) and the admin kubeconfig, for ``server``."""
    ca = (layout.pki / "ca.crt").read_bytes()
    for who in COMPONENT_KUBECONFIGS:
        write_kubeconfig(
            layout.pki / f"{who}.kubeconfig",
            server_url=server,
            token=token(layout, who),
            ca_pem=ca,
            name=f"realnode-{who}",
        )
    write_kubeconfig(
        layout.kubeconfig,
        server_url=server,
        token=token(layout, "admin"),
        ca_pem=ca,
        name="rewardplane-realnode",
    )
