"""start_now: every coroutine runs its first step before the caller goes on (Python 3.12+), so a
scoring request's prompts are with the engine before the event loop serves anything else."""

from __future__ import annotations

import asyncio
import sys

import pytest

from rewardplane.server.engines.eager_tasks import start_now


async def _submit_then_wait(submitted: list[int], i: int, answer: asyncio.Event) -> int:
    submitted.append(i)  # the engine's add_request: no wait
    await answer.wait()  # the engine's output: a real wait
    return i * 10


@pytest.mark.skipif(sys.version_info < (3, 12), reason="eager tasks need Python 3.12")
def test_every_prompt_is_submitted_before_the_caller_goes_on() -> None:
    async def main() -> tuple[list[int], list[int]]:
        submitted: list[int] = []
        answer = asyncio.Event()
        tasks = start_now(_submit_then_wait(submitted, i, answer) for i in range(8))
        before_any_wait = list(submitted)
        answer.set()
        return before_any_wait, list(await asyncio.gather(*tasks))

    before_any_wait, results = asyncio.run(main())
    assert before_any_wait == list(range(8))
    assert results == [i * 10 for i in range(8)]


def test_results_and_errors_come_back_in_order() -> None:
    async def fails() -> int:
        raise ValueError("bad prompt")

    async def main() -> None:
        answer = asyncio.Event()
        answer.set()
        assert await asyncio.gather(*start_now(_submit_then_wait([], i, answer) for i in range(3))) == [
            0,
            10,
            20,
        ]
        with pytest.raises(ValueError, match="bad prompt"):
            await asyncio.gather(*start_now([fails()]))

    asyncio.run(main())
