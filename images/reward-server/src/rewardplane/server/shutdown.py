"""Stopping the server: a SIGTERM ends the process in bounded time, whatever still runs.

uvicorn drains requests for ``--graceful-shutdown-s``, then the engine stops. Should anything
after that hang (an engine teardown, a library's exit hook, a C call that never returns), the
process would otherwise sit until the kubelet's SIGKILL, and nobody would learn what held it.
``exit_deadline`` prints every thread's stack and exits once the deadline passes. Its timer is a
Python thread, which cannot run while a C call holds the GIL or once the interpreter has begun to
finalize (daemon threads are stopped then); a moment later faulthandler's watchdog, a C thread
that needs no GIL, dumps the stacks and exits instead.
"""

from __future__ import annotations

import contextlib
import faulthandler
import logging
import os
import sys
import threading
from collections.abc import Iterator
from types import FrameType
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import uvicorn

log = logging.getLogger(__name__)

# What the engine may take to stop after the requests drained (vLLM tears down its engine core
# and frees the GPU); the pod's grace period leaves room for drain + this.
ENGINE_STOP_ALLOWANCE_S = 10.0
EXIT_CODE_SHUTDOWN_HUNG = 70  # EX_SOFTWARE: tells a hung stop apart from SIGKILL (137)
# how long after the deadline the GIL-free watchdog acts (it exits with status 1)
WATCHDOG_AFTER_S = 2.0


def exit_deadline(seconds: float) -> threading.Timer:
    """Start a daemon timer that dumps every thread's stack to stderr and ends the process
    (``os._exit``: no exit hooks, they may be what hangs) after ``seconds``, and faulthandler's
    watchdog that does the same ``WATCHDOG_AFTER_S`` later should the timer not get to run."""

    def expire() -> None:
        print(
            f"rewardplane server: shutdown did not finish within {seconds:g} s of the stop "
            "signal; exiting. Threads still running:",
            file=sys.stderr,
            flush=True,
        )
        faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
        sys.stderr.flush()
        os._exit(EXIT_CODE_SHUTDOWN_HUNG)

    faulthandler.dump_traceback_later(seconds + WATCHDOG_AFTER_S, exit=True)
    timer = threading.Timer(seconds, expire)
    timer.name = "rp-exit-deadline"
    timer.daemon = True
    timer.start()
    return timer


def bounded_shutdown_server(config: uvicorn.Config, graceful_shutdown_s: float) -> uvicorn.Server:
    """A uvicorn server whose first stop signal also arms ``exit_deadline`` (drain time plus
    ``ENGINE_STOP_ALLOWANCE_S``), and that returns normally once it has stopped."""
    import uvicorn

    class Server(uvicorn.Server):
        @contextlib.contextmanager
        def capture_signals(self) -> Iterator[None]:
            with super().capture_signals():
                try:
                    yield
                finally:
                    # uvicorn raises the stop signal again once it has drained, which ends the
                    # process with 143 (130 and a KeyboardInterrupt traceback for Ctrl-C); a
                    # drained stop is a clean one: exit 0.
                    self._captured_signals.clear()

        def handle_exit(self, sig: int, frame: FrameType | None) -> None:
            if not self.should_exit:
                deadline = graceful_shutdown_s + ENGINE_STOP_ALLOWANCE_S
                log.info(
                    "stop signal %d: draining for up to %ss, exiting within %ss",
                    sig,
                    graceful_shutdown_s,
                    deadline,
                )
                exit_deadline(deadline)
            super().handle_exit(sig, frame)

    return Server(config)
