"""The reward loop without a server: detection of sync/async functions, per-sample calls under
the concurrency limit, result shapes, extras, and fail-fast errors."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from rewardplane.sdk import RewardFunctionError, RewardLoop, RewardplaneError, RewardSample


class InFlight:
    """Counts calls in flight (from threads and coroutines alike) and keeps the peak."""

    def __init__(self) -> None:
        self.now = self.peak = self.calls = 0
        self._lock = threading.Lock()

    def __enter__(self) -> None:
        with self._lock:
            self.now += 1
            self.calls += 1
            self.peak = max(self.peak, self.now)

    def __exit__(self, *exc: object) -> None:
        with self._lock:
            self.now -= 1


def samples(n: int) -> list[RewardSample]:
    return [RewardSample(prompt=f"q{i}", response="x" * i, ground_truth=i % 3) for i in range(n)]


def test_200_samples_mixing_sync_and_async_run_concurrently_under_the_limit_and_keep_extras() -> None:
    gauge = InFlight()
    threads: set[str] = set()
    loop = RewardLoop(max_concurrency=16)

    @loop.register
    def length_rule(sample: RewardSample) -> float:  # sync: runs in the loop's thread pool
        with gauge:
            threads.add(threading.current_thread().name)
            time.sleep(0.01)
            return len(sample.response) / 100

    @loop.register(weight=2.0)
    async def exact_match(sample: RewardSample) -> dict[str, object]:
        with gauge:
            await asyncio.sleep(0.01)
            hit = sample.ground_truth == 0
            return {"score": 1.0 if hit else 0.0, "matched": hit, "why": f"gt={sample.ground_truth}"}

    batch = samples(200)
    start = time.perf_counter()
    results = asyncio.run(loop.run(batch))
    elapsed = time.perf_counter() - start
    sequential = 400 * 0.01  # what one call at a time would at least take
    print(
        f"\n200 samples x 2 functions: {elapsed:.2f}s (one at a time: >= {sequential:.1f}s), peak {gauge.peak}"
    )

    assert gauge.calls == 400
    assert gauge.peak == 16  # the limit is reached and never exceeded
    assert all(t.startswith("rewardplane-reward") for t in threads)  # sync ones ran off the loop
    for i, r in enumerate(results):
        hit = i % 3 == 0
        assert r.components == {"length_rule": pytest.approx(i / 100), "exact_match": 1.0 if hit else 0.0}
        assert r.score == pytest.approx(i / 100 + 2.0 * (1.0 if hit else 0.0))
        assert r.extra == {"exact_match": {"matched": hit, "why": f"gt={i % 3}"}}


def test_functions_that_ask_for_the_client_get_it() -> None:
    client = object()  # any object: the loop only hands it over
    seen: list[object] = []
    loop = RewardLoop(client=client)  # type: ignore[arg-type]

    @loop.register
    def sync_with_client(sample: RewardSample, client: object) -> float:
        seen.append(client)
        return 0.0

    @loop.register
    async def async_with_kwargs(sample: RewardSample, **kwargs: object) -> float:
        seen.append(kwargs["client"])
        return 0.0

    asyncio.run(loop.run(samples(3)))
    assert seen == [client] * 6


def test_callable_objects_with_async_call_are_detected() -> None:
    class Judge:
        async def __call__(self, sample: RewardSample) -> float:
            await asyncio.sleep(0)
            return 0.5

    loop = RewardLoop()
    loop.register(Judge(), name="judge")
    assert [r.score for r in asyncio.run(loop.run(samples(2)))] == [0.5, 0.5]


@pytest.mark.parametrize(
    ("value", "match"),
    [
        ({"reward": 1.0}, "without 'score'"),
        ("1.0", "type str"),
        (True, "type bool"),
        (float("inf"), "non-finite"),
    ],
)
def test_unusable_results_name_the_function_and_sample(value: object, match: str) -> None:
    loop = RewardLoop()
    loop.register(lambda s: value if s.prompt == "q2" else 0.0, name="rule")
    with pytest.raises(RewardFunctionError, match=match) as info:
        asyncio.run(loop.run(samples(4)))
    assert "'rule'" in str(info.value) and "sample 2" in str(info.value)
    assert isinstance(info.value, RewardplaneError)


def test_a_failing_function_stops_the_run_and_cancels_the_rest() -> None:
    started: list[int] = []
    loop = RewardLoop(max_concurrency=4)

    @loop.register
    async def flaky(sample: RewardSample) -> float:
        i = int(sample.prompt[1:])
        started.append(i)
        if i == 1:
            raise KeyError("ground_truth")
        await asyncio.sleep(10)  # would take minutes in total if not cancelled
        return 0.0

    start = time.monotonic()
    with pytest.raises(RewardFunctionError, match=r"'flaky' failed on sample 1: KeyError") as info:
        asyncio.run(loop.run(samples(50)))
    assert isinstance(info.value.__cause__, KeyError)
    assert time.monotonic() - start < 8
    assert len(started) < 50


def test_registration_errors_are_clear() -> None:
    loop = RewardLoop()
    with pytest.raises(ValueError, match="no reward function registered"):
        asyncio.run(loop.run(samples(1)))
    loop.register(lambda s: 0.0, name="a")
    with pytest.raises(ValueError, match="already registered"):
        loop.register(lambda s: 1.0, name="a")
    with pytest.raises(ValueError, match="needs a scoring client"):
        loop.add_reward_model()
    with pytest.raises(ValueError, match="max_concurrency"):
        RewardLoop(max_concurrency=0)
    assert asyncio.run(loop.run([])) == []
