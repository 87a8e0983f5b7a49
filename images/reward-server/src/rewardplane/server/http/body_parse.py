"""Parsing request bodies without holding the event loop for a body the server will refuse.

Every JSON parser holds the GIL while it builds Python objects (pydantic's takes 40-60 ms for a
2 MB body of 200,000 token-id lists), so a thread does not free the loop: measured, parsing on a
thread stalled a 1 ms sleep on the main thread for 290 ms. So:

- a body whose parse is cheap (small, or with few arrays, objects and commas, counted in C on the
  raw bytes: ~1 ms per MB) is parsed on the loop, as before;
- any other body is parsed first by a helper process (``python -m rewardplane.server.http.body_parse``,
  started on first need, one body at a time) that applies the rules of its route (``BodyRules``:
  scoring's limits, ``check_body_shape``, and a cap on JSON arrays and objects) and answers the
  400's message or nothing. Only a body that passes is parsed on the loop, and its cost is bounded
  by those rules.

If the helper cannot run, bodies are parsed on the loop as before (logged once)."""

from __future__ import annotations

import asyncio
import logging
import struct
import sys
from dataclasses import dataclass
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
# scoring's limits apply (0/1), max_items, max_tokens, max_input_bytes, max_containers, body length
_HEADER = struct.Struct("!BQQQQQ")
_REPLY = struct.Struct("!BI")  # what was wrong (_FITS, _SHAPE, _CONTAINERS), the message's length
_FITS, _SHAPE, _CONTAINERS = 0, 1, 2


def container_budget(limits: Limits) -> int:
    """The arrays and objects a request within the limits can need, generously: a few per input
    (a token-id list, a chat message and its parts) and per token (a message per token at most)."""
    return 4 * (limits.max_items + limits.max_tokens) + 1024


@dataclass(frozen=True)
class BodyRules:
    """What a route's JSON body must meet before it is parsed on the loop: scoring's ``limits``
    (None on the control plane), at most ``max_containers`` arrays and objects, and the message of
    the 400 for a body over that cap."""

    limits: Limits | None
    max_containers: int
    too_many: str

    @classmethod
    def scoring(cls, limits: Limits) -> BodyRules:
        budget = container_budget(limits)
        return cls(
            limits,
            budget,
            f"the request body holds more than {budget} JSON arrays and objects; a request this server takes "
            f"needs fewer (it takes at most {limits.max_items} inputs of at most {limits.max_tokens} tokens: "
            "--max-items-per-request, --max-model-len): send fewer or smaller inputs, and no other arrays",
        )


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


def body_problem(raw: bytes, limits: Limits | None, max_containers: int) -> tuple[int, str]:
    """What the helper decides: ``(_SHAPE, message)`` for a body over scoring's limits,
    ``(_CONTAINERS, "")`` for one over the cap on arrays and objects, else ``(_FITS, "")`` (a body
    that is not JSON included: the loop's parse answers it, with its 422)."""
    try:
        body = pydantic_core.from_json(raw)
    except ValueError:
        return _FITS, ""
    if limits is not None:
        try:
            check_body_shape(body, limits)
        except BadRequest as exc:
            return _SHAPE, exc.message
    if _count_containers(body, max_containers) > max_containers:
        return _CONTAINERS, ""
    return _FITS, ""


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

    async def parse(self, raw: bytes, rules: BodyRules) -> Any:
        counted = self._costly(raw) and await self._ask(raw, rules)
        body = pydantic_core.from_json(raw)  # ValueError: the caller answers FastAPI's 422
        check_parsed(body, rules, count=not counted)
        return body

    def _costly(self, raw: bytes) -> bool:
        if len(raw) <= SMALL_BODY_BYTES or self._broken:
            return False
        return len(raw) > LARGE_BODY_BYTES or _parse_cost(raw) > LOOP_PARSE_COST

    async def _ask(self, raw: bytes, rules: BodyRules) -> bool:
        """``BadRequest`` if the helper finds the body breaks ``rules``; False if no helper could
        tell (the rules are then checked on the loop)."""
        limits = rules.limits or Limits(0, 0, 0)
        async with self._lock:  # one body at a time: a flood queues here, not on the loop
            for attempt in (1, 2):
                try:
                    proc = await self._helper()
                    assert proc.stdin is not None and proc.stdout is not None
                    proc.stdin.write(
                        _HEADER.pack(
                            rules.limits is not None,
                            limits.max_items,
                            limits.max_tokens,
                            limits.max_input_bytes,
                            rules.max_containers,
                            len(raw),
                        )
                    )
                    proc.stdin.write(raw)
                    # a wedged helper is replaced, like a dead one
                    verdict, message = await asyncio.wait_for(_answer(proc), HELPER_TIMEOUT_S)
                except (OSError, asyncio.IncompleteReadError, asyncio.TimeoutError) as exc:
                    self._stop_helper()
                    if attempt == 2:
                        self._broken = True
                        log.error(
                            "the body-parsing helper failed (%s); large bodies are parsed on the loop", exc
                        )
                    continue
                if verdict != _FITS:
                    raise BadRequest(message if verdict == _SHAPE else rules.too_many)
                return True
        return False

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


def check_parsed(body: Any, rules: BodyRules, *, count: bool = True) -> None:
    """The rules, on a body parsed on the loop (cheap: counting stops at the cap); ``count``
    False where the helper counted already."""
    if rules.limits is not None:
        check_body_shape(body, rules.limits)
    if count and _count_containers(body, rules.max_containers) > rules.max_containers:
        raise BadRequest(rules.too_many)


async def _answer(proc: asyncio.subprocess.Process) -> tuple[int, str]:
    assert proc.stdin is not None and proc.stdout is not None
    await proc.stdin.drain()
    verdict, size = _REPLY.unpack(await proc.stdout.readexactly(_REPLY.size))
    return verdict, (await proc.stdout.readexactly(size)).decode() if size else ""


def _serve() -> None:
    """The helper: read (rules, body) from stdin, answer the verdict and its message."""
    stdin, stdout = sys.stdin.buffer, sys.stdout.buffer
    while True:
        header = stdin.read(_HEADER.size)
        if len(header) < _HEADER.size:
            return  # the server closed the pipe
        scoring, max_items, max_tokens, max_input_bytes, max_containers, size = _HEADER.unpack(header)
        raw = stdin.read(size)
        limits = Limits(max_items, max_tokens, max_input_bytes) if scoring else None
        verdict, problem = body_problem(raw, limits, max_containers)
        reply = problem.encode()
        stdout.write(_REPLY.pack(verdict, len(reply)) + reply)
        stdout.flush()


if __name__ == "__main__":
    _serve()
