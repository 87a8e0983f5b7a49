"""The blocking scoring client, :class:`RewardClient`: the SDK's main client.

Everything but the I/O — configuration, routing over replicas, the requests each method makes and
the parsing of their answers — is the base's (``_client_base.BaseRewardClient``), shared with
:class:`~rewardplane.sdk.AsyncRewardClient`; this module sends those requests on one
``httpx.Client`` and a small thread pool.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
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

from ._client_base import ITEM_LIMIT_PROBE_TIMEOUT_S, BaseRewardClient, _Call
from ._replies import ScoreInfo
from .http_pool import json_body
from .retry import check_response

__all__ = ["RewardClient"]

T = TypeVar("T")


class RewardClient(BaseRewardClient):
    """The blocking scoring client (see :class:`BaseRewardClient` for the arguments).

    Thread-safe. A batch split over several servers is sent concurrently from a small thread
    pool. Close with ``client.close()`` or ``with``.
    """

    def __init__(self, endpoints: str | Sequence[str], **kwargs: Any) -> None:
        super().__init__(endpoints, **kwargs)
        self._http: httpx.Client | None = None
        self._pool: ThreadPoolExecutor | None = None

    # -- I/O ------------------------------------------------------------------------------------

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

    def _send(self, call: _Call[T]) -> T:
        """One request under the retry policy, its answer parsed."""
        client = self._client()
        attempts = self._attempts(call.index, call.method, call.path, call.failover)
        with attempts.giving_up():
            for attempt in self.retry.retrying():
                with attempt, attempts.next_url() as url:
                    resp = check_response(
                        client.request(call.method, url + call.path, **json_body(call.json))
                    )
                    return call.parse(resp, url, len(attempts.tried))
        raise AssertionError("unreachable: tenacity returns, raises or gives RetryError")

    def _send_all(self, calls: Sequence[_Call[T]]) -> list[T]:
        """Several requests, concurrently from the thread pool; answers in order."""
        return self._fan_out([functools.partial(self._send, c) for c in calls])

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

    # -- the API (the same methods and parameters as AsyncRewardClient's) ----------------------

    def score(self, request: ScoringRequest) -> tuple[ScoringResponse, ScoreInfo]:
        """Score ``request.inputs``; returns ``(response, info)`` (as :meth:`AsyncRewardClient.score`)."""
        self._check_open()
        calls = self._score_calls(request, self._item_limit(request.items()))
        start = time.monotonic()
        return self._scored(request, self._send_all(calls), start)

    def score_batch(
        self,
        inputs: Sequence[str],
        *,
        normalize: bool = False,
        n_labels: int | None = None,
        truncate: bool = False,
    ) -> list[Score]:
        """Scores of ``inputs`` in order (as :meth:`AsyncRewardClient.score_batch`)."""
        self._check_open()
        if len(inputs) == 0:
            return []
        response, _ = self.score(self._batch_request(inputs, normalize, n_labels, truncate))
        return response.scores

    def score_steps(
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
        response, _ = self.score(request)
        return sorted(response.data, key=lambda d: d.index)

    def score_chats(
        self, chats: Sequence[Sequence[Mapping[str, Any]]], *, normalize: bool = False
    ) -> list[Score]:
        """Scores of chats in order (as :meth:`AsyncRewardClient.score_chats`), sent concurrently
        from the client's thread pool."""
        self._check_open()
        return self._send_all(self._chat_score_calls(chats, normalize))

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
        return self._send(self._chat_call(messages, sampling))

    def get_runtime_versions(self) -> dict[str, RuntimeVersionResponse]:
        """``/runtime_version`` of every endpoint (version and state), one after another."""
        self._check_open()
        return dict(self._send(c) for c in self._runtime_version_calls())

    def sleep(
        self, level: int = 1, *, timeout_s: float = DEFAULT_SLEEP_TIMEOUT_S
    ) -> dict[str, SleepResponse]:
        """Put every server to sleep (see :meth:`AsyncRewardClient.sleep`)."""
        calls = self._sleep_calls(level, timeout_s)
        self._check_open()
        return dict(self._send_all(calls))

    def wake(
        self, *, timeout_s: float = DEFAULT_SLEEP_TIMEOUT_S, reload: bool = True
    ) -> dict[str, SleepResponse]:
        """Wake every server (see :meth:`AsyncRewardClient.wake`)."""
        self._check_open()
        return dict(self._send_all(self._wake_calls(timeout_s, reload)))

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
