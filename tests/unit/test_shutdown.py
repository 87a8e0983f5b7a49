"""A stopping server that something holds up still exits, and says what held it."""

from __future__ import annotations

import subprocess
import sys
import textwrap

from rewardplane.server.shutdown import EXIT_CODE_SHUTDOWN_HUNG

# A process whose exit would wait forever: a non-daemon thread that never returns is joined at
# interpreter exit (as a stuck engine teardown or a library's exit hook would hold a server).
HUNG_EXIT = textwrap.dedent(
    """
    import threading, time
    from rewardplane.server.shutdown import exit_deadline

    def stuck_engine_teardown():
        while True:
            time.sleep(1)

    threading.Thread(target=stuck_engine_teardown).start()
    exit_deadline(0.5)
    """
)


def test_exit_deadline_ends_a_hung_exit_and_prints_the_threads_that_held_it() -> None:
    done = subprocess.run([sys.executable, "-c", HUNG_EXIT], capture_output=True, text=True, timeout=60)
    assert done.returncode == EXIT_CODE_SHUTDOWN_HUNG, done
    assert "shutdown did not finish within 0.5 s" in done.stderr, done.stderr
    assert "stuck_engine_teardown" in done.stderr, done.stderr


def test_a_process_that_exits_in_time_is_left_alone() -> None:
    quick = "from rewardplane.server.shutdown import exit_deadline\nexit_deadline(30)\nprint('bye')"
    done = subprocess.run([sys.executable, "-c", quick], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and done.stdout.strip() == "bye", done


# The main thread holds the GIL forever (a C call that never releases it: libc's pause() through
# ctypes.PyDLL, which keeps the GIL across the call), so no Python thread, the deadline's timer
# included, can run again.
GIL_HELD_FOREVER = textwrap.dedent(
    """
    import ctypes
    from rewardplane.server.shutdown import exit_deadline

    exit_deadline(0.5)
    ctypes.PyDLL(None).pause()
    """
)


def test_a_stop_hung_while_holding_the_gil_still_ends() -> None:
    done = subprocess.run(
        [sys.executable, "-c", GIL_HELD_FOREVER], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 1, done  # faulthandler's watchdog: the timer never ran
    assert "Timeout (0:00:02.500000)!" in done.stderr, done.stderr
    assert "line 6" in done.stderr, done.stderr  # the main thread's stack, at the pause() call
