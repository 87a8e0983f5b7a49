"""A real Kubernetes control plane on loopback: etcd + kube-apiserver, nothing else.

There is no controller-manager, scheduler or kubelet: Deployments make no Pods and Pods only run
when a node agent (:mod:`rewardplane.localcluster.nodeagent`) plays the kubelet. Authentication
is a static bearer token in group ``system:masters`` (an admin); the API server's certificate is
self-signed, and the kubeconfig trusts it through ``certificate-authority-data``.

``connect_existing()`` returns a handle on a cluster the user already has (e.g. kind) when
``REWARDPLANE_EXISTING_CLUSTER=1`` and ``KUBECONFIG`` are set; both handles expose the same
``kubeconfig``, ``server_url``, ``token``, ``api_client()``, ``start()`` and ``stop()``.
"""

from __future__ import annotations

import base64
import contextlib
import json
import logging
import os
import secrets
import signal
import socket
import ssl
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rewardplane.localcluster.binaries import find_binary
from rewardplane.protocol import settings

if TYPE_CHECKING:
    from kubernetes.client import ApiClient

log = logging.getLogger(__name__)

SERVICE_CLUSTER_IP_RANGE = "10.96.0.0/16"
LOG_TAIL_LINES = 40
STOP_GRACE_S = 10.0


class ControlPlaneError(RuntimeError):
    """The control plane failed to start or stop; the message carries the log tail."""


def free_port() -> int:
    """A TCP port on 127.0.0.1 that is free right now (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def log_tail(path: Path, lines: int = LOG_TAIL_LINES) -> str:
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return f"(no log at {path})"
    return "\n".join(text.splitlines()[-lines:])


def spawn_logged(cmd: list[str], log_path: Path, *, cwd: Path) -> subprocess.Popen[bytes]:
    """Start ``cmd`` in a session of its own (its pid is its group id), stdin closed, stdout and
    stderr appended to ``log_path``."""
    with open(log_path, "ab") as logf:
        return subprocess.Popen(
            cmd,
            stdout=logf,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            cwd=cwd,
            start_new_session=True,
        )


def stop_process_group(proc: subprocess.Popen[bytes], grace_s: float = STOP_GRACE_S) -> None:
    """SIGTERM the process's group, SIGKILL it after ``grace_s``; always reaps the process.

    Children run in their own session (``start_new_session=True``), so the group id is the
    pid and signalling the group also reaches anything they forked: no orphans are left.
    """
    if proc.poll() is not None:
        return
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=grace_s)
    # Children of the leader that outlived it would still be in the group.
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)


def make_rsa_key(path: Path) -> None:
    """Write an RSA private key (PEM) for signing service-account tokens."""
    try:
        subprocess.run(
            ["openssl", "genrsa", "-out", str(path), "2048"],
            check=True,
            capture_output=True,
            timeout=60,
        )
    except FileNotFoundError:
        # No openssl binary: fall back to the `cryptography` package when it is installed.
        try:
            from cryptography.hazmat.primitives import serialization
            from cryptography.hazmat.primitives.asymmetric import rsa
        except ImportError as exc:
            raise ControlPlaneError(
                "cannot make the service-account key: neither `openssl` nor the Python package "
                "`cryptography` is available; apt-get install openssl (or pip install cryptography)"
            ) from exc
        key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
        path.write_bytes(
            key.private_bytes(
                serialization.Encoding.PEM,
                serialization.PrivateFormat.TraditionalOpenSSL,
                serialization.NoEncryption(),
            )
        )
    path.chmod(0o600)


def write_kubeconfig(
    path: Path, *, server_url: str, token: str, ca_pem: bytes | None, name: str = "rewardplane-local"
) -> None:
    """An admin kubeconfig (JSON is valid YAML, so no yaml dependency is needed)."""
    cluster: dict[str, Any] = {"server": server_url}
    if ca_pem:
        cluster["certificate-authority-data"] = base64.b64encode(ca_pem).decode()
    else:
        cluster["insecure-skip-tls-verify"] = True
    config = {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [{"name": name, "cluster": cluster}],
        "users": [{"name": f"{name}-admin", "user": {"token": token}}],
        "contexts": [
            {"name": name, "context": {"cluster": name, "user": f"{name}-admin", "namespace": "default"}}
        ],
        "current-context": name,
    }
    path.write_text(json.dumps(config, indent=2) + "\n")
    path.chmod(0o600)


def api_client_for(kubeconfig: Path) -> ApiClient:
    """A fresh ``kubernetes.client.ApiClient`` for ``kubeconfig`` (not the global default)."""
    from kubernetes import config as kconfig

    return kconfig.new_client_from_config(config_file=str(kubeconfig))


class LocalControlPlane:
    """etcd + kube-apiserver on 127.0.0.1, with an admin kubeconfig. Use as a context manager.

    All state (etcd data, certificates, token file, logs, kubeconfig) lives under ``workdir``.
    """

    def __init__(
        self, workdir: Path, *, etcd_port: int | None = None, apiserver_port: int | None = None
    ) -> None:
        self.workdir = Path(workdir).resolve()
        self.etcd_port = etcd_port or free_port()
        self.etcd_peer_port = free_port()
        self.apiserver_port = apiserver_port or free_port()
        self.server_url = f"https://127.0.0.1:{self.apiserver_port}"
        self.token = secrets.token_hex(24)
        self.kubeconfig = self.workdir / "kubeconfig"
        self.etcd_log = self.workdir / "etcd.log"
        self.apiserver_log = self.workdir / "kube-apiserver.log"
        self._etcd: subprocess.Popen[bytes] | None = None
        self._apiserver: subprocess.Popen[bytes] | None = None

    # -- lifecycle ----------------------------------------------------------------------------
    def start(self, timeout_s: float = 60) -> None:
        """Start etcd, then kube-apiserver; return once ``/readyz`` answers ok.

        Raises ControlPlaneError (with the log tail) when either does not come up in time.
        """
        if self._apiserver is not None:
            return
        deadline = time.monotonic() + timeout_s
        etcd_bin = find_binary("etcd")
        apiserver_bin = find_binary("kube-apiserver")
        self.workdir.mkdir(parents=True, exist_ok=True)
        try:
            self._start_etcd(etcd_bin, deadline)
            self._start_apiserver(apiserver_bin, deadline)
        except BaseException:
            self.stop()
            raise
        log.info("control plane ready at %s (kubeconfig %s)", self.server_url, self.kubeconfig)

    def stop(self) -> None:
        """Stop kube-apiserver, then etcd (SIGTERM, SIGKILL after a grace period)."""
        for attr in ("_apiserver", "_etcd"):
            proc = getattr(self, attr)
            if proc is not None:
                stop_process_group(proc)
                setattr(self, attr, None)

    def __enter__(self) -> LocalControlPlane:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    @property
    def running(self) -> bool:
        return self._apiserver is not None and self._apiserver.poll() is None

    def api_client(self) -> ApiClient:
        return api_client_for(self.kubeconfig)

    # -- etcd ---------------------------------------------------------------------------------
    def _start_etcd(self, etcd_bin: Path, deadline: float) -> None:
        client_url = f"http://127.0.0.1:{self.etcd_port}"
        peer_url = f"http://127.0.0.1:{self.etcd_peer_port}"
        data_dir = self.workdir / "etcd-data"
        cmd = [
            str(etcd_bin),
            "--name",
            "rewardplane-local",
            "--data-dir",
            str(data_dir),
            "--listen-client-urls",
            client_url,
            "--advertise-client-urls",
            client_url,
            "--listen-peer-urls",
            peer_url,
            "--initial-advertise-peer-urls",
            peer_url,
            "--initial-cluster",
            f"rewardplane-local={peer_url}",
            # A development store: no need to keep history or fsync hard.
            "--auto-compaction-retention",
            "1",
            "--quota-backend-bytes",
            str(2 * 1024**3),
        ]
        self._etcd = self._spawn(cmd, self.etcd_log)
        self._wait(
            "etcd",
            self._etcd,
            self.etcd_log,
            deadline,
            lambda: _http_ok(f"{client_url}/health", check=lambda body: b'"health":"true"' in body),
        )

    # -- kube-apiserver -----------------------------------------------------------------------
    def _start_apiserver(self, apiserver_bin: Path, deadline: float) -> None:
        pki = self.workdir / "pki"
        pki.mkdir(exist_ok=True)
        token_file = self.workdir / "tokens.csv"
        # Format: token,user,uid,"group1,group2"; system:masters bypasses RBAC entirely.
        token_file.write_text(f'{self.token},rewardplane-admin,rewardplane-admin,"system:masters"\n')
        token_file.chmod(0o600)
        sa_key = pki / "service-account.key"
        if not sa_key.exists():
            make_rsa_key(sa_key)
        cmd = [
            str(apiserver_bin),
            f"--etcd-servers=http://127.0.0.1:{self.etcd_port}",
            f"--cert-dir={pki}",  # the apiserver writes a self-signed cert + CA here
            f"--secure-port={self.apiserver_port}",
            "--bind-address=127.0.0.1",
            "--advertise-address=127.0.0.1",
            f"--service-cluster-ip-range={SERVICE_CLUSTER_IP_RANGE}",
            "--authorization-mode=RBAC",
            f"--token-auth-file={token_file}",
            "--service-account-issuer=https://kubernetes.default.svc.cluster.local",
            f"--service-account-key-file={sa_key}",
            f"--service-account-signing-key-file={sa_key}",
            # No controller-manager creates the default ServiceAccount, so the admission plugin
            # would reject every Pod ("serviceaccount default not found").
            "--disable-admission-plugins=ServiceAccount",
            "--allow-privileged=true",
            # 1.20 still opens an insecure port on 8080 by default; two clusters would collide.
            "--insecure-port=0",
        ]
        self._apiserver = self._spawn(cmd, self.apiserver_log)
        self._wait(
            "kube-apiserver",
            self._apiserver,
            self.apiserver_log,
            deadline,
            lambda: _http_ok(f"{self.server_url}/readyz", token=self.token),
        )
        write_kubeconfig(
            self.kubeconfig, server_url=self.server_url, token=self.token, ca_pem=self._ca_pem(pki)
        )

    def _ca_pem(self, pki: Path) -> bytes | None:
        """The self-signed chain (server cert + its CA) when it verifies 127.0.0.1, else None."""
        cert = pki / "apiserver.crt"
        if not cert.exists():
            return None
        pem = cert.read_bytes()
        ctx = ssl.create_default_context(cadata=pem.decode())
        try:
            with (
                socket.create_connection(("127.0.0.1", self.apiserver_port), timeout=5) as raw,
                ctx.wrap_socket(raw, server_hostname="127.0.0.1"),
            ):
                return pem
        except (ssl.SSLError, OSError) as exc:
            log.warning(
                "self-signed certificate does not verify (%s); kubeconfig skips TLS verification instead", exc
            )
            return None

    # -- helpers ------------------------------------------------------------------------------
    def _spawn(self, cmd: list[str], log_path: Path) -> subprocess.Popen[bytes]:
        return spawn_logged(cmd, log_path, cwd=self.workdir)

    @staticmethod
    def _wait(name: str, proc: subprocess.Popen[bytes], log_path: Path, deadline: float, probe: Any) -> None:
        while True:
            if proc.poll() is not None:
                raise ControlPlaneError(
                    f"{name} exited with code {proc.returncode} while starting. "
                    f"Last lines of {log_path}:\n{log_tail(log_path)}"
                )
            if probe():
                return
            if time.monotonic() > deadline:
                raise ControlPlaneError(
                    f"{name} not ready before the timeout; raise timeout_s if the machine is slow. "
                    f"Last lines of {log_path}:\n{log_tail(log_path)}"
                )
            time.sleep(0.2)


def _http_ok(url: str, *, token: str | None = None, check: Any = None) -> bool:
    """True when ``url`` answers 200 (and ``check(body)`` holds); never raises, 2 s timeout."""
    req = urllib.request.Request(url)
    if token:
        req.add_header("Authorization", f"Bearer {token}")
    ctx = ssl._create_unverified_context() if url.startswith("https") else None  # readiness only
    try:
        with urllib.request.urlopen(req, timeout=2, context=ctx) as resp:
            body = resp.read()
            return resp.status == 200 and (check is None or bool(check(body)))
    except (urllib.error.URLError, OSError, ValueError):
        return False


class ExistingCluster:
    """A cluster the user already runs (e.g. kind), reached through ``KUBECONFIG``.

    ``start``/``stop`` do nothing: the cluster's lifecycle is the user's.
    """

    def __init__(self, kubeconfig: Path) -> None:
        self.kubeconfig = Path(kubeconfig)
        self.server_url, self.token = _read_kubeconfig(self.kubeconfig)

    def start(self, timeout_s: float = 60) -> None:
        return None

    def stop(self) -> None:
        return None

    def __enter__(self) -> ExistingCluster:
        return self

    def __exit__(self, *exc: object) -> None:
        return None

    def api_client(self) -> ApiClient:
        return api_client_for(self.kubeconfig)


def _read_kubeconfig(path: Path) -> tuple[str, str | None]:
    import yaml

    try:
        doc = yaml.safe_load(path.read_text())
    except (OSError, yaml.YAMLError) as exc:
        raise ControlPlaneError(f"cannot read KUBECONFIG {path}: {exc}") from exc
    contexts = {c["name"]: c["context"] for c in doc.get("contexts") or []}
    ctx = contexts.get(doc.get("current-context", ""), {})
    clusters = {c["name"]: c["cluster"] for c in doc.get("clusters") or []}
    users = {u["name"]: u.get("user") or {} for u in doc.get("users") or []}
    cluster = clusters.get(ctx.get("cluster", ""))
    if not cluster:
        raise ControlPlaneError(
            f"KUBECONFIG {path} has no cluster for its current-context; run `kubectl config use-context NAME`"
        )
    return str(cluster["server"]), users.get(ctx.get("user", ""), {}).get("token")


def connect_existing() -> ExistingCluster | None:
    """The user's own cluster when ``REWARDPLANE_EXISTING_CLUSTER=1`` and ``KUBECONFIG`` is set."""
    if not settings.EXISTING_CLUSTER.get():
        return None
    kubeconfig = os.environ.get("KUBECONFIG")
    if not kubeconfig:
        raise ControlPlaneError(
            "REWARDPLANE_EXISTING_CLUSTER=1 needs KUBECONFIG set to the cluster's "
            "kubeconfig (e.g. `kind get kubeconfig > kc; export KUBECONFIG=kc`)"
        )
    # KUBECONFIG may list several files; the first one names the cluster to use.
    return ExistingCluster(Path(kubeconfig.split(os.pathsep)[0]).expanduser())
