"""The node's daemons as processes: started in sessions of their own with pid files and logs under
the layout, found again by pid file (a recycled pid does not count), stopped by pid.

Each daemon writes its log to ``logs/<component>.log``, a line marking each start. A daemon that
dies while ``up`` waits for the node is started again, at most ``START_RETRIES`` times.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

from rewardplane.localcluster.controlplane import log_tail, spawn_logged
from rewardplane.localcluster.realnode.layout import Layout
from rewardplane.localcluster.realnode.tools import KUBE_BINARIES, RealNodeError

log = logging.getLogger("rewardplane.localcluster.realnode")

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
# What the node runs: its daemons, and the containerd shims (which name the node's socket).
DAEMON_NAMES = frozenset(
    {
        *KUBE_BINARIES,
        "containerd",
        "containerd-shim",
        "containerd-shim-runc-v1",
        "containerd-shim-runc-v2",
        "runc",
    }
)


def alive(pid: int) -> bool:
    """The process exists and is not a zombie."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def read_pid(layout: Layout, name: str) -> int | None:
    """The component's pid while it still runs; a recycled pid does not count (every component
    leads its own session, and its command line names the state dir or its binary)."""
    try:
        pid = int(layout.pid_file(name).read_text().strip())
    except (OSError, ValueError):
        return None
    if not alive(pid):
        return None
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return None
    return pid if (str(layout.root) in cmdline or name in cmdline) else None


def _wait_gone(pid: int, seconds: float) -> None:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline and alive(pid):
        time.sleep(0.1)


def stop_pid(pid: int, grace_s: float) -> None:
    """SIGTERM, SIGKILL after ``grace_s``; waits (bounded) until the process is gone."""
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGTERM)
    _wait_gone(pid, grace_s)
    if alive(pid):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
        _wait_gone(pid, 5)


def our_processes(layout: Layout) -> list[tuple[int, str]]:
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
        if exe in DAEMON_NAMES and needle in cmdline and alive(int(entry.name)):
            found.append((int(entry.name), cmdline.replace(b"\0", b" ").decode(errors="replace").strip()))
    return found


class Components:
    """Starts, watches and stops the node's daemons; remembers what this ``up`` started."""

    def __init__(self, layout: Layout) -> None:
        self.layout = layout
        self._started: dict[str, tuple[subprocess.Popen[bytes], list[str]]] = {}
        self._retries: dict[str, int] = {}

    def pid(self, name: str) -> int | None:
        return read_pid(self.layout, name)

    def start(self, name: str, cmd: list[str]) -> None:
        lay = self.layout
        with open(lay.log_file(name), "ab") as logf:
            logf.write(f"--- {time.strftime('%Y-%m-%dT%H:%M:%S')} starting {name}\n".encode())
        proc = spawn_logged(cmd, lay.log_file(name), cwd=lay.root)
        lay.pid_file(name).write_text(f"{proc.pid}\n")
        self._started[name] = (proc, cmd)

    def check_started(self) -> None:
        """Every component started by this ``up`` still runs; one that died is started again (at
        most ``START_RETRIES`` times: on a busy machine a daemon can be killed at birth) and the
        error says how it ended."""
        for name, (proc, cmd) in list(self._started.items()):
            code = proc.poll()
            if code is None:
                continue
            how = f"killed by signal {-code}" if code < 0 else f"exited with code {code}"
            retries = self._retries.get(name, 0)
            if retries >= START_RETRIES:
                raise RealNodeError(f"{name} {how} while starting; {self.log_excerpt(name)}")
            log.warning("%s %s while starting; starting it again", name, how)
            self._retries[name] = retries + 1
            self.start(name, cmd)

    def wait(
        self, what: str, deadline: float, ready: Callable[[], bool], log_name: str | None = None
    ) -> None:
        """Until ``ready()``, checking that the started components still run; RealNodeError with
        the log of ``log_name`` (default ``what``) after ``deadline``."""
        while not ready():
            self.check_started()
            if time.monotonic() > deadline:
                raise RealNodeError(f"timed out waiting for {what}; {self.log_excerpt(log_name or what)}")
            time.sleep(0.5)

    def stop(self, name: str) -> None:
        pid = read_pid(self.layout, name)
        self.layout.pid_file(name).unlink(missing_ok=True)
        if pid is not None:
            stop_pid(pid, STOP_GRACE_S)

    def log_excerpt(self, name: str) -> str:
        path = self.layout.log_file(name)
        return f"last lines of {path}:\n{log_tail(path)}"

    def log_tails(self, lines: int = 15) -> str:
        """The last lines of every component's log, for a node that did not come up."""
        return "\n".join(
            f"--- {n}:\n{log_tail(self.layout.log_file(n), lines)}"
            for n in COMPONENTS
            if self.layout.log_file(n).exists()
        )
