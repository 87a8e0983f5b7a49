"""A real single-node Kubernetes 1.20 on this machine: etcd, kube-apiserver, controller-manager,
scheduler, containerd, CNI (bridge + host-local + portmap + loopback), kubelet and kube-proxy.

Everything lives under one state directory (default ``~/.cache/rewardplane/realnode``): PKI,
configs, logs, pid files, etcd data, containerd's content store and the kubelet's root. The node
gets an address of its own, ``NODE_IP``, so that the API server (bound there, not
on 0.0.0.0) is reachable from pods through the ``kubernetes`` Service without listening on the
machine's real network (the address sits on ``lo``: these kernels have no dummy links). Pods
get addresses from ``POD_CIDR`` on the bridge ``BRIDGE``; the host
reaches them directly.

``down`` leaves nothing behind: pods are deleted through the API (so they drain), what remains is
killed through containerd, every process stops by its recorded pid, and then mounts, network
namespaces, links, iptables chains, cgroups, sysctls and host paths that the daemons created are
removed. :func:`leftovers` lists whatever would still be there; the end-to-end suite asserts it is
empty after ``down``.

Only one real node can run on a machine (the bridge, iptables and a few kubelet paths are
machine-wide): ``OWNER_FILE`` records the state dir of the one that runs.
"""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import os
import re
import shutil
import signal
import subprocess
import tarfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rewardplane.localcluster.binaries import cache_dir, find_binary
from rewardplane.localcluster.controlplane import (
    ControlPlaneError,
    _http_ok,
    free_port,
    log_tail,
    write_kubeconfig,
)

log = logging.getLogger(__name__)

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
# Stop order: dependants first, the store and the runtime last.
COMPONENTS = (
    "kube-proxy",
    "kubelet",
    "kube-scheduler",
    "kube-controller-manager",
    "kube-apiserver",
    "etcd",
    "containerd",
)
STOP_GRACE_S = 15.0
START_RETRIES = 2
# Paths outside the state dir that the daemons create (kubelet 1.20 and libcni hard-code them);
# removed by ``down`` when they did not exist before ``up``.
HOST_PATHS = (
    Path("/var/lib/kubelet"),
    Path("/var/log/pods"),
    Path("/var/log/containers"),
    Path("/var/lib/cni"),
    Path("/run/containerd"),
    Path("/run/netns"),
)
# Sysctls the node changes (ip_forward by us; the kubelet and kube-proxy set the rest); ``down``
# puts back what ``up`` found.
SYSCTLS = (
    "net.ipv4.ip_forward",
    "net.ipv4.conf.all.route_localnet",
    "vm.overcommit_memory",
    "kernel.panic",
    "kernel.panic_on_oops",
    "net.netfilter.nf_conntrack_max",
    "net.netfilter.nf_conntrack_tcp_timeout_established",
    "net.netfilter.nf_conntrack_tcp_timeout_close_wait",
)
CHAIN_PREFIXES = ("KUBE-", "CNI-")
CGROUP_NAMES = ("kubepods", "k8s.io")
REQUIRED_TOOLS = ("containerd", "containerd-shim-runc-v2", "runc", "ctr", "iptables", "ip")


class RealNodeError(ControlPlaneError):
    """The real node failed to start or stop; the message says what to look at."""


def default_state_dir() -> Path:
    return cache_dir() / "realnode"


def images_dir() -> Path:
    """Where ``scripts/build-images.sh`` leaves docker-archive tarballs of the images."""
    return cache_dir() / "images"


def archive_image_names(path: Path) -> list[str]:
    """The image names a docker-archive tarball (``docker save``) carries: its manifest's
    RepoTags. Raises RealNodeError for a file that is not such an archive."""
    try:
        with tarfile.open(path) as tar:
            member = tar.extractfile("manifest.json")
            if member is None:
                raise KeyError("manifest.json")
            manifest = json.load(member)
        return [str(tag) for entry in manifest for tag in entry.get("RepoTags") or []]
    except (OSError, KeyError, ValueError, AttributeError, tarfile.TarError) as exc:
        raise RealNodeError(
            f"{path} is not a docker-archive image tarball ({exc}); rebuild the images: bash scripts/build-images.sh"
        ) from exc


def _run(
    cmd: list[str], *, check: bool = True, timeout: float = 60, input_: bytes | None = None
) -> subprocess.CompletedProcess[str]:
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


# ---------------------------------------------------------------------------------------------
# state layout
# ---------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Layout:
    root: Path

    @property
    def pki(self) -> Path:
        return self.root / "pki"

    @property
    def logs(self) -> Path:
        return self.root / "logs"

    @property
    def pids(self) -> Path:
        return self.root / "pids"

    @property
    def run(self) -> Path:
        return self.root / "run"

    @property
    def etcd_data(self) -> Path:
        return self.root / "etcd"

    @property
    def kubelet_root(self) -> Path:
        return self.root / "kubelet"

    @property
    def containerd_root(self) -> Path:
        """Content store and snapshots: kept across down/up, so images are imported once."""
        return self.root / "containerd" / "root"

    @property
    def containerd_state(self) -> Path:
        return self.root / "containerd" / "state"

    @property
    def containerd_sock(self) -> Path:
        return self.run / "containerd.sock"

    @property
    def cni_conf(self) -> Path:
        return self.root / "cni" / "net.d"

    @property
    def cni_ipam(self) -> Path:
        return self.root / "cni" / "ipam"

    @property
    def kubeconfig(self) -> Path:
        """The admin kubeconfig (what ``dev up`` exports)."""
        return self.root / "kubeconfig"

    @property
    def cluster_json(self) -> Path:
        return self.root / "cluster.json"

    @property
    def before_json(self) -> Path:
        """What the machine looked like before ``up`` (sysctls, host paths), for ``down``."""
        return self.root / "before-up.json"

    def pid_file(self, name: str) -> Path:
        return self.pids / f"{name}.pid"

    def log_file(self, name: str) -> Path:
        return self.logs / f"{name}.log"


# ---------------------------------------------------------------------------------------------
# processes
# ---------------------------------------------------------------------------------------------
def _alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def _read_pid(layout: Layout, name: str) -> int | None:
    """The component's pid while it still runs; a recycled pid does not count (every component
    leads its own session, and its command line names the state dir or its binary)."""
    try:
        pid = int(layout.pid_file(name).read_text().strip())
    except (OSError, ValueError):
        return None
    if not _alive(pid):
        return None
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return None
    return pid if (str(layout.root) in cmdline or name in cmdline) else None


def _stop_pid(pid: int, grace_s: float) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline and _alive(pid):
        time.sleep(0.1)
    if _alive(pid):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline and _alive(pid):
            time.sleep(0.1)


# What the node runs: its daemons, and the containerd shims (which name the node's socket).
DAEMON_NAMES = frozenset(
    {
        "containerd",
        "containerd-shim",
        "containerd-shim-runc-v1",
        "containerd-shim-runc-v2",
        "runc",
        "etcd",
        "kube-apiserver",
        "kube-controller-manager",
        "kube-scheduler",
        "kubelet",
        "kube-proxy",
    }
)


def _our_processes(layout: Layout) -> list[tuple[int, str]]:
    """The node's daemons and shims that still run: a daemon binary whose command line names the
    state dir (a shell or a test that merely mentions the path is not one of them)."""
    found = []
    needle = str(layout.root).encode()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes()
            exe = os.path.basename(os.readlink(entry / "exe")).removesuffix(" (deleted)")
        except OSError:
            continue
        if exe in DAEMON_NAMES and needle in cmdline and _alive(int(entry.name)):
            found.append((int(entry.name), cmdline.replace(b"\0", b" ").decode(errors="replace").strip()))
    return found


# ---------------------------------------------------------------------------------------------
# the node
# ---------------------------------------------------------------------------------------------
class RealNode:
    """Start (``up``) and tear down (``down``) the real single-node cluster under ``state``."""

    def __init__(self, state: Path | None = None, *, images: Path | None = None) -> None:
        self.layout = Layout((state or default_state_dir()).expanduser().resolve())
        self.images = images or images_dir()
        self._started: dict[str, tuple[subprocess.Popen[bytes], list[str]]] = {}
        self._retries: dict[str, int] = {}

    # -- public ---------------------------------------------------------------------------------
    @property
    def kubeconfig(self) -> Path:
        return self.layout.kubeconfig

    def running(self) -> bool:
        return _read_pid(self.layout, "kube-apiserver") is not None

    def status(self) -> dict[str, int | None]:
        return {name: _read_pid(self.layout, name) for name in COMPONENTS}

    def up(self, *, timeout_s: float = 180, import_images: bool = True) -> Path:
        """Start every component; return the admin kubeconfig once the Node is Ready."""
        if self.running():
            if import_images:  # images built since: a tarball that did not change is skipped
                self.import_images()
            return self.kubeconfig
        self._claim_machine()
        deadline = time.monotonic() + timeout_s
        bins = self._binaries()
        lay = self.layout
        # A fresh cluster each time; the containerd content store (images) and PKI are kept.
        self.down(quiet=True, keep_owner=True)
        for d in (lay.logs, lay.pids, lay.run, lay.cni_conf, lay.cni_ipam, lay.kubelet_root):
            d.mkdir(parents=True, exist_ok=True)
        self._record_before()
        try:
            self._network()
            self._pki()
            self._write_configs()
            self._start(
                "containerd", [str(bins["containerd"]), "--config", str(lay.root / "containerd.toml")]
            )
            self._wait("containerd", deadline, lambda: self.ctr(["version"], check=False).returncode == 0)
            if import_images:
                self.import_images()
            etcd_port, etcd_peer = free_port(), free_port()
            self._start(
                "etcd",
                [
                    str(bins["etcd"]),
                    "--name",
                    NODE_NAME,
                    "--data-dir",
                    str(lay.etcd_data),
                    "--listen-client-urls",
                    f"http://127.0.0.1:{etcd_port}",
                    "--advertise-client-urls",
                    f"http://127.0.0.1:{etcd_port}",
                    "--listen-peer-urls",
                    f"http://127.0.0.1:{etcd_peer}",
                    "--initial-advertise-peer-urls",
                    f"http://127.0.0.1:{etcd_peer}",
                    "--initial-cluster",
                    f"{NODE_NAME}=http://127.0.0.1:{etcd_peer}",
                    "--auto-compaction-retention",
                    "1",
                ],
            )
            self._wait("etcd", deadline, lambda: _http_ok(f"http://127.0.0.1:{etcd_port}/health"))
            api_port = free_port()
            server = f"https://{NODE_IP}:{api_port}"
            self._kubeconfigs(server)
            self._start("kube-apiserver", self._apiserver_cmd(bins, etcd_port, api_port))
            self._wait(
                "kube-apiserver", deadline, lambda: _http_ok(f"{server}/readyz", token=self._token("admin"))
            )
            self._start("kube-controller-manager", self._controller_manager_cmd(bins))
            self._start("kube-scheduler", self._scheduler_cmd(bins))
            self._start("kubelet", self._kubelet_cmd(bins))
            self._start("kube-proxy", self._kube_proxy_cmd(bins))
            lay.cluster_json.write_text(
                json.dumps(
                    {
                        "server_url": server,
                        "kubeconfig": str(lay.kubeconfig),
                        "node": NODE_NAME,
                        "node_ip": NODE_IP,
                    },
                    indent=2,
                )
            )
            self._wait("node Ready", deadline, self._node_ready, log_name="kubelet")
            self._wait(
                "default ServiceAccount", deadline, self._default_sa_ready, log_name="kube-controller-manager"
            )
        except BaseException:
            tails = "\n".join(
                f"--- {n}:\n{log_tail(lay.log_file(n), 15)}" for n in COMPONENTS if lay.log_file(n).exists()
            )
            log.error("real node did not come up; logs:\n%s", tails)
            self.down(quiet=True)
            raise
        return lay.kubeconfig

    def import_images(self, paths: list[Path] | None = None) -> list[str]:
        """Import docker-archive tarballs into the node's containerd (``k8s.io`` namespace).

        Default: every ``*.tar`` in the images dir (the pause image first). A tarball already
        imported (same size and mtime) is skipped only while containerd still lists every image it
        names: the record can outlive the content store (a cleaned disk, a reused cache), and a
        node without its pause image never starts a pod.
        """
        if paths is None:
            paths = sorted(self.images.glob("*.tar"), key=lambda p: (p.name != "pause.tar", p.name))
        if not any(p.name == "pause.tar" for p in paths) and not self._has_image(PAUSE_IMAGE):
            raise RealNodeError(
                f"no pause image in {self.images}; build the images first: bash scripts/build-images.sh"
            )
        stamps_file = self.layout.root / "imported.json"
        try:
            stamps = json.loads(stamps_file.read_text())
        except (OSError, ValueError):
            stamps = {}
        present = self.image_names()
        imported = []
        for path in paths:
            st = path.stat()
            stamp = f"{st.st_size}:{st.st_mtime_ns}"
            if stamps.get(str(path)) == stamp and set(archive_image_names(path)) <= present:
                continue
            self.ctr(["images", "import", str(path)], timeout=600)
            stamps[str(path)] = stamp
            imported.append(path.name)
            stamps_file.write_text(json.dumps(stamps, indent=2))
        return imported

    def down(self, *, quiet: bool = False, keep_owner: bool = False, purge: bool = False) -> list[str]:
        """Stop everything and remove what the node made; returns what could not be removed."""
        lay = self.layout
        if not lay.root.exists():
            return []
        # Controllers first, so that nothing recreates the pods being deleted.
        first = ("kube-controller-manager", "kube-scheduler", "kube-proxy", "kubelet")
        steps: list[tuple[str, Callable[[], None]]] = [
            ("stop kube-controller-manager", lambda: self._stop("kube-controller-manager")),
            ("stop kube-scheduler", lambda: self._stop("kube-scheduler")),
            ("delete pods", self._delete_pods_through_api),
            ("stop kube-proxy", lambda: self._stop("kube-proxy")),
            ("stop kubelet", lambda: self._stop("kubelet")),
            ("kill containers", self._kill_containers),
        ]
        steps += [(f"stop {n}", functools.partial(self._stop, n)) for n in COMPONENTS if n not in first]
        steps += [
            ("stop leftover processes", self._stop_leftover_processes),
            ("unmount", self._unmount),
            ("network namespaces", self._remove_netns),
            ("links", self._remove_links),
            ("iptables", self._remove_iptables),
            ("cgroups", self._remove_cgroups),
            ("sysctls", self._restore_sysctls),
            ("host paths", self._remove_host_paths),
            ("state", lambda: self._remove_state(purge)),
        ]
        for what, step in steps:
            try:
                step()
            except Exception as exc:  # every step runs: one failure must not leave the rest behind
                log.warning("down: %s failed: %s", what, exc)
        if not keep_owner:
            self._release_machine()
        left = leftovers(lay.root)
        if left and not quiet:
            log.warning("down left behind: %s", left)
        return left

    # -- machine ownership ----------------------------------------------------------------------
    def _claim_machine(self) -> None:
        with contextlib.suppress(OSError):
            owner = Path(OWNER_FILE.read_text().strip())
            if owner != self.layout.root and RealNode(owner).running():
                raise RealNodeError(
                    f"a real node already runs on this machine (state {owner}); stop it "
                    f"first: rewardplane dev down --node real --state-dir {owner}"
                )
        OWNER_FILE.write_text(f"{self.layout.root}\n")

    def _release_machine(self) -> None:
        with contextlib.suppress(OSError):
            if Path(OWNER_FILE.read_text().strip()) == self.layout.root:
                OWNER_FILE.unlink()

    # -- binaries and config ---------------------------------------------------------------------
    def _binaries(self) -> dict[str, Path]:
        missing = [t for t in REQUIRED_TOOLS if shutil.which(t) is None]
        if missing:
            raise RealNodeError(
                f"missing on PATH: {', '.join(missing)}; run scripts/install-k8s-tools.sh "
                "(it installs containerd, runc, the CNI plugins and iptables from Debian)"
            )
        for plugin in ("bridge", "host-local", "portmap", "loopback"):
            if not (CNI_BIN_DIR / plugin).exists():
                raise RealNodeError(
                    f"CNI plugin {CNI_BIN_DIR / plugin} missing: apt-get install "
                    "containernetworking-plugins (scripts/install-k8s-tools.sh does)"
                )
        names = (
            "etcd",
            "kube-apiserver",
            "kube-controller-manager",
            "kube-scheduler",
            "kubelet",
            "kube-proxy",
        )
        out = {n: find_binary(n) for n in names}
        out["containerd"] = Path(shutil.which("containerd") or "containerd")
        return out

    def _record_before(self) -> None:
        lay = self.layout
        if lay.before_json.exists():  # an earlier up that was never brought down: keep its record
            return
        sysctls = {}
        for key in SYSCTLS:
            with contextlib.suppress(OSError):
                sysctls[key] = Path("/proc/sys", *key.split(".")).read_text().strip()
        lay.before_json.write_text(
            json.dumps(
                {
                    "sysctls": sysctls,
                    "host_paths": [str(p) for p in HOST_PATHS if p.exists()],
                },
                indent=2,
            )
        )

    def _network(self) -> None:
        _run(["ip", "addr", "replace", f"{NODE_IP}/32", "dev", NODE_LINK])
        Path("/proc/sys/net/ipv4/ip_forward").write_text("1\n")

    def _pki(self) -> None:
        pki = self.layout.pki
        if (pki / "done").exists():
            return
        pki.mkdir(parents=True, exist_ok=True)

        def ossl(*args: str) -> None:
            _run(["openssl", *args], timeout=60)

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
        sans = (
            f"subjectAltName=IP:{NODE_IP},IP:127.0.0.1,IP:{KUBERNETES_SERVICE_IP},DNS:localhost,"
            "DNS:kubernetes,DNS:kubernetes.default,DNS:kubernetes.default.svc,"
            "DNS:kubernetes.default.svc.cluster.local\nextendedKeyUsage=serverAuth\n"
        )
        for name, subject, ext in (
            ("apiserver", "/CN=kube-apiserver", sans),
            (
                "apiserver-kubelet-client",
                "/O=system:masters/CN=kube-apiserver-kubelet-client",
                "extendedKeyUsage=clientAuth\n",
            ),
        ):
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
        # Static bearer tokens for the admin and the components (token,user,uid,"groups").
        users = {
            "admin": ("admin", "system:masters"),
            "controller-manager": ("system:kube-controller-manager", ""),
            "scheduler": ("system:kube-scheduler", ""),
            "kubelet": (f"system:node:{NODE_NAME}", "system:nodes"),
            "kube-proxy": ("system:kube-proxy", ""),
        }
        lines = []
        for who, (user, groups) in users.items():
            token = os.urandom(24).hex()
            (pki / f"{who}.token").write_text(token)
            lines.append(f"{token},{user},{user}" + (f',"{groups}"' if groups else ""))
        (pki / "tokens.csv").write_text("\n".join(lines) + "\n")
        for f in pki.iterdir():
            f.chmod(0o600)
        (pki / "done").write_text("")

    def _token(self, who: str) -> str:
        return (self.layout.pki / f"{who}.token").read_text().strip()

    def _kubeconfigs(self, server: str) -> None:
        ca = (self.layout.pki / "ca.crt").read_bytes()
        for who in ("controller-manager", "scheduler", "kubelet", "kube-proxy"):
            write_kubeconfig(
                self.layout.pki / f"{who}.kubeconfig",
                server_url=server,
                token=self._token(who),
                ca_pem=ca,
                name=f"realnode-{who}",
            )
        write_kubeconfig(
            self.layout.kubeconfig,
            server_url=server,
            token=self._token("admin"),
            ca_pem=ca,
            name="rewardplane-realnode",
        )

    def _write_configs(self) -> None:
        lay = self.layout
        (lay.root / "containerd.toml").write_text(f"""version = 2
root = "{lay.containerd_root}"
state = "{lay.containerd_state}"
disabled_plugins = ["io.containerd.snapshotter.v1.btrfs", "io.containerd.snapshotter.v1.zfs",
                    "io.containerd.snapshotter.v1.aufs", "io.containerd.snapshotter.v1.devmapper"]
[grpc]
  address = "{lay.containerd_sock}"
[plugins."io.containerd.internal.v1.opt"]
  path = "{lay.root / "containerd" / "opt"}"
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
    conf_dir = "{lay.cni_conf}"
""")
        # containerd's CRI adds the loopback plugin itself; bridge + host-local give each pod an
        # address on BRIDGE (the host is the gateway), portmap serves hostPort.
        (lay.cni_conf / "10-rewardplane.conflist").write_text(
            json.dumps(
                {
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
                                "dataDir": str(lay.cni_ipam),
                            },
                        },
                        {"type": "portmap", "capabilities": {"portMappings": True}},
                    ],
                },
                indent=2,
            )
        )
        (lay.root / "kubelet.yaml").write_text(
            json.dumps(
                {
                    "apiVersion": "kubelet.config.k8s.io/v1beta1",
                    "kind": "KubeletConfiguration",
                    "cgroupDriver": "cgroupfs",
                    "failSwapOn": False,
                    "address": NODE_IP,
                    "port": free_port(),
                    "healthzBindAddress": "127.0.0.1",
                    "healthzPort": free_port(),
                    "readOnlyPort": 0,
                    "authentication": {
                        "anonymous": {"enabled": False},
                        "webhook": {"enabled": False},
                        "x509": {"clientCAFile": str(lay.pki / "ca.crt")},
                    },
                    "authorization": {"mode": "AlwaysAllow"},
                    "clusterDomain": "cluster.local",
                    "resolvConf": "/etc/resolv.conf",
                    # This node's images are built here and cannot be pulled again (pullPolicy
                    # Never), yet the kubelet deletes every unused image when the disk runs short
                    # (it once did at 2% free of a 252 GB disk during a test run, pause image
                    # included). So: image GC off (100 disables it), and disk-pressure eviction, which
                    # reclaims images too, only when the disk is really full.
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
                },
                indent=2,
            )
        )

    def _apiserver_cmd(self, bins: dict[str, Path], etcd_port: int, api_port: int) -> list[str]:
        pki = self.layout.pki
        return [
            str(bins["kube-apiserver"]),
            f"--etcd-servers=http://127.0.0.1:{etcd_port}",
            f"--bind-address={NODE_IP}",
            f"--advertise-address={NODE_IP}",
            f"--secure-port={api_port}",
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
            f"--cert-dir={self.layout.root / 'apiserver-certs'}",
        ]

    def _controller_manager_cmd(self, bins: dict[str, Path]) -> list[str]:
        pki = self.layout.pki
        kc = pki / "controller-manager.kubeconfig"
        return [
            str(bins["kube-controller-manager"]),
            f"--kubeconfig={kc}",
            f"--authentication-kubeconfig={kc}",
            f"--authorization-kubeconfig={kc}",
            "--use-service-account-credentials=true",
            f"--service-account-private-key-file={pki / 'sa.key'}",
            f"--root-ca-file={pki / 'ca.crt'}",
            "--leader-elect=false",
            "--port=0",
            "--bind-address=127.0.0.1",
            f"--secure-port={free_port()}",
            f"--cert-dir={self.layout.root / 'controller-manager-certs'}",
        ]

    def _scheduler_cmd(self, bins: dict[str, Path]) -> list[str]:
        kc = self.layout.pki / "scheduler.kubeconfig"
        return [
            str(bins["kube-scheduler"]),
            f"--kubeconfig={kc}",
            f"--authentication-kubeconfig={kc}",
            f"--authorization-kubeconfig={kc}",
            "--leader-elect=false",
            "--port=0",
            "--bind-address=127.0.0.1",
            f"--secure-port={free_port()}",
            f"--cert-dir={self.layout.root / 'scheduler-certs'}",
        ]

    def _kubelet_cmd(self, bins: dict[str, Path]) -> list[str]:
        lay = self.layout
        return [
            str(bins["kubelet"]),
            f"--config={lay.root / 'kubelet.yaml'}",
            f"--kubeconfig={lay.pki / 'kubelet.kubeconfig'}",
            f"--hostname-override={NODE_NAME}",
            f"--node-ip={NODE_IP}",
            f"--root-dir={lay.kubelet_root}",
            f"--cert-dir={lay.root / 'kubelet-pki'}",
            "--container-runtime=remote",
            f"--container-runtime-endpoint=unix://{lay.containerd_sock}",
            "--runtime-request-timeout=10m",
            "--v=1",
        ]

    def _kube_proxy_cmd(self, bins: dict[str, Path]) -> list[str]:
        return [
            str(bins["kube-proxy"]),
            f"--kubeconfig={self.layout.pki / 'kube-proxy.kubeconfig'}",
            f"--hostname-override={NODE_NAME}",
            f"--cluster-cidr={POD_CIDR}",
            "--proxy-mode=iptables",
            f"--metrics-bind-address=127.0.0.1:{free_port()}",
            f"--healthz-bind-address=127.0.0.1:{free_port()}",
        ]

    # -- processes ---------------------------------------------------------------------------
    def _start(self, name: str, cmd: list[str]) -> None:
        lay = self.layout
        with open(lay.log_file(name), "ab") as logf:
            logf.write(f"--- {time.strftime('%Y-%m-%dT%H:%M:%S')} starting {name}\n".encode())
            logf.flush()
            proc = subprocess.Popen(
                cmd,
                stdout=logf,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                cwd=lay.root,
                start_new_session=True,
            )
        lay.pid_file(name).write_text(f"{proc.pid}\n")
        self._started[name] = (proc, cmd)

    def _check_started(self) -> None:
        """Every component started by this ``up`` still runs; one that died is started again (at
        most ``START_RETRIES`` times: on a machine shared with busy test suites a daemon has been
        seen killed at birth) and the error says how it ended."""
        for name, (proc, cmd) in list(self._started.items()):
            code = proc.poll()
            if code is None:
                continue
            how = f"killed by signal {-code}" if code < 0 else f"exited with code {code}"
            retries = self._retries.get(name, 0)
            if retries >= START_RETRIES:
                raise RealNodeError(
                    f"{name} {how} while starting; last lines of {self.layout.log_file(name)}:\n"
                    f"{log_tail(self.layout.log_file(name))}"
                )
            log.warning("%s %s while starting; starting it again", name, how)
            self._retries[name] = retries + 1
            self._start(name, cmd)

    def _stop(self, name: str) -> None:
        pid = _read_pid(self.layout, name)
        self.layout.pid_file(name).unlink(missing_ok=True)
        if pid is not None:
            _stop_pid(pid, STOP_GRACE_S)

    def _wait(
        self, what: str, deadline: float, ready: Callable[[], bool], log_name: str | None = None
    ) -> None:
        name = log_name or what
        while not ready():
            self._check_started()
            if time.monotonic() > deadline:
                raise RealNodeError(
                    f"timed out waiting for {what}; last lines of {self.layout.log_file(name)}:\n"
                    f"{log_tail(self.layout.log_file(name))}"
                )
            time.sleep(0.5)

    def ctr(
        self, args: list[str], *, check: bool = True, timeout: float = 60
    ) -> subprocess.CompletedProcess[str]:
        """``ctr`` against the node's containerd, in the namespace the kubelet uses."""
        return _run(
            ["ctr", "-a", str(self.layout.containerd_sock), "-n", K8S_NAMESPACE, *args],
            check=check,
            timeout=timeout,
        )

    def image_names(self) -> set[str]:
        """The image names the node's containerd lists (none while it is not running)."""
        if not self.layout.containerd_sock.exists():
            return set()
        return set(self.ctr(["images", "ls", "-q"], check=False).stdout.split())

    def _has_image(self, ref: str) -> bool:
        return ref in self.image_names()

    def _api(
        self, path: str, *, method: str = "GET", body: dict[str, object] | None = None
    ) -> dict[str, Any]:  # parsed JSON
        import ssl
        import urllib.request

        info = json.loads(self.layout.cluster_json.read_text())
        req = urllib.request.Request(
            info["server_url"] + path,
            method=method,
            data=json.dumps(body).encode() if body is not None else None,
        )
        req.add_header("Authorization", f"Bearer {self._token('admin')}")
        req.add_header("Content-Type", "application/json")
        ctx = ssl.create_default_context(cafile=str(self.layout.pki / "ca.crt"))
        with urllib.request.urlopen(req, timeout=10, context=ctx) as resp:
            return json.loads(resp.read() or b"{}")

    def _node_ready(self) -> bool:
        try:
            node = self._api(f"/api/v1/nodes/{NODE_NAME}")
        except Exception:
            return False
        conds = (node.get("status") or {}).get("conditions") or []
        return any(c.get("type") == "Ready" and c.get("status") == "True" for c in conds)

    def _default_sa_ready(self) -> bool:
        # Pods are refused until the controller-manager made the namespace's default ServiceAccount
        # and its token Secret (1.20 mounts the Secret).
        try:
            sa = self._api("/api/v1/namespaces/default/serviceaccounts/default")
        except Exception:
            return False
        return bool(sa.get("secrets"))

    # -- teardown steps ------------------------------------------------------------------------
    def _delete_pods_through_api(self) -> None:
        """Delete every pod while the kubelet still runs, so containers stop gracefully and CNI
        releases their addresses; bounded: what is left gets killed through containerd next."""
        if _read_pid(self.layout, "kube-apiserver") is None or _read_pid(self.layout, "kubelet") is None:
            return
        pods = self._api("/api/v1/pods").get("items") or []
        for pod in pods:
            meta = pod["metadata"]
            with contextlib.suppress(Exception):
                self._api(
                    f"/api/v1/namespaces/{meta['namespace']}/pods/{meta['name']}",
                    method="DELETE",
                    body={"kind": "DeleteOptions", "apiVersion": "v1", "gracePeriodSeconds": 5},
                )
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and self._running_tasks():
            # controllers may recreate pods meanwhile; what counts is that none runs any more
            time.sleep(0.5)

    def _running_tasks(self) -> list[str]:
        done = self.ctr(["tasks", "ls"], check=False)
        return [line.split()[0] for line in done.stdout.splitlines()[1:] if "RUNNING" in line.split()[2:]]

    def _kill_containers(self) -> None:
        """Kill every container and sandbox left in the node's containerd, then remove them."""
        if _read_pid(self.layout, "containerd") is None:
            return
        for task in self.ctr(["tasks", "ls", "-q"], check=False).stdout.split():
            self.ctr(["tasks", "kill", "-a", "-s", "SIGKILL", task], check=False)
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            states = self.ctr(["tasks", "ls"], check=False).stdout.splitlines()[1:]
            if all("STOPPED" in s for s in states):
                break
            time.sleep(0.3)
        for task in self.ctr(["tasks", "ls", "-q"], check=False).stdout.split():
            self.ctr(["tasks", "rm", "-f", task], check=False)
        for container in self.ctr(["containers", "ls", "-q"], check=False).stdout.split():
            self.ctr(["containers", "rm", container], check=False)

    def _stop_leftover_processes(self) -> None:
        for pid, _ in _our_processes(self.layout):  # shims that outlived containerd
            _stop_pid(pid, 5)

    def _unmount(self) -> None:
        for target in sorted(_mounts_under(self.layout.root), key=len, reverse=True):
            _run(["umount", "-l", target], check=False)

    def _remove_netns(self) -> None:
        for ns in _cni_netns():
            _run(["umount", str(ns)], check=False)
            ns.unlink(missing_ok=True)

    def _remove_links(self) -> None:
        if _run(["ip", "link", "show", BRIDGE], check=False).returncode == 0:
            _run(["ip", "link", "del", BRIDGE], check=False)
        if _node_address_present():
            _run(["ip", "addr", "del", f"{NODE_IP}/32", "dev", NODE_LINK], check=False)

    def _remove_iptables(self) -> None:
        kube_proxy = cache_dir() / "bin" / "kube-proxy"
        if kube_proxy.exists():
            _run([str(kube_proxy), "--cleanup"], check=False, timeout=60)
        for cmd in ("iptables", "ip6tables"):
            if shutil.which(cmd):
                _remove_chains(cmd)

    def _remove_cgroups(self) -> None:
        for d in _our_cgroups():
            for sub in sorted(
                (p for p in d.rglob("*") if p.is_dir()), key=lambda p: len(p.parts), reverse=True
            ):
                with contextlib.suppress(OSError):
                    sub.rmdir()
            with contextlib.suppress(OSError):
                d.rmdir()

    def _restore_sysctls(self) -> None:
        try:
            before = json.loads(self.layout.before_json.read_text())
        except (OSError, ValueError):
            return
        for key, value in before.get("sysctls", {}).items():
            with contextlib.suppress(OSError):
                Path("/proc/sys", *key.split(".")).write_text(f"{value}\n")

    def _remove_host_paths(self) -> None:
        try:
            before = json.loads(self.layout.before_json.read_text())
        except (OSError, ValueError):
            return
        existed = set(before.get("host_paths", []))
        for path in HOST_PATHS:
            if str(path) not in existed and path.exists():
                if _mounts_under(path) or (path == Path("/run/netns") and any(path.iterdir())):
                    continue  # something else mounted there since: not ours to remove
                shutil.rmtree(path, ignore_errors=True)
        self.layout.before_json.unlink(missing_ok=True)

    def _remove_state(self, purge: bool) -> None:
        lay = self.layout
        # A fresh cluster each `up`: cluster data goes; images (containerd root) and PKI stay.
        for d in (
            lay.etcd_data,
            lay.kubelet_root,
            lay.containerd_state,
            lay.cni_ipam,
            lay.run,
            lay.root / "kubelet-pki",
        ):
            if not _mounts_under(d):
                shutil.rmtree(d, ignore_errors=True)
        lay.cluster_json.unlink(missing_ok=True)
        if purge and not _mounts_under(lay.root):
            shutil.rmtree(lay.root, ignore_errors=True)


# ---------------------------------------------------------------------------------------------
# what is left on the machine
# ---------------------------------------------------------------------------------------------
def _mounts_under(root: Path) -> list[str]:
    prefix = str(root).rstrip("/") + "/"
    out = []
    with contextlib.suppress(OSError):
        for line in Path("/proc/self/mounts").read_text().splitlines():
            target = line.split()[1].replace("\\040", " ")
            if target == str(root) or target.startswith(prefix):
                out.append(target)
    return out


def _node_address_present() -> bool:
    done = _run(["ip", "-4", "-o", "addr", "show", "dev", NODE_LINK], check=False)
    return f" {NODE_IP}/" in done.stdout


def _cni_netns() -> list[Path]:
    netns = Path("/run/netns")
    return sorted(netns.glob("cni-*")) if netns.is_dir() else []


def _our_cgroups() -> list[Path]:
    found = []
    for ctrl in Path("/sys/fs/cgroup").iterdir() if Path("/sys/fs/cgroup").is_dir() else []:
        for name in CGROUP_NAMES:
            if (ctrl / name).is_dir():
                found.append(ctrl / name)
    return found


def _chains(cmd: str) -> dict[str, list[str]]:
    """table → chains of ours (by prefix) in it."""
    out: dict[str, list[str]] = {}
    for table in ("filter", "nat", "mangle", "raw"):
        done = _run([cmd, "-t", table, "-S"], check=False)
        if done.returncode != 0:
            continue
        chains = [
            line.split()[1]
            for line in done.stdout.splitlines()
            if line.startswith("-N ") and line.split()[1].startswith(CHAIN_PREFIXES)
        ]
        if chains:
            out[table] = chains
    return out


def _remove_chains(cmd: str) -> None:
    """Delete the rules that jump to our chains, then flush and delete the chains themselves."""
    for table, chains in _chains(cmd).items():
        rules = _run([cmd, "-t", table, "-S"], check=False).stdout.splitlines()
        pattern = re.compile(r"-j (" + "|".join(re.escape(p) for p in CHAIN_PREFIXES) + r")")
        for rule in rules:
            if (
                rule.startswith("-A ")
                and not rule.split()[1].startswith(CHAIN_PREFIXES)
                and pattern.search(rule)
            ):
                _run([cmd, "-t", table, "-D", *_split_rule(rule[3:])], check=False)
        for chain in chains:
            _run([cmd, "-t", table, "-F", chain], check=False)
        for chain in chains:
            _run([cmd, "-t", table, "-X", chain], check=False)


def _split_rule(rule: str) -> list[str]:
    import shlex

    return shlex.split(rule)


def leftovers(state: Path | None = None) -> list[str]:
    """Everything a real node could leave on the machine that is still there (empty = clean)."""
    root = (state or default_state_dir()).expanduser().resolve()
    left = [f"process {pid}: {cmd[:120]}" for pid, cmd in _our_processes(Layout(root))]
    left += [f"mount {m}" for m in _mounts_under(root)]
    left += [f"netns {ns}" for ns in _cni_netns()]
    if Path(f"/sys/class/net/{BRIDGE}").exists():
        left.append(f"link {BRIDGE}")
    if _node_address_present():
        left.append(f"address {NODE_IP} on {NODE_LINK}")
    left += [
        f"veth {p.name}"
        for p in Path("/sys/class/net").iterdir()
        if (p / "master").exists() and (p / "master").resolve().name == BRIDGE
    ]
    for cmd in ("iptables", "ip6tables"):
        if shutil.which(cmd):
            left += [f"{cmd} -t {t} chain {c}" for t, cs in _chains(cmd).items() for c in cs]
    left += [f"cgroup {c}" for c in _our_cgroups()]
    return left


@contextlib.contextmanager
def running_node(state: Path | None = None, *, timeout_s: float = 180) -> Iterator[RealNode]:
    """A real node for the duration of the block; brought down (and checked clean) afterwards."""
    node = RealNode(state)
    node.up(timeout_s=timeout_s)
    try:
        yield node
    finally:
        node.down()
