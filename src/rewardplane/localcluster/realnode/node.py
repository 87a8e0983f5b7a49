"""``RealNode``: brings the real node up and down, composed of its parts — the PKI and kubeconfigs
(:mod:`.pki`), the rendered configs (:mod:`.configs`) and command lines (:mod:`.commands`), the
daemons as processes (:mod:`.processes`), containerd (:mod:`.containerd`), the admin API
(:mod:`.admin_api`) and the host cleanup (:mod:`.teardown`).

``up`` starts containerd, etcd, the API server, then the controller-manager, scheduler, kubelet and
kube-proxy, and returns once the Node is Ready and the default ServiceAccount exists. ``down`` runs
every step even when one fails: controllers first (nothing recreates pods), pods deleted through the
API while the kubelet runs (they drain), what is left killed through containerd, every daemon
stopped by pid, then the host cleanup.
"""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path

from rewardplane.localcluster.controlplane import _http_ok, free_port
from rewardplane.localcluster.realnode import commands, configs, pki, teardown
from rewardplane.localcluster.realnode.admin_api import AdminApi
from rewardplane.localcluster.realnode.containerd import Containerd
from rewardplane.localcluster.realnode.layout import (
    NODE_IP,
    NODE_LINK,
    NODE_NAME,
    OWNER_FILE,
    Layout,
    default_state_dir,
    images_dir,
)
from rewardplane.localcluster.realnode.processes import COMPONENTS, Components, our_processes, stop_pid
from rewardplane.localcluster.realnode.tools import RealNodeError, node_binaries, run

log = logging.getLogger("rewardplane.localcluster.realnode")

# Stopped before the pods are deleted, so that nothing recreates them.
CONTROLLERS = ("kube-controller-manager", "kube-scheduler")
# Stopped after the pods are deleted and before containerd's leftovers are killed.
NODE_DAEMONS = ("kube-proxy", "kubelet")
PODS_GONE_S = 30.0  # how long ``down`` waits for the kubelet to stop the deleted pods
# The node agents ``restart`` can stop and start again, and how each one's command line is made.
RESTARTABLE: dict[str, Callable[[commands.Binaries, Layout], list[str]]] = {
    "containerd": commands.containerd,
    "kubelet": commands.kubelet,
}


class RealNode:
    """Start (``up``) and tear down (``down``) the real single-node cluster under ``state``."""

    def __init__(self, state: Path | None = None, *, images: Path | None = None) -> None:
        self.layout = Layout((state or default_state_dir()).expanduser().resolve())
        self.images = images or images_dir()
        self.components = Components(self.layout)
        self.containerd = Containerd(self.layout, self.images)
        self.api = AdminApi(self.layout)

    # -- public ---------------------------------------------------------------------------------
    @property
    def kubeconfig(self) -> Path:
        return self.layout.kubeconfig

    def running(self) -> bool:
        return self.components.pid("kube-apiserver") is not None

    def status(self) -> dict[str, int | None]:
        return {name: self.components.pid(name) for name in COMPONENTS}

    def ctr(
        self, args: list[str], *, check: bool = True, timeout: float = 60
    ) -> subprocess.CompletedProcess[str]:
        """``ctr`` against the node's containerd, in the namespace the kubelet uses."""
        return self.containerd.ctr(args, check=check, timeout=timeout)

    def image_names(self) -> set[str]:
        """The image names the node's containerd lists (none while it is not running)."""
        return self.containerd.image_names()

    def import_images(self, paths: list[Path] | None = None) -> list[str]:
        """Import docker-archive tarballs into the node's containerd (see :meth:`Containerd.import_images`)."""
        return self.containerd.import_images(paths)

    def up(self, *, timeout_s: float = 180, import_images: bool = True) -> Path:
        """Start every component; return the admin kubeconfig once the Node is Ready."""
        if self.running():
            if import_images:  # images built since: a tarball that did not change is skipped
                self.import_images()
            return self.kubeconfig
        self._claim_machine()
        deadline = time.monotonic() + timeout_s
        bins = node_binaries()
        lay = self.layout
        # A fresh cluster each time; the containerd content store (images) and PKI are kept.
        self.down(quiet=True, keep_owner=True)
        for d in (lay.logs, lay.pids, lay.run, lay.cni_conf, lay.cni_ipam, lay.kubelet_root):
            d.mkdir(parents=True, exist_ok=True)
        teardown.record_host_state(lay)
        try:
            self._start_components(bins, deadline, import_images=import_images)
        except BaseException:
            log.error("real node did not come up; logs:\n%s", self.components.log_tails())
            self.down(quiet=True)
            raise
        return lay.kubeconfig

    def down(self, *, quiet: bool = False, keep_owner: bool = False, purge: bool = False) -> list[str]:
        """Stop everything and remove what the node made; returns what could not be removed."""
        lay = self.layout
        if not lay.root.exists():
            return []
        stop = self.components.stop
        steps: list[tuple[str, Callable[[], None]]] = [
            (f"stop {n}", functools.partial(stop, n)) for n in CONTROLLERS
        ]
        steps.append(("delete pods", self._delete_pods_through_api))
        steps += [(f"stop {n}", functools.partial(stop, n)) for n in NODE_DAEMONS]
        steps.append(("kill containers", self._kill_containers))
        done = (*CONTROLLERS, *NODE_DAEMONS)
        steps += [(f"stop {n}", functools.partial(stop, n)) for n in COMPONENTS if n not in done]
        steps += [
            ("stop leftover processes", self._stop_leftover_processes),
            ("unmount", lambda: teardown.unmount(lay)),
            ("network namespaces", teardown.remove_netns),
            ("links", teardown.remove_links),
            ("iptables", teardown.remove_iptables),
            ("cgroups", teardown.remove_cgroups),
            ("sysctls", lambda: teardown.restore_sysctls(lay)),
            ("host paths", lambda: teardown.remove_host_paths(lay)),
            ("state", lambda: teardown.remove_state(lay, purge)),
        ]
        for what, step in steps:
            try:
                step()
            except Exception as exc:  # every step runs: one failure must not leave the rest behind
                log.warning("down: %s failed: %s", what, exc)
        if not keep_owner:
            self._release_machine()
        left = teardown.leftovers(lay.root)
        if left and not quiet:
            log.warning("down left behind: %s", left)
        return left

    def restart(self, name: str, *, timeout_s: float = 60) -> float:
        """Stop a node agent (SIGTERM, as ``systemctl restart`` does) and start it again with the
        same command line; returns the seconds until it serves again (containerd answers ``ctr
        version``, the kubelet its healthz). Running containers are left alone: their shims outlive
        containerd, and the kubelet finds its pods again."""
        if name not in RESTARTABLE:
            raise ValueError(f"restart takes one of {sorted(RESTARTABLE)}, not {name!r}")
        cmd = RESTARTABLE[name](node_binaries(), self.layout)
        started = time.monotonic()
        self.components.stop(name)
        self.components.start(name, cmd)
        serving = self._containerd_serving if name == "containerd" else self._kubelet_healthy
        self.components.wait(name, started + timeout_s, serving)
        return time.monotonic() - started

    def _containerd_serving(self) -> bool:
        return self.ctr(["version"], check=False, timeout=10).returncode == 0

    def _kubelet_healthy(self) -> bool:
        port = json.loads(self.layout.kubelet_config.read_text())["healthzPort"]
        return _http_ok(f"http://127.0.0.1:{port}/healthz")

    # -- up -------------------------------------------------------------------------------------
    def _start_components(self, bins: commands.Binaries, deadline: float, *, import_images: bool) -> None:
        lay, procs = self.layout, self.components
        run(["ip", "addr", "replace", f"{NODE_IP}/32", "dev", NODE_LINK])
        Path("/proc/sys/net/ipv4/ip_forward").write_text("1\n")
        pki.make_pki(lay)
        self._write_configs()
        procs.start("containerd", commands.containerd(bins, lay))
        procs.wait("containerd", deadline, lambda: self.ctr(["version"], check=False).returncode == 0)
        if import_images:
            self.import_images()
        etcd_port, etcd_peer = free_port(), free_port()
        procs.start("etcd", commands.etcd(bins, lay, client_port=etcd_port, peer_port=etcd_peer))
        procs.wait("etcd", deadline, lambda: _http_ok(f"http://127.0.0.1:{etcd_port}/health"))
        api_port = free_port()
        server = f"https://{NODE_IP}:{api_port}"
        pki.write_kubeconfigs(lay, server)
        procs.start("kube-apiserver", commands.apiserver(bins, lay, etcd_port=etcd_port, port=api_port))
        admin = pki.token(lay, "admin")
        procs.wait("kube-apiserver", deadline, lambda: _http_ok(f"{server}/readyz", token=admin))
        procs.start(
            "kube-controller-manager", commands.controller_manager(bins, lay, secure_port=free_port())
        )
        procs.start("kube-scheduler", commands.scheduler(bins, lay, secure_port=free_port()))
        procs.start("kubelet", commands.kubelet(bins, lay))
        procs.start(
            "kube-proxy", commands.kube_proxy(bins, lay, metrics_port=free_port(), healthz_port=free_port())
        )
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
        procs.wait("node Ready", deadline, self.api.node_ready, log_name="kubelet")
        procs.wait(
            "default ServiceAccount", deadline, self.api.default_sa_ready, log_name="kube-controller-manager"
        )

    def _write_configs(self) -> None:
        lay = self.layout
        lay.containerd_config.write_text(configs.containerd_config(lay))
        (lay.cni_conf / configs.CNI_CONFIG_NAME).write_text(json.dumps(configs.cni_config(lay), indent=2))
        kubelet = configs.kubelet_config(lay, port=free_port(), healthz_port=free_port())
        lay.kubelet_config.write_text(json.dumps(kubelet, indent=2))

    # -- down -----------------------------------------------------------------------------------
    def _delete_pods_through_api(self) -> None:
        """Delete every pod while the kubelet still runs, so containers stop gracefully and CNI
        releases their addresses; bounded: what is left gets killed through containerd next."""
        if self.components.pid("kube-apiserver") is None or self.components.pid("kubelet") is None:
            return
        self.api.delete_all_pods()
        deadline = time.monotonic() + PODS_GONE_S
        while time.monotonic() < deadline and self.containerd.running_tasks():
            # controllers may recreate pods meanwhile; what counts is that none runs any more
            time.sleep(0.5)

    def _kill_containers(self) -> None:
        if self.components.pid("containerd") is not None:
            self.containerd.kill_containers()

    def _stop_leftover_processes(self) -> None:
        for pid, _ in our_processes(self.layout):  # shims that outlived containerd
            stop_pid(pid, 5)

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


@contextlib.contextmanager
def running_node(state: Path | None = None, *, timeout_s: float = 180) -> Iterator[RealNode]:
    """A real node for the duration of the block; brought down (and checked clean) afterwards."""
    node = RealNode(state)
    node.up(timeout_s=timeout_s)
    try:
        yield node
    finally:
        node.down()
