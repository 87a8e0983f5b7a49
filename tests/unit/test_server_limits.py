"""The server's pure input limits and error capping: sizes are judged before tokenization, and an
error about many things stays small."""

from __future__ import annotations

import asyncio
import threading

import pytest

from rewardplane.server.errors import MAX_DETAIL_ITEMS, BadRequest, cap_detail, error_body
from rewardplane.server.http.inputs import bound_texts, limits_for, split_prompt_input
from rewardplane.server.threads import run_in_daemon_thread

LIMITS = limits_for(max_items=4, max_tokens=8)  # 256 bytes per input


def test_texts_over_the_byte_limit_are_refused_or_cut_to_their_end() -> None:
    ok = ["short", "é" * 64]  # 128 bytes: under 256
    assert bound_texts(ok, LIMITS, truncate=False) is ok
    with pytest.raises(
        BadRequest,
        match=r"input 1 is 257 characters \(at least as many bytes\); this server takes at most 256 bytes",
    ):
        bound_texts(["fine", "é" * 257], LIMITS, truncate=False)
    with pytest.raises(BadRequest, match=r"input 0 is 258 bytes; this server takes at most 256 bytes"):
        bound_texts(["é" * 129], LIMITS, truncate=False)
    cut = bound_texts(["fine", "x" * 1000 + "END"], LIMITS, truncate=True)
    assert cut[0] == "fine" and len(cut[1]) == 256 and cut[1].endswith("END")


def test_prompt_input_is_split_without_tokenizing() -> None:
    assert split_prompt_input("a") == (["a"], None)
    assert split_prompt_input(["a", "b"]) == (["a", "b"], None)
    assert split_prompt_input([1, 2]) == (None, [[1, 2]])
    assert split_prompt_input([[1], [2, 3]]) == (None, [[1], [2, 3]])
    with pytest.raises(BadRequest, match="input must be"):
        split_prompt_input([[1], "a"])


def test_error_details_are_capped() -> None:
    problems = [f"unknown parameter 'p{i}'" for i in range(100_000)]
    body = error_body("x" * 10_000, {"problems": problems, "deep": [[[[["bottom"]]]]]})
    assert len(body["error"]) < 2100 and body["error"].endswith("(8000 more characters)")
    capped = body["detail"]["problems"]
    assert len(capped) == MAX_DETAIL_ITEMS + 1 and capped[-1] == f"… and {100_000 - MAX_DETAIL_ITEMS} more"
    assert isinstance(body["detail"]["deep"][0][0][0], str)  # nesting is bounded
    assert cap_detail({"a": 1, "b": None, "c": 2.5}) == {"a": 1, "b": None, "c": 2.5}


def test_daemon_thread_call_returns_raises_and_does_not_hold_exit() -> None:
    seen: list[bool] = []

    def work(x: int) -> int:
        seen.append(threading.current_thread().daemon)
        if x < 0:
            raise ValueError("negative")
        return 2 * x

    async def run() -> int:
        with pytest.raises(ValueError, match="negative"):
            await run_in_daemon_thread(work, -1, name="t")
        return await run_in_daemon_thread(work, 21, name="t")

    assert asyncio.run(run()) == 42 and seen == [True, True]
