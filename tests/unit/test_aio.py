"""gather_or_cancel: the SDK's fan-out of requests (scoring chunks, judge chats, reward batches)."""

from __future__ import annotations

import asyncio
import warnings

import pytest

from rewardplane.sdk._aio import gather_or_cancel


async def _waits(i: int, cancelled: list[int]) -> int:
    """A request whose answer never comes in time: records its cancellation."""
    try:
        await asyncio.sleep(10)
    except asyncio.CancelledError:
        cancelled.append(i)
        raise
    return i


def test_the_first_request_is_on_its_way_before_the_last_is_built() -> None:
    events: list[str] = []

    async def request(i: int) -> int:
        events.append(f"build {i}")
        await asyncio.sleep(0)  # the pool hands out a connection
        events.append(f"send {i}")
        await asyncio.sleep(0.01)  # the answer
        return i

    results = asyncio.run(gather_or_cancel([request(i) for i in range(50)]))
    assert results == list(range(50))
    assert events.index("send 0") < events.index("build 49")


def test_the_first_failure_cancels_the_rest_and_starts_no_more() -> None:
    started: list[int] = []
    cancelled: list[int] = []

    async def request(i: int) -> int:
        started.append(i)
        if i == 2:
            raise ValueError("server said no")
        return await _waits(i, cancelled)

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a coroutine never awaited would warn
        with pytest.raises(ValueError, match="server said no"):
            asyncio.run(gather_or_cancel([request(i) for i in range(100)]))
    assert started == [0, 1, 2]
    assert sorted(cancelled) == [0, 1]


def test_cancelling_the_caller_cancels_what_started_and_drops_the_rest() -> None:
    cancelled: list[int] = []

    async def main() -> None:
        task = asyncio.ensure_future(gather_or_cancel([_waits(i, cancelled) for i in range(1000)]))
        for _ in range(5):
            await asyncio.sleep(0)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        asyncio.run(main())
    assert cancelled and len(cancelled) < 1000
    assert sorted(cancelled) == list(range(len(cancelled)))
