"""Per-key coalescing: runs never overlap, requests during a run cause exactly one more run."""

from __future__ import annotations

import threading
import time

import pytest

from rewardplane.operator.coalesce import Coalescer


def test_requests_during_a_run_coalesce_into_one_more_run() -> None:
    c: Coalescer[str] = Coalescer()
    started, release = threading.Event(), threading.Event()
    runs: list[int] = []
    active = [0]

    def work() -> None:
        active[0] += 1
        assert active[0] == 1, "two runs of one key overlapped"
        runs.append(len(runs))
        if len(runs) == 1:
            started.set()
            release.wait(5)
        active[0] -= 1

    t = threading.Thread(target=c.run, args=("a", work))
    t.start()
    assert started.wait(5)
    for _ in range(5):  # five requests while the first run is busy
        c.run("a", work)
    release.set()
    t.join(5)
    assert len(runs) == 2  # the first run plus exactly one more
    c.run("a", work)  # released: a later request runs again
    assert len(runs) == 3


def test_other_keys_run_independently_and_failures_release_the_key() -> None:
    c: Coalescer[str] = Coalescer()
    seen: list[str] = []
    c.run("a", lambda: seen.append("a"))
    c.run("b", lambda: seen.append("b"))
    assert seen == ["a", "b"]

    def boom() -> None:
        raise RuntimeError("x")

    with pytest.raises(RuntimeError):
        c.run("a", boom)
    c.run("a", lambda: seen.append("a2"))  # not stuck as "running"
    assert seen[-1] == "a2"


def test_mark_dirty_reruns_once() -> None:
    c: Coalescer[str] = Coalescer()
    runs: list[float] = []

    def work() -> None:
        runs.append(time.monotonic())
        if len(runs) == 1:
            c.mark_dirty("k")

    c.run("k", work)
    assert len(runs) == 2
