"""Scoring client for rewardplane reward servers, on httpx.

One client talks to one or several reward servers (replicas of one model):

- a small call (at most ``min_chunk`` inputs) goes whole to one server, round robin;
- a larger batch is split by deterministic contiguous chunking — server ``i`` gets
  items ``[i * ceil(N/S), (i + 1) * ceil(N/S))`` — sent concurrently and reassembled in order;
- ``N == 0`` returns at once without any request;
- 5xx, connection errors and timeouts are retried with capped exponential backoff
  (:class:`~rewardplane.sdk.retry.RetryPolicy`); a connection error moves the retry to the next
  server; 4xx is never retried and raises :class:`~rewardplane.sdk.retry.RewardServerError` with the
  server's message.

Every scoring reply carries the weights version that produced it; the per-chunk versions are kept
in ``info["versions"]`` and ``ScoringResponse.metadata["versions"]``.

Weight pushes (``sync_weights``) live in a separate module that extends this client.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import itertools
import logging
import os
import threading
import time
import weakref
from collections.abc import Coroutine, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import httpx
import tenacity
from pydantic import ValidationError

from rewardplane.protocol import (
    DEFAULT_BUCKET_BYTES,
    DEFAULT_GROUP_PORT,
    DEFAULT_HTTP_PORT,
    VERSION_HEADER,
    ClassifyResponse,
    Endpoints,
    RewardModelTrainingMode,
    RuntimeVersionResponse,
    Score,
    ScoringRequest,
    ScoringResponse,
    ScoringResult,
    Usage,
    pair_servers,
)
from rewardplane.protocol.auth import auth_headers, resolve_token
from rewardplane.sdk.chunking import assignments, reassemble, split_range
from rewardplane.sdk.http_pool import ShardedAsyncClient
from rewardplane.sdk.retry import (
    RetryPolicy,
    RewardClientError,
    RewardServerError,
    RewardServerUnavailable,
    check_response,
)
from rewardplane.sdk.reward_client_protocol import RewardModelClient

__all__ = ["RewardModelClient", "VLLMRewardClient"]

logger = logging.getLogger(__name__)

T = TypeVar("T")

_HEALTH_POLL_INTERVAL_S = 0.5
_HEALTH_PROBE_TIMEOUT_S = 5.0
_CONNECT_TIMEOUT_CAP_S = 10.0
_CLOSE_TIMEOUT_S = 5.0


@dataclass(frozen=True)
class _Piece:
    """One request's share of a batch and what came back for it."""

    rows: range
    url: str
    attempts: int
    response: ScoringResponse
    raw: dict[str, Any]


def _base_url(host: str, port: int) -> str:
    if "://" in host:  # a full URL passed as host: take it as the base
        return host.rstrip("/")
    if ":" in host and not host.startswith("["):  # bare IPv6 literal
        host = f"[{host}]"
    return f"http://{host}:{port}"


def _normalize_endpoint(url: str) -> str:
    url = url.strip().rstrip("/")
    if "://" not in url:
        url = f"http://{url}"
    parsed = httpx.URL(url)
    if parsed.scheme not in ("http", "https") or not parsed.host:
        raise ValueError(f"endpoint {url!r} is not an http(s) base URL like 'http://127.0.0.1:8001'")
    return url


class VLLMRewardClient:
    """Client for one or several reward servers serving the same model.

    Args (the seed's, then rewardplane's):
        host, port: the server when ``endpoints`` is not given (``host`` is used as given).
        group_port: process-group port for weight pushes; server ``i`` uses ``group_port + i``
            unless ``group_ports`` lists them.
        connection_timeout_s: how long the start-up health check waits for every server.
        enable_weight_updates, device: read by the weight-sync module.
        model_name: ``model`` field of scoring requests.
        endpoints: base URLs of several servers (``http://127.0.0.2:8001``); overrides host/port.
        group_ports: one group port per endpoint.
        retry: the retry policy for transient failures.
        request_timeout_s: per-attempt timeout of a scoring request (connect capped at 10 s).
        token, token_file: control-plane token (see :func:`~rewardplane.protocol.auth.resolve_token`).
        check_server: poll ``/health`` of every server at construction and fail fast if one does
            not come up within ``connection_timeout_s``.
        min_chunk: batches of at most this many inputs go whole to one server (round robin).
        max_items_per_request: cut each server's chunk into requests of at most this many inputs
            (match the server's max items per request); ``None`` sends one request per chunk.
        max_connections: connections per event loop (many concurrent scoring calls), spread
            over pools of at most 32 (``http_pool``: one large httpx pool costs CPU per request).
        trainer_host: this trainer's address as the servers reach it (weight pushes; default:
            the local address on the route to the first server).
        bucket_bytes: size of the flat buckets a push broadcasts (large buckets reach the link's
            limit; 1 GiB by default).
        atomic_updates: servers stage a whole push and swap it in under the scoring lock (costs
            a copy of the pushed parameters on each server; scoring continues during the transfer).
        per_server_groups: one process group per server on ``group_ports`` instead of one group
            spanning all servers.
    """

    def __init__(
        self,
        *,
        host: str = "0.0.0.0",
        port: int = DEFAULT_HTTP_PORT,
        group_port: int = DEFAULT_GROUP_PORT,
        connection_timeout_s: float = 60,
        enable_weight_updates: bool = False,
        device: Any = 0,
        model_name: str = "reward-model",
        endpoints: Sequence[str] | None = None,
        group_ports: int | Sequence[int] | None = None,
        retry: RetryPolicy | None = None,
        request_timeout_s: float = 60.0,
        token: str | None = None,
        token_file: str | os.PathLike[str] | None = None,
        check_server: bool = True,
        min_chunk: int = 8,
        max_items_per_request: int | None = None,
        max_connections: int = 256,
        trainer_host: str | None = None,
        bucket_bytes: int = DEFAULT_BUCKET_BYTES,
        atomic_updates: bool = False,
        per_server_groups: bool = False,
    ) -> None:
        if connection_timeout_s <= 0 or request_timeout_s <= 0:
            raise ValueError("connection_timeout_s and request_timeout_s must be > 0")
        if min_chunk < 1:
            raise ValueError(f"min_chunk must be >= 1, got {min_chunk}")
        if max_items_per_request is not None and max_items_per_request < 1:
            raise ValueError(f"max_items_per_request must be >= 1 or None, got {max_items_per_request}")
        if max_connections < 1:
            raise ValueError(f"max_connections must be >= 1, got {max_connections}")
        if isinstance(endpoints, str):
            endpoints = [endpoints]
        if endpoints is not None and len(endpoints) == 0:
            raise ValueError("endpoints is empty: give at least one reward server URL, or None for host/port")

        self.host = host
        self.port = port
        self.group_port = group_port
        self.connection_timeout_s = float(connection_timeout_s)
        self.enable_weight_updates = enable_weight_updates
        self.device = device
        self.model_name = model_name
        self._model_name = model_name  # the seed's attribute name
        self.retry = retry if retry is not None else RetryPolicy()
        self.request_timeout_s = float(request_timeout_s)
        self.min_chunk = min_chunk
        self.max_items_per_request = max_items_per_request

        urls = [_normalize_endpoint(u) for u in endpoints] if endpoints else [_base_url(host, port)]
        ports: int | list[int] = (
            group_port
            if group_ports is None
            else (group_ports if isinstance(group_ports, int) else list(group_ports))
        )
        self.servers: list[tuple[str, int]] = pair_servers(urls, ports)
        self.endpoints: list[str] = [u for u, _ in self.servers]
        self.group_ports: list[int] = [p for _, p in self.servers]
        self.server_url = self.endpoints[0]  # the seed's attribute (single-server code paths)

        self.token = resolve_token(token, token_file)
        self.headers: dict[str, str] = auth_headers(self.token)

        self._timeout = httpx.Timeout(
            self.request_timeout_s, connect=min(self.request_timeout_s, _CONNECT_TIMEOUT_CAP_S)
        )
        self._max_connections = max_connections
        self._limits = httpx.Limits(
            max_connections=max_connections, max_keepalive_connections=max_connections
        )
        self._round_robin = itertools.count()
        self._lock = threading.Lock()
        self._closed = False
        self._sync_client: httpx.Client | None = None
        # httpx.AsyncClient is bound to the loop that first used it, so keep one per loop.
        self._async_clients: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, ShardedAsyncClient] = (
            weakref.WeakKeyDictionary()
        )
        # Private loop on a daemon thread for the *_sync methods (works under a running loop too).
        self._loop: asyncio.AbstractEventLoop | None = None
        self._loop_thread: threading.Thread | None = None

        self._weight_sync_options: dict[str, Any] = {
            "trainer_host": trainer_host,
            "bucket_bytes": bucket_bytes,
            "atomic": atomic_updates,
            "per_server_groups": per_server_groups,
        }
        self._weight_sync: Any = None

        if check_server:
            self.check_server(self.connection_timeout_s)
        if enable_weight_updates:
            self._direct_sync().open()  # the seed joins the group at construction

    # ------------------------------------------------------------------------------------------
    # HTTP clients (lazy)
    # ------------------------------------------------------------------------------------------

    @property
    def http(self) -> httpx.Client:
        """The synchronous httpx client (control plane, health checks); created on first use."""
        self._check_open()
        with self._lock:
            if self._sync_client is None or self._sync_client.is_closed:
                self._sync_client = httpx.Client(
                    timeout=self._timeout, limits=self._limits, headers=self.headers
                )
            return self._sync_client

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

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("VLLMRewardClient is closed; create a new client")

    # ------------------------------------------------------------------------------------------
    # Health
    # ------------------------------------------------------------------------------------------

    def check_server(self, timeout_s: float | None = None) -> None:
        """Wait until every endpoint's ``/health`` says ok, at most ``timeout_s`` (bounded poll).

        A 4xx on ``/health`` fails at once: whatever listens there is not a reward server.
        """
        timeout_s = self.connection_timeout_s if timeout_s is None else timeout_s
        deadline = time.monotonic() + timeout_s
        pending = list(dict.fromkeys(self.endpoints))
        last_error: dict[str, BaseException] = {}
        polls = 0
        while True:
            polls += 1
            for url in list(pending):
                remaining = max(0.1, deadline - time.monotonic())
                try:
                    resp = self.http.get(
                        url + Endpoints.HEALTH, timeout=min(_HEALTH_PROBE_TIMEOUT_S, remaining)
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
            time.sleep(max(0.0, min(_HEALTH_POLL_INTERVAL_S, deadline - time.monotonic())))

    # ------------------------------------------------------------------------------------------
    # Requests with retry
    # ------------------------------------------------------------------------------------------

    async def _request(
        self, method: str, index: int, path: str, *, json: Any = None, failover: bool = True
    ) -> tuple[httpx.Response, str, int]:
        """Send one request to endpoint ``index`` under the retry policy.

        Returns (response, url that answered, attempts). A connection error moves to the next
        endpoint when ``failover`` and the policy allow it (the request never reached a server,
        so resending elsewhere cannot duplicate work).
        """
        client = self._aclient()
        n = len(self.endpoints)
        idx = index % n
        tried: list[str] = []
        start = time.monotonic()
        try:
            async for attempt in self.retry.async_retrying():
                with attempt:
                    url = self.endpoints[idx]
                    tried.append(url)
                    try:
                        resp = check_response(await client.request(method, url + path, json=json))
                    except (httpx.TransportError, RewardServerError) as exc:
                        if self.retry.is_retryable(exc):
                            logger.warning(
                                "attempt %d/%d: %s %s%s failed: %s",
                                len(tried),
                                self.retry.max_attempts,
                                method,
                                url,
                                path,
                                exc,
                            )
                            if failover and self.retry.failover and n > 1 and self.retry.should_failover(exc):
                                idx = (idx + 1) % n
                        raise
                    return resp, url, len(tried)
        except tenacity.RetryError as err:
            last = err.last_attempt.exception()
            raise RewardServerUnavailable(
                tried[-1], len(tried), last, urls=tried, elapsed_s=time.monotonic() - start
            ) from last
        except httpx.TransportError as exc:  # a transport error the policy does not retry
            raise RewardServerUnavailable(
                tried[-1] if tried else self.endpoints[idx],
                len(tried),
                exc,
                urls=tried,
                elapsed_s=time.monotonic() - start,
            ) from exc
        raise AssertionError("unreachable: tenacity returns, raises or gives RetryError")

    # ------------------------------------------------------------------------------------------
    # Scoring
    # ------------------------------------------------------------------------------------------

    def _plan(self, n: int) -> list[tuple[int, range]]:
        """(endpoint index, rows) of every request for a batch of ``n`` inputs."""
        if n == 0:
            return []
        servers = len(self.endpoints)
        if servers == 1 or n <= self.min_chunk:
            plan = [(next(self._round_robin) % servers, range(n))]
        else:
            plan = assignments(n, servers)
        if self.max_items_per_request is not None:
            plan = [(i, piece) for i, rows in plan for piece in split_range(rows, self.max_items_per_request)]
        return plan

    async def _score_piece(self, index: int, rows: range, base: dict[str, Any], inputs: list[str]) -> _Piece:
        payload = {**base, "input": inputs[rows.start : rows.stop]}
        resp, url, attempts = await self._request("POST", index, Endpoints.SCORE, json=payload)
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

    async def score(self, request: ScoringRequest) -> tuple[ScoringResponse, dict[str, Any]]:
        """Score ``request.inputs``; returns ``(response, info)``.

        ``response.scores`` is in input order. ``response.version`` is the lowest weights version
        among the chunks (the conservative value for staleness checks);
        ``response.metadata["versions"]`` and ``info["versions"]`` list every chunk's version, and
        ``metadata["mixed_versions"]`` says whether a weight update landed between chunks.
        An empty ``inputs`` makes no request and returns an empty response (version 0).
        """
        self._check_open()
        base = request.wire()
        inputs = list(request.inputs)
        plan = self._plan(len(inputs))
        start = time.monotonic()
        if not plan:
            meta: dict[str, Any] = {"versions": [], "endpoints": [], "mixed_versions": False}
            return (
                ScoringResponse(model=request.model, data=[], version=0, metadata=meta),
                {"versions": [], "chunks": [], "request": base, "raw_responses": [], "elapsed_s": 0.0},
            )
        pieces = await _gather_or_cancel([self._score_piece(i, rows, base, inputs) for i, rows in plan])

        try:
            ordered = reassemble(
                [p.rows for p in pieces],
                [sorted(p.response.data, key=lambda d: d.index) for p in pieces],
                len(inputs),
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
            versions=versions,
            endpoints=[p.url for p in pieces],
            mixed_versions=len(set(versions)) > 1,
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
        if isinstance(inputs, str):
            inputs = [inputs]
        if len(inputs) == 0:
            return []
        request = ScoringRequest(
            model=self.model_name,
            inputs=list(inputs),
            normalize=normalize,
            n_labels=n_labels,
            truncate=truncate,
        )
        response, _ = await self.score(request)
        return response.scores

    def score_batch_sync(
        self,
        inputs: Sequence[str],
        *,
        normalize: bool = True,
        n_labels: int | None = None,
        truncate: bool = False,
    ) -> list[Score]:
        """Blocking :meth:`score_batch`; usable from plain code and from inside a running loop's thread."""
        if len(inputs) == 0:
            return []
        return self._run_sync(
            self.score_batch(inputs, normalize=normalize, n_labels=n_labels, truncate=truncate)
        )

    def score_sync(self, request: ScoringRequest) -> tuple[ScoringResponse, dict[str, Any]]:
        """Blocking :meth:`score`."""
        return self._run_sync(self.score(request))

    async def score_chats(
        self, chats: Sequence[Sequence[Mapping[str, Any]]], *, normalize: bool = True
    ) -> list[Score]:
        """Scores of chats (lists of ``{"role", "content"}`` messages, the answer last), each rendered
        through the model's chat template by the server: one ``/classify`` request per chat
        (vLLM's chat shape), spread round robin over the servers, in input order.
        ``normalize=False`` returns the raw head output."""
        self._check_open()

        async def one(chat: Sequence[Mapping[str, Any]]) -> Score:
            payload = {
                "model": self.model_name,
                "messages": [dict(m) for m in chat],
                "use_activation": normalize,
            }
            resp, url, _ = await self._request(
                "POST", next(self._round_robin), Endpoints.CLASSIFY, json=payload
            )
            try:
                probs = ClassifyResponse.model_validate(resp.json()).data[0].probs
            except (ValueError, ValidationError, IndexError) as exc:
                raise RewardClientError(
                    f"reward server {url} sent an unreadable /classify reply ({exc}); is it a rewardplane "
                    "server of a compatible version?"
                ) from exc
            return probs[0] if len(probs) == 1 else probs

        return await _gather_or_cancel([one(c) for c in chats])

    def score_chats_sync(
        self, chats: Sequence[Sequence[Mapping[str, Any]]], *, normalize: bool = True
    ) -> list[Score]:
        """Blocking :meth:`score_chats`."""
        if len(chats) == 0:
            return []
        return self._run_sync(self.score_chats(chats, normalize=normalize))

    # ------------------------------------------------------------------------------------------
    # Versions
    # ------------------------------------------------------------------------------------------

    async def get_runtime_versions(self) -> dict[str, RuntimeVersionResponse]:
        """``/runtime_version`` of every endpoint (version and state), asked concurrently."""
        self._check_open()

        async def one(i: int) -> tuple[str, RuntimeVersionResponse]:
            # No failover: the answer must come from this very endpoint.
            resp, url, _ = await self._request("GET", i, Endpoints.RUNTIME_VERSION, failover=False)
            try:
                return url, RuntimeVersionResponse.model_validate(resp.json())
            except (ValueError, ValidationError) as exc:
                raise RewardClientError(
                    f"reward server {url} sent an unreadable /runtime_version reply: {exc}"
                ) from exc

        unique = list(dict.fromkeys(self.endpoints))
        results = await _gather_or_cancel([one(self.endpoints.index(u)) for u in unique])
        return dict(results)

    async def get_model_versions(self) -> dict[str, int]:
        """Weights version per endpoint."""
        return {url: r.version for url, r in (await self.get_runtime_versions()).items()}

    async def get_model_version(self) -> int:
        """Weights version served everywhere: the minimum over endpoints (the stalest replica)."""
        return min((await self.get_model_versions()).values())

    def get_model_version_sync(self) -> int:
        return self._run_sync(self.get_model_version())

    # ------------------------------------------------------------------------------------------
    # Private event loop for the *_sync methods
    # ------------------------------------------------------------------------------------------

    def _sync_budget_s(self) -> float:
        # A safety net only: the inner calls are already bounded by per-attempt timeouts and the
        # retry policy; this catches a wedged loop so that a sync caller never hangs forever.
        return 2 * self.retry.worst_case_s(self.request_timeout_s) + 30.0

    def _ensure_loop(self) -> asyncio.AbstractEventLoop:
        with self._lock:
            if self._loop is not None:
                return self._loop
            loop = asyncio.new_event_loop()
            ready = threading.Event()

            def main() -> None:
                asyncio.set_event_loop(loop)
                ready.set()
                try:
                    loop.run_forever()
                finally:
                    loop.run_until_complete(loop.shutdown_asyncgens())
                    loop.close()

            thread = threading.Thread(target=main, name="rewardplane-client-loop", daemon=True)
            thread.start()
            if not ready.wait(_CLOSE_TIMEOUT_S):
                raise RuntimeError("the client's private event loop did not start within 5s")
            self._loop, self._loop_thread = loop, thread
            return loop

    def _run_sync(self, coro: Coroutine[Any, Any, T]) -> T:
        if threading.current_thread() is self._loop_thread:
            coro.close()
            raise RuntimeError("a *_sync method was called on the client's own loop; await the async method")
        try:
            self._check_open()
        except RuntimeError:
            coro.close()  # never started: no "was never awaited" warning on top of the error
            raise
        loop = self._ensure_loop()
        future = asyncio.run_coroutine_threadsafe(coro, loop)
        budget = self._sync_budget_s()
        try:
            return future.result(timeout=budget)
        except concurrent.futures.TimeoutError:
            future.cancel()
            raise TimeoutError(
                f"scoring call did not finish within {budget:.0f}s although every attempt is bounded; "
                "the client's event loop may be blocked"
            ) from None

    # ------------------------------------------------------------------------------------------
    # Weight sync (direct mode: this client drives the servers' control plane)
    # ------------------------------------------------------------------------------------------

    def _direct_sync(self, timeout_s: float = 600.0) -> Any:
        if self._weight_sync is None:
            from .direct_sync import DirectWeightSync  # torch is only needed for pushes

            self._weight_sync = DirectWeightSync(
                self.endpoints,
                group_port=self.group_ports[0],
                group_ports=self.group_ports,
                token=self.token,
                device=self.device,
                timeout_s=timeout_s,
                connect_timeout_s=self.connection_timeout_s,
                **self._weight_sync_options,
            )
        return self._weight_sync

    def sync_weights(
        self,
        params: Mapping[str, Any],
        *,
        timeout_s: float = 600.0,
        version: int | None = None,
        training_mode: RewardModelTrainingMode | str = RewardModelTrainingMode.FULL,
        keep_lora: bool = False,
    ) -> str:
        """Push reward-model parameters into every server; returns the version.

        ``params`` by mode: head_only → only the head (``naming.select_head``); lora → the merged
        state dict (``lora.merge_for_sync``); full → the whole state dict. Names are normalised
        from HF/PEFT form; the servers validate names, shapes and dtypes before any byte moves.
        ``version`` defaults to the servers' version + 1. Blocks until every server serves it.
        """
        sync = self._direct_sync(timeout_s)
        pushed = sync.sync(
            params, version=version, training_mode=RewardModelTrainingMode(training_mode), keep_lora=keep_lora
        )
        return str(pushed)

    def create_reward_publisher(self) -> Any:
        """The ``RewardModelPublisher`` behind ``sync_weights`` (joins the group on first use)."""
        return self._direct_sync().open()

    # ------------------------------------------------------------------------------------------
    # Closing
    # ------------------------------------------------------------------------------------------

    def close(self) -> None:
        """Close connection pools and the private loop. From async code prefer :meth:`aclose`."""
        if self._closed:
            return
        self._closed = True
        if self._weight_sync is not None:
            try:
                self._weight_sync.close()
            except Exception as exc:  # closing must not fail the caller's shutdown
                logger.debug("closing the weight sync failed: %s", exc)
            self._weight_sync = None
        loop, thread = self._loop, self._loop_thread
        with self._lock:
            clients = list(self._async_clients.items())
            self._async_clients.clear()
            sync_client, self._sync_client = self._sync_client, None
        for client_loop, client in clients:
            if client.is_closed or client_loop.is_closed():
                continue
            if client_loop is loop or client_loop.is_running():
                fut = asyncio.run_coroutine_threadsafe(client.aclose(), client_loop)
                if client_loop is loop:
                    try:
                        fut.result(timeout=_CLOSE_TIMEOUT_S)
                    except Exception as exc:  # closing must not fail the caller's shutdown
                        logger.debug("closing the async client failed: %s", exc)
            # A client of a loop that is no longer running cannot be closed from here; its
            # sockets are released when it is garbage-collected.
        if sync_client is not None:
            sync_client.close()
        if loop is not None and thread is not None:
            loop.call_soon_threadsafe(loop.stop)
            thread.join(_CLOSE_TIMEOUT_S)
            self._loop = self._loop_thread = None

    async def aclose(self) -> None:
        """Close the current loop's client, then everything else (without blocking the loop)."""
        if self._closed:
            return
        with self._lock:
            client = self._async_clients.pop(asyncio.get_running_loop(), None)
        if client is not None:
            await client.aclose()
        await asyncio.to_thread(self.close)

    def __enter__(self) -> VLLMRewardClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    async def __aenter__(self) -> VLLMRewardClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    def __repr__(self) -> str:
        return f"VLLMRewardClient(endpoints={self.endpoints!r}, model_name={self.model_name!r})"


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


async def _gather_or_cancel(coros: Sequence[Coroutine[Any, Any, T]]) -> list[T]:
    """Run concurrently; on the first failure cancel the rest and raise it (no orphaned requests)."""
    if len(coros) == 1:
        return [await coros[0]]
    tasks = [asyncio.ensure_future(c) for c in coros]
    try:
        await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
    finally:
        pending = [t for t in tasks if not t.done()]
        for t in pending:
            t.cancel()
        if pending:
            # Cancelled httpx requests unwind promptly; the bound guards against a stuck task.
            await asyncio.wait(pending, timeout=_CLOSE_TIMEOUT_S)
    for t in tasks:
        if t.done() and not t.cancelled() and t.exception() is not None:
            raise t.exception()  # type: ignore[misc]
    return [t.result() for t in tasks]
