"""Small asyncio helpers shared by the clients and the reward loop."""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine, Sequence
from typing import Any, TypeVar

T = TypeVar("T")

CANCEL_WAIT_S = 5.0


async def gather_or_cancel(coros: Sequence[Coroutine[Any, Any, T]]) -> list[T]:
    """Run concurrently; on the first failure cancel the rest and raise it (no orphaned work)."""
    if not coros:
        return []
    if len(coros) == 1:
        return [await coros[0]]
    tasks = [asyncio.ensure_future(c) for c in coros]
    try:
        await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
    finally:
        pending = [t for t in tasks if not t.done()]
        for t in pending:
            t.cancel()
        if pending:
            # Cancelled requests unwind promptly; the bound guards against a stuck task.
            await asyncio.wait(pending, timeout=CANCEL_WAIT_S)
    for t in tasks:
        if t.done() and not t.cancelled() and t.exception() is not None:
            raise t.exception()  # type: ignore[misc]
    return [t.result() for t in tasks]
