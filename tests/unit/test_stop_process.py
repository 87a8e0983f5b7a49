"""``stop_process``: a child that exits on the signal is reaped; one that ignores it is killed
within the bounds; an exited one is only reaped."""

from __future__ import annotations

import signal
import subprocess
import sys
import time

from rewardplane.testing.processes import stop_process


def child(code: str) -> subprocess.Popen[bytes]:
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE)
    assert proc.stdout is not None
    assert proc.stdout.readline() == b"ready\n"  # its signal handlers are in place
    return proc


def test_a_child_that_stops_on_sigterm_is_reaped() -> None:
    proc = child("import time; print('ready', flush=True); time.sleep(60)")
    assert stop_process(proc, grace_s=10) == -signal.SIGTERM


def test_a_child_that_ignores_the_signal_is_killed_after_the_grace() -> None:
    code = "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); print('ready', flush=True); time.sleep(60)"
    proc = child(code)
    t0 = time.monotonic()
    assert stop_process(proc, grace_s=0.5) == -signal.SIGKILL
    assert time.monotonic() - t0 < 10


def test_the_signal_is_the_callers_and_an_exited_child_is_only_reaped() -> None:
    code = (
        "import signal, sys, time\n"
        "signal.signal(signal.SIGINT, lambda *a: sys.exit(3))\n"
        "print('ready', flush=True); time.sleep(60)"
    )
    proc = child(code)
    assert stop_process(proc, sig=signal.SIGINT) == 3
    assert stop_process(proc) == 3  # already gone: no signal, same status
