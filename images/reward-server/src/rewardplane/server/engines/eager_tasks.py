"""Tasks that start at once: how a request's prompts reach the engine before other requests run."""

from __future__ import annotations

import asyncio
import sys
from collections.abc import Coroutine, Iterable
from typing import Any, TypeVar

T = TypeVar("T")


def start_now(coros: Iterable[Coroutine[Any, Any, T]]) -> list[asyncio.Task[T]]:
    """Tasks that run at once, up to their first real wait (eager tasks, Python 3.12 and later;
    ordinary tasks on 3.10 and 3.11). A scoring task's first step hands its prompt to the engine
    core without waiting, so eagerly every prompt of a request reaches the engine while its handler
    still runs. As ordinary tasks they queue behind everything the event loop already holds: in a
    burst of requests the engine got its first prompts only after most bodies had been read and
    parsed, and meanwhile ran small, launch-bound batches."""
    loop = asyncio.get_running_loop()
    if sys.version_info >= (3, 12):
        return [asyncio.Task(c, loop=loop, eager_start=True) for c in coros]
    return [loop.create_task(c) for c in coros]
