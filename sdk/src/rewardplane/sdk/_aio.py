"""Small asyncio helpers shared by the clients and the reward loop."""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine, Sequence
from typing import Any, TypeVar

T = TypeVar("T")

CANCEL_WAIT_S = 5.0


async def gather_or_cancel(coros: Sequence[Coroutine[Any, Any, T]]) -> list[T]:
    """Run concurrently; on the first failure cancel the rest and raise it (no orphaned work).

    The tasks start in turn: each gets one step of the event loop (for a request: its body built
    and on its way) before the next is created. Created all at once, every request would be built
    before the first one left, and a server would wait for the whole batch to be encoded (~0.2 s
    for 256 requests of 8 prompts) before it had anything to work on."""
    if not coros:
        return []
    if len(coros) == 1:
        return [await coros[0]]
    tasks: list[asyncio.Future[T]] = []
    try:
        for c in coros:
            tasks.append(asyncio.ensure_future(c))
            await asyncio.sleep(0)
            if _failed(tasks[-1]):
                break  # a request already failed: start no more
        await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
    finally:
        for c in coros[len(tasks) :]:
            c.close()  # never started: nothing to cancel, and no "never awaited" warning
        pending = [t for t in tasks if not t.done()]
        for t in pending:
            t.cancel()
        if pending:
            # Cancelled requests unwind promptly; the bound guards against a stuck task.
            await asyncio.wait(pending, timeout=CANCEL_WAIT_S)
    for t in tasks:
        if _failed(t):
            raise t.exception()  # type: ignore[misc]
    return [t.result() for t in tasks]


def _failed(task: asyncio.Future[Any]) -> bool:
    return task.done() and not task.cancelled() and task.exception() is not None
