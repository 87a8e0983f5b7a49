"""Errors the server turns into HTTP answers, and the one shape every error body has.

Bad input is a 4xx with a message, never a 500. Every error — the server's own, FastAPI's
validation errors, Starlette's 404/405 — answers ``ErrorResponse`` (``{"error": ..., "detail": ...}``),
with the message and the detail capped: an error about 100,000 bad names stays a few kilobytes.
The one exception: under ``/v1/`` (the routes the ``openai`` package calls) errors take OpenAI's
shape, ``{"error": {"message", "type", "param", "code"}}``, the only one whose message it shows.
"""

from __future__ import annotations

from typing import Any

from fastapi.responses import JSONResponse

from rewardplane.protocol import Endpoints, ErrorResponse, OpenAIError, OpenAIErrorResponse

MAX_MESSAGE_CHARS = 2000
MAX_DETAIL_ITEMS = 20
MAX_DETAIL_STRING_CHARS = 500
MAX_DETAIL_DEPTH = 4


class ServerError(Exception):
    status_code = 500

    def __init__(self, message: str, *, detail: object = None) -> None:
        super().__init__(message)
        self.message = message
        self.detail = detail


class BadRequest(ServerError):
    status_code = 400


class Unauthorized(ServerError):
    status_code = 401


class Forbidden(ServerError):
    status_code = 403


class Conflict(ServerError):
    status_code = 409


class PayloadTooLarge(ServerError):
    status_code = 413


class Unavailable(ServerError):
    """The replica cannot score right now (e.g. a streamed weight update failed part-way)."""

    status_code = 503


def _cut(text: str, limit: int) -> str:
    return text if len(text) <= limit else f"{text[:limit]}… ({len(text) - limit} more characters)"


def cap_detail(detail: Any, depth: int = 0) -> Any:
    """``detail`` with long lists cut to their first items (plus a count of the rest), long strings
    cut, and nesting bounded: what a client needs to fix its request, not a copy of it."""
    if isinstance(detail, str):
        return _cut(detail, MAX_DETAIL_STRING_CHARS)
    if detail is None or isinstance(detail, bool | int | float):
        return detail
    if depth >= MAX_DETAIL_DEPTH:
        return _cut(repr(detail), MAX_DETAIL_STRING_CHARS)
    if isinstance(detail, dict):
        items = list(detail.items())
        out = {str(k): cap_detail(v, depth + 1) for k, v in items[:MAX_DETAIL_ITEMS]}
        if len(items) > MAX_DETAIL_ITEMS:
            out["…"] = f"{len(items) - MAX_DETAIL_ITEMS} more entries"
        return out
    if isinstance(detail, list | tuple):
        capped = [cap_detail(v, depth + 1) for v in detail[:MAX_DETAIL_ITEMS]]
        if len(detail) > MAX_DETAIL_ITEMS:
            capped.append(f"… and {len(detail) - MAX_DETAIL_ITEMS} more")
        return capped
    return _cut(str(detail), MAX_DETAIL_STRING_CHARS)


def error_body(message: str, detail: object = None) -> dict[str, Any]:
    return ErrorResponse(error=_cut(message, MAX_MESSAGE_CHARS), detail=cap_detail(detail)).model_dump(
        mode="json"
    )


# OpenAI's error types by status (what its own API answers); anything else is a server_error.
_OPENAI_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    408: "timeout_error",
    409: "conflict_error",
    413: "invalid_request_error",
    422: "invalid_request_error",
}


def openai_error_body(status_code: int, message: str, detail: object = None) -> dict[str, Any]:
    """OpenAI's ``{"error": {"message", "type", "param", "code"}}``; ``param`` names the first
    request field a validation error is about, ``code`` is the HTTP status (as vLLM answers)."""
    param = None
    if isinstance(detail, list) and detail and isinstance(detail[0], dict):
        # the request field, as OpenAI's param names one (pydantic adds union variants after it)
        loc = [str(x) for x in detail[0].get("loc", ()) if x != "body"]
        param = loc[0] if loc else None
    error = OpenAIError(
        message=_cut(message, MAX_MESSAGE_CHARS),
        type=_OPENAI_TYPES.get(
            status_code, "server_error" if status_code >= 500 else "invalid_request_error"
        ),
        param=param,
        code=status_code,
    )
    return OpenAIErrorResponse(error=error).model_dump(mode="json")


def speaks_openai(path: str) -> bool:
    """Under ``/v1/`` (the drop-in routes an ``openai`` client calls) errors take OpenAI's shape."""
    return path.startswith(Endpoints.V1_PREFIX + "/")


def error_response(status_code: int, message: str, detail: object = None, *, path: str = "") -> JSONResponse:
    """The error answer for a request to ``path``: ``ErrorResponse``, or OpenAI's shape under /v1/."""
    body = (
        openai_error_body(status_code, message, detail)
        if speaks_openai(path)
        else error_body(message, detail)
    )
    return JSONResponse(body, status_code=status_code)
