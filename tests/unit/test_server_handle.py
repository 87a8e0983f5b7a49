"""Stopping a server started by ``rewardplane.testing.servers`` waits for every process of its
session: vLLM's engine core outlives the server process by a moment while it still holds GPU
memory, and a server started right after on the same GPU found no room for its KV cache."""

from __future__ import annotations

import subprocess
import time
from pathlib import Path

from rewardplane.testing.servers import ServerHandle, live_in_group


def _session_leaving_a_child(child: str) -> subprocess.Popen[bytes]:
    """A "server" whose child runs on after the server itself has exited, in its own session."""
    proc = subprocess.Popen(["bash", "-c", f"({child}) & exit 0"], start_new_session=True)
    proc.wait(timeout=10)
    return proc


def test_stop_returns_once_the_servers_children_have_exited(tmp_path: Path) -> None:
    proc = _session_leaving_a_child("sleep 1")
    assert live_in_group(proc.pid), "the child should still run when the server has exited"
    ServerHandle("", 0, proc, tmp_path / "log").stop()
    assert not live_in_group(proc.pid)


def test_a_child_that_does_not_exit_is_killed_after_the_grace(tmp_path: Path) -> None:
    proc = _session_leaving_a_child("sleep 300")
    t0 = time.monotonic()
    ServerHandle("", 0, proc, tmp_path / "log").end_session(grace_s=0.5)
    assert not live_in_group(proc.pid)
    assert time.monotonic() - t0 < 5
