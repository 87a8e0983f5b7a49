"""Retry policy and client errors for calls to reward servers.

What is retried: 5xx replies, connection errors and timeouts — transient by nature (a server
restarting, overloaded, or swapping weights). What is not: 4xx replies — the request itself is
wrong and would fail identically again; the caller gets the server's message at once.

The retry loop itself is ``tenacity`` (sync and async from one policy); this module only decides
*what* is retryable and *how long* to wait, both as pure, unit-testable functions.
"""

from __future__ import annotations

import random
from collections.abc import Awaitable, Callable
from typing import Any

import httpx
import tenacity
from pydantic import BaseModel, ConfigDict, Field, model_validator

# The errors live in the SDK's one exception tree; imported here for the retry decisions and for
# code that imports them from this module.
from ._exceptions import RewardClientError, RewardServerError, RewardServerUnavailable

__all__ = [
    "RetryPolicy",
    "RewardClientError",
    "RewardServerError",
    "RewardServerUnavailable",
    "acall_with_retry",
    "call_with_retry",
    "check_response",
]

# --------------------------------------------------------------------------------------------
# Policy
# --------------------------------------------------------------------------------------------


class RetryPolicy(BaseModel):
    """How a client retries transient failures.

    Attempt ``k`` (1-based) that fails transiently is followed by a wait of
    ``min(max_backoff_s, initial_backoff_s * multiplier ** (k - 1))``, scaled by a random factor in
    ``[1 - jitter, 1 + jitter]`` (so many trainers hitting one recovering server do not retry in
    lock step) and capped at ``max_backoff_s`` again.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    max_attempts: int = Field(default=4, ge=1, description="Total tries, the first included.")
    initial_backoff_s: float = Field(default=0.2, ge=0)
    multiplier: float = Field(default=2.0, ge=1)
    max_backoff_s: float = Field(default=5.0, ge=0)
    jitter: float = Field(default=0.1, ge=0, le=1, description="Relative spread of each wait.")
    deadline_s: float | None = Field(
        default=None, gt=0, description="No new attempt starts once this much time has passed."
    )
    retry_on_timeout: bool = True
    failover: bool = Field(
        default=True,
        description="On a connection error (the request never reached the server) move the retry "
        "to the next endpoint; 5xx and timeouts retry the same endpoint.",
    )

    @model_validator(mode="after")
    def _backoff_order(self) -> RetryPolicy:
        if self.max_backoff_s < self.initial_backoff_s:
            raise ValueError(
                f"max_backoff_s ({self.max_backoff_s}) is below initial_backoff_s ({self.initial_backoff_s})"
            )
        return self

    @classmethod
    def no_retry(cls) -> RetryPolicy:
        return cls(max_attempts=1)

    # -- pure decisions ------------------------------------------------------------------------

    def base_backoff_s(self, attempt: int) -> float:
        """Wait after failed attempt ``attempt`` (1-based), before jitter."""
        if attempt < 1:
            raise ValueError(f"attempt numbers start at 1, got {attempt}")
        try:
            raw = self.initial_backoff_s * self.multiplier ** (attempt - 1)
        except OverflowError:
            raw = self.max_backoff_s
        return min(self.max_backoff_s, raw)

    def backoff_s(self, attempt: int, rng: random.Random | None = None) -> float:
        """Wait after failed attempt ``attempt`` (1-based), jitter applied, within ``[0, max]``."""
        base = self.base_backoff_s(attempt)
        if self.jitter:
            base *= 1 + self.jitter * (2 * (rng or random).random() - 1)
        return max(0.0, min(self.max_backoff_s, base))

    def max_total_backoff_s(self) -> float:
        """Upper bound of all waits together (for bounding callers' own timeouts)."""
        return sum(self.base_backoff_s(k) for k in range(1, self.max_attempts))

    def worst_case_s(self, attempt_timeout_s: float) -> float:
        """Upper bound of one retried call when each attempt takes at most ``attempt_timeout_s``."""
        bound = self.max_attempts * attempt_timeout_s + self.max_total_backoff_s()
        if self.deadline_s is not None:
            bound = min(bound, self.deadline_s + attempt_timeout_s)
        return bound

    def is_retryable(self, exc: BaseException) -> bool:
        if isinstance(exc, RewardServerError):
            return exc.retryable
        if isinstance(exc, httpx.TimeoutException):
            # PoolTimeout is local queueing, not a server fault, but it is transient all the same.
            return self.retry_on_timeout
        # ConnectError, ReadError, RemoteProtocolError (server died mid-reply), ...
        return isinstance(exc, httpx.TransportError)

    @staticmethod
    def should_failover(exc: BaseException) -> bool:
        """True when the request certainly never reached the server (safe to send elsewhere)."""
        return isinstance(exc, httpx.ConnectError | httpx.ConnectTimeout)

    # -- tenacity plumbing ---------------------------------------------------------------------

    def _stop(self) -> tenacity.stop.stop_base:
        stop: tenacity.stop.stop_base = tenacity.stop_after_attempt(self.max_attempts)
        if self.deadline_s is not None:
            stop = stop | tenacity.stop_after_delay(self.deadline_s)
        return stop

    def _wait(self, retry_state: tenacity.RetryCallState) -> float:
        return self.backoff_s(retry_state.attempt_number)

    def _retry(self) -> tenacity.retry_base:
        return tenacity.retry_if_exception(self.is_retryable)

    def retrying(self, *, sleep: Callable[[float], None] | None = None) -> tenacity.Retrying:
        """A fresh synchronous tenacity controller. Exhaustion raises ``tenacity.RetryError``;
        a non-retryable error propagates unchanged."""
        kwargs: dict[str, Any] = {} if sleep is None else {"sleep": sleep}
        return tenacity.Retrying(stop=self._stop(), wait=self._wait, retry=self._retry(), **kwargs)

    def async_retrying(
        self, *, sleep: Callable[[float], Awaitable[None]] | None = None
    ) -> tenacity.AsyncRetrying:
        """The asynchronous counterpart of :meth:`retrying` (waits with ``asyncio.sleep``)."""
        kwargs: dict[str, Any] = {} if sleep is None else {"sleep": sleep}
        return tenacity.AsyncRetrying(stop=self._stop(), wait=self._wait, retry=self._retry(), **kwargs)


def check_response(response: httpx.Response) -> httpx.Response:
    """Raise :class:`RewardServerError` for a 4xx/5xx reply; return the response otherwise."""
    if response.is_error:
        raise RewardServerError.from_response(response)
    return response


def call_with_retry(
    policy: RetryPolicy,
    fn: Callable[[], httpx.Response],
    *,
    url: str,
    sleep: Callable[[float], None] | None = None,
) -> httpx.Response:
    """Run one synchronous HTTP call under ``policy``; map exhaustion to ``RewardServerUnavailable``.

    ``fn`` returns the response; error statuses are turned into :class:`RewardServerError` here
    (so 5xx are retried and 4xx raised with the server's message).
    """
    attempts = 0
    try:
        for attempt in policy.retrying(sleep=sleep):
            with attempt:
                attempts += 1
                return check_response(fn())
    except tenacity.RetryError as err:
        last = err.last_attempt.exception()
        raise RewardServerUnavailable(url, attempts, last) from last
    raise AssertionError("unreachable: tenacity either returns, raises or gives RetryError")


async def acall_with_retry(
    policy: RetryPolicy,
    fn: Callable[[], Awaitable[httpx.Response]],
    *,
    url: str,
    sleep: Callable[[float], Awaitable[None]] | None = None,
) -> httpx.Response:
    """The asynchronous counterpart of :func:`call_with_retry`."""
    attempts = 0
    try:
        async for attempt in policy.async_retrying(sleep=sleep):
            with attempt:
                attempts += 1
                return check_response(await fn())
    except tenacity.RetryError as err:
        last = err.last_attempt.exception()
        raise RewardServerUnavailable(url, attempts, last) from last
    raise AssertionError("unreachable: tenacity either returns, raises or gives RetryError")
