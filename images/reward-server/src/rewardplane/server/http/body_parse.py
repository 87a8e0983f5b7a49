"""Parsing request bodies without holding the event loop for a body the server will refuse.

Every JSON parser holds the GIL while it builds Python objects (pydantic's takes 40-60 ms for a
2 MB body of 200,000 token-id lists), so a thread does not free the loop: measured, parsing on a
thread stalled a 1 ms sleep on the main thread for 290 ms. So:

- a body whose parse is cheap (small, or with few arrays, objects and commas, counted in C on the
  raw bytes: ~1 ms per MB) is parsed on the loop, as before;
- any other body is parsed first by a helper process (``python -m rewardplane.server.http.body_parse``,
  started on first need, one body at a time) that applies the limits a request must meet
  (``check_body_shape``) and answers the 400's message or nothing. Only a body that passes is parsed
  on the loop, and its cost is bounded by the server's limits (inputs, tokens, arrays and objects).

If the helper cannot run, bodies are parsed on the loop as before (logged once)."""

from __future__ import annotations

import asyncio
import logging
import struct
import sys
from typing import Any

import pydantic_core

from rewardplane.server.errors import BadRequest
from rewardplane.server.http.inputs import Limits, check_items

log = logging.getLogger(__name__)

# Parsed on the loop whatever they hold: 64 KiB of the costliest JSON ("[]," repeated) parses in ~3 ms.
SMALL_BODY_BYTES = 64 * 1024
# Sent to the helper without counting (counting costs the loop ~1 ms per MB).
LARGE_BODY_BYTES = 4 * 1024 * 1024
# The loop's parse budget, in the units of ``_parse_cost``: ~70 ns each, so about 7 ms.
LOOP_PARSE_COST = 100_000
# How long the helper may take for one body (a 4 MiB body parses in well under a second).
HELPER_TIMEOUT_S = 30.0
_HEADER = struct.Struct("!QQQQ")  # max_items, max_tokens, max_input_bytes, body length
_REPLY = struct.Struct("!I")


def container_budget(limits: Limits) -> int:
    """The arrays and objects a request within the limits can need, generously: a few per input
    (a token-id list, a chat message and its parts) and per token (a message per token at most)."""
    return 4 * (limits.max_items + limits.max_tokens) + 1024


def check_body_shape(body: Any, limits: Limits) -> None:
    """Too many inputs, or one token-id prompt longer than the model takes, refused from the parsed
    JSON in microseconds: validating 200,000 token-id lists against the request model held the event
    loop for about a second before the same 400 (and /health with it)."""
    if not isinstance(body, dict):
        return
    for key in ("input", "inputs", "query"):
        value = body.get(key)
        if not isinstance(value, list) or not value:
            continue
        if isinstance(value[0], int) and not isinstance(value[0], bool):  # one prompt of token ids
            cut = body.get("truncate") or body.get("truncate_prompt_tokens") is not None
            if len(value) > limits.max_tokens and not cut:
                raise BadRequest(
                    f"{key} is one prompt of {len(value)} token ids; this server takes at most {limits.max_tokens} "
                    "(--max-model-len): shorten it, or ask for truncation (truncate_prompt_tokens)"
                )
        else:
            check_items(len(value), limits)


def _count_containers(body: Any, stop_at: int) -> int:
    """Arrays and objects in a parsed body, counted up to just past ``stop_at``."""
    n, stack = 0, [body]
    while stack and n <= stop_at:
        value = stack.pop()
        if isinstance(value, list):
            n += 1
            stack.extend(v for v in value if isinstance(v, list | dict))
        elif isinstance(value, dict):
            n += 1
            stack.extend(v for v in value.values() if isinstance(v, list | dict))
    return n


def body_problem(raw: bytes, limits: Limits) -> str | None:
    """What the helper decides: the 400's message for a body over the limits, else None (a body
    that is not JSON included: the loop's parse answers it, with FastAPI's 422)."""
    try:
        body = pydantic_core.from_json(raw)
    except ValueError:
        return None
    try:
        check_body_shape(body, limits)
    except BadRequest as exc:
        return exc.message
    budget = container_budget(limits)
    if _count_containers(body, budget) > budget:
        return (
            f"the request body holds more than {budget} JSON arrays and objects; a request this server takes "
            f"needs fewer (it takes at most {limits.max_items} inputs of at most {limits.max_tokens} tokens: "
            "--max-items-per-request, --max-model-len): send fewer or smaller inputs, and no other arrays"
        )
    return None


def _parse_cost(raw: bytes) -> int:
    """An upper bound on the parse's work: containers cost about four scalars (brackets or commas
    inside strings only overcount, sending a cheap body to the helper needlessly)."""
    return 4 * (raw.count(b"[") + raw.count(b"{")) + raw.count(b",")


class BodyParser:
    """``parse``: a request body's JSON, refused (``BadRequest``) by the helper process where
    parsing it on the loop could be costly and the body breaks the limits."""

    def __init__(self) -> None:
        self._proc: asyncio.subprocess.Process | None = None
        self._lock = asyncio.Lock()
        self._broken = False

    async def parse(self, raw: bytes, limits: Limits | None) -> Any:
        if limits is not None and self._costly(raw):
            problem = await self._ask(raw, limits)
            if problem:
                raise BadRequest(problem)
        body = pydantic_core.from_json(raw)  # ValueError: the caller answers FastAPI's 422
        if limits is not None:
            check_body_shape(body, limits)
        return body

    def _costly(self, raw: bytes) -> bool:
        if len(raw) <= SMALL_BODY_BYTES or self._broken:
            return False
        return len(raw) > LARGE_BODY_BYTES or _parse_cost(raw) > LOOP_PARSE_COST

    async def _ask(self, raw: bytes, limits: Limits) -> str | None:
        async with self._lock:  # one body at a time: a flood queues here, not on the loop
            for attempt in (1, 2):
                try:
                    proc = await self._helper()
                    assert proc.stdin is not None and proc.stdout is not None
                    proc.stdin.write(
                        _HEADER.pack(limits.max_items, limits.max_tokens, limits.max_input_bytes, len(raw))
                    )
                    proc.stdin.write(raw)
                    # a wedged helper is replaced, like a dead one
                    return await asyncio.wait_for(_answer(proc), HELPER_TIMEOUT_S)
                except (OSError, asyncio.IncompleteReadError, asyncio.TimeoutError) as exc:
                    self._stop_helper()
                    if attempt == 2:
                        self._broken = True
                        log.error(
                            "the body-parsing helper failed (%s); large bodies are parsed on the loop", exc
                        )
        return None

    async def _helper(self) -> asyncio.subprocess.Process:
        if self._proc is None or self._proc.returncode is not None:
            self._proc = await asyncio.create_subprocess_exec(
                sys.executable,
                "-m",
                __name__,
                stdin=asyncio.subprocess.PIPE,
                stdout=asyncio.subprocess.PIPE,
                limit=1 << 20,
            )
        return self._proc

    def _stop_helper(self) -> None:
        proc, self._proc = self._proc, None
        if proc is not None and proc.returncode is None:
            proc.kill()

    async def close(self) -> None:
        proc, self._proc = self._proc, None
        if proc is not None and proc.returncode is None:
            proc.kill()
            await proc.wait()


async def _answer(proc: asyncio.subprocess.Process) -> str | None:
    assert proc.stdin is not None and proc.stdout is not None
    await proc.stdin.drain()
    (size,) = _REPLY.unpack(await proc.stdout.readexactly(_REPLY.size))
    return (await proc.stdout.readexactly(size)).decode() if size else None


def _serve() -> None:
    """The helper: read (limits, body) from stdin, answer the problem's message (empty: none)."""
    stdin, stdout = sys.stdin.buffer, sys.stdout.buffer
    while True:
        header = stdin.read(_HEADER.size)
        if len(header) < _HEADER.size:
            return  # the server closed the pipe
        max_items, max_tokens, max_input_bytes, size = _HEADER.unpack(header)
        raw = stdin.read(size)
        problem = body_problem(raw, Limits(max_items, max_tokens, max_input_bytes)) or ""
        reply = problem.encode()
        stdout.write(_REPLY.pack(len(reply)) + reply)
        stdout.flush()


if __name__ == "__main__":
    _serve()
