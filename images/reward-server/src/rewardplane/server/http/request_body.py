"""Request bodies, before any route sees them: the size limit, and large bodies read one at a time.

The event loop handles every byte of a body (parsing it: httptools, or h11 where that is missing,
see ``http_stack``; copying it into uvicorn's buffer and the app's), so a client streaming 10 MB
bodies makes the loop busy for as long as those bytes arrive. Read one at a time, large bodies
cost the loop what one client costs, however many clients send them: the others' bytes wait in
the kernel (uvicorn stops reading a request the app does not consume), and ``/health`` and small
scoring requests, which never queue here, are served between the chunks.
"""

from __future__ import annotations

import asyncio

from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from rewardplane.server.errors import error_response

# A scoring request of 32 texts of a few KB is far below this; a body above it is read alone.
LARGE_BODY_BYTES = 1 << 20
# How long a large body may wait for its turn, and then take to arrive once reading it started.
LARGE_BODY_WAIT_S = 30.0
LARGE_BODY_READ_S = 60.0


def content_length(scope: Scope) -> int | None:
    for name, value in scope.get("headers", ()):
        if name == b"content-length" and value.isdigit():
            return int(value)
    return None


def is_large(scope: Scope, large_bytes: int) -> bool:
    """A body over ``large_bytes``, or one of unknown length (chunked), which may be as large."""
    length = content_length(scope)
    if length is not None:
        return length > large_bytes
    return any(name == b"transfer-encoding" for name, _ in scope.get("headers", ()))


class BodyLimitMiddleware:
    """413 for a request body over ``max_bytes``, decided before the body is parsed: at once from
    ``Content-Length`` (nothing read), else while the body streams in. Bodies over ``large_bytes``
    are read one at a time: one waits at most ``wait_s`` for its turn (then 503, retry), and must
    arrive within ``read_s`` once its turn came (then 408), so a client that stalls mid-body cannot
    hold the others back for longer."""

    def __init__(
        self,
        app: ASGIApp,
        max_bytes: int,
        *,
        large_bytes: int = LARGE_BODY_BYTES,
        wait_s: float = LARGE_BODY_WAIT_S,
        read_s: float = LARGE_BODY_READ_S,
    ) -> None:
        self.app = app
        self.max_bytes = max_bytes
        self.large_bytes = large_bytes
        self.wait_s = wait_s
        self.read_s = read_s
        self._turn: asyncio.Lock | None = None  # made on the server's loop, at the first request

    def _message(self, size: str) -> str:
        return (
            f"the request body is {size} bytes; this server takes at most {self.max_bytes} "
            "(--max-request-bytes): send fewer or shorter inputs per request"
        )

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        length = content_length(scope)
        if length is not None and length > self.max_bytes:
            await error_response(413, self._message(str(length)), path=scope["path"])(scope, receive, send)
            return
        if not is_large(scope, self.large_bytes):
            await self.app(scope, self._counted(receive), send)
            return
        if self._turn is None:
            self._turn = asyncio.Lock()
        turn = _Turn(self._turn, self.large_bytes, self.wait_s, self.read_s)
        try:
            await self.app(scope, self._counted(turn.receive_with(receive)), send)
        finally:
            turn.release()

    def _counted(self, receive: Receive) -> Receive:
        return capped_receive(receive, self.max_bytes, self._message(f"more than {self.max_bytes}"))


def capped_receive(receive: Receive, max_bytes: int, message: str) -> Receive:
    """``receive``, refusing (413, ``message``) a body that streams in past ``max_bytes``."""
    seen = 0

    async def counted_receive() -> Message:
        nonlocal seen
        message_in = await receive()
        if message_in["type"] == "http.request":
            seen += len(message_in.get("body", b""))
            if seen > max_bytes:
                # An HTTPException reaches the app's handler as it is (FastAPI turns other
                # errors while reading the body into a 400).
                raise HTTPException(413, message)
        return message_in

    return counted_receive


class _Turn:
    """One large body's turn at the loop: taken at its first read, given back when the body is
    complete (or the request ends), so parsing and scoring it never hold the others back."""

    def __init__(self, lock: asyncio.Lock, large_bytes: int, wait_s: float, read_s: float) -> None:
        self.lock = lock
        self.large_bytes = large_bytes
        self.wait_s = wait_s
        self.read_s = read_s
        self.holding = False
        self.done = False
        self.deadline = 0.0

    def release(self) -> None:
        self.done = True
        if self.holding:
            self.holding = False
            self.lock.release()

    def receive_with(self, receive: Receive) -> Receive:
        async def receive_in_turn() -> Message:
            if self.done:  # the body is in; later reads only wait for a disconnect
                return await receive()
            loop = asyncio.get_running_loop()
            if not self.holding:
                try:
                    await asyncio.wait_for(self.lock.acquire(), self.wait_s)
                except asyncio.TimeoutError:
                    self.done = True
                    raise HTTPException(
                        503,
                        f"other large request bodies (over {self.large_bytes} bytes) kept this server "
                        f"busy for {self.wait_s:.0f} s: retry later, or send smaller requests",
                        headers={"Retry-After": "5"},
                    ) from None
                self.holding = True
                self.deadline = loop.time() + self.read_s
            try:
                message = await asyncio.wait_for(receive(), max(0.0, self.deadline - loop.time()))
            except asyncio.TimeoutError:
                self.release()
                raise HTTPException(
                    408, f"the request body did not arrive within {self.read_s:.0f} s: send it at once"
                ) from None
            if message["type"] != "http.request" or not message.get("more_body", False):
                self.release()
            return message

        return receive_in_turn
