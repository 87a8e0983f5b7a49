"""Scoring clients for rewardplane reward servers, on httpx: :class:`RewardClient` (blocking)
and :class:`AsyncRewardClient` (asyncio), over one base that holds everything but the I/O.

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

import asyncio
import contextlib
import itertools
import logging
import os
import threading
import time
import weakref
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, TypeVar

import httpx
import tenacity
from pydantic import BaseModel, ValidationError

from rewardplane.protocol import (
    DEFAULT_SLEEP_TIMEOUT_S,
    VERSION_HEADER,
    ChatCompletionResponse,
    ClassifyResponse,
    Endpoints,
    RuntimeVersionResponse,
    Score,
    ScoringRequest,
    ScoringResponse,
    ScoringResult,
    SleepRequest,
    SleepResponse,
    Usage,
    WakeRequest,
)
from rewardplane.protocol.auth import auth_headers, resolve_token

from ._aio import gather_or_cancel
from ._exceptions import ClientClosedError, RewardClientError, RewardServerError, RewardServerUnavailable
from .chunking import assignments, reassemble, split_range
from .http_pool import ShardedAsyncClient
from .retry import RetryPolicy, check_response

logger = logging.getLogger("rewardplane.sdk.client")

CONNECT_TIMEOUT_CAP_S = 10.0
# rewardplane's default --max-items-per-request: the split for a server whose /model_info names none
DEFAULT_ITEM_LIMIT = 1024
ITEM_LIMIT_PROBE_TIMEOUT_S = 10.0
HEALTH_POLL_INTERVAL_S = 0.5
HEALTH_PROBE_TIMEOUT_S = 5.0

T = TypeVar("T")
M = TypeVar("M", bound=BaseModel)

ScoreInfo = dict[str, Any]
"""Transport details of one ``score`` call: ``versions``, ``chunks`` (start, stop, endpoint,
version, attempts), ``request``, ``raw_responses``, ``elapsed_s``."""


@dataclass(frozen=True)
class _Piece:
    """One request's share of a batch and what came back for it."""

    rows: range
    url: str
    attempts: int
    response: ScoringResponse
    raw: dict[str, Any]


def normalize_endpoint(url: str) -> str:
    """``host:port`` or a base URL → ``http(s)://host:port`` without a trailing slash."""
    url = url.strip().rstrip("/")
    if "://" not in url:
        url = f"http://{url}"
    parsed = httpx.URL(url)
    if parsed.scheme not in ("http", "https") or not parsed.host:
        raise ValueError(f"endpoint {url!r} is not an http(s) base URL like 'http://127.0.0.1:8001'")
    return url


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

    @staticmethod
    def _parse_piece(resp: httpx.Response, url: str, attempts: int, rows: range) -> _Piece:
        try:
            raw = resp.json()
            parsed = ScoringResponse.model_validate(raw)
        except (ValueError, ValidationError) as exc:
            raise RewardClientError(
                f"reward server {url} sent an unreadable /score reply ({exc}); is it a rewardplane "
                "server of a compatible version?"
            ) from exc
        header = resp.headers.get(VERSION_HEADER)
        if header is not None and "version" not in raw:  # body is authoritative when both exist
            parsed = parsed.model_copy(update={"version": int(header)})
        return _Piece(rows=rows, url=url, attempts=attempts, response=parsed, raw=raw)

    @staticmethod
    def _empty(request: ScoringRequest, base: dict[str, Any]) -> tuple[ScoringResponse, ScoreInfo]:
        meta: dict[str, Any] = {"versions": [], "endpoints": [], "mixed_versions": False}
        return (
            ScoringResponse(model=request.model, data=[], version=0, metadata=meta),
            {"versions": [], "chunks": [], "request": base, "raw_responses": [], "elapsed_s": 0.0},
        )

    @staticmethod
    def _assemble(
        pieces: Sequence[_Piece], n: int, base: dict[str, Any], start: float
    ) -> tuple[ScoringResponse, ScoreInfo]:
        try:
            ordered = reassemble(
                [p.rows for p in pieces], [sorted(p.response.data, key=lambda d: d.index) for p in pieces], n
            )
        except ValueError as exc:
            raise RewardClientError(f"reward server reply does not match the request: {exc}") from exc
        data = [ScoringResult(index=i, score=d.score, num_tokens=d.num_tokens) for i, d in enumerate(ordered)]
        versions = [p.response.version for p in pieces]
        chunks = [
            {
                "start": p.rows.start,
                "stop": p.rows.stop,
                "endpoint": p.url,
                "version": p.response.version,
                "attempts": p.attempts,
            }
            for p in pieces
        ]
        metadata: dict[str, Any] = dict(pieces[0].response.metadata) if len(pieces) == 1 else {}
        metadata.update(
            versions=versions, endpoints=[p.url for p in pieces], mixed_versions=len(set(versions)) > 1
        )
        response = ScoringResponse(
            model=pieces[0].response.model,
            data=data,
            usage=Usage(
                prompt_tokens=sum(p.response.usage.prompt_tokens for p in pieces),
                total_tokens=sum(p.response.usage.total_tokens for p in pieces),
            ),
            version=min(versions),
            metadata=metadata,
        )
        info = {
            "versions": versions,
            "chunks": chunks,
            "request": base,
            "raw_responses": [p.raw for p in pieces],
            "elapsed_s": time.monotonic() - start,
        }
        return response, info

    def _chat_payload(self, chat: Sequence[Mapping[str, Any]], normalize: bool) -> dict[str, Any]:
        return {"model": self.model_name, "messages": [dict(m) for m in chat], "use_activation": normalize}

    def _chat_completion_payload(
        self, messages: Sequence[Mapping[str, Any]], sampling: Mapping[str, Any]
    ) -> dict[str, Any]:
        # Only the fields given: the server's defaults are OpenAI's.
        given = {k: v for k, v in sampling.items() if v is not None}
        return {"model": self.model_name, "messages": [dict(m) for m in messages], **given}

    @staticmethod
    def _parse_chat_completion(resp: httpx.Response, url: str) -> ChatCompletionResponse:
        try:
            return ChatCompletionResponse.model_validate(resp.json())
        except (ValueError, ValidationError) as exc:
            raise RewardClientError(
                f"server {url} sent an unreadable /v1/chat/completions reply ({exc}); is it a rewardplane "
                "server of task generate (or another OpenAI-compatible server)?"
            ) from exc

    @staticmethod
    def _parse_classify(resp: httpx.Response, url: str) -> Score:
        try:
            probs = ClassifyResponse.model_validate(resp.json()).data[0].probs
        except (ValueError, ValidationError, IndexError) as exc:
            raise RewardClientError(
                f"reward server {url} sent an unreadable /classify reply ({exc}); is it a rewardplane "
                "server of a compatible version?"
            ) from exc
        return probs[0] if len(probs) == 1 else probs

    @staticmethod
    def _parse_reply(model: type[M], resp: httpx.Response, url: str, path: str) -> M:
        try:
            return model.model_validate(resp.json())
        except (ValueError, ValidationError) as exc:
            raise RewardClientError(f"reward server {url} sent an unreadable {path} reply: {exc}") from exc

    @classmethod
    def _parse_runtime_version(cls, resp: httpx.Response, url: str) -> RuntimeVersionResponse:
        return cls._parse_reply(RuntimeVersionResponse, resp, url, Endpoints.RUNTIME_VERSION)

    @classmethod
    def _parse_sleep(cls, resp: httpx.Response, url: str) -> SleepResponse:
        return cls._parse_reply(SleepResponse, resp, url, "sleep/wake")

    @staticmethod
    def _sleep_body(level: int, timeout_s: float) -> dict[str, Any]:
        # validated here: a bad level fails before any server is asked
        try:
            return SleepRequest(level=level, timeout_s=float(timeout_s)).model_dump()
        except ValidationError as exc:
            raise ValueError(
                f"sleep(level={level!r}, timeout_s={timeout_s!r}): level is 1 or 2, timeout_s > 0"
            ) from exc

    def _unique_endpoint_indices(self) -> list[int]:
        return [self.endpoints.index(u) for u in dict.fromkeys(self.endpoints)]

    # -- retry bookkeeping shared by the sync and async request loops --------------------------

    def _attempts(self, index: int, method: str, path: str, failover: bool) -> _Attempts:
        return _Attempts(self, index % len(self.endpoints), method, path, failover)

    # -- health (blocking; used at construction by VLLMRewardClient) ---------------------------

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
                            f"No healthy reward server within connection_timeout_s={timeout_s:g}. Start it "
                            "(python -m rewardplane.server --model DIR --host H --port P), check host/port/"
                            "endpoints, raise connection_timeout_s if the model loads slowly, or pass "
                            "check_server=False to skip this check."
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


class AsyncRewardClient(BaseRewardClient):
    """The asyncio scoring client (see :class:`BaseRewardClient` for the arguments).

    Usable from several event loops: each loop gets its own connection pools (httpx clients are
    bound to the loop that first used them). Close with ``await client.aclose()`` or
    ``async with``.
    """

    def __init__(self, endpoints: str | Sequence[str], **kwargs: Any) -> None:
        super().__init__(endpoints, **kwargs)
        self._async_clients: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, ShardedAsyncClient] = (
            weakref.WeakKeyDictionary()
        )

    def _aclient(self) -> ShardedAsyncClient:
        self._check_open()
        loop = asyncio.get_running_loop()
        with self._lock:
            client = self._async_clients.get(loop)
            if client is None or client.is_closed:
                client = ShardedAsyncClient(
                    max_connections=self._max_connections, timeout=self._timeout, headers=self.headers
                )
                self._async_clients[loop] = client
            return client

    async def _request(
        self, method: str, index: int, path: str, *, json: Any = None, failover: bool = True
    ) -> tuple[httpx.Response, str, int]:
        """One request to endpoint ``index`` under the retry policy: (response, url, attempts)."""
        client = self._aclient()
        attempts = self._attempts(index, method, path, failover)
        with attempts.giving_up():
            async for attempt in self.retry.async_retrying():
                with attempt, attempts.next_url() as url:
                    resp = check_response(await client.request(method, url + path, json=json))
                    return resp, url, len(attempts.tried)
        raise AssertionError("unreachable: tenacity returns, raises or gives RetryError")

    async def _item_limit(self, n: int) -> int | None:
        """The servers' per-request item limit, asked once (``/model_info``) when a batch could need it."""
        if not self._needs_item_limit(n):
            return self._server_item_limit
        try:
            resp: httpx.Response | None = await self._aclient().request(
                "GET", self.endpoints[0] + Endpoints.MODEL_INFO, timeout=ITEM_LIMIT_PROBE_TIMEOUT_S
            )
        except httpx.HTTPError:
            resp = None
        return self._learn_item_limit(resp)

    async def _score_piece(self, index: int, rows: range, base: dict[str, Any], inputs: list[str]) -> _Piece:
        payload = {**base, "input": inputs[rows.start : rows.stop]}
        resp, url, attempts = await self._request("POST", index, Endpoints.SCORE, json=payload)
        return self._parse_piece(resp, url, attempts, rows)

    async def score(self, request: ScoringRequest) -> tuple[ScoringResponse, ScoreInfo]:
        """Score ``request.inputs``; returns ``(response, info)``.

        ``response.scores`` is in input order. ``response.version`` is the lowest weights version
        among the chunks (the conservative value for staleness checks);
        ``response.metadata["versions"]`` lists every chunk's version and
        ``metadata["mixed_versions"]`` says whether a weight update landed between chunks.
        An empty ``inputs`` makes no request and returns an empty response (version 0).
        """
        self._check_open()
        base = request.wire()
        inputs = list(request.inputs)
        plan = self._plan(len(inputs), await self._item_limit(len(inputs)))
        start = time.monotonic()
        if not plan:
            return self._empty(request, base)
        pieces = await gather_or_cancel([self._score_piece(i, rows, base, inputs) for i, rows in plan])
        return self._assemble(pieces, len(inputs), base, start)

    async def score_batch(
        self,
        inputs: Sequence[str],
        *,
        normalize: bool = True,
        n_labels: int | None = None,
        truncate: bool = False,
    ) -> list[Score]:
        """Scores of ``inputs`` in order: floats, or lists for multi-label heads.

        ``normalize=False`` returns the raw head output (what reward-model training uses).
        ``n_labels`` makes the server reject a model with a different head size; ``truncate`` cuts
        over-long inputs instead of a 400.
        """
        self._check_open()
        if len(inputs) == 0:
            return []
        response, _ = await self.score(self._batch_request(inputs, normalize, n_labels, truncate))
        return response.scores

    async def score_chats(
        self, chats: Sequence[Sequence[Mapping[str, Any]]], *, normalize: bool = True
    ) -> list[Score]:
        """Scores of chats (lists of ``{"role", "content"}`` messages, the answer last), each
        rendered through the model's chat template by the server: one ``/classify`` request per
        chat, spread round robin over the servers, in input order. ``normalize=False`` returns the
        raw head output."""
        self._check_open()

        async def one(chat: Sequence[Mapping[str, Any]]) -> Score:
            payload = self._chat_payload(chat, normalize)
            resp, url, _ = await self._request(
                "POST", next(self._round_robin), Endpoints.CLASSIFY, json=payload
            )
            return self._parse_classify(resp, url)

        return await gather_or_cancel([one(c) for c in chats])

    # The keywords are spelled out here and in RewardClient.chat rather than shared as an
    # Unpack[TypedDict]: help() and IDEs then show them with their defaults, and **extra still passes
    # any other OpenAI field (test_sdk_surface keeps the two signatures alike).
    async def chat(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        max_tokens: int | None = None,
        temperature: float | None = None,
        top_p: float | None = None,
        n: int | None = None,
        seed: int | None = None,
        stop: str | Sequence[str] | None = None,
        **extra: Any,
    ) -> ChatCompletionResponse:
        """Answer one chat with a generative model (a server of task ``generate``, an LLM judge):
        ``POST /v1/chat/completions`` (OpenAI's shape), round robin over the servers, under the
        client's timeouts and retries. Fields left ``None`` take the server's (OpenAI's)
        defaults; ``extra`` fields are sent as they are (e.g. ``chat_template_kwargs``)."""
        self._check_open()
        sampling = dict(
            max_tokens=max_tokens, temperature=temperature, top_p=top_p, n=n, seed=seed, stop=stop, **extra
        )
        payload = self._chat_completion_payload(messages, sampling)
        path = Endpoints.V1_PREFIX + Endpoints.CHAT_COMPLETIONS
        resp, url, _ = await self._request("POST", next(self._round_robin), path, json=payload)
        return self._parse_chat_completion(resp, url)

    async def get_runtime_versions(self) -> dict[str, RuntimeVersionResponse]:
        """``/runtime_version`` of every endpoint (version and state), asked concurrently."""
        self._check_open()

        async def one(i: int) -> tuple[str, RuntimeVersionResponse]:
            # No failover: the answer must come from this very endpoint.
            resp, url, _ = await self._request("GET", i, Endpoints.RUNTIME_VERSION, failover=False)
            return url, self._parse_runtime_version(resp, url)

        return dict(await gather_or_cancel([one(i) for i in self._unique_endpoint_indices()]))

    async def sleep(
        self, level: int = 1, *, timeout_s: float = DEFAULT_SLEEP_TIMEOUT_S
    ) -> dict[str, SleepResponse]:
        """Put every server to sleep (``POST /sleep``, token needed), concurrently: level 1 offloads
        the weights to host memory, level 2 discards them (reloaded on wake). Each waits at most
        ``timeout_s`` for its scoring in flight. Idempotent. Per endpoint, the state it is in now."""
        self._check_open()
        body = self._sleep_body(level, timeout_s)

        async def one(i: int) -> tuple[str, SleepResponse]:
            resp, url, _ = await self._request("POST", i, Endpoints.SLEEP, json=body, failover=False)
            return url, self._parse_sleep(resp, url)

        return dict(await gather_or_cancel([one(i) for i in self._unique_endpoint_indices()]))

    async def wake(self, *, timeout_s: float = DEFAULT_SLEEP_TIMEOUT_S) -> dict[str, SleepResponse]:
        """Wake every server (``POST /wake``), concurrently; idempotent. A server whose level-2 weights
        could not be rebuilt answers ``weights="broken"`` with the reason in ``detail``."""
        self._check_open()
        body = WakeRequest(timeout_s=float(timeout_s)).model_dump()

        async def one(i: int) -> tuple[str, SleepResponse]:
            resp, url, _ = await self._request("POST", i, Endpoints.WAKE, json=body, failover=False)
            return url, self._parse_sleep(resp, url)

        return dict(await gather_or_cancel([one(i) for i in self._unique_endpoint_indices()]))

    async def get_model_versions(self) -> dict[str, int]:
        """Weights version per endpoint."""
        return {url: r.version for url, r in (await self.get_runtime_versions()).items()}

    async def get_model_version(self) -> int:
        """Weights version served everywhere: the minimum over endpoints (the stalest replica)."""
        return min((await self.get_model_versions()).values())

    def _detach_pools(self) -> list[tuple[asyncio.AbstractEventLoop, ShardedAsyncClient]]:
        with self._lock:
            pools = list(self._async_clients.items())
            self._async_clients.clear()
        return pools

    async def aclose(self) -> None:
        """Close this loop's connection pools (and schedule the close of other loops' pools)."""
        if self._closed:
            return
        self._closed = True
        await self._close_pools()

    async def _close_pools(self) -> None:
        current = asyncio.get_running_loop()
        for loop, pool in self._detach_pools():
            if pool.is_closed or loop.is_closed():
                continue
            if loop is current:
                await pool.aclose()
            elif loop.is_running():
                asyncio.run_coroutine_threadsafe(pool.aclose(), loop)
            # A pool of a loop that no longer runs cannot be closed from here; its sockets are
            # released when it is garbage-collected.

    async def __aenter__(self) -> AsyncRewardClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()


class RewardClient(BaseRewardClient):
    """The blocking scoring client (see :class:`BaseRewardClient` for the arguments).

    Thread-safe. A batch split over several servers is sent concurrently from a small thread
    pool. Close with ``client.close()`` or ``with``.
    """

    def __init__(self, endpoints: str | Sequence[str], **kwargs: Any) -> None:
        super().__init__(endpoints, **kwargs)
        self._http: httpx.Client | None = None
        self._pool: ThreadPoolExecutor | None = None

    def _client(self) -> httpx.Client:
        self._check_open()
        with self._lock:
            if self._http is None:
                limits = httpx.Limits(
                    max_connections=self._max_connections, max_keepalive_connections=self._max_connections
                )
                self._http = httpx.Client(timeout=self._timeout, limits=limits, headers=self.headers)
            return self._http

    def _fan_out(self, calls: Sequence[Callable[[], T]]) -> list[T]:
        if not calls:
            return []
        if len(calls) == 1:
            return [calls[0]()]
        with self._lock:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(
                    max_workers=min(32, self._max_connections), thread_name_prefix="rewardplane-score"
                )
            pool = self._pool
        futures = [pool.submit(c) for c in calls]
        try:
            return [f.result() for f in futures]
        finally:
            for f in futures:  # the first failure is raised; requests not yet started are dropped
                f.cancel()

    def _request(
        self, method: str, index: int, path: str, *, json: Any = None, failover: bool = True
    ) -> tuple[httpx.Response, str, int]:
        """One request to endpoint ``index`` under the retry policy: (response, url, attempts)."""
        client = self._client()
        attempts = self._attempts(index, method, path, failover)
        with attempts.giving_up():
            for attempt in self.retry.retrying():
                with attempt, attempts.next_url() as url:
                    resp = check_response(client.request(method, url + path, json=json))
                    return resp, url, len(attempts.tried)
        raise AssertionError("unreachable: tenacity returns, raises or gives RetryError")

    def _item_limit(self, n: int) -> int | None:
        """The servers' per-request item limit, asked once (``/model_info``) when a batch could need it."""
        if not self._needs_item_limit(n):
            return self._server_item_limit
        try:
            resp: httpx.Response | None = self._client().get(
                self.endpoints[0] + Endpoints.MODEL_INFO, timeout=ITEM_LIMIT_PROBE_TIMEOUT_S
            )
        except httpx.HTTPError:
            resp = None
        return self._learn_item_limit(resp)

    def _score_piece(self, index: int, rows: range, base: dict[str, Any], inputs: list[str]) -> _Piece:
        payload = {**base, "input": inputs[rows.start : rows.stop]}
        resp, url, attempts = self._request("POST", index, Endpoints.SCORE, json=payload)
        return self._parse_piece(resp, url, attempts, rows)

    def score(self, request: ScoringRequest) -> tuple[ScoringResponse, ScoreInfo]:
        """Score ``request.inputs``; returns ``(response, info)`` (as :meth:`AsyncRewardClient.score`)."""
        self._check_open()
        base = request.wire()
        inputs = list(request.inputs)
        plan = self._plan(len(inputs), self._item_limit(len(inputs)))
        start = time.monotonic()
        if not plan:
            return self._empty(request, base)
        calls = [lambda i=i, rows=rows: self._score_piece(i, rows, base, inputs) for i, rows in plan]
        return self._assemble(self._fan_out(calls), len(inputs), base, start)

    def score_batch(
        self,
        inputs: Sequence[str],
        *,
        normalize: bool = True,
        n_labels: int | None = None,
        truncate: bool = False,
    ) -> list[Score]:
        """Scores of ``inputs`` in order (as :meth:`AsyncRewardClient.score_batch`)."""
        self._check_open()
        if len(inputs) == 0:
            return []
        response, _ = self.score(self._batch_request(inputs, normalize, n_labels, truncate))
        return response.scores

    def score_chats(
        self, chats: Sequence[Sequence[Mapping[str, Any]]], *, normalize: bool = True
    ) -> list[Score]:
        """Scores of chats in order (as :meth:`AsyncRewardClient.score_chats`), sent concurrently
        from the client's thread pool."""
        self._check_open()

        def one(chat: Sequence[Mapping[str, Any]]) -> Callable[[], Score]:
            def call() -> Score:
                payload = self._chat_payload(chat, normalize)
                resp, url, _ = self._request(
                    "POST", next(self._round_robin), Endpoints.CLASSIFY, json=payload
                )
                return self._parse_classify(resp, url)

            return call

        return self._fan_out([one(c) for c in chats])

    def chat(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        max_tokens: int | None = None,
        temperature: float | None = None,
        top_p: float | None = None,
        n: int | None = None,
        seed: int | None = None,
        stop: str | Sequence[str] | None = None,
        **extra: Any,
    ) -> ChatCompletionResponse:
        """Answer one chat with a generative model (as :meth:`AsyncRewardClient.chat`)."""
        self._check_open()
        sampling = dict(
            max_tokens=max_tokens, temperature=temperature, top_p=top_p, n=n, seed=seed, stop=stop, **extra
        )
        payload = self._chat_completion_payload(messages, sampling)
        path = Endpoints.V1_PREFIX + Endpoints.CHAT_COMPLETIONS
        resp, url, _ = self._request("POST", next(self._round_robin), path, json=payload)
        return self._parse_chat_completion(resp, url)

    def get_runtime_versions(self) -> dict[str, RuntimeVersionResponse]:
        """``/runtime_version`` of every endpoint (version and state)."""
        out: dict[str, RuntimeVersionResponse] = {}
        for i in self._unique_endpoint_indices():
            resp, url, _ = self._request("GET", i, Endpoints.RUNTIME_VERSION, failover=False)
            out[url] = self._parse_runtime_version(resp, url)
        return out

    def sleep(
        self, level: int = 1, *, timeout_s: float = DEFAULT_SLEEP_TIMEOUT_S
    ) -> dict[str, SleepResponse]:
        """Put every server to sleep (see :meth:`AsyncRewardClient.sleep`)."""
        body = self._sleep_body(level, timeout_s)
        return self._control_all(Endpoints.SLEEP, body)

    def wake(self, *, timeout_s: float = DEFAULT_SLEEP_TIMEOUT_S) -> dict[str, SleepResponse]:
        """Wake every server (see :meth:`AsyncRewardClient.wake`)."""
        return self._control_all(Endpoints.WAKE, WakeRequest(timeout_s=float(timeout_s)).model_dump())

    def _control_all(self, path: str, body: dict[str, Any]) -> dict[str, SleepResponse]:
        self._check_open()

        def one(i: int) -> Callable[[], tuple[str, SleepResponse]]:
            def call() -> tuple[str, SleepResponse]:
                resp, url, _ = self._request("POST", i, path, json=body, failover=False)
                return url, self._parse_sleep(resp, url)

            return call

        return dict(self._fan_out([one(i) for i in self._unique_endpoint_indices()]))

    def get_model_versions(self) -> dict[str, int]:
        """Weights version per endpoint."""
        return {url: r.version for url, r in self.get_runtime_versions().items()}

    def get_model_version(self) -> int:
        """Weights version served everywhere: the minimum over endpoints (the stalest replica)."""
        return min(self.get_model_versions().values())

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        with self._lock:
            http, self._http = self._http, None
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=False, cancel_futures=True)
        if http is not None:
            http.close()

    def __enter__(self) -> RewardClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
