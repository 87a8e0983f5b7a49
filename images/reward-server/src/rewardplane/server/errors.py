"""Errors the server turns into HTTP answers. Bad input is a 4xx with a message, never a 500."""

from __future__ import annotations


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


class Conflict(ServerError):
    status_code = 409


class Unavailable(ServerError):
    """The replica cannot score right now (e.g. a streamed weight update failed part-way)."""

    status_code = 503
