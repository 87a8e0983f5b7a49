"""``VLLMRewardClient``: the seed-compatible client, a thin layer over the SDK's parts.

It is an :class:`~rewardplane.sdk.AsyncRewardClient` (``await score_batch``, ``await score``)
that also offers

- the seed's constructor (``host``/``port``/``group_port``, ``enable_weight_updates``, ...) and
  attributes (``server_url``, ``_model_name``);
- blocking ``*_sync`` methods, served by a :class:`~rewardplane.sdk.RewardClient` with the same
  configuration (a real blocking client: no private event loop);
- weight pushes (``sync_weights``, ``create_reward_publisher``) through a
  :class:`~rewardplane.sdk.WeightPusher` (direct mode; needs torch).

New code can use the three parts directly: ``AsyncRewardClient`` or ``RewardClient`` to score,
``WeightPusher`` to push.
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import httpx

from rewardplane.protocol import (
    DEFAULT_BUCKET_BYTES,
    DEFAULT_GROUP_PORT,
    DEFAULT_HTTP_PORT,
    AdapterConfig,
    RewardModelTrainingMode,
    Score,
    ScoringRequest,
    ScoringResponse,
    pair_servers,
)

from ._client import AsyncRewardClient, RewardClient, ScoreInfo
from .retry import RetryPolicy
from .reward_client_protocol import RewardModelClient

if TYPE_CHECKING:  # torch is only imported when a push runs
    from .direct_sync import WeightPusher
    from .publisher import RewardModelPublisher

__all__ = ["RewardModelClient", "VLLMRewardClient"]

logger = logging.getLogger(__name__)


def _base_url(host: str, port: int) -> str:
    if "://" in host:  # a full URL passed as host: take it as the base
        return host.rstrip("/")
    if ":" in host and not host.startswith("["):  # bare IPv6 literal
        host = f"[{host}]"
    return f"http://{host}:{port}"


class VLLMRewardClient(AsyncRewardClient):
    """Client for one or several reward servers serving the same model (seed-compatible).

    Args (the seed's, then rewardplane's):
        host, port: the server when ``endpoints`` is not given (``host`` is used as given).
        group_port: process-group port for weight pushes; server ``i`` uses ``group_port + i``
            unless ``group_ports`` lists them.
        connection_timeout_s: how long the start-up health check waits for every server.
        enable_weight_updates: join the servers' process group at construction (the seed's
            behaviour); otherwise the first push joins it.
        device: the trainer's device for pushes (an int is a CUDA index).
        model_name: ``model`` field of scoring requests.
        endpoints: base URLs of several servers (``http://127.0.0.2:8001``); overrides host/port.
        group_ports: one group port per endpoint.
        retry, request_timeout_s, token, token_file, min_chunk, max_items_per_request,
            max_connections: as for :class:`~rewardplane.sdk.AsyncRewardClient`.
        check_server: poll ``/health`` of every server at construction and fail fast if one does
            not come up within ``connection_timeout_s``.
        trainer_host, bucket_bytes, atomic_updates, per_server_groups: as for
            :class:`~rewardplane.sdk.WeightPusher` (``atomic_updates`` is its ``atomic``).
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
        if connection_timeout_s <= 0:
            raise ValueError(f"connection_timeout_s must be > 0, got {connection_timeout_s}")
        if isinstance(endpoints, str):
            endpoints = [endpoints]
        if endpoints is not None and len(endpoints) == 0:
            raise ValueError("endpoints is empty: give at least one reward server URL, or None for host/port")
        super().__init__(
            list(endpoints) if endpoints else [_base_url(host, port)],
            model_name=model_name,
            retry=retry,
            request_timeout_s=request_timeout_s,
            token=token,
            token_file=token_file,
            min_chunk=min_chunk,
            max_items_per_request=max_items_per_request,
            max_connections=max_connections,
        )
        self.host = host
        self.port = port
        self.group_port = group_port
        self.connection_timeout_s = float(connection_timeout_s)
        self.enable_weight_updates = enable_weight_updates
        self.device = device
        self._model_name = model_name  # the seed's attribute name
        ports: int | list[int] = (
            group_port
            if group_ports is None
            else (group_ports if isinstance(group_ports, int) else list(group_ports))
        )
        self.servers: list[tuple[str, int]] = pair_servers(self.endpoints, ports)
        self.group_ports: list[int] = [p for _, p in self.servers]
        self.server_url = self.endpoints[0]  # the seed's attribute (single-server code paths)
        self._push_options: dict[str, Any] = {
            "trainer_host": trainer_host,
            "bucket_bytes": bucket_bytes,
            "atomic": atomic_updates,
            "per_server_groups": per_server_groups,
        }
        self._blocking_client: RewardClient | None = None
        self._pusher: WeightPusher | None = None

        if check_server:
            self.check_server(self.connection_timeout_s)
        if enable_weight_updates:
            self.weight_pusher().open()  # the seed joins the group at construction

    def check_server(self, timeout_s: float | None = None) -> None:
        """Wait until every endpoint's ``/health`` says ok (default: ``connection_timeout_s``)."""
        super().check_server(self.connection_timeout_s if timeout_s is None else timeout_s)

    # ------------------------------------------------------------------------------------------
    # Blocking API: a RewardClient with this client's configuration
    # ------------------------------------------------------------------------------------------

    def blocking(self) -> RewardClient:
        """The blocking client behind the ``*_sync`` methods (same endpoints, policy, limits)."""
        self._check_open()
        with self._lock:
            if self._blocking_client is None:
                self._blocking_client = RewardClient(
                    self.endpoints,
                    model_name=self.model_name,
                    retry=self.retry,
                    request_timeout_s=self.request_timeout_s,
                    token=self.token,
                    min_chunk=self.min_chunk,
                    max_items_per_request=self.max_items_per_request,
                    max_connections=self._max_connections,
                )
                # One round robin for sync and async calls alike.
                self._blocking_client._round_robin = self._round_robin
            client = self._blocking_client
        # Settings changed on this client after construction apply to the blocking calls too.
        client.model_name, client.retry = self.model_name, self.retry
        client.min_chunk, client.max_items_per_request = self.min_chunk, self.max_items_per_request
        return client

    @property
    def http(self) -> httpx.Client:
        """The blocking httpx client (kept for code that used it directly)."""
        return self.blocking()._client()

    def score_sync(self, request: ScoringRequest) -> tuple[ScoringResponse, ScoreInfo]:
        """Blocking :meth:`score`."""
        return self.blocking().score(request)

    def score_batch_sync(
        self,
        inputs: Sequence[str],
        *,
        normalize: bool = True,
        n_labels: int | None = None,
        truncate: bool = False,
    ) -> list[Score]:
        """Blocking :meth:`score_batch`; usable from plain code and from inside a running loop."""
        return self.blocking().score_batch(inputs, normalize=normalize, n_labels=n_labels, truncate=truncate)

    def score_chats_sync(
        self, chats: Sequence[Sequence[Mapping[str, Any]]], *, normalize: bool = True
    ) -> list[Score]:
        """Blocking :meth:`score_chats`."""
        return self.blocking().score_chats(chats, normalize=normalize)

    def get_model_version_sync(self) -> int:
        """Blocking :meth:`get_model_version`."""
        return self.blocking().get_model_version()

    # ------------------------------------------------------------------------------------------
    # Weight pushes (direct mode: this client drives the servers' control plane)
    # ------------------------------------------------------------------------------------------

    def weight_pusher(self, timeout_s: float = 600.0) -> WeightPusher:
        """The :class:`~rewardplane.sdk.WeightPusher` over this client's servers (created once)."""
        self._check_open()
        if self._pusher is None:
            from .direct_sync import WeightPusher  # torch is only needed for pushes

            self._pusher = WeightPusher(
                self.endpoints,
                group_port=self.group_ports[0],
                group_ports=self.group_ports,
                token=self.token,
                device=self.device,
                timeout_s=timeout_s,
                connect_timeout_s=self.connection_timeout_s,
                **self._push_options,
            )
        return self._pusher

    def sync_weights(
        self,
        params: Mapping[str, Any],
        *,
        timeout_s: float = 600.0,
        version: int | None = None,
        training_mode: RewardModelTrainingMode | str = RewardModelTrainingMode.FULL,
        keep_lora: bool = False,
        adapter: AdapterConfig | None = None,
    ) -> str:
        """Push reward-model parameters into every server; returns the new version as a string
        (the seed's contract; :meth:`WeightPusher.push` returns it as an int).

        ``params`` by mode: head_only → only the head (``select_head``); lora → the merged state
        dict (``lora.merge_for_sync``); full → the whole state dict. Names are normalised from
        HF/PEFT form; the servers validate names, shapes and dtypes before any byte moves.
        ``version`` defaults to the servers' version + 1. Blocks until every server serves it.
        """
        pushed = self.weight_pusher(timeout_s).push(
            params, version=version, training_mode=training_mode, keep_lora=keep_lora, adapter=adapter
        )
        return str(pushed)

    def max_lora_rank(self) -> int:
        """The largest LoRA rank every server serves as an adapter (0: adapter-only sync is refused)."""
        return self.weight_pusher().max_lora_rank()

    def create_reward_publisher(self) -> RewardModelPublisher:
        """The ``RewardModelPublisher`` behind ``sync_weights`` (joins the group on first use)."""
        return self.weight_pusher().open()

    # ------------------------------------------------------------------------------------------
    # Closing
    # ------------------------------------------------------------------------------------------

    def close(self) -> None:
        """Close the pusher, the blocking client and the connection pools. From async code prefer
        :meth:`aclose` (it also closes the current loop's pools cleanly)."""
        if self._closed:
            return
        self._closed = True
        if self._pusher is not None:
            try:
                self._pusher.close()
            except Exception as exc:  # closing must not fail the caller's shutdown
                logger.debug("closing the weight pusher failed: %s", exc)
            self._pusher = None
        if self._blocking_client is not None:
            self._blocking_client.close()
        for loop, pool in self._detach_pools():
            if not pool.is_closed and not loop.is_closed() and loop.is_running():
                asyncio.run_coroutine_threadsafe(pool.aclose(), loop)

    async def aclose(self) -> None:
        """Close this loop's pools, then everything else (without blocking the loop)."""
        if self._closed:
            return
        await self._close_pools()
        await asyncio.to_thread(self.close)

    def __enter__(self) -> VLLMRewardClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    async def __aenter__(self) -> VLLMRewardClient:
        return self
