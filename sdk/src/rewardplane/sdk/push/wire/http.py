"""Trainer side of a weight push: an ``HTTPControlPlane`` announces, a
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
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import httpx
import torch

from rewardplane.protocol import (
    STALE_BASE,
    AdapterConfig,
    Bucket,
    CloseCommunicatorResponse,
    Endpoints,
    InitCommunicatorRequest,
    ParamMeta,
    RewardModelTrainingMode,
    UpdateParamBatchRequest,
    layout_id,
    plan_buckets,
)
from rewardplane.protocol.auth import resolve_token
from rewardplane.sdk._exceptions import DeltaRefused, WeightSyncError
from rewardplane.sdk.push.options import PushOptions
from rewardplane.sdk.push.plan.checks import check_fits, names_for_mode
from rewardplane.sdk.push.wire.data_plane import DataPlaneStarter, describe
from rewardplane.sdk.retry import RetryPolicy, RewardServerError, call_with_retry, check_response
from rewardplane.transport.buckets import meta_of
from rewardplane.transport.comm import Backend, Communicator, TensorCommunicator, create_store
from rewardplane.transport.group import open_group
from rewardplane.transport.slices import send_slices
from rewardplane.transport.transfer import send_buckets

log = logging.getLogger(__name__)


# How long the early long-poll for a pushed version waits on the server (finalize_update polls on
# after it, up to the control plane's timeout): long enough for a large push on a fast link.
EARLY_WAIT_S = 10.0


# --------------------------------------------------------------------------------------------
# HTTP control plane over one or more servers
# --------------------------------------------------------------------------------------------


class HTTPControlPlane:
    """Drives the control plane of every listed server (one process group spans them all)."""

    def __init__(
        self,
        urls: Sequence[str],
        *,
        token: str | None = None,
        token_file: str | None = None,
        timeout_s: float = 600.0,
        http_timeout_s: float = 30.0,
        retry: RetryPolicy | None = None,
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
        # The read timeout covers finalize's server-side wait (at most 30 s a request).
        self._http = httpx.Client(
            timeout=httpx.Timeout(max(http_timeout_s, 35.0), connect=min(http_timeout_s, 10.0)),
            headers={"Authorization": f"Bearer {token}"},
        )
        self._world_sizes: list[int] | None = None
        self._manifest: dict[str, ParamMeta] | None = None
        # Servers are driven concurrently: with sequential calls, the last replica joins a push
        # (and reports it done) one HTTP round trip per replica later than the first.
        self._pool = (
            ThreadPoolExecutor(max_workers=min(32, len(self.urls)), thread_name_prefix="rp-control")
            if len(self.urls) > 1
            else None
        )
        self._metadata_json: tuple[list[ParamMeta], int, str, list[dict[str, Any]]] | None = None
        # Layouts every server accepted since the group formed: later pushes name them by id.
        self._announced: set[str] = set()
        # A long-poll per server for the announced version, sent as soon as the announce is
        # accepted: when the update commits, the answer is on its way (finalize_update takes it)
        # instead of a request only then starting its trip. Bounded, so a failed push leaves
        # nothing waiting for long.
        self._waiters = ThreadPoolExecutor(
            max_workers=min(32, len(self.urls)), thread_name_prefix="rp-finalize"
        )
        self._early: tuple[int, dict[str, Future[Any]]] | None = None

    def _each(self, fn: Any) -> list[Any]:
        """``fn(url)`` for every server, concurrently; the first error is raised after all answered."""
        if self._pool is None:
            return [fn(self.urls[0])]
        return [f.result() for f in [self._pool.submit(fn, u) for u in self.urls]]

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

    def versions(self) -> list[int]:
        """The weights version each server serves now."""
        return [int(self._get(u, Endpoints.RUNTIME_VERSION)["version"]) for u in self.urls]

    def delta_bases(self) -> list[int | None]:
        """The version each server would take a delta push on (``RuntimeVersionResponse.delta_base``:
        None where it restarted, was restored or broke since its last push, or is older)."""

        def base(url: str) -> int | None:
            answer = self._get(url, Endpoints.RUNTIME_VERSION)
            return None if answer.get("state") != "serving" else answer.get("delta_base")

        return self._each(base)

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

    def max_lora_rank(self) -> int:
        """The largest LoRA rank every server serves as an adapter; 0 where any takes no adapters."""
        return min(int(self._get(u, Endpoints.MODEL_INFO).get("max_lora_rank", 0)) for u in self.urls)

    def manifest(self) -> dict[str, ParamMeta]:
        if self._manifest is None:
            items = self._get(self.urls[0], Endpoints.PARAM_MANIFEST)
            self._manifest = {m["name"]: ParamMeta(**m) for m in items}
        return self._manifest

    def init_communicator(
        self, host: str, port: int, *, backend: Backend, timeout_s: float, group_id: str, senders: int = 1
    ) -> None:
        """Ask every server to join the group whose last ``senders`` ranks are the trainer's."""
        self._announced.clear()  # a new group may mean restarted servers: announce layouts in full again
        world = sum(self.world_sizes()) + senders
        for url, offset in zip(self.urls, self.rank_offsets(), strict=True):
            req = InitCommunicatorRequest(
                host=host,
                port=port,
                world_size=world,
                rank_offset=offset,
                backend=backend,
                timeout_s=timeout_s,
                group_id=group_id,
                senders=senders,
            )
            self._post(url, Endpoints.INIT_COMMUNICATOR, req.model_dump(mode="json", exclude_defaults=True))

    def announce_update_batch(
        self,
        metadata: list[ParamMeta],
        *,
        version: int,
        training_mode: RewardModelTrainingMode,
        bucket_bytes: int,
        atomic: bool,
        adapter: AdapterConfig | None = None,
        base_version: int | None = None,
    ) -> None:
        cached = self._metadata_json
        if cached is None or cached[0] is not metadata or cached[1] != bucket_bytes:
            # a publisher re-sends one layout: name and dump it once
            cached = (
                metadata,
                bucket_bytes,
                layout_id(metadata, bucket_bytes),
                [m.model_dump(mode="json") for m in metadata],
            )
            self._metadata_json = cached
        lid = cached[2]
        body = UpdateParamBatchRequest.model_construct(
            training_mode=training_mode,
            version=version,
            bucket_bytes=bucket_bytes,
            atomic=atomic,
            timeout_s=self.timeout_s,
            layout_id=lid,
            adapter=adapter,
            base_version=base_version,
        ).model_dump(mode="json", exclude={"metadata"})
        known = lid in self._announced
        if not known:
            body["metadata"] = cached[3]
        self._early = None
        try:
            self._each(lambda url: self._post(url, Endpoints.UPDATE_PARAM_BATCH, body))
        except RewardServerError as exc:
            self._announced.discard(lid)  # e.g. a server forgot it (409): the next push sends it again
            if _is_stale_base(exc.detail):
                raise DeltaRefused(exc.message) from exc
            raise
        except Exception:
            self._announced.discard(lid)
            raise
        self._announced.add(lid)
        query = f"{Endpoints.RUNTIME_VERSION}?wait_for_version={version}&timeout_s={EARLY_WAIT_S:.0f}"
        self._early = (version, {u: self._waiters.submit(self._http.get, u + query) for u in self.urls})

    def finalize_update(self, version: int) -> None:
        """Wait (bounded) until every server reports ``version``; raise with the server's reason.

        Each server holds the request until it serves the version (or fails), so this costs one
        round trip per server rather than a polling loop."""
        deadline = time.monotonic() + self.timeout_s
        early = self._early[1] if self._early is not None and self._early[0] == version else {}
        self._early = None

        def answered_early(url: str) -> bool:
            try:
                state = early[url].result(timeout=EARLY_WAIT_S + 5).json()
            except Exception:  # no early answer (e.g. connection trouble): the loop below decides
                return False
            return bool(state["version"] >= version and state["state"] == "serving")

        def wait_for(url: str) -> None:
            if url in early and answered_early(url):
                return
            while True:
                wait_s = max(0.0, min(30.0, deadline - time.monotonic()))
                state = self._get(
                    url, f"{Endpoints.RUNTIME_VERSION}?wait_for_version={version}&timeout_s={wait_s:.3f}"
                )
                if state["version"] >= version and state["state"] == "serving":
                    return
                tasks = self._get(url, Endpoints.NUM_BACKGROUND_TASKS)
                if tasks["num_background_tasks"] == 0 and tasks.get("last_error"):
                    raise WeightSyncError(f"reward server {url} failed the update: {tasks['last_error']}")
                if time.monotonic() > deadline:
                    raise WeightSyncError(
                        f"server {url} did not report version {version} within {self.timeout_s:.0f}s "
                        f"(it serves {state['version']}, state {state['state']!r})"
                    )

        self._each(wait_for)

    def close_communicator(self) -> None:
        """Every server leaves the group; one still waiting to join it stops waiting (its join is cancelled)."""

        def close(url: str) -> None:
            try:
                answer = CloseCommunicatorResponse.model_validate(
                    self._post(url, Endpoints.CLOSE_COMMUNICATOR, {})
                )
            except Exception as exc:  # closing is best effort; the group is discarded anyway
                log.warning("closing the communicator on %s failed: %s", url, exc)
                return
            if answer.cancelled_join is not None:
                j = answer.cancelled_join
                log.info(
                    "%s: cancelled its join of group %s at %s:%d (pending %.1fs)",
                    url,
                    j.group_id,
                    j.host,
                    j.port,
                    j.pending_s,
                )

        self._each(close)

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
        self._waiters.shutdown(wait=False, cancel_futures=True)
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
    control: HTTPControlPlane,
    *,
    host: str,
    port: int,
    device: torch.device,
    backend: Backend = "auto",
    timeout_s: float = 120.0,
    bind_host: str | None = None,
) -> Communicator:
    """Host the rendezvous, ask every server to join, and join as the last rank."""
    world = control.total_world_size()
    store = create_store(bind_host or host, port, is_master=True, world_size=world, timeout_s=timeout_s)
    group_id = uuid.uuid4().hex[:12]
    control.init_communicator(host, port, backend=backend, timeout_s=timeout_s, group_id=group_id)
    return open_group(
        store,
        rank=world - 1,
        world_size=world,
        device=device,
        backend=backend,
        timeout_s=timeout_s,
        group_id=group_id,
    )


# --------------------------------------------------------------------------------------------
# The publisher
# --------------------------------------------------------------------------------------------


class RewardModelPublisher:
    """Publish reward-model weights for a training mode."""

    def __init__(
        self,
        control: HTTPControlPlane,
        comm: TensorCommunicator,
        src_rank: int,
        options: PushOptions | None = None,
        *,
        data_plane: DataPlaneStarter | None = None,
    ) -> None:
        self.control = control
        self.comm = comm
        self.src_rank = src_rank
        # bucket size, atomic, timeout and head patterns: the front door's (default: the defaults)
        self.options = options or PushOptions()
        # where set, pushes of a layout every server accepted start from the data plane
        self.data_plane = data_plane
        self.last_stats: dict[str, float] = {}
        self._layout_cache: tuple[Any, list[tuple[str, str]], list[ParamMeta], list[Bucket], str] | None = (
            None
        )

    def prepare(
        self,
        state_dict: Mapping[str, torch.Tensor],
        training_mode: RewardModelTrainingMode,
        *,
        keep_lora: bool = False,
        adapter: AdapterConfig | None = None,
    ) -> dict[str, torch.Tensor]:
        """Normalised names → tensors, validated for the mode (and against the served manifest)."""
        names, _, _, _ = self._layout(state_dict, training_mode, keep_lora, adapter)
        return {server: state_dict[key] for server, key in names}

    def _layout(
        self,
        state_dict: Mapping[str, torch.Tensor],
        mode: RewardModelTrainingMode,
        keep_lora: bool,
        adapter: AdapterConfig | None = None,
        partial: bool = False,
    ) -> tuple[list[tuple[str, str]], list[ParamMeta], list[Bucket], str]:
        """(server name, caller's key) in broadcast order, the metadata to announce, its buckets,
        its layout id. ``partial``: a delta push's subset, whose mode rules (e.g. a full push carries
        the backbone) held for the whole push it is a delta of; names and shapes are checked all the same.

        Cached by the names, shapes and dtypes: a trainer pushes the same layout every step, and
        this work would otherwise sit on the critical path of every push."""
        key = (mode, keep_lora, adapter, partial, tuple((k, v.shape, v.dtype) for k, v in state_dict.items()))
        if self._layout_cache is not None and self._layout_cache[0] == key:
            return self._layout_cache[1:]
        manifest = self.control.manifest()
        renamed = names_for_mode(
            {k: k for k in state_dict},
            mode,
            served=set(manifest) if manifest else None,
            keep_lora=keep_lora,
            head_patterns=self.options.head_patterns,
            adapter=adapter,
            check_mode=not partial,
        )
        order = [(server, renamed[server]) for server in sorted(renamed)]  # deterministic on both sides
        metadata = [meta_of(server, state_dict[k]) for server, k in order]
        if manifest:  # the server would answer 400: say so before anything moves
            check_fits(metadata, manifest, mode, adapter)
        plan = plan_buckets(metadata, self.options.bucket_bytes)
        lid = layout_id(metadata, self.options.bucket_bytes)
        self._layout_cache = (key, order, metadata, plan, lid)
        return order, metadata, plan, lid

    def publish(
        self,
        state_dict: Mapping[str, torch.Tensor],
        version: int,
        *,
        training_mode: RewardModelTrainingMode = RewardModelTrainingMode.FULL,
        keep_lora: bool = False,
        adapter: AdapterConfig | None = None,
        base_version: int | None = None,
    ) -> int:
        """Push ``state_dict`` as ``version``. ``base_version``: a delta push — ``state_dict`` holds
        only what changed since that version, which every replica must hold as it was pushed; where
        one does not, :class:`DeltaRefused` is raised before any byte moves."""
        start = time.perf_counter()
        started_at = time.monotonic()  # the servers' timelines use this clock too (same host)
        mode = RewardModelTrainingMode(training_mode)
        order, metadata, plan, lid = self._layout(
            state_dict, mode, keep_lora, adapter, partial=base_version is not None
        )
        prepared = time.perf_counter()
        # An adapter push is announced over HTTP: its adapter settings are not in the push header.
        dp = self.data_plane if adapter is None else None
        if dp is not None and dp.usable(lid):
            stats = self._publish_from_data_plane(
                dp, state_dict, order, metadata, plan, lid, version, mode, base_version
            )
            if stats is not None:
                self.last_stats = {
                    "bytes": stats["bytes"],
                    "prepare_s": prepared - start,
                    "transfer_s": stats["synchronized"] - prepared,
                    "finalize_s": stats["committed"] - stats["synchronized"],
                    "total_s": stats["committed"] - start,
                    "started_at": started_at,
                    "announced_at_s": stats["header"] - start,  # the header is written
                    "ready_at_s": stats["ready"] - start,  # every replica accepted it
                    "synchronized_at_s": stats["synchronized"] - start,
                    "flagged_at_s": stats["committed"] - start,  # every replica committed
                }
                return version
            # the servers lost the layout: announce it over HTTP, below
        if base_version is not None:
            self._check_delta_bases(base_version)
        # The announce on this thread, once the first bucket's packing is enqueued (the GPU packs
        # while the servers accept); a refusal raises before a byte is sent. While the servers set
        # up their receive this thread enqueues the first buckets. (Announcing from a helper
        # thread during packing was slower: it waited for the GIL.)
        announced = prepared
        tensors = _detached(state_dict, order)

        def announce() -> bool:
            nonlocal announced
            self.control.announce_update_batch(
                metadata,
                version=version,
                training_mode=mode,
                bucket_bytes=self.options.bucket_bytes,
                atomic=self.options.atomic,
                adapter=adapter,
                base_version=base_version,
            )
            announced = time.perf_counter()
            self._phase("send")
            return True

        total = self._broadcast(metadata, tensors, plan, before_first=announce)
        synchronized = time.perf_counter()
        if self.comm.max_flag(0) != 0:
            raise WeightSyncError(
                f"a reward server failed to load version {version}; see its log and /get_num_background_tasks"
            )
        sent = time.perf_counter()
        self.control.finalize_update(version)
        if dp is not None:
            dp.learned(lid)  # every server accepted it: the next pushes start from the data plane
        done = time.perf_counter()
        # phases, and a timeline (seconds after the call) to set beside the servers' (last_update)
        self.last_stats = {
            "bytes": total,
            "prepare_s": prepared - start,
            "transfer_s": sent - prepared,
            "finalize_s": done - sent,
            "total_s": done - start,
            "started_at": started_at,
            "announced_at_s": announced - start,
            "synchronized_at_s": synchronized - start,
            "flagged_at_s": sent - start,
        }
        return version

    def _broadcast(
        self,
        metadata: list[ParamMeta],
        tensors: dict[str, torch.Tensor],
        plan: list[Bucket],
        *,
        before_first: Callable[[], bool],
    ) -> int:
        """``plan``'s buckets broadcast from this rank, whole (not sliced); ``before_first`` runs
        before any byte is sent (False: nothing is sent). Returns the bytes sent."""
        return send_buckets(
            self.comm,
            metadata,
            tensors,
            self.options.bucket_bytes,
            self.src_rank,
            plan=plan,
            before_first=before_first,
        )

    def _check_delta_bases(self, base_version: int) -> None:
        """Before a delta push is announced over HTTP: every server says it holds ``base_version``
        as pushed, else DeltaRefused. Each server checks again when the announce arrives; asking
        first keeps one replica's refusal from leaving the others, which accepted, waiting for bytes
        (a push from the data plane agrees on refusals in its ready reduction instead)."""
        bases = self.control.delta_bases()
        if any(b != base_version for b in bases):
            raise DeltaRefused(
                f"a delta push builds on version {base_version}, but the replicas hold "
                f"{bases} as pushed (None: restarted, restored, broken or never pushed to)"
            )

    def _phase(self, step: str, *, sliced: bool = False) -> None:
        """Called as a push enters a phase other sending ranks take part in (``ready``: a
        data-plane push's ready reduction is next, ``sliced`` or broadcast; ``send``: the servers
        accepted the announce)."""

    def _publish_from_data_plane(
        self,
        dp: DataPlaneStarter,
        state_dict: Mapping[str, torch.Tensor],
        order: list[tuple[str, str]],
        metadata: list[ParamMeta],
        plan: list[Bucket],
        lid: str,
        version: int,
        mode: RewardModelTrainingMode,
        base_version: int | None = None,
    ) -> dict[str, float] | None:
        """Header → ready reduction → buckets → commit reduction. None: a server no longer knows the
        layout (nothing moved; announce it over HTTP). Raises the servers' reasons otherwise."""
        # tensor-parallel replicas that published what they keep get only that (protocol.slices);
        # an atomic push's workers stage only their slices too
        schedule = dp.slices.schedule(lid, metadata, plan)
        seq = dp.start(
            version=version,
            layout=lid,
            bucket_bytes=self.options.bucket_bytes,
            training_mode=mode,
            atomic=self.options.atomic,
            timeout_s=self.options.timeout_s,
            sliced=schedule is not None,
            base_version=base_version,
        )
        header = time.perf_counter()
        self._phase("ready", sliced=schedule is not None)
        tensors = _detached(state_dict, order)  # while the servers take the header in
        ready: float | None = None  # when every replica had accepted it; None: one refused

        def agreed() -> bool:
            # the ready reduction, while the first bucket is being packed
            nonlocal ready
            if self.comm.max_flag(0) != 0:
                return False
            ready = time.perf_counter()
            return True

        if schedule is None:
            total = self._broadcast(metadata, tensors, plan, before_first=agreed)
        else:
            assert isinstance(self.comm, Communicator)  # a data plane has one group
            total = send_slices(self.comm, metadata, tensors, schedule) if agreed() else 0
        if ready is None:  # some replica refused: nothing moved, the group is intact
            verdicts = dp.verdicts(seq, 10.0)
            if any(v.code == "unknown_layout" for v in verdicts.values()):
                dp.forget(lid)
                return None
            if any(v.code == STALE_BASE for v in verdicts.values()):
                raise DeltaRefused(describe(verdicts, dp.replicas))
            raise RewardServerError(
                409, describe(verdicts, dp.replicas), url="the group's store (data-plane push)"
            )
        synchronized = time.perf_counter()
        if self.comm.max_flag(0) != 0:  # every replica's commit, confirmed in one reduction
            reasons = describe(dp.verdicts(seq, 5.0), dp.replicas)
            raise WeightSyncError(f"a reward server did not commit version {version}: {reasons}")
        committed = time.perf_counter()
        return {
            "bytes": total,
            "header": header,
            "ready": ready,
            "synchronized": synchronized,
            "committed": committed,
        }


def _is_stale_base(detail: Any) -> bool:
    """A server's 409 refusing a delta push (``detail.code`` is ``STALE_BASE``)."""
    return isinstance(detail, dict) and detail.get("code") == STALE_BASE


def _detached(
    state_dict: Mapping[str, torch.Tensor], order: list[tuple[str, str]]
) -> dict[str, torch.Tensor]:
    """Server name → the caller's tensor, detached (the wire takes raw views of it). A tensor outside
    autograd is taken as it is: no new tensor objects to make and free on every push."""
    out: dict[str, torch.Tensor] = {}
    for server, k in order:
        t = state_dict[k]
        out[server] = t.detach() if t.requires_grad else t
    return out


class Rank0OnlyPublisher:
    """For multi-process learners: barrier → rank 0 pushes → barrier. Other ranks never
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
        dist.broadcast_object_list(
            outcome, src=dist.get_global_rank(self._group, 0) if self._group else 0, group=self._group
        )
        if outcome[0] is not None:
            raise WeightSyncError(f"rank 0's weight push of version {version} failed: {outcome[0]}")
        return version
