"""What a real node leaves on the machine outside its processes, how ``down`` removes it, and
:func:`leftovers`, which lists whatever is still there (empty = clean).

``up`` records the sysctls it will change and which machine-wide paths exist (``before-up.json``);
``down`` unmounts everything under the state dir, removes the CNI network namespaces, the bridge
and the node's address, every ``KUBE-``/``CNI-`` iptables chain and the rules that jump to them,
the pod cgroups, then puts the sysctls back and removes the machine-wide paths that did not exist
before. Each step is a function of the layout; the node runs them all even when one fails.
"""

from __future__ import annotations

import contextlib
import json
import re
import shlex
import shutil
from pathlib import Path
from typing import Any

from rewardplane.localcluster.binaries import cache_dir
from rewardplane.localcluster.realnode.layout import BRIDGE, NODE_IP, NODE_LINK, Layout, default_state_dir
from rewardplane.localcluster.realnode.processes import our_processes
from rewardplane.localcluster.realnode.tools import run

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
IPTABLES = ("iptables", "ip6tables")


def _sysctl_path(key: str) -> Path:
    return Path("/proc/sys", *key.split("."))


def record_host_state(layout: Layout) -> None:
    """Write what ``down`` puts back: the sysctls' values and which ``HOST_PATHS`` exist."""
    if layout.before_json.exists():  # a node that was never brought down: its record stays the truth
        return
    sysctls = {}
    for key in SYSCTLS:
        with contextlib.suppress(OSError):
            sysctls[key] = _sysctl_path(key).read_text().strip()
    layout.before_json.write_text(
        json.dumps({"sysctls": sysctls, "host_paths": [str(p) for p in HOST_PATHS if p.exists()]}, indent=2)
    )


def _recorded(layout: Layout) -> dict[str, Any] | None:
    try:
        before: dict[str, Any] = json.loads(layout.before_json.read_text())
    except (OSError, ValueError):
        return None
    return before


# -- what is there ------------------------------------------------------------------------------
def mounts_under(root: Path) -> list[str]:
    prefix = str(root).rstrip("/") + "/"
    out = []
    with contextlib.suppress(OSError):
        for line in Path("/proc/self/mounts").read_text().splitlines():
            target = line.split()[1].replace("\\040", " ")
            if target == str(root) or target.startswith(prefix):
                out.append(target)
    return out


def node_address_present() -> bool:
    done = run(["ip", "-4", "-o", "addr", "show", "dev", NODE_LINK], check=False)
    return f" {NODE_IP}/" in done.stdout


def cni_netns() -> list[Path]:
    netns = Path("/run/netns")
    return sorted(netns.glob("cni-*")) if netns.is_dir() else []


def our_cgroups() -> list[Path]:
    found = []
    for ctrl in Path("/sys/fs/cgroup").iterdir() if Path("/sys/fs/cgroup").is_dir() else []:
        for name in CGROUP_NAMES:
            if (ctrl / name).is_dir():
                found.append(ctrl / name)
    return found


def chains(cmd: str) -> dict[str, list[str]]:
    """table → chains of ours (by prefix) in it."""
    out: dict[str, list[str]] = {}
    for table in ("filter", "nat", "mangle", "raw"):
        done = run([cmd, "-t", table, "-S"], check=False)
        if done.returncode != 0:
            continue
        ours = [
            line.split()[1]
            for line in done.stdout.splitlines()
            if line.startswith("-N ") and line.split()[1].startswith(CHAIN_PREFIXES)
        ]
        if ours:
            out[table] = ours
    return out


def _installed_iptables() -> list[str]:
    return [cmd for cmd in IPTABLES if shutil.which(cmd)]


def leftovers(state: Path | None = None) -> list[str]:
    """Everything a real node could leave on the machine that is still there (empty = clean)."""
    root = (state or default_state_dir()).expanduser().resolve()
    left = [f"process {pid}: {cmd[:120]}" for pid, cmd in our_processes(Layout(root))]
    left += [f"mount {m}" for m in mounts_under(root)]
    left += [f"netns {ns}" for ns in cni_netns()]
    if Path(f"/sys/class/net/{BRIDGE}").exists():
        left.append(f"link {BRIDGE}")
    if node_address_present():
        left.append(f"address {NODE_IP} on {NODE_LINK}")
    left += [
        f"veth {p.name}"
        for p in Path("/sys/class/net").iterdir()
        if (p / "master").exists() and (p / "master").resolve().name == BRIDGE
    ]
    for cmd in _installed_iptables():
        left += [f"{cmd} -t {t} chain {c}" for t, cs in chains(cmd).items() for c in cs]
    left += [f"cgroup {c}" for c in our_cgroups()]
    return left


# -- removing it ---------------------------------------------------------------------------------
def unmount(layout: Layout) -> None:
    for target in sorted(mounts_under(layout.root), key=len, reverse=True):
        run(["umount", "-l", target], check=False)


def remove_netns() -> None:
    for ns in cni_netns():
        run(["umount", str(ns)], check=False)
        ns.unlink(missing_ok=True)


def remove_links() -> None:
    if run(["ip", "link", "show", BRIDGE], check=False).returncode == 0:
        run(["ip", "link", "del", BRIDGE], check=False)
    if node_address_present():
        run(["ip", "addr", "del", f"{NODE_IP}/32", "dev", NODE_LINK], check=False)


def remove_iptables() -> None:
    kube_proxy = cache_dir() / "bin" / "kube-proxy"
    if kube_proxy.exists():
        run([str(kube_proxy), "--cleanup"], check=False, timeout=60)
    for cmd in _installed_iptables():
        remove_chains(cmd)


def remove_chains(cmd: str) -> None:
    """Delete the rules that jump to our chains, then flush and delete the chains themselves."""
    jump = re.compile(r"-j (" + "|".join(re.escape(p) for p in CHAIN_PREFIXES) + r")")
    for table, ours in chains(cmd).items():
        for rule in run([cmd, "-t", table, "-S"], check=False).stdout.splitlines():
            if (
                rule.startswith("-A ")
                and not rule.split()[1].startswith(CHAIN_PREFIXES)
                and jump.search(rule)
            ):
                run([cmd, "-t", table, "-D", *shlex.split(rule[3:])], check=False)
        for chain in ours:
            run([cmd, "-t", table, "-F", chain], check=False)
        for chain in ours:
            run([cmd, "-t", table, "-X", chain], check=False)


def remove_cgroups() -> None:
    for d in our_cgroups():
        for sub in sorted((p for p in d.rglob("*") if p.is_dir()), key=lambda p: len(p.parts), reverse=True):
            with contextlib.suppress(OSError):
                sub.rmdir()
        with contextlib.suppress(OSError):
            d.rmdir()


def restore_sysctls(layout: Layout) -> None:
    before = _recorded(layout)
    if before is None:
        return
    for key, value in before.get("sysctls", {}).items():
        with contextlib.suppress(OSError):
            _sysctl_path(key).write_text(f"{value}\n")


def remove_host_paths(layout: Layout) -> None:
    before = _recorded(layout)
    if before is None:
        return
    existed = set(before.get("host_paths", []))
    for path in HOST_PATHS:
        if str(path) not in existed and path.exists():
            if mounts_under(path) or (path == Path("/run/netns") and any(path.iterdir())):
                continue  # something else mounted there since: not ours to remove
            shutil.rmtree(path, ignore_errors=True)
    layout.before_json.unlink(missing_ok=True)


def remove_state(layout: Layout, purge: bool) -> None:
    """A fresh cluster each ``up``: cluster data goes; images (containerd root) and PKI stay,
    unless ``purge``."""
    for d in (
        layout.etcd_data,
        layout.kubelet_root,
        layout.containerd_state,
        layout.cni_ipam,
        layout.run,
        layout.kubelet_pki,
    ):
        if not mounts_under(d):
            shutil.rmtree(d, ignore_errors=True)
    layout.cluster_json.unlink(missing_ok=True)
    if purge and not mounts_under(layout.root):
        shutil.rmtree(layout.root, ignore_errors=True)
