"""Every error the SDK raises on purpose, in one tree under :class:`RewardplaneError`::

    RewardplaneError
    ├── RewardClientError              scoring and HTTP calls to reward servers
    │   ├── RewardServerError          a server answered 4xx/5xx (``status_code``, ``retryable``)
    │   ├── RewardServerUnavailable    every attempt failed transiently (also a ConnectionError)
    │   └── ClientClosedError          the client was used after close() (also a RuntimeError)
    ├── WeightSyncError                a weight push failed (also a RuntimeError)
    │   └── WeightSyncFailed           the operator reported the push Failed (``reason``)
    ├── WeightValidationError          the pushed parameters do not fit; nothing moved (ValueError)
    ├── ClusterError                   the RewardModel is missing or not in the state asked for
    ├── RewardplaneTimeout             a bounded wait ran out (also a TimeoutError)
    ├── CreditAssignmentError          rollouts cannot be turned into weights (also a ValueError)
    ├── JudgeParseError                a judge's answers could not be read as scores (ValueError)
    └── RewardFunctionError            a reward function failed or returned something unusable

The built-in second bases keep ``except ValueError`` / ``except RuntimeError`` /
``except ConnectionError`` / ``except TimeoutError`` code working.

The HTTP-reading helpers that build :class:`RewardServerError` from a reply stay next to it, so
this module needs httpx but not torch.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

import httpx

from rewardplane.protocol.errors import RewardplaneError
from rewardplane.protocol.naming import WeightValidationError

__all__ = [
    "ClientClosedError",
    "ClusterError",
    "CreditAssignmentError",
    "RewardClientError",
    "RewardFunctionError",
    "RewardServerError",
    "RewardServerUnavailable",
    "RewardplaneError",
    "RewardplaneTimeout",
    "WeightSyncError",
    "WeightSyncFailed",
    "WeightValidationError",
]


class RewardClientError(RewardplaneError):
    """Base class of every error the scoring client raises on purpose."""


class RewardServerError(RewardClientError):
    """A reward server answered with an HTTP error status.

    ``message`` is the server's own explanation (its ``error``/``detail`` fields), so a 400 for
    "too many items" tells the caller which limit it hit.
    """

    def __init__(self, status_code: int, message: str, url: str, detail: Any = None) -> None:
        self.status_code = status_code
        self.message = message
        self.url = url
        self.detail = detail
        super().__init__(f"reward server {url} answered {status_code}: {message}")

    @property
    def retryable(self) -> bool:
        return self.status_code >= 500

    @classmethod
    def from_response(cls, response: httpx.Response) -> RewardServerError:
        message, detail = _error_message(response)
        return cls(response.status_code, message, str(response.request.url), detail)


class RewardServerUnavailable(RewardClientError, ConnectionError):
    """Every attempt failed with a transient error (5xx, connection error, timeout)."""

    def __init__(
        self,
        url: str,
        attempts: int,
        last_error: BaseException | None,
        *,
        urls: Sequence[str] = (),
        elapsed_s: float | None = None,
        hint: str | None = None,
    ) -> None:
        self.url = url
        self.urls = list(dict.fromkeys(urls or [url]))  # de-duplicated, order of first try kept
        self.attempts = attempts
        self.last_error = last_error
        self.elapsed_s = elapsed_s
        where = url if len(self.urls) == 1 else f"{url} (tried {', '.join(self.urls)})"
        took = f" in {elapsed_s:.1f}s" if elapsed_s is not None else ""
        hint = hint or (
            "Check that the server is running and reachable (GET /health), or raise "
            "RetryPolicy.max_attempts / request_timeout_s if it is just slow."
        )
        super().__init__(
            f"reward server {where} unavailable after {attempts} attempt(s){took}; last error: "
            f"{_describe(last_error)}. {hint}"
        )


class ClientClosedError(RewardClientError, RuntimeError):
    """The client was used after ``close()``; create a new one."""


class WeightSyncError(RewardplaneError, RuntimeError):
    """A weight push failed; the message says where and what to do."""


class DeltaRefused(WeightSyncError):
    """A replica does not hold the version a delta push builds on (another version, restarted,
    restored or broken); nothing moved. ``WeightPusher`` then pushes everything instead."""


class WeightSyncFailed(WeightSyncError):
    """The operator reported the push Failed; ``reason`` is its CamelCase reason
    (``Timeout``, ``RendezvousFailed``, ...) and ``status`` the WeightSync status it read."""

    def __init__(
        self, message: str, reason: str | None = None, status: Mapping[str, Any] | None = None
    ) -> None:
        super().__init__(message)
        self.reason = reason
        self.status = dict(status or {})


class ClusterError(RewardplaneError, RuntimeError):
    """Talking to the cluster failed, or the RewardModel is not in the state asked for."""


class RewardplaneTimeout(RewardplaneError, TimeoutError):
    """A bounded wait ran out; the message says what was awaited and where to look."""


class CreditAssignmentError(RewardplaneError, ValueError):
    """Rollouts cannot be turned into credit weights (a missing or unusable score); the message
    names the rollout (and step) and what to do."""


class RewardFunctionError(RewardplaneError):
    """A registered reward function raised, or returned something that is not a score; the
    message names the function and the sample."""


def _describe(exc: BaseException | None) -> str:
    if exc is None:
        return "none"
    text = str(exc) or "(no message)"
    return f"{type(exc).__name__}: {text}"


def _error_message(response: httpx.Response) -> tuple[str, Any]:
    """The server's explanation from ``{"error", "detail"}``, OpenAI's ``{"error": {"message"}}`` or
    FastAPI's ``{"detail"}``."""
    try:
        body = response.json()
    except (json.JSONDecodeError, UnicodeDecodeError, ValueError):
        text = response.text.strip()
        return (text[:2000] or response.reason_phrase or "no message"), None
    if not isinstance(body, dict):
        return json.dumps(body)[:2000], body
    error, detail = body.get("error"), body.get("detail")
    if isinstance(error, dict) and "message" in error:  # OpenAI's shape (the server's /v1/... routes)
        return str(error["message"])[:2000], error
    parts: list[str] = []
    if error:
        parts.append(str(error))
    if detail is not None:
        parts.append(_format_detail(detail))
    if not parts:
        parts.append(json.dumps(body)[:2000])
    return ": ".join(parts), detail if detail is not None else error


def _format_detail(detail: Any) -> str:
    # FastAPI's 422 detail is a list of {"loc": [...], "msg": "..."}; name the field for each.
    if isinstance(detail, list) and all(isinstance(d, dict) and "msg" in d for d in detail):
        items = []
        for d in detail:
            loc = ".".join(str(x) for x in d.get("loc", ()) if x != "body")
            items.append(f"{loc}: {d['msg']}" if loc else str(d["msg"]))
        return "; ".join(items)
    if isinstance(detail, str):
        return detail
    return json.dumps(detail)[:2000]


class JudgeParseError(RewardplaneError, ValueError):
    """A generative judge's answers could not be read as scores and no ``default`` was given;
    nothing was written. ``failures`` holds ``(where, answer)`` pairs, e.g. ``("rollout 'r3'", "...")``."""

    def __init__(self, message: str, failures: Sequence[tuple[str, str]] = ()) -> None:
        super().__init__(message)
        self.failures = list(failures)
