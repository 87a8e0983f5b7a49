"""Stopping a child process: a signal, a bounded wait, then SIGKILL and another bounded wait."""

from __future__ import annotations

import signal
import subprocess


def stop_process(
    proc: subprocess.Popen[bytes] | subprocess.Popen[str],
    *,
    sig: int = signal.SIGTERM,
    grace_s: float = 10.0,
    kill_wait_s: float = 10.0,
) -> int | None:
    """Send ``sig`` (unless the process has exited), wait up to ``grace_s``, then SIGKILL and wait up
    to ``kill_wait_s``. Returns the exit status, None if even SIGKILL left it running (a process in
    uninterruptible sleep): never waits without a bound."""
    if proc.poll() is None:
        proc.send_signal(sig)
        try:
            return proc.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            proc.kill()
    try:
        return proc.wait(timeout=kill_wait_s)
    except subprocess.TimeoutExpired:
        return None
