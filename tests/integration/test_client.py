"""The scoring client against real reward-server processes on loopback.

Three servers of the same tiny model run for the whole module (each on its own loopback address,
like replicas); ``FlakyProxy`` sits in front of them where a test must count requests or inject
failures.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from rewardplane.protocol import ScoringRequest
from rewardplane.sdk import AsyncRewardClient, RewardClient
from rewardplane.sdk.chunking import contiguous_chunks
from rewardplane.sdk.retry import RetryPolicy, RewardServerError, RewardServerUnavailable
from rewardplane.testing.servers import ServerHandle, free_port, start_server
from tests.fixtures.flaky_proxy import FlakyProxy
from tests.fixtures.models import reference_logits

pytestmark = pytest.mark.slow

# Fast retries keep the suite quick; the shape of the policy is what is under test.
FAST = RetryPolicy(max_attempts=4, initial_backoff_s=0.05, max_backoff_s=0.2, jitter=0)

TEXTS = [f"sample {i}: the answer is {i * 7 % 13} because " + "step " * (i % 9) for i in range(100)]


@pytest.fixture(scope="module")
def servers(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[ServerHandle]]:
    log_dir = tmp_path_factory.mktemp("client-servers")
    hosts = ["127.0.0.1", "127.0.0.2", "127.0.0.3"]
    # Start the three in parallel: model load dominates and they do not depend on each other.
    with ThreadPoolExecutor(len(hosts)) as pool:
        futures = [pool.submit(start_server, tiny_model_dir, log_dir, host=h) for h in hosts]
        handles = []
        errors = []
        for f in futures:
            try:
                handles.append(f.result())
            except Exception as exc:  # start the rest, stop them all, then fail
                errors.append(exc)
    try:
        if errors:
            raise errors[0]
        yield handles
    finally:
        for h in handles:
            h.stop()


@pytest.fixture(scope="module")
def proxies(servers: list[ServerHandle]) -> Iterator[list[FlakyProxy]]:
    ps = [FlakyProxy(s.url).start() for s in servers]
    yield ps
    for p in ps:
        p.stop()


@pytest.fixture
def fresh_proxies(proxies: list[FlakyProxy]) -> list[FlakyProxy]:
    for p in proxies:
        p.fail_next(0)
        p.reset_counts()
    return proxies


def dead_url() -> str:
    return f"http://127.0.0.1:{free_port()}"  # nothing listens there: connection refused


def test_batch_of_100_is_chunked_in_order_and_equals_a_single_server(
    servers: list[ServerHandle], fresh_proxies: list[FlakyProxy]
) -> None:
    with RewardClient([servers[0].url], retry=FAST) as single:
        reference = single.score_batch(TEXTS, normalize=False)
    for p in fresh_proxies:
        p.reset_counts()

    request = ScoringRequest(inputs=TEXTS, normalize=False)
    with RewardClient([p.url for p in fresh_proxies], retry=FAST) as client:
        response, info = client.score(request)
        again, info_again = client.score(request)

    assert response.scores == pytest.approx(reference, rel=1e-4, abs=1e-5)
    assert [d.index for d in response.data] == list(range(100))
    # ceil(100/3) = 34 → [0,34) [34,68) [68,100), server i gets chunk i, both times.
    expected = [(r.start, r.stop, fresh_proxies[i].url) for i, r in enumerate(contiguous_chunks(100, 3))]
    assert [(c["start"], c["stop"], c["endpoint"]) for c in info["chunks"]] == expected
    assert [(c["start"], c["stop"], c["endpoint"]) for c in info_again["chunks"]] == expected
    assert again.scores == pytest.approx(response.scores, rel=1e-5, abs=1e-6)
    # Each server saw exactly one /score per run: its own chunk.
    assert [p.count("/score") for p in fresh_proxies] == [2, 2, 2]
    # Every chunk reports the weights version that scored it.
    assert info["versions"] == [0, 0, 0]
    assert response.metadata["versions"] == [0, 0, 0] and response.metadata["mixed_versions"] is False
    assert response.version == 0
    assert response.usage.prompt_tokens > 0


def test_small_calls_round_robin(servers: list[ServerHandle], fresh_proxies: list[FlakyProxy]) -> None:
    with RewardClient([p.url for p in fresh_proxies], retry=FAST) as client:
        for _ in range(6):
            assert len(client.score_batch(TEXTS[:3])) == 3
    assert [p.count("/score") for p in fresh_proxies] == [2, 2, 2]


def test_503_twice_then_200_is_retried(servers: list[ServerHandle], fresh_proxies: list[FlakyProxy]) -> None:
    proxy = fresh_proxies[0]
    with RewardClient([servers[0].url], retry=FAST) as direct:
        expected = direct.score_batch(TEXTS[:5])
    proxy.fail_next(2, status=503)
    with RewardClient([proxy.url], retry=FAST) as client:
        response, info = client.score(ScoringRequest(inputs=TEXTS[:5], normalize=False))
    assert response.scores == pytest.approx(expected, rel=1e-5, abs=1e-6)
    assert proxy.count("/score") == 3 and proxy.count("/score", injected=True) == 2
    assert info["chunks"][0]["attempts"] == 3


def test_400_is_not_retried_and_the_message_reaches_the_caller(
    servers: list[ServerHandle], fresh_proxies: list[FlakyProxy]
) -> None:
    proxy = fresh_proxies[0]
    with (
        RewardClient([proxy.url], retry=FAST) as client,
        pytest.raises(RewardServerError) as err,
    ):
        client.score_batch(TEXTS[:2], n_labels=3)  # the served model has 1 label
    assert err.value.status_code == 400
    assert "n_labels 3 does not match" in err.value.message
    assert "n_labels 3 does not match" in str(err.value) and proxy.url in str(err.value)
    assert proxy.count("/score") == 1  # one request: not retried


def test_too_many_items_is_a_400_with_the_limit(tiny_model_dir: Path, server_factory) -> None:  # type: ignore[no-untyped-def]
    """A client told a larger per-request limit than the server's gets the server's 400 naming it
    (not retried); left to itself, a client reads the server's limit and splits."""
    server = server_factory(tiny_model_dir, max_items_per_request=4)
    with FlakyProxy(server.url) as proxy, RewardClient([proxy.url], retry=FAST) as client:
        client.max_items_per_request = 8
        with pytest.raises(RewardServerError) as err:
            client.score_batch(TEXTS[:5])
        assert err.value.status_code == 400 and "at most 4" in err.value.message
        assert proxy.count("/score") == 1
        client.max_items_per_request = None  # the server's own limit, from /model_info
        assert len(client.score_batch(TEXTS[:10])) == 10
        assert proxy.count("/score") == 1 + 3


def test_zero_inputs_make_no_request(servers: list[ServerHandle], fresh_proxies: list[FlakyProxy]) -> None:
    proxy = fresh_proxies[0]
    with RewardClient([proxy.url], retry=FAST) as client:
        assert client.score_batch([]) == []
        response, info = client.score(ScoringRequest(inputs=[]))
        assert response.scores == [] and info["versions"] == [] and info["chunks"] == []

    async def empty() -> list[object]:
        async with AsyncRewardClient(proxy.url, retry=FAST) as aclient:
            return await aclient.score_batch([])  # type: ignore[return-value]

    assert asyncio.run(empty()) == []
    assert proxy.count() == 0


def test_dead_endpoint_raises_unavailable_within_the_retry_budget() -> None:
    url = dead_url()
    policy = RetryPolicy(max_attempts=3, initial_backoff_s=0.1, max_backoff_s=1, jitter=0)
    with RewardClient([url], retry=policy, request_timeout_s=5) as client:
        start = time.monotonic()
        with pytest.raises(RewardServerUnavailable) as err:
            client.score_batch(["hello"])
        elapsed = time.monotonic() - start
    assert err.value.attempts == 3 and err.value.url == url
    assert url in str(err.value) and "3 attempt" in str(err.value)
    # Refused connections fail at once, so the time is the backoff (0.1 + 0.2 s), far below the
    # three 5 s request timeouts a client waiting on each attempt would take (slack for a loaded CI).
    assert policy.max_total_backoff_s() <= elapsed < policy.max_total_backoff_s() + 5


def test_connection_error_fails_over_to_the_next_endpoint(servers: list[ServerHandle]) -> None:
    dead = dead_url()
    with RewardClient([dead, servers[1].url], retry=FAST) as client:
        # Round robin starts at endpoint 0, the dead one; the retry moves to endpoint 1.
        response, info = client.score(ScoringRequest(inputs=TEXTS[:2]))
        assert len(response.scores) == 2
        assert info["chunks"][0]["endpoint"] == servers[1].url and info["chunks"][0]["attempts"] == 2
        # A large batch: the dead server's chunk moves over too, order still preserved.
        scores = client.score_batch(TEXTS[:20])
    with RewardClient([servers[1].url], retry=FAST) as direct:
        assert scores == pytest.approx(direct.score_batch(TEXTS[:20]), rel=1e-4, abs=1e-5)


def test_startup_check_fails_fast_with_an_actionable_message() -> None:
    url = dead_url()
    start = time.monotonic()
    with RewardClient([url]) as client, pytest.raises(RewardServerUnavailable) as err:
        client.check_server(1)
    assert time.monotonic() - start < 8  # not the default timeouts (tens of seconds); slack for load
    assert url in str(err.value) and "check_server(timeout_s=1)" in str(err.value)


def test_versions_and_async_use(servers: list[ServerHandle]) -> None:
    urls = [s.url for s in servers]

    async def main() -> None:
        async with AsyncRewardClient(urls, retry=FAST) as client:
            assert await client.get_model_version() == 0
            assert await client.get_model_versions() == dict.fromkeys(urls, 0)
            many = await asyncio.gather(*(client.score_batch([t]) for t in TEXTS[:24]))
            assert [len(m) for m in many] == [1] * 24
            # The blocking client also works from inside a running loop (it runs no event loop).
            with RewardClient(urls, retry=FAST) as blocking:
                assert blocking.score_batch(TEXTS[:24]) == pytest.approx(
                    [m[0] for m in many], rel=1e-4, abs=1e-5
                )
                assert blocking.get_model_version() == 0

    asyncio.run(main())


def test_three_labels_through_the_client(tiny_model_dir_3labels: Path, server_factory) -> None:  # type: ignore[no-untyped-def]
    server = server_factory(tiny_model_dir_3labels)
    texts = TEXTS[:12]
    with RewardClient([server.url], retry=FAST) as client:
        raw = client.score_batch(texts, normalize=False, n_labels=3)
        probs = client.score_batch(texts, normalize=True)
    reference = reference_logits(tiny_model_dir_3labels, texts)
    assert all(isinstance(r, list) and len(r) == 3 for r in raw)
    # pytest.approx does not nest: compare flattened vectors.
    assert [x for r in raw for x in r] == pytest.approx([x for r in reference for x in r], rel=1e-4, abs=1e-4)
    assert all(isinstance(p, list) and len(p) == 3 and sum(p) == pytest.approx(1, abs=1e-5) for p in probs)


def test_batches_are_split_to_the_limit_the_server_names(tiny_model_dir: Path, tmp_path: Path) -> None:
    """A server that takes 8 inputs per request: both clients read that from /model_info and split
    a batch of 100 (no 400), scores in input order and equal to one request per text."""
    server = start_server(tiny_model_dir, tmp_path, extra_args=["--max-items-per-request", "8"])
    try:
        expected = [row[0] for row in reference_logits(tiny_model_dir, TEXTS)]
        with RewardClient(server.url, retry=FAST) as client:
            got = client.score_batch(TEXTS, normalize=False)
        assert all(abs(g - e) < 1e-4 for g, e in zip(got, expected, strict=True))

        async def run() -> list[float]:
            async with AsyncRewardClient(server.url, retry=FAST) as client:
                return await client.score_batch(TEXTS, normalize=False)  # type: ignore[return-value]

        got_async = asyncio.run(run())
        assert all(abs(g - e) < 1e-4 for g, e in zip(got_async, expected, strict=True))
    finally:
        server.stop()
