"""A pod's process on the host: started in a process group of its own that dies with the agent,
stopped by signalling the group, found again by a marker in its environment after the agent
crashed, and its log's last run read back.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import IO

from rewardplane.localcluster.nodeagent.config import MARKER_ENV, START_MARKER

LOG_TAIL_BYTES = 64 * 1024  # how much of a log's end is read for a failed run's cause


def _die_with_parent() -> None:
    """Runs in the child before exec: SIGKILL it if the agent's spawning thread dies, so a killed
    agent leaves no pod processes behind (Linux only; harmless elsewhere)."""
    if _PRCTL is not None:
        with contextlib.suppress(Exception):
            _PRCTL(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


_PRCTL: Callable[..., int] | None
try:
    _PRCTL = ctypes.CDLL(None, use_errno=True).prctl
except (OSError, AttributeError):  # not Linux
    _PRCTL = None


def kill_group(proc: subprocess.Popen[bytes], grace_s: float) -> int:
    """SIGTERM the process group, SIGKILL after ``grace_s``; returns the exit code (bounded)."""
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=max(grace_s, 0.1))
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.pid, signal.SIGKILL)
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=10)
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)  # stragglers the leader left in its group
    return exit_code(proc.returncode if proc.returncode is not None else -signal.SIGKILL)


def kill_leftovers(agent_id: str) -> int:
    """Kill process groups an earlier (crashed) agent with the same id left running."""
    killed = 0
    me = os.getpid()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == me:
            continue
        try:
            environ = (entry / "environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if f"{MARKER_ENV}={agent_id}".encode() in environ:
            pid = int(entry.name)
            with contextlib.suppress(ProcessLookupError, PermissionError):
                if os.getpgid(pid) == pid:
                    os.killpg(pid, signal.SIGKILL)
                    killed += 1
    return killed


def exit_code(returncode: int) -> int:
    """A Popen return code as container runtimes report it: -15 (a signal) is 143."""
    return 128 - returncode if returncode < 0 else returncode


def spawn(argv: list[str], *, env: dict[str, str], cwd: str, log: IO[bytes]) -> subprocess.Popen[bytes]:
    """Start a pod's process: its own session and process group, output to ``log``, killed when
    the agent's spawning thread dies."""
    return subprocess.Popen(
        argv,
        env=env,
        cwd=cwd,
        stdin=subprocess.DEVNULL,
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
        preexec_fn=_die_with_parent if _PRCTL is not None else None,
    )


def last_run_output(log_path: Path) -> str | None:
    """The end of a pod's log after the agent's last start line (None: no log)."""
    try:
        with open(log_path, "rb") as f:
            f.seek(max(0, f.seek(0, os.SEEK_END) - LOG_TAIL_BYTES))
            text = f.read().decode("utf-8", "replace")
    except OSError:
        return None
    marker = text.rfind(START_MARKER)
    if marker >= 0:
        text = text[text.find("\n", marker) + 1 :]
    return text
