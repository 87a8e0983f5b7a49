"""The asyncio scoring client, :class:`AsyncRewardClient`.

Everything but the I/O is the base's (``_client_base.BaseRewardClient``), shared with the blocking
:class:`~rewardplane.sdk.RewardClient`; this module sends the requests on one set of connection
pools per event loop (``http_pool.ShardedAsyncClient``), concurrently where a method makes several.
"""

from __future__ import annotations

import asyncio
import time
import weakref
from collections.abc import Mapping, Sequence
from typing import Any, TypeVar

import httpx

from rewardplane.protocol import (
    DEFAULT_SLEEP_TIMEOUT_S,
    ChatCompletionResponse,
    Endpoints,
    RuntimeVersionResponse,
    Score,
    ScoringRequest,
    ScoringResponse,
    ScoringResult,
    SleepResponse,
    StepAggregation,
)

from ._aio import gather_or_cancel
from ._client_base import ITEM_LIMIT_PROBE_TIMEOUT_S, BaseRewardClient, _Call
from ._replies import ScoreInfo
from .http_pool import ShardedAsyncClient, json_body
from .retry import check_response

__all__ = ["AsyncRewardClient"]

T = TypeVar("T")


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

    # -- I/O ------------------------------------------------------------------------------------

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

    async def _send(self, call: _Call[T]) -> T:
        """One request under the retry policy, its answer parsed."""
        client = self._aclient()
        attempts = self._attempts(call.index, call.method, call.path, call.failover)
        with attempts.giving_up():
            async for attempt in self.retry.async_retrying():
                with attempt, attempts.next_url() as url:
                    resp = check_response(
                        await client.request(call.method, url + call.path, **json_body(call.json))
                    )
                    return call.parse(resp, url, len(attempts.tried))
        raise AssertionError("unreachable: tenacity returns, raises or gives RetryError")

    async def _send_all(self, calls: Sequence[_Call[T]]) -> list[T]:
        """Several requests, concurrently; answers in order (the first failure cancels the rest)."""
        return await gather_or_cancel([self._send(c) for c in calls])

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

    # -- the API (the same methods and parameters as RewardClient's) ---------------------------

    async def score(self, request: ScoringRequest) -> tuple[ScoringResponse, ScoreInfo]:
        """Score ``request.inputs``; returns ``(response, info)``.

        ``response.scores`` is in input order. ``response.version`` is the lowest weights version
        among the chunks (the conservative value for staleness checks);
        ``response.metadata["versions"]`` lists every chunk's version and
        ``metadata["mixed_versions"]`` says whether a weight update landed between chunks.
        An empty ``inputs`` makes no request and returns an empty response (version 0).
        """
        self._check_open()
        calls = self._score_calls(request, await self._item_limit(request.items()))
        start = time.monotonic()
        return self._scored(request, await self._send_all(calls), start)

    async def score_batch(
        self,
        inputs: Sequence[str],
        *,
        normalize: bool = False,
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

    async def score_steps(
        self,
        solutions: Sequence[str | Sequence[str]],
        *,
        prompts: Sequence[str] | None = None,
        aggregation: StepAggregation | str | None = None,
        normalize: bool = True,
        first_step: int = 0,
    ) -> list[ScoringResult]:
        """A process reward model's scores of ``solutions``, in order, one pass each (see
        ``BaseRewardClient._steps_request`` for the fields)."""
        self._check_open()
        if len(solutions) == 0:
            return []
        request = self._steps_request(solutions, prompts, aggregation, normalize, first_step)
        response, _ = await self.score(request)
        return sorted(response.data, key=lambda d: d.index)

    async def score_chats(
        self, chats: Sequence[Sequence[Mapping[str, Any]]], *, normalize: bool = False
    ) -> list[Score]:
        """Scores of chats (lists of ``{"role", "content"}`` messages, the answer last), each
        rendered through the model's chat template by the server: one ``/classify`` request per
        chat, spread round robin over the servers, in input order. ``normalize=False`` returns the
        raw head output."""
        self._check_open()
        return await self._send_all(self._chat_score_calls(chats, normalize))

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
        return await self._send(self._chat_call(messages, sampling))

    async def get_runtime_versions(self) -> dict[str, RuntimeVersionResponse]:
        """``/runtime_version`` of every endpoint (version and state), asked concurrently."""
        self._check_open()
        return dict(await self._send_all(self._runtime_version_calls()))

    async def sleep(
        self, level: int = 1, *, timeout_s: float = DEFAULT_SLEEP_TIMEOUT_S
    ) -> dict[str, SleepResponse]:
        """Put every server to sleep (``POST /sleep``, token needed), concurrently: level 1 offloads
        the weights to host memory, level 2 discards them (reloaded on wake). Each waits at most
        ``timeout_s`` for its scoring in flight. Idempotent. Per endpoint, the state it is in now."""
        self._check_open()
        return dict(await self._send_all(self._sleep_calls(level, timeout_s)))

    async def wake(
        self, *, timeout_s: float = DEFAULT_SLEEP_TIMEOUT_S, reload: bool = True
    ) -> dict[str, SleepResponse]:
        """Wake every server (``POST /wake``), concurrently; idempotent. A server whose level-2 weights
        could not be rebuilt answers ``weights="broken"`` with the reason in ``detail``. ``reload``
        False: after a level-2 sleep the weights are not rebuilt (nothing is read from disk); the
        servers answer 503 until the next full push (``weights="broken"``, ``detail`` says so)."""
        self._check_open()
        return dict(await self._send_all(self._wake_calls(timeout_s, reload)))

    async def get_model_versions(self) -> dict[str, int]:
        """Weights version per endpoint."""
        return {url: r.version for url, r in (await self.get_runtime_versions()).items()}

    async def get_model_version(self) -> int:
        """Weights version served everywhere: the minimum over endpoints (the stalest replica)."""
        return min((await self.get_model_versions()).values())

    # -- closing --------------------------------------------------------------------------------

    async def aclose(self) -> None:
        """Close this loop's connection pools (and schedule the close of other loops' pools)."""
        if self._closed:
            return
        self._closed = True
        current = asyncio.get_running_loop()
        with self._lock:
            pools = list(self._async_clients.items())
            self._async_clients.clear()
        for loop, pool in pools:
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
