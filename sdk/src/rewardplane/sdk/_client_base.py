"""What the blocking and the asyncio scoring clients share, laid out like httpx: one base
(:class:`BaseRewardClient`) holds the configuration, the routing over replicas, every request a
method makes (built here as a :class:`_Call`) and the parsing of its answer; the clients
(:class:`~rewardplane.sdk.RewardClient`, :class:`~rewardplane.sdk.AsyncRewardClient`) only send.

One client talks to one or several reward servers (replicas of one model):

- a small call (at most ``min_chunk`` inputs) goes whole to one server, round robin;
- a larger batch is split by deterministic contiguous chunking — server ``i`` gets
  items ``[i * ceil(N/S), (i + 1) * ceil(N/S))`` — sent concurrently and reassembled in order;
- ``N == 0`` returns at once without any request;
- 5xx, connection errors and timeouts are retried with capped exponential backoff
  (:class:`~rewardplane.sdk.RetryPolicy`); a connection error moves the retry to the next
  server; 4xx is never retried and raises :class:`~rewardplane.sdk.RewardServerError` with the
  server's message.

Chats (lists of ``{"role", "content"}`` messages) are scored with ``score_chats``: one
``/classify`` request per chat (vLLM's chat shape), round robin over the servers, rendered
through the model's chat template by the server.

Every scoring reply carries the weights version that produced it; the per-chunk versions are kept
in ``info["versions"]`` and ``ScoringResponse.metadata["versions"]``.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import logging
import os
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

import httpx
import tenacity
from pydantic import ValidationError

from rewardplane.protocol import (
    ChatCompletionResponse,
    Endpoints,
    RuntimeVersionResponse,
    Score,
    ScoringRequest,
    ScoringResponse,
    SleepRequest,
    SleepResponse,
    StepAggregation,
    WakeRequest,
)
from rewardplane.protocol.auth import auth_headers, resolve_token

from ._exceptions import ClientClosedError, RewardClientError, RewardServerError, RewardServerUnavailable
from ._replies import (
    Piece,
    ScoreInfo,
    assemble,
    empty_answer,
    parse_chat_completion,
    parse_classify,
    parse_piece,
    parse_reply,
)
from .chunking import assignments, split_range
from .retry import RetryPolicy

logger = logging.getLogger("rewardplane.sdk.client")

CONNECT_TIMEOUT_CAP_S = 10.0
# rewardplane's default --max-items-per-request: the split for a server whose /model_info names none
DEFAULT_ITEM_LIMIT = 1024
ITEM_LIMIT_PROBE_TIMEOUT_S = 10.0
HEALTH_POLL_INTERVAL_S = 0.5
HEALTH_PROBE_TIMEOUT_S = 5.0

T = TypeVar("T")


@dataclass(frozen=True)
class _Call(Generic[T]):
    """One request a client method makes, built by the base and sent by a client's I/O layer
    under the retry policy; ``parse(response, url, attempts)`` reads the answer."""

    method: str
    index: int
    path: str
    parse: Callable[[httpx.Response, str, int], T]
    json: Any = None
    failover: bool = True


def normalize_endpoint(url: str) -> str:
    """``host:port`` or a base URL → ``http(s)://host:port`` without a trailing slash."""
    url = url.strip().rstrip("/")
    if "://" not in url:
        url = f"http://{url}"
    parsed = httpx.URL(url)
    if parsed.scheme not in ("http", "https") or not parsed.host:
        raise ValueError(f"endpoint {url!r} is not an http(s) base URL like 'http://127.0.0.1:8001'")
    return url


def sleep_body(level: int, timeout_s: float) -> dict[str, Any]:
    """The body of ``POST /sleep``, validated: a bad level fails before any server is asked."""
    try:
        return SleepRequest(level=level, timeout_s=float(timeout_s)).model_dump()
    except ValidationError as exc:
        raise ValueError(
            f"sleep(level={level!r}, timeout_s={timeout_s!r}): level is 1 or 2, timeout_s > 0"
        ) from exc


def _healthy(resp: httpx.Response) -> bool:
    if resp.status_code != 200:
        return False
    if not resp.content:  # vLLM's own /health answers 200 with an empty body
        return True
    try:
        body = resp.json()
    except ValueError:
        return True
    return not isinstance(body, dict) or body.get("status", "ok") == "ok"


class BaseRewardClient:
    """What the sync and async clients share: configuration, routing, parsing and assembling.

    Args:
        endpoints: base URLs of the reward servers (replicas of one model), e.g.
            ``"http://127.0.0.1:8001"``; one string for one server.
        model_name: ``model`` field of scoring requests.
        retry: the retry policy for transient failures (default :class:`RetryPolicy`).
        request_timeout_s: per-attempt timeout of a request (connect capped at 10 s).
        token, token_file: control-plane token (default ``REWARDPLANE_TOKEN``); scoring needs
            none unless the servers require it.
        min_chunk: batches of at most this many inputs go whole to one server (round robin).
        max_items_per_request: cut each server's chunk into requests of at most this many inputs;
            ``None`` (the default) cuts to the server's own limit, read once from its
            ``/model_info`` (1024 where the server names none).
        max_connections: connections per client (per event loop for the async client).
    """

    def __init__(
        self,
        endpoints: str | Sequence[str],
        *,
        model_name: str = "reward-model",
        retry: RetryPolicy | None = None,
        request_timeout_s: float = 60.0,
        token: str | None = None,
        token_file: str | os.PathLike[str] | None = None,
        min_chunk: int = 8,
        max_items_per_request: int | None = None,
        max_connections: int = 256,
    ) -> None:
        if isinstance(endpoints, str):
            endpoints = [endpoints]
        if len(endpoints) == 0:
            raise ValueError("endpoints is empty: give at least one reward server URL")
        if request_timeout_s <= 0:
            raise ValueError(f"request_timeout_s must be > 0, got {request_timeout_s}")
        if min_chunk < 1:
            raise ValueError(f"min_chunk must be >= 1, got {min_chunk}")
        if max_items_per_request is not None and max_items_per_request < 1:
            raise ValueError(f"max_items_per_request must be >= 1 or None, got {max_items_per_request}")
        if max_connections < 1:
            raise ValueError(f"max_connections must be >= 1, got {max_connections}")
        self.endpoints: list[str] = [normalize_endpoint(u) for u in endpoints]
        self.model_name = model_name
        self.retry = retry if retry is not None else RetryPolicy()
        self.request_timeout_s = float(request_timeout_s)
        self.min_chunk = min_chunk
        self.max_items_per_request = max_items_per_request
        self.token = resolve_token(token, token_file)
        self.headers: dict[str, str] = auth_headers(self.token)
        self._max_connections = max_connections
        self._timeout = httpx.Timeout(
            self.request_timeout_s, connect=min(self.request_timeout_s, CONNECT_TIMEOUT_CAP_S)
        )
        self._round_robin = itertools.count()
        self._lock = threading.Lock()
        self._closed = False
        self._server_item_limit: int | None = None  # learned from /model_info, once

    @property
    def closed(self) -> bool:
        return self._closed

    def _check_open(self) -> None:
        if self._closed:
            raise ClientClosedError(f"{type(self).__name__} is closed; create a new client")

    # -- pure parts ----------------------------------------------------------------------------

    def _plan(self, n: int, item_limit: int | None = None) -> list[tuple[int, range]]:
        """(endpoint index, rows) of every request for a batch of ``n`` inputs, each request at
        most ``item_limit`` inputs (``max_items_per_request`` when set wins)."""
        if n == 0:
            return []
        servers = len(self.endpoints)
        if servers == 1 or n <= self.min_chunk:
            plan = [(next(self._round_robin) % servers, range(n))]
        else:
            plan = assignments(n, servers)
        limit = self.max_items_per_request or item_limit
        if limit is not None:
            plan = [(i, piece) for i, rows in plan for piece in split_range(rows, limit)]
        return plan

    def _needs_item_limit(self, n: int) -> bool:
        return self.max_items_per_request is None and self._server_item_limit is None and n > 1

    def _learn_item_limit(self, resp: httpx.Response | None) -> int:
        """The per-request item limit from a ``/model_info`` answer (``None``: no answer). A server
        that answered is remembered; one that did not is asked again next time."""
        if resp is None:
            return DEFAULT_ITEM_LIMIT
        limit = DEFAULT_ITEM_LIMIT
        if resp.status_code == 200:
            with contextlib.suppress(ValueError, AttributeError):
                given = resp.json().get("max_items_per_request")
                if isinstance(given, int) and given >= 1:
                    limit = given
        self._server_item_limit = limit
        return limit

    def _batch_request(
        self, inputs: Sequence[str], normalize: bool, n_labels: int | None, truncate: bool
    ) -> ScoringRequest:
        if isinstance(inputs, str):
            inputs = [inputs]
        return ScoringRequest(
            model=self.model_name,
            inputs=list(inputs),
            normalize=normalize,
            n_labels=n_labels,
            truncate=truncate,
        )

    def _steps_request(
        self,
        solutions: Sequence[str | Sequence[str]],
        prompts: Sequence[str] | None,
        aggregation: StepAggregation | str | None,
        normalize: bool,
        first_step: int,
    ) -> ScoringRequest:
        """A process reward model's request (``score_steps``): ``solutions`` each a text with the
        server's step separator, or a list of steps. Every result has ``steps`` (each step's score,
        character span and token offsets) and, as ``score``, their aggregate (``aggregation``, else
        the server's; without either, the list of step scores). ``prompts``: the text before each
        solution's first step. ``first_step`` k scores steps k... only, the earlier ones read as
        context (reused from the server's prefix cache where it has one)."""
        texts = [s for s in solutions if isinstance(s, str)]
        if texts and len(texts) != len(solutions):
            raise ValueError("send every solution as a text with separators, or every one as a list of steps")
        return ScoringRequest(
            model=self.model_name,
            inputs=texts,
            steps=None if texts or not solutions else [list(s) for s in solutions],
            prompts=None if prompts is None else list(prompts),
            aggregation=None if aggregation is None else StepAggregation(aggregation),
            normalize=normalize,
            first_step=first_step,
        )

    # -- the requests each method makes (sent by the clients' I/O layers) ----------------------

    def _score_calls(self, request: ScoringRequest, item_limit: int | None) -> list[_Call[Piece]]:
        """One ``/score`` request per piece of the plan, each with its share of the inputs."""
        return [
            _Call(
                "POST",
                i,
                Endpoints.SCORE,
                functools.partial(parse_piece, rows=rows),
                json=request.wire_rows(rows.start, rows.stop),
            )
            for i, rows in self._plan(request.items(), item_limit)
        ]

    def _scored(
        self, request: ScoringRequest, pieces: Sequence[Piece], start: float
    ) -> tuple[ScoringResponse, ScoreInfo]:
        """The answer to ``score``: the pieces put back in input order (none: an empty answer)."""
        base = request.wire()
        if not pieces:
            return empty_answer(request, base)
        return assemble(pieces, request.items(), base, start)

    def _chat_score_calls(
        self, chats: Sequence[Sequence[Mapping[str, Any]]], normalize: bool
    ) -> list[_Call[Score]]:
        """One ``/classify`` request per chat, round robin over the servers."""
        return [
            _Call(
                "POST",
                next(self._round_robin),
                Endpoints.CLASSIFY,
                lambda resp, url, _: parse_classify(resp, url),
                json={
                    "model": self.model_name,
                    "messages": [dict(m) for m in chat],
                    "use_activation": normalize,
                },
            )
            for chat in chats
        ]

    def _chat_call(
        self, messages: Sequence[Mapping[str, Any]], sampling: Mapping[str, Any]
    ) -> _Call[ChatCompletionResponse]:
        """``POST /v1/chat/completions`` with only the sampling fields given (the server's defaults
        are OpenAI's), round robin over the servers."""
        given = {k: v for k, v in sampling.items() if v is not None}
        return _Call(
            "POST",
            next(self._round_robin),
            Endpoints.V1_PREFIX + Endpoints.CHAT_COMPLETIONS,
            lambda resp, url, _: parse_chat_completion(resp, url),
            json={"model": self.model_name, "messages": [dict(m) for m in messages], **given},
        )

    def _runtime_version_calls(self) -> list[_Call[tuple[str, RuntimeVersionResponse]]]:
        """``/runtime_version`` of every endpoint; no failover: the answer must come from that very
        endpoint."""
        return [
            _Call(
                "GET",
                i,
                Endpoints.RUNTIME_VERSION,
                lambda resp, url, _: (
                    url,
                    parse_reply(RuntimeVersionResponse, resp, url, Endpoints.RUNTIME_VERSION),
                ),
                failover=False,
            )
            for i in self._unique_endpoint_indices()
        ]

    def _sleep_calls(self, level: int, timeout_s: float) -> list[_Call[tuple[str, SleepResponse]]]:
        return self._control_calls(Endpoints.SLEEP, sleep_body(level, timeout_s))

    def _wake_calls(self, timeout_s: float, reload: bool = True) -> list[_Call[tuple[str, SleepResponse]]]:
        body = WakeRequest(timeout_s=float(timeout_s), reload=reload)
        return self._control_calls(Endpoints.WAKE, body.model_dump())

    def _control_calls(self, path: str, body: dict[str, Any]) -> list[_Call[tuple[str, SleepResponse]]]:
        """``POST /sleep`` or ``/wake`` to every endpoint (no failover: each must change itself)."""
        return [
            _Call(
                "POST",
                i,
                path,
                lambda resp, url, _: (url, parse_reply(SleepResponse, resp, url, "sleep/wake")),
                json=body,
                failover=False,
            )
            for i in self._unique_endpoint_indices()
        ]

    def _unique_endpoint_indices(self) -> list[int]:
        return [self.endpoints.index(u) for u in dict.fromkeys(self.endpoints)]

    # -- retry bookkeeping shared by the sync and async request loops --------------------------

    def _attempts(self, index: int, method: str, path: str, failover: bool) -> _Attempts:
        return _Attempts(self, index % len(self.endpoints), method, path, failover)

    # -- health (blocking) ----------------------------------------------------------------------

    def check_server(self, timeout_s: float) -> None:
        """Wait until every endpoint's ``/health`` says ok, at most ``timeout_s`` (bounded poll).

        A 4xx on ``/health`` fails at once: whatever listens there is not a reward server.
        Blocking; from async code run it in a thread.
        """
        self._check_open()
        deadline = time.monotonic() + timeout_s
        pending = list(dict.fromkeys(self.endpoints))
        last_error: dict[str, BaseException] = {}
        polls = 0
        with httpx.Client(timeout=self._timeout, headers=self.headers) as http:
            while True:
                polls += 1
                for url in list(pending):
                    remaining = max(0.1, deadline - time.monotonic())
                    try:
                        resp = http.get(
                            url + Endpoints.HEALTH, timeout=min(HEALTH_PROBE_TIMEOUT_S, remaining)
                        )
                    except httpx.TransportError as exc:
                        last_error[url] = exc
                        continue
                    if _healthy(resp):
                        pending.remove(url)
                    elif 400 <= resp.status_code < 500:
                        err = RewardServerError.from_response(resp)
                        raise RewardServerError(
                            resp.status_code,
                            f"{err.message} — {url}{Endpoints.HEALTH} is not a reward server's health "
                            "endpoint; check the host/port (reward servers default to policy port + 1)",
                            err.url,
                            err.detail,
                        )
                    else:
                        last_error[url] = (
                            RewardServerError.from_response(resp)
                            if resp.is_error
                            else RewardClientError(f"health reply not ok: {resp.text[:200]}")
                        )
                if not pending:
                    return
                if time.monotonic() >= deadline:
                    url = pending[0]
                    raise RewardServerUnavailable(
                        url,
                        polls,
                        last_error.get(url),
                        urls=pending,
                        elapsed_s=timeout_s,
                        hint=(
                            f"No healthy reward server within check_server(timeout_s={timeout_s:g}). Start "
                            "it (python -m rewardplane.server --model DIR --host H --port P), check the "
                            "endpoints, or give a larger timeout_s if the model loads slowly."
                        ),
                    )
                time.sleep(max(0.0, min(HEALTH_POLL_INTERVAL_S, deadline - time.monotonic())))

    def __repr__(self) -> str:
        return f"{type(self).__name__}(endpoints={self.endpoints!r}, model_name={self.model_name!r})"


class _Attempts:
    """One request's attempts under the retry policy, shared by the sync and async loops (which
    differ only in how they wait): the endpoint each attempt goes to (failover on connect errors:
    the request never reached a server, so resending elsewhere cannot duplicate work), the log line
    of each retryable failure, and the ``RewardServerUnavailable`` that ends a request."""

    def __init__(self, client: BaseRewardClient, idx: int, method: str, path: str, failover: bool) -> None:
        self.client = client
        self.idx = idx
        self.method = method
        self.path = path
        self.failover = failover
        self.tried: list[str] = []
        self.start = time.monotonic()

    @contextlib.contextmanager
    def next_url(self) -> Iterator[str]:
        """The base URL of this attempt; a failure inside picks the next attempt's endpoint."""
        url = self.client.endpoints[self.idx]
        self.tried.append(url)
        try:
            yield url
        except (httpx.TransportError, RewardServerError) as exc:
            self._failed(exc)
            raise

    def _failed(self, exc: BaseException) -> None:
        retry = self.client.retry
        if not retry.is_retryable(exc):
            return
        logger.warning(
            "attempt %d/%d: %s %s%s failed: %s",
            len(self.tried),
            retry.max_attempts,
            self.method,
            self.tried[-1],
            self.path,
            exc,
        )
        n = len(self.client.endpoints)
        if self.failover and retry.failover and n > 1 and retry.should_failover(exc):
            self.idx = (self.idx + 1) % n

    @contextlib.contextmanager
    def giving_up(self) -> Iterator[None]:
        """Turns the policy giving up (or a transport error it does not retry) into
        ``RewardServerUnavailable`` naming every URL tried and the time spent."""
        try:
            yield
        except tenacity.RetryError as err:
            last = err.last_attempt.exception()
            raise self._unavailable(last) from last
        except httpx.TransportError as exc:
            raise self._unavailable(exc) from exc

    def _unavailable(self, exc: BaseException | None) -> RewardServerUnavailable:
        return RewardServerUnavailable(
            self.tried[-1] if self.tried else self.client.endpoints[self.idx],
            len(self.tried),
            exc,
            urls=self.tried,
            elapsed_s=time.monotonic() - self.start,
        )
