"""The weights guard's change notification: a trainer's long-poll on /runtime_version wakes when
the version commits or an update fails, not at its next poll."""

from __future__ import annotations

import asyncio
import time

import pytest

from rewardplane.server.errors import Conflict
from rewardplane.server.locking import WeightsGuard


def test_wait_change_wakes_on_commit_and_on_failure_and_times_out() -> None:
    async def run() -> tuple[float, float, float, int, str]:
        guard = WeightsGuard()

        async def commit_later() -> None:
            await asyncio.sleep(0.05)
            async with guard.updating(timeout_s=5):
                guard.commit(7)

        t0 = time.monotonic()
        task = asyncio.ensure_future(commit_later())
        while guard.version < 7:
            await guard.wait_change(10.0)
        woke_commit = time.monotonic() - t0
        await task

        async def break_later() -> None:
            await asyncio.sleep(0.05)
            async with guard.updating(timeout_s=5):
                guard.mark_broken("trainer died")

        t0 = time.monotonic()
        task = asyncio.ensure_future(break_later())
        while guard.state != "broken":
            await guard.wait_change(10.0)
        woke_broken = time.monotonic() - t0
        await task

        t0 = time.monotonic()
        await guard.wait_change(0.05)  # nothing changes: returns at the timeout
        return woke_commit, woke_broken, time.monotonic() - t0, guard.version, guard.state

    woke_commit, woke_broken, idle, version, state = asyncio.run(run())
    assert (version, state) == (7, "broken")
    assert woke_commit < 1.0 and woke_broken < 1.0  # woken by the change, not the 10 s bound
    assert 0.04 <= idle < 1.0


def test_writes_are_refused_with_one_reason_while_asleep() -> None:
    async def run() -> None:
        guard = WeightsGuard()
        assert guard.write_refusal() is None
        async with guard.updating(timeout_s=5):
            guard.fall_asleep(1)
        reason = guard.write_refusal()
        assert reason is not None and "asleep (sleep level 1)" in reason and "/wake" in reason
        # the lock refuses with the same reason that paths admitting a write early ask for
        with pytest.raises(Conflict) as refused:
            async with guard.updating(timeout_s=5):
                pass
        assert refused.value.message == reason
        async with guard.updating(timeout_s=5, waking=True):
            guard.woke()
        assert guard.write_refusal() is None

    asyncio.run(run())
