"""Retry policy, error classification and message extraction (pure, no sockets)."""

from __future__ import annotations

import asyncio
import random
from collections.abc import Callable

import httpx
import pytest
from hypothesis import given
from hypothesis import strategies as st
from pydantic import ValidationError

from rewardplane.sdk.retry import (
    RetryPolicy,
    RewardServerError,
    RewardServerUnavailable,
    acall_with_retry,
    call_with_retry,
    check_response,
)

URL = "http://127.0.0.9:8001/score"


def reply(status: int, body: object = None, *, text: str | None = None) -> httpx.Response:
    request = httpx.Request("POST", URL)
    if text is not None:
        return httpx.Response(status, text=text, request=request)
    return httpx.Response(status, json=body if body is not None else {}, request=request)


def scripted(*outcomes: httpx.Response | Exception) -> tuple[Callable[[], httpx.Response], list[int]]:
    """A fake HTTP call that plays ``outcomes`` in order and counts its calls."""
    calls: list[int] = []

    def fn() -> httpx.Response:
        calls.append(1)
        outcome = outcomes[min(len(calls), len(outcomes)) - 1]
        if isinstance(outcome, Exception):
            raise outcome
        return outcome

    return fn, calls


def connect_error() -> httpx.ConnectError:
    return httpx.ConnectError("[Errno 111] Connection refused", request=httpx.Request("POST", URL))


# -- policy -----------------------------------------------------------------------------------


def test_defaults() -> None:
    p = RetryPolicy()
    assert (p.max_attempts, p.initial_backoff_s, p.multiplier, p.max_backoff_s) == (4, 0.2, 2.0, 5.0)
    assert [p.base_backoff_s(k) for k in (1, 2, 3)] == pytest.approx([0.2, 0.4, 0.8])
    assert p.max_total_backoff_s() == pytest.approx(1.4)


def test_backoff_is_capped() -> None:
    p = RetryPolicy(initial_backoff_s=1, multiplier=10, max_backoff_s=5, jitter=0)
    assert [p.backoff_s(k) for k in (1, 2, 3, 50, 10_000)] == [1, 5, 5, 5, 5]


@given(
    st.floats(0, 2),
    st.floats(1, 4),
    st.floats(0, 1),
    st.integers(1, 60),
    st.integers(0, 2**32 - 1),
)
def test_jittered_backoff_stays_in_bounds(
    initial: float, multiplier: float, jitter: float, attempt: int, seed: int
) -> None:
    p = RetryPolicy(initial_backoff_s=initial, multiplier=multiplier, max_backoff_s=5, jitter=jitter)
    base = p.base_backoff_s(attempt)
    wait = p.backoff_s(attempt, random.Random(seed))
    assert 0 <= wait <= p.max_backoff_s
    assert base * (1 - jitter) - 1e-9 <= wait <= base * (1 + jitter) + 1e-9


def test_invalid_policies_are_rejected() -> None:
    with pytest.raises(ValidationError):
        RetryPolicy(max_attempts=0)
    with pytest.raises(ValidationError, match="below initial_backoff_s"):
        RetryPolicy(initial_backoff_s=2, max_backoff_s=1)
    with pytest.raises(ValidationError):
        RetryPolicy(jitter=1.5)


def test_worst_case_bounds_a_call() -> None:
    p = RetryPolicy(max_attempts=3, jitter=0)
    assert p.worst_case_s(10) == pytest.approx(3 * 10 + 0.2 + 0.4)
    assert RetryPolicy(max_attempts=3, deadline_s=1).worst_case_s(10) == pytest.approx(11)


@pytest.mark.parametrize(
    ("exc", "retryable"),
    [
        (RewardServerError(500, "boom", URL), True),
        (RewardServerError(503, "busy", URL), True),
        (RewardServerError(400, "bad", URL), False),
        (RewardServerError(404, "nope", URL), False),
        (RewardServerError(422, "invalid", URL), False),
        (connect_error(), True),
        (httpx.ReadTimeout("slow"), True),
        (httpx.RemoteProtocolError("server hung up"), True),
        (ValueError("a bug"), False),
    ],
)
def test_what_is_retried(exc: Exception, retryable: bool) -> None:
    assert RetryPolicy().is_retryable(exc) is retryable


def test_timeouts_can_be_excluded() -> None:
    assert RetryPolicy(retry_on_timeout=False).is_retryable(httpx.ReadTimeout("slow")) is False


def test_failover_only_when_the_request_never_arrived() -> None:
    assert RetryPolicy.should_failover(connect_error())
    assert RetryPolicy.should_failover(httpx.ConnectTimeout("no SYN-ACK"))
    assert not RetryPolicy.should_failover(httpx.ReadTimeout("slow"))
    assert not RetryPolicy.should_failover(RewardServerError(503, "busy", URL))


# -- server messages --------------------------------------------------------------------------


def test_error_message_from_rewardplane_body() -> None:
    err = RewardServerError.from_response(
        reply(400, {"error": "too many items", "detail": "got 600 inputs, max_items_per_request is 512"})
    )
    assert err.status_code == 400 and err.url == URL
    assert err.message == "too many items: got 600 inputs, max_items_per_request is 512"
    assert "too many items" in str(err) and URL in str(err) and "400" in str(err)


def test_error_message_from_fastapi_detail() -> None:
    err = RewardServerError.from_response(reply(404, {"detail": "Not Found"}))
    assert err.message == "Not Found"


def test_error_message_from_fastapi_validation_list() -> None:
    body = {"detail": [{"loc": ["body", "input"], "msg": "Field required", "type": "missing"}]}
    err = RewardServerError.from_response(reply(422, body))
    assert err.message == "input: Field required"
    assert err.detail == body["detail"]


def test_error_message_from_openai_shape() -> None:
    # the server's /v1/... routes answer OpenAI's shape; the SDK's chat() goes there
    body = {
        "error": {
            "message": "stream is not supported",
            "type": "invalid_request_error",
            "param": None,
            "code": 400,
        }
    }
    err = RewardServerError.from_response(reply(400, body))
    assert err.message == "stream is not supported"
    assert err.detail == body["error"]


def test_error_message_from_plain_text() -> None:
    assert RewardServerError.from_response(reply(502, text="Bad Gateway\n")).message == "Bad Gateway"


def test_check_response_passes_success() -> None:
    ok = reply(200, {"x": 1})
    assert check_response(ok) is ok


def test_unavailable_message_names_url_attempts_and_cause() -> None:
    err = RewardServerUnavailable(URL, 4, connect_error(), urls=[URL, URL, "http://b:1"], elapsed_s=1.25)
    text = str(err)
    assert URL in text and "http://b:1" in text and "4 attempt" in text and "Connection refused" in text
    assert "1.2s" in text
    assert err.urls == [URL, "http://b:1"]
    assert isinstance(err, ConnectionError)


# -- the loop (tenacity) ----------------------------------------------------------------------


def test_5xx_twice_then_success() -> None:
    fn, calls = scripted(reply(503, {"error": "busy"}), reply(503, {"error": "busy"}), reply(200, {"ok": 1}))
    sleeps: list[float] = []
    resp = call_with_retry(RetryPolicy(jitter=0), fn, url=URL, sleep=sleeps.append)
    assert resp.json() == {"ok": 1}
    assert len(calls) == 3
    assert sleeps == pytest.approx([0.2, 0.4])


def test_4xx_is_not_retried_and_carries_the_message() -> None:
    fn, calls = scripted(reply(400, {"error": "input is empty", "detail": "send at least one text"}))
    sleeps: list[float] = []
    with pytest.raises(RewardServerError) as info:
        call_with_retry(RetryPolicy(), fn, url=URL, sleep=sleeps.append)
    assert len(calls) == 1 and sleeps == []
    assert info.value.status_code == 400
    assert "input is empty: send at least one text" in str(info.value)


def test_exhaustion_raises_unavailable() -> None:
    fn, calls = scripted(connect_error())
    sleeps: list[float] = []
    with pytest.raises(RewardServerUnavailable) as info:
        call_with_retry(RetryPolicy(max_attempts=3, jitter=0), fn, url=URL, sleep=sleeps.append)
    assert len(calls) == 3 and sleeps == pytest.approx([0.2, 0.4])
    assert info.value.attempts == 3 and info.value.url == URL
    assert isinstance(info.value.last_error, httpx.ConnectError)
    assert isinstance(info.value.__cause__, httpx.ConnectError)


def test_exhaustion_on_5xx_keeps_the_server_message() -> None:
    fn, _ = scripted(reply(500, {"error": "CUDA out of memory"}))
    with pytest.raises(RewardServerUnavailable, match="CUDA out of memory"):
        call_with_retry(RetryPolicy(max_attempts=2), fn, url=URL, sleep=lambda _: None)


def test_no_retry_policy_tries_once() -> None:
    fn, calls = scripted(reply(503, {}))
    with pytest.raises(RewardServerUnavailable):
        call_with_retry(RetryPolicy.no_retry(), fn, url=URL, sleep=lambda _: None)
    assert len(calls) == 1


def test_unexpected_exceptions_propagate_unchanged() -> None:
    fn, calls = scripted(KeyError("bug"))
    with pytest.raises(KeyError):
        call_with_retry(RetryPolicy(), fn, url=URL, sleep=lambda _: None)
    assert len(calls) == 1


def test_async_loop_matches_sync() -> None:
    fn, calls = scripted(reply(502, text="bad gateway"), connect_error(), reply(200, {"v": 2}))
    sleeps: list[float] = []

    async def sleep(s: float) -> None:
        sleeps.append(s)

    async def afn() -> httpx.Response:
        return fn()

    resp = asyncio.run(acall_with_retry(RetryPolicy(jitter=0), afn, url=URL, sleep=sleep))
    assert resp.json() == {"v": 2} and len(calls) == 3
    assert sleeps == pytest.approx([0.2, 0.4])

    fn4, calls4 = scripted(reply(409, {"detail": "version conflict"}))

    async def afn4() -> httpx.Response:
        return fn4()

    with pytest.raises(RewardServerError, match="version conflict"):
        asyncio.run(acall_with_retry(RetryPolicy(), afn4, url=URL, sleep=sleep))
    assert len(calls4) == 1
