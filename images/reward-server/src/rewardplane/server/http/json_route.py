"""The routes' request bodies: JSON parsed by pydantic's Rust parser, after the route's rules
(``body_parse.BodyRules``) were applied to the raw bytes, and a body that is not UTF-8 or not
JSON answered with where it breaks. A route class decides the rules (and may refuse the request)
before a byte of the body is read: ``control_route`` checks the bearer token there."""

from __future__ import annotations

import functools
import json
import time
from collections.abc import Callable, Coroutine
from typing import Any

import pydantic_core
from fastapi import HTTPException, Request, Response
from fastapi.routing import APIRoute
from starlette.types import Receive

from rewardplane.server.errors import BadRequest
from rewardplane.server.http.body_parse import BodyParser, BodyRules, check_parsed
from rewardplane.server.http.inputs import Limits
from rewardplane.server.metrics import ServerMetrics


def not_json(raw: bytes, exc: ValueError) -> json.JSONDecodeError:
    """FastAPI's 422 json_invalid for ``raw``, naming where it breaks: the byte that is not UTF-8
    (a Latin-1 client's), else the parser's line and column."""
    try:
        raw.decode("utf-8")
    except UnicodeDecodeError as bad:
        return json.JSONDecodeError(
            f"the body is not UTF-8: byte offset {bad.start} is 0x{raw[bad.start]:02x} ({bad.reason}); "
            "send JSON encoded as UTF-8",
            "",
            bad.start,
        )
    return json.JSONDecodeError(f"the body is not valid JSON: {exc}", "", 0)


class JSONRequest(Request):
    """A request whose JSON body is parsed by pydantic's Rust parser: ~1 ms for a 10 MB text where
    ``json.loads`` holds the event loop for 15-40 ms. The body stays Starlette's joined ``bytes``:
    the parser takes a ``bytearray`` too, but 7-15x slower (a preallocated one cost 15 ms a 10 MB
    body on the loop, where the join costs about 1). A body that would be costly to parse is checked
    against ``rules`` by a helper process first (``body_parse``)."""

    def __init__(self, request: Request, receive: Receive, rules: BodyRules | None) -> None:
        super().__init__(request.scope, receive)
        self.rules = rules

    async def json(self) -> Any:
        if not hasattr(self, "_json"):
            started = time.perf_counter()
            body = await self.body()
            state = self.scope["app"].state
            parser: BodyParser | None = getattr(state, "body_parser", None)
            try:
                if self.rules is None:
                    self._json = pydantic_core.from_json(body)
                elif parser is None:
                    self._json = pydantic_core.from_json(body)
                    check_parsed(self._json, self.rules)
                else:
                    self._json = await parser.parse(body, self.rules)
            except ValueError as exc:  # FastAPI answers a JSONDecodeError with its 422 json_invalid
                raise not_json(body, exc) from exc
            except BadRequest as exc:  # FastAPI turns any other error while reading a body into
                raise HTTPException(400, exc.message) from exc  # "error parsing the body"
            metrics: ServerMetrics | None = getattr(state, "metrics", None)
            if metrics is not None and self.rules is not None and self.rules.limits is not None:
                metrics.parse_stage.observe(time.perf_counter() - started)  # a scoring request's first stage
        return self._json


@functools.lru_cache(maxsize=8)
def _scoring_rules(limits: Limits) -> BodyRules:
    return BodyRules.scoring(limits)


class JSONRoute(APIRoute):
    """A route whose body is a ``JSONRequest`` under scoring's limits (``app.state.limits``)."""

    def prepare(self, request: Request) -> tuple[Receive, BodyRules | None]:
        """Before the body is read: how to read it, and the rules it must meet (or raise)."""
        limits: Limits | None = getattr(request.app.state, "limits", None)
        return request.receive, _scoring_rules(limits) if limits is not None else None

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handler = super().get_route_handler()

        async def handle(request: Request) -> Response:
            receive, rules = self.prepare(request)
            return await handler(JSONRequest(request, receive, rules))

        return handle
