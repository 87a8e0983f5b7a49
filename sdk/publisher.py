"""Trainer side of a weight push (seed 000 §6.4): a ``ControlPlane`` (HTTP) announces, a
``TensorCommunicator`` (torch.distributed) moves the bytes, ``RewardModelPublisher`` ties them.

A push: normalise names and validate for the training mode → announce to every server (each
validates against its model and answers 400 before any byte moves) → broadcast flat buckets in
deterministic order → agree on success in one status reduction → wait until every server serves
the new version.
"""

from __future__ import annotations

import logging
import socket
import time
import uuid
from collections.abc import Mapping, Sequence
from typing import Any, Protocol

import httpx
import torch

from .auth import resolve_token
from .buckets import meta_of, pack_bucket
from .comm import Backend, Communicator, create_store
from .naming import DEFAULT_HEAD_PATTERNS, normalize_params, validate_for_mode
from .protocol import (
    DEFAULT_BUCKET_BYTES,
    Endpoints,
    InitCommunicatorRequest,
    ParamMeta,
    RewardModelTrainingMode,
    UpdateParamBatchRequest,
    plan_buckets,
)
from .retry import RetryPolicy, call_with_retry, check_response

log = logging.getLogger(__name__)


class WeightSyncError(RuntimeError):
    """A push failed; the message says where and what to do."""


# --------------------------------------------------------------------------------------------
# Interfaces (seed 000 §8.4)
# --------------------------------------------------------------------------------------------


class ControlPlane(Protocol):
    def manifest(self) -> dict[str, ParamMeta] | None: ...

    def announce_update_batch(
        self, metadata: list[ParamMeta], *, version: int, training_mode: RewardModelTrainingMode,
        bucket_bytes: int, atomic: bool,
    ) -> None: ...

    def finalize_update(self, version: int) -> None: ...


class TensorCommunicator(Protocol):
    device: torch.device

    def broadcast(self, tensor: torch.Tensor, src: int) -> None: ...

    def max_flag(self, value: int) -> int: ...

    def close(self) -> None: ...


# --------------------------------------------------------------------------------------------
# HTTP control plane over one or more servers
# --------------------------------------------------------------------------------------------


class HTTPControlPlane:
    """Drives the control plane of every listed server (one process group spans them all)."""

    def __init__(
        self, urls: Sequence[str], *, token: str | None = None, token_file: str | None = None,
        timeout_s: float = 600.0, http_timeout_s: float = 30.0, retry: RetryPolicy | None = None,
    ) -> None:
        if not urls:
            raise ValueError("no reward servers given: pass at least one base URL")
        self.urls = [u.rstrip("/") for u in urls]
        self.timeout_s = timeout_s
        self.retry = retry or RetryPolicy()
        token = resolve_token(token, token_file)
        if token is None:
            raise WeightSyncError(
                "no control-plane token: set REWARDPLANE_TOKEN (or REWARDPLANE_TOKEN_FILE / token_file=) to the "
                "token the reward servers were started with"
            )
        self._http = httpx.Client(timeout=http_timeout_s, headers={"Authorization": f"Bearer {token}"})
        self._world_sizes: list[int] | None = None
        self._manifest: dict[str, ParamMeta] | None = None

    def _get(self, url: str, path: str) -> Any:
        return call_with_retry(self.retry, lambda: self._http.get(url + path), url=url + path).json()

    def _post(self, url: str, path: str, body: dict[str, Any]) -> Any:
        try:
            return check_response(self._http.post(url + path, json=body)).json()
        except httpx.HTTPError as exc:
            raise WeightSyncError(f"reward server {url} did not answer {path}: {exc}") from exc

    def world_sizes(self) -> list[int]:
        if self._world_sizes is None:
            self._world_sizes = [int(self._get(u, Endpoints.WORLD_SIZE)["world_size"]) for u in self.urls]
        return self._world_sizes

    def rank_offsets(self) -> list[int]:
        """Replica i's workers start at Σ world sizes of the replicas before it."""
        offsets, total = [], 0
        for ws in self.world_sizes():
            offsets.append(total)
            total += ws
        return offsets

    def total_world_size(self) -> int:
        """Every server worker plus the trainer (the last rank)."""
        return sum(self.world_sizes()) + 1

    def manifest(self) -> dict[str, ParamMeta]:
        if self._manifest is None:
            items = self._get(self.urls[0], Endpoints.PARAM_MANIFEST)
            self._manifest = {m["name"]: ParamMeta(**m) for m in items}
        return self._manifest

    def init_communicator(self, host: str, port: int, *, backend: Backend, timeout_s: float, group_id: str) -> None:
        world = self.total_world_size()
        for url, offset in zip(self.urls, self.rank_offsets(), strict=True):
            req = InitCommunicatorRequest(host=host, port=port, world_size=world, rank_offset=offset,
                                          backend=backend, timeout_s=timeout_s, group_id=group_id)
            self._post(url, Endpoints.INIT_COMMUNICATOR, req.model_dump(mode="json"))

    def announce_update_batch(
        self, metadata: list[ParamMeta], *, version: int, training_mode: RewardModelTrainingMode,
        bucket_bytes: int, atomic: bool,
    ) -> None:
        body = UpdateParamBatchRequest(
            metadata=metadata, training_mode=training_mode, version=version, bucket_bytes=bucket_bytes,
            atomic=atomic, timeout_s=self.timeout_s,
        ).model_dump(mode="json")
        for url in self.urls:
            self._post(url, Endpoints.UPDATE_PARAM_BATCH, body)

    def finalize_update(self, version: int) -> None:
        """Wait (bounded) until every server reports ``version``; raise with the server's reason."""
        deadline = time.monotonic() + self.timeout_s
        pending = list(self.urls)
        while pending:
            for url in list(pending):
                state = self._get(url, Endpoints.RUNTIME_VERSION)
                if state["version"] >= version and state["state"] == "serving":
                    pending.remove(url)
                    continue
                tasks = self._get(url, Endpoints.NUM_BACKGROUND_TASKS)
                if tasks["num_background_tasks"] == 0 and tasks.get("last_error"):
                    raise WeightSyncError(f"reward server {url} failed the update: {tasks['last_error']}")
            if pending:
                if time.monotonic() > deadline:
                    raise WeightSyncError(
                        f"servers {pending} did not report version {version} within {self.timeout_s:.0f}s"
                    )
                time.sleep(0.005)

    def close_communicator(self) -> None:
        for url in self.urls:
            try:
                self._post(url, Endpoints.CLOSE_COMMUNICATOR, {})
            except Exception as exc:  # closing is best effort; the group is discarded anyway
                log.warning("closing the communicator on %s failed: %s", url, exc)

    def close(self) -> None:
        self._http.close()


def local_address_towards(url: str) -> str:
    """This host's address as the server sees it (the route to the server's host)."""
    host = httpx.URL(url).host
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect((host, 9))  # UDP connect sends nothing; it only picks the route
            return str(s.getsockname()[0])
        except OSError:
            return "127.0.0.1"


def open_trainer_group(
    control: HTTPControlPlane, *, host: str, port: int, device: torch.device, backend: Backend = "auto",
    timeout_s: float = 120.0, bind_host: str | None = None,
) -> Communicator:
    """Host the rendezvous, ask every server to join, and join as the last rank."""
    world = control.total_world_size()
    store = create_store(bind_host or host, port, is_master=True, world_size=world, timeout_s=timeout_s)
    group_id = uuid.uuid4().hex[:12]
    control.init_communicator(host, port, backend=backend, timeout_s=timeout_s, group_id=group_id)
    return Communicator(store, rank=world - 1, world_size=world, device=device, backend=backend,
                        timeout_s=timeout_s, group_id=group_id)


# --------------------------------------------------------------------------------------------
# The publisher
# --------------------------------------------------------------------------------------------


class RewardModelPublisher:
    """Publish reward-model weights for a training mode (seed 000 §6.4)."""

    def __init__(
        self, control: ControlPlane, comm: TensorCommunicator, src_rank: int, *,
        head_name_patterns: Sequence[str] | None = None, bucket_bytes: int = DEFAULT_BUCKET_BYTES,
        atomic: bool = False,
    ) -> None:
        self.control = control
        self.comm = comm
        self.src_rank = src_rank
        self.head_name_patterns = tuple(head_name_patterns or DEFAULT_HEAD_PATTERNS)
        self.bucket_bytes = bucket_bytes
        self.atomic = atomic
        self.last_stats: dict[str, float] = {}

    def prepare(
        self, state_dict: Mapping[str, torch.Tensor], training_mode: RewardModelTrainingMode, *, keep_lora: bool = False
    ) -> dict[str, torch.Tensor]:
        manifest = self.control.manifest()
        params = normalize_params(state_dict, served=set(manifest) if manifest else None, keep_lora=keep_lora)
        validate_for_mode(params, training_mode, self.head_name_patterns)
        return params

    def publish(
        self, state_dict: Mapping[str, torch.Tensor], version: int, *,
        training_mode: RewardModelTrainingMode = RewardModelTrainingMode.FULL, keep_lora: bool = False,
    ) -> int:
        start = time.perf_counter()
        params = self.prepare(state_dict, RewardModelTrainingMode(training_mode), keep_lora=keep_lora)
        names = sorted(params)  # deterministic order on both sides
        tensors = {n: params[n].detach() for n in names}
        metadata = [meta_of(n, tensors[n]) for n in names]
        self.control.announce_update_batch(
            metadata, version=version, training_mode=RewardModelTrainingMode(training_mode),
            bucket_bytes=self.bucket_bytes, atomic=self.atomic,
        )
        announced = time.perf_counter()
        device = self.comm.device
        scratch: torch.Tensor | None = None
        total = 0
        for bucket in plan_buckets(metadata, self.bucket_bytes):
            scratch = pack_bucket(bucket, metadata, tensors, device, out=scratch)
            self.comm.broadcast(scratch, self.src_rank)
            total += bucket.nbytes
            if scratch.numel() < self.bucket_bytes and bucket.nbytes == scratch.numel():
                scratch = None  # a small last bucket; keep the large buffer only
        if self.comm.max_flag(0) != 0:
            raise WeightSyncError(
                f"a reward server failed to load version {version}; see its log and /get_num_background_tasks"
            )
        sent = time.perf_counter()
        self.control.finalize_update(version)
        done = time.perf_counter()
        self.last_stats = {"bytes": total, "prepare_s": announced - start, "transfer_s": sent - announced,
                           "finalize_s": done - sent, "total_s": done - start}
        return version


class Rank0OnlyPublisher:
    """For multi-process learners (seed 004): barrier → rank 0 pushes → barrier. Other ranks never
    join the communicator; they learn rank 0's outcome, so a failed push fails every rank."""

    def __init__(self, make_publisher: Any, *, group: Any = None) -> None:
        self._make = make_publisher
        self._group = group
        self._publisher: RewardModelPublisher | None = None

    def publish(self, state_dict: Mapping[str, torch.Tensor] | None, version: int, **kwargs: Any) -> int:
        import torch.distributed as dist

        if not dist.is_available() or not dist.is_initialized():
            raise WeightSyncError("Rank0OnlyPublisher needs torch.distributed initialised (torchrun)")
        rank = dist.get_rank(self._group)
        dist.barrier(group=self._group)
        outcome: list[Any] = [None]
        if rank == 0:
            try:
                if self._publisher is None:
                    self._publisher = self._make()
                if state_dict is None:
                    raise WeightSyncError("rank 0 must pass the state_dict to publish")
                self._publisher.publish(state_dict, version, **kwargs)
            except Exception as exc:
                outcome[0] = f"{type(exc).__name__}: {exc}"
        dist.broadcast_object_list(outcome, src=dist.get_global_rank(self._group, 0) if self._group else 0,
                                   group=self._group)
        if outcome[0] is not None:
            raise WeightSyncError(f"rank 0's weight push of version {version} failed: {outcome[0]}")
        return version
