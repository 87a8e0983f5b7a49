"""The token-protected routes' requests, decided before a byte of the body is read: the bearer
token first (an anonymous 10 MB body costs the event loop nothing), then the body's size from
``Content-Length`` (and while it streams in), then, once read, its JSON arrays and objects
counted before it is parsed on the loop (``body_parse``). A control body is a few numbers and
names, or an announce of the served model's parameters: its caps follow from that."""

from __future__ import annotations

import hmac
from collections.abc import Callable
from dataclasses import dataclass

from fastapi import Request
from starlette.types import Receive

from rewardplane.protocol import Endpoints
from rewardplane.server.errors import Forbidden, PayloadTooLarge, Unauthorized
from rewardplane.server.http.body_parse import BodyRules
from rewardplane.server.http.json_route import JSONRoute
from rewardplane.server.http.request_body import capped_receive, content_length

# Every control body but an announce: a few numbers and names.
SMALL_BODY_BYTES = 64 * 1024
SMALL_BODY_CONTAINERS = 256
# One announced parameter: a name of hundreds of characters, its shape, and a piece per sending
# rank (pieces of a sharded push) fit in 2 KiB and 20 arrays and objects.
PARAM_BYTES = 2048
PARAM_CONTAINERS = 20


@dataclass(frozen=True)
class ControlBodyCap:
    """The most a control route's body may hold, and what the refusals say."""

    path: str
    max_bytes: int
    max_containers: int
    takes: str  # what the route's body is, for the messages

    def too_large(self, size: str) -> str:
        return (
            f"the {self.path} body is {size} bytes; this route takes at most {self.max_bytes} "
            f"({self.takes}): send only the fields the route documents (GET /docs)"
        )

    @property
    def rules(self) -> BodyRules:
        return BodyRules(
            None,
            self.max_containers,
            f"the {self.path} body holds more than {self.max_containers} JSON arrays and objects; this "
            f"route takes at most that many ({self.takes}): send only the fields the route documents (GET /docs)",
        )


def control_body_cap(path: str, parameters: int) -> ControlBodyCap:
    """``path``'s cap; ``parameters``: how many the served model has (an announce names each once)."""
    if path == Endpoints.UPDATE_PARAM_BATCH:
        return ControlBodyCap(
            path,
            SMALL_BODY_BYTES + parameters * PARAM_BYTES,
            SMALL_BODY_CONTAINERS + parameters * PARAM_CONTAINERS,
            f"an announce of at most the served model's {parameters} parameters",
        )
    return ControlBodyCap(path, SMALL_BODY_BYTES, SMALL_BODY_CONTAINERS, "a few numbers and names")


def check_token(token: str | None, request: Request) -> None:
    """``Authorization: Bearer <token>``, or the 401/403 that says what to send."""
    if token is None:
        raise Forbidden(
            "the weight-sync control plane is disabled: start the server with REWARDPLANE_TOKEN or --token-file"
        )
    header = request.headers.get("authorization", "")
    scheme, _, given = header.partition(" ")
    if scheme.lower() != "bearer" or not given:
        raise Unauthorized("missing bearer token: send 'Authorization: Bearer <token>' (REWARDPLANE_TOKEN)")
    if not hmac.compare_digest(given.strip().encode(), token.encode()):
        raise Unauthorized("wrong bearer token: use the token this server was started with")


def control_route(token: str | None, parameters: Callable[[], int]) -> type[JSONRoute]:
    """The route class of a token-protected router; ``parameters``: the served model's count."""

    class ControlRoute(JSONRoute):
        def prepare(self, request: Request) -> tuple[Receive, BodyRules | None]:
            check_token(token, request)
            cap = control_body_cap(self.path, parameters())
            length = content_length(request.scope)
            if length is not None and length > cap.max_bytes:
                raise PayloadTooLarge(cap.too_large(str(length)))
            return capped_receive(
                request.receive, cap.max_bytes, cap.too_large(f"more than {cap.max_bytes}")
            ), cap.rules

    return ControlRoute
