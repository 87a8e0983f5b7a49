"""The weight-sync worker extension, shared by both engines.

vLLM mixes this class into every GPU worker (``worker_extension_cls``) and reaches its methods
with ``collective_rpc``; the transformers engine instantiates ``HFWeightSyncWorker`` directly. The
methods are synchronous and run where the weights live; each returns plain data.
"""

from __future__ import annotations

import faulthandler
import json
import logging
import os
import shutil
import signal
import tempfile
import threading
import time
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any, Protocol, cast

import torch

from rewardplane.protocol import (
    AdapterConfig,
    Bucket,
    ParamMeta,
    PushGo,
    PushLoaded,
    PushVerdict,
    plan_buckets,
    remember_layout,
)
from rewardplane.protocol.adapters import LORA_PAIR
from rewardplane.server.engines.checkpoint import iter_checkpoint
from rewardplane.server.engines.lora_hooks import LoraHooks
from rewardplane.server.engines.vllm_lora import (
    IN_MEMORY_PATH,
    PEFT_PREFIX,
    VLLMInternalsChanged,
    adapter_load_from_env,
    loading_from_memory,
    lora_model_from_tensors,
    peft_adapter_config,
)
from rewardplane.server.weight_sync.copy_plan import CopyPlan
from rewardplane.server.weight_sync.data_push import RESET_CACHE_AT
from rewardplane.server.weight_sync.persistence import WeightsStore
from rewardplane.server.weight_sync.push_channel import COMING, POSTED, SPIN_S, ChannelClosed, WorkerChannel
from rewardplane.server.weight_sync.staging import staging_limit_from_env, staging_problem
from rewardplane.transport.buckets import torch_dtype, unpack_bucket
from rewardplane.transport.checksums import digests
from rewardplane.transport.comm import Communicator, create_store
from rewardplane.transport.transfer import Received, receive_buckets, send_buckets

log = logging.getLogger(__name__)

# vLLM imports this module in its engine-core process (where the weights live): as in the API
# server, `kill -USR1 <pid>` then prints every thread's stack — the way to see where a stuck engine
# or weight update waits. Only where nobody else handles SIGUSR1.
if (
    threading.current_thread() is threading.main_thread()
    and signal.getsignal(signal.SIGUSR1) == signal.SIG_DFL
):
    faulthandler.register(signal.SIGUSR1, all_threads=True)


class _VLLMModel(Protocol):
    """What vLLM models add to ``torch.nn.Module`` (untyped there): their own weight loader."""

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> Any: ...


class RewardWeightSyncExtension:
    """Receive flat buckets from the trainer and load them. vLLM workers provide ``model_runner``,
    ``device`` and ``rank``; other hosts override the ``rp_`` accessors."""

    _rp_comm: Communicator | None = None
    _rp_staged: list[tuple[Bucket, torch.Tensor]] | None = None
    # Persistence (--weights-dir): host copies, under HF names, of what the running update loaded
    # (kept by the replica's first worker only: every worker receives every full tensor).
    _rp_store: WeightsStore | None = None
    _rp_kept: dict[str, torch.Tensor] | None = None
    _rp_writer: threading.Thread | None = None
    # The adapter this worker serves (adapter-only sync): its id and where it was written (None:
    # built in memory). Whether adapters are built in memory: off once vLLM's internals differ.
    _rp_adapter: tuple[int, Path | None] | None = None
    _rp_lora_from_memory = adapter_load_from_env() == "memory"
    # Pushes started from the data plane: the group's rendezvous (host, port, timeout, id), the
    # listener thread waiting for this replica's go, and its last outcome (seq, what it reported).
    _rp_listener: threading.Thread | None = None
    _rp_listen_stop: threading.Event | None = None
    _rp_push_outcome: tuple[int, PushLoaded] | None = None
    # Parsed layouts by key (rp_init_communicator); made per worker on first use, never shared.
    _rp_layouts: dict[str, tuple[list[ParamMeta], list[Bucket]]] | None = None
    # Where each pushed name lands in vLLM's parameters (copy_plan.py), learned on first load.
    _rp_copy_plan: CopyPlan | None = None
    # A send of this replica's weights to peers (peer restore): its thread and (succeeded, detail).
    _rp_sender: threading.Thread | None = None
    _rp_send_outcome: tuple[bool, str] | None = None

    # ---- accessors (vLLM defaults) ------------------------------------------------------------
    def rp_model(self) -> torch.nn.Module:
        # get_model() unwraps vLLM's CUDA-graph wrappers; load_weights lives on the model itself.
        model: torch.nn.Module = self.model_runner.get_model()  # type: ignore[attr-defined]
        _plain_parameter_names(model)
        return model

    def rp_device(self) -> torch.device:
        return torch.device(self.device)  # type: ignore[attr-defined]

    def rp_local_rank(self) -> int:
        return int(getattr(self, "rank", 0))

    def rp_load(self, weights: list[tuple[str, torch.Tensor]]) -> None:
        # vLLM's loader takes HF names and full tensors; it fuses q/k/v, gate/up and shards for TP.
        # The copy plan learns from it where each name lands and then copies there directly.
        plan = self._rp_copy_plan
        if plan is None:
            model = self.rp_model()
            plan = self._rp_copy_plan = CopyPlan(
                lambda w: cast("_VLLMModel", model).load_weights(weights=w), model
            )
        plan.load(weights)

    def rp_place(self, meta: ParamMeta) -> torch.Tensor | None:
        """Where a pushed tensor would be received in place (per-tensor wire; ``receive_buckets``
        uses it only where it fits exactly). Never while host copies of the loaded weights are kept
        (they are taken from what the loader sees)."""
        return None if self._rp_kept is not None else self._rp_parameter_view(meta.name)

    def _rp_parameter_view(self, name: str) -> torch.Tensor | None:
        # vLLM: the parameter view the copy plan learned for the name
        plan = self._rp_copy_plan
        return None if plan is None else plan.target(name)

    # ---- collective RPCs -----------------------------------------------------------------------
    def rp_init_communicator(
        self,
        host: str,
        port: int,
        world_size: int,
        rank_offset: int,
        backend: str,
        timeout_s: float,
        group_id: str,
    ) -> int:
        self.rp_close_communicator()
        rank = rank_offset + self.rp_local_rank()
        store = create_store(host, port, is_master=False, world_size=world_size, timeout_s=timeout_s)
        self._rp_comm = Communicator(
            store,
            rank=rank,
            world_size=world_size,
            device=self.rp_device(),
            backend=backend,  # type: ignore[arg-type]
            timeout_s=timeout_s,
            group_id=group_id,
        )
        return rank

    def rp_receive(
        self,
        metadata: list[dict[str, Any]] | None,
        bucket_bytes: int,
        apply: bool,
        layout_key: str,
    ) -> dict[str, Any]:
        """Receive every bucket. ``apply``: load each as it arrives (streamed); else stage them all.

        ``metadata`` may be None for a layout this worker received before (``layout_key``); if it
        does not hold it, it answers ``unknown_layout`` at once, before posting any receive, and the
        control plane calls again with the metadata.

        A rank whose load fails keeps receiving (so the trainer's broadcast is not left hanging),
        then reports failure in the final status reduction that every rank and the trainer join.
        """
        entered = time.monotonic()
        layout = self._rp_layout(metadata, bucket_bytes, layout_key)
        if layout is None:
            return {
                "ok": False,
                "partial": False,
                "bytes": 0,
                "unknown_layout": True,
                "error": f"layout {layout_key} is not cached in this worker; send its metadata",
            }
        metas, plan = layout
        comm = self._rp_comm
        if comm is None:
            return {
                "ok": False,
                "partial": False,
                "bytes": 0,
                "error": "no communicator: call /init_communicator first",
            }
        src = comm.world_size - 1
        got = Received()

        def outcome(ok: bool, partial: bool, error: str | None) -> dict[str, Any]:
            # monotonic stamps (one clock for every process of the host) for the update's timeline
            times = {"worker_in": entered, "worker_posted": got.posted_at, "worker_out": time.monotonic()}
            return {
                "ok": ok,
                "partial": partial,
                "bytes": got.bytes,
                "in_place_bytes": got.in_place_bytes,
                "error": error,
                "times": times,
            }

        self._rp_kept = {} if self._rp_keeps() else None
        try:
            receive_buckets(
                comm,
                metas,
                bucket_bytes,
                src,
                self._rp_load_kept if apply else None,
                out=got,
                plan=plan,
                place=self.rp_place,
            )
            if comm.max_flag(1 if got.error else 0) != 0 and got.error is None:
                got.error = "another rank failed to load its part of the update"
        except Exception as exc:  # communication failed: the trainer died or timed out
            self.rp_close_communicator()
            return outcome(False, apply and got.applied_any, str(exc))
        if got.error is not None:
            return outcome(False, got.applied_any, got.error)
        self._rp_staged = None if apply else got.staged
        return outcome(True, False, None)

    def _rp_layout(
        self,
        metadata: list[dict[str, Any]] | None,
        bucket_bytes: int,
        layout_key: str,
    ) -> tuple[list[ParamMeta], list[Bucket]] | None:
        """Parsed metadata and bucket plan, cached by the layout's id (the control plane's, which
        covers the bucket size): a trainer pushes the same layout again and again, and re-parsing
        hundreds of entries sits on every push's critical path. None: not cached, no metadata.

        Eviction is ``protocol.remember_layout``'s (first in, first out): ``control_plane`` mirrors
        it to know which layouts it can name by id alone, so every worker of a replica decides alike."""
        cache = self._rp_layouts
        if cache is None:
            cache = self._rp_layouts = {}
        hit = cache.get(layout_key)
        if hit is None:
            if metadata is None:
                return None
            metas = [ParamMeta(**m) for m in metadata]
            hit = (metas, plan_buckets(metas, bucket_bytes))
            remember_layout(cache, layout_key, hit)
        return hit

    def rp_apply_staged(self, metadata: list[dict[str, Any]]) -> None:
        metas = [ParamMeta(**m) for m in metadata]  # staged updates are not on the fast path
        staged, self._rp_staged = self._rp_staged or [], None
        self._rp_kept = {} if self._rp_keeps() else None
        for bucket, buf in staged:
            self._rp_load_kept(list(unpack_bucket(bucket, metas, buf)))

    def rp_drop_staged(self) -> None:
        self._rp_staged = None

    # ---- adapter-only sync -------------------------------------------------------------------------
    def rp_apply_adapter(
        self, metadata: list[dict[str, Any]], adapter: dict[str, Any], adapter_id: int
    ) -> dict[str, Any]:
        """Serve the staged LoRA tensors as adapter ``adapter_id`` (replacing the current one), and load
        the staged plain parameters (e.g. the head) in place. The adapter is built and loaded before
        anything changes: a bad one leaves the old adapter serving. Returns where it was written
        (``path``, None when built in memory) and when each step ended (``times``, monotonic: the
        update's timeline)."""
        metas = [ParamMeta(**m) for m in metadata]
        staged, self._rp_staged = self._rp_staged or [], None
        lora: dict[str, torch.Tensor] = {}
        plain: list[tuple[str, torch.Tensor]] = []
        for bucket, buf in staged:
            for name, tensor in unpack_bucket(bucket, metas, buf):
                if LORA_PAIR.match(name):
                    lora[name] = tensor.clone()  # the staged buffer is freed; the adapter outlives it
                else:
                    plain.append((name, tensor))
        times = {"adapter_unpacked": time.monotonic()}
        path = self.rp_set_adapter(lora, AdapterConfig(**adapter), adapter_id, times)
        self._rp_kept = None  # adapters are not persisted (docs/weight-sync.md)
        if plain:
            self.rp_load(plain)
        times["adapter_plain_loaded"] = time.monotonic()
        return {"path": path, "times": times}

    def rp_set_adapter(
        self,
        tensors: dict[str, torch.Tensor],
        adapter: AdapterConfig,
        adapter_id: int,
        times: dict[str, float],
    ) -> str | None:
        """vLLM: serve ``tensors`` as adapter ``adapter_id`` through the worker's LoRA manager, then
        drop the previous adapter. Scoring requests name it (``ServedAdapter``). The adapter is
        built from the tensors where they are (``vllm_lora.py``); where this vLLM's LoRA manager is
        not shaped for that, it is written in PEFT's format to a tmpfs directory and loaded from
        there (vLLM's public path). Returns that directory, or None. ``times`` gets when the
        adapter was built (or written), added to vLLM, and the previous one dropped."""
        from vllm.lora.request import LoRARequest

        name = f"rp-adapter-{adapter_id}"
        if RewardWeightSyncExtension._rp_lora_from_memory:
            try:
                manager = self.model_runner.lora_manager  # type: ignore[attr-defined]
                lora = lora_model_from_tensors(manager, adapter_id, tensors, adapter)
                times["adapter_built"] = time.monotonic()
                with loading_from_memory(manager, adapter_id, lora):
                    loaded = self.add_lora(LoRARequest(name, adapter_id, IN_MEMORY_PATH))  # type: ignore[attr-defined]
            except VLLMInternalsChanged as e:
                log.warning("adapters are loaded from a directory from now on (slower): %s", e)
                RewardWeightSyncExtension._rp_lora_from_memory = False
            else:
                if not loaded:
                    raise RuntimeError(f"vLLM did not load adapter {adapter_id}")
                times["adapter_added"] = time.monotonic()
                self._rp_drop_adapter()
                self._rp_adapter = (adapter_id, None)
                times["adapter_previous_dropped"] = time.monotonic()
                return None
        path = _adapter_root() / str(adapter_id)
        write_peft_adapter(path, tensors, adapter)
        times["adapter_written"] = time.monotonic()
        try:
            if not self.add_lora(LoRARequest(name, adapter_id, str(path))):  # type: ignore[attr-defined]
                raise RuntimeError(f"vLLM did not load adapter {adapter_id}")
        except Exception:
            shutil.rmtree(path, ignore_errors=True)
            raise
        times["adapter_added"] = time.monotonic()
        self._rp_drop_adapter()
        self._rp_adapter = (adapter_id, path)
        times["adapter_previous_dropped"] = time.monotonic()
        return str(path)

    def rp_clear_adapter(self) -> None:
        """Back to the base weights alone (a full or merged push replaces what the adapter adapted)."""
        self._rp_drop_adapter()

    def _rp_drop_adapter(self) -> None:
        old, self._rp_adapter = self._rp_adapter, None
        if old is not None:
            self.remove_lora(old[0])  # type: ignore[attr-defined]
            if old[1] is not None:
                shutil.rmtree(old[1], ignore_errors=True)

    def rp_named_parameters(self) -> dict[str, torch.Tensor] | None:
        """The live parameters under their pushed names, for the base fingerprint; None where they
        are not (vLLM fuses q/k/v and gate/up, shards for TP, and its tensors cannot travel back over
        its RPC). A peer send reads them in the worker instead (``rp_peer_send_start``)."""
        return None

    # ---- peer send: this replica's weights to a restarted one (peer.py) ---------------------------
    def _rp_peer_view(self, name: str) -> torch.Tensor | None:
        """The live tensor that holds ``name``'s values under its pushed shape, read in place. vLLM:
        the parameter slice a push copied it into (the copy plan), where it has been pushed since
        the replica started and the loader only copied it (tensor parallelism shards instead)."""
        plan = self._rp_copy_plan
        return None if plan is None else plan.held(name)

    def rp_peer_send_problem(self, names: list[str]) -> str | None:
        """Why this worker cannot send ``names`` to a peer now, or None."""
        missing = [n for n in names if self._rp_peer_view(n) is None]
        if not missing:
            return None
        why = (
            "direct loads are off (REWARDPLANE_DIRECT_LOAD=0), so the replica does not know where its loader put them"
            if self._rp_copy_plan is not None and not self._rp_copy_plan.enabled
            else "they were not pushed to this replica since it started, or its loader transforms them"
        )
        return f"{len(missing)} of {len(names)} parameters cannot be read back under their pushed names ({why}): e.g. {missing[:3]}"

    def rp_peer_send_start(
        self,
        metadata: list[dict[str, Any]],
        port: int,
        world_size: int,
        bucket_bytes: int,
        timeout_s: float,
        group_id: str,
    ) -> None:
        """Host the group's rendezvous, take its last rank and broadcast ``metadata``'s tensors as a
        full push, on a thread of its own (vLLM's engine loop, and scoring, go on meanwhile);
        ``rp_peer_send_outcome`` tells how it ended."""
        if self._rp_sender is not None and self._rp_sender.is_alive():
            raise RuntimeError("this worker is sending its weights to peers already")
        metas = [ParamMeta(**m) for m in metadata]
        device = self.rp_device()
        tensors: dict[str, torch.Tensor] = {}
        for meta in metas:
            view = self._rp_peer_view(meta.name)
            if view is None:
                raise LookupError(f"{meta.name} cannot be read back (rp_peer_send_problem says why)")
            # the wire carries the manifest's dtype (an fp32 head pushed as bf16 goes back as bf16)
            want = torch_dtype(meta.dtype)
            tensors[meta.name] = (
                view if view.dtype == want and view.is_contiguous() else view.to(want).contiguous()
            )
        self._rp_send_outcome = None

        def send() -> None:
            if device.type == "cuda":
                torch.cuda.set_device(device)  # the device is per thread
            rank = world_size - 1
            try:
                store = create_store(
                    "0.0.0.0", port, is_master=True, world_size=world_size, timeout_s=timeout_s
                )
                comm = Communicator(
                    store,
                    rank=rank,
                    world_size=world_size,
                    device=device,
                    timeout_s=timeout_s,
                    group_id=group_id,
                )
                try:
                    with torch.no_grad():
                        sent = send_buckets(comm, metas, tensors, bucket_bytes, src=rank)
                    failed = comm.max_flag(0)  # the receivers commit only once every rank agrees
                except BaseException:
                    comm.abort()  # the receivers see the group fail at once instead of waiting it out
                    raise
                comm.close()
                self._rp_send_outcome = (
                    (False, "a receiver reported a failure")
                    if failed
                    else (True, f"{sent} bytes to {rank} rank(s)")
                )
            except Exception as e:  # reported through rp_peer_send_outcome; this replica only read
                log.exception("sending the weights to peers failed")
                self._rp_send_outcome = (False, f"{type(e).__name__}: {e}")

        self._rp_sender = threading.Thread(target=send, name="rp-peer-send", daemon=True)
        self._rp_sender.start()

    def rp_peer_send_outcome(self) -> tuple[bool, str] | None:
        """(succeeded, what happened) once the send started last has ended; None while it runs."""
        if self._rp_sender is not None and self._rp_sender.is_alive():
            return None
        return self._rp_send_outcome or (False, "no send was started")

    def rp_close_communicator(self) -> None:
        self._rp_stop_listening()
        if self._rp_comm is not None:
            self._rp_comm.close()
            self._rp_comm = None

    # ---- pushes started from the data plane ----------------------------------------------------
    def rp_listen(self, address: str, authkey: bytes) -> bool:
        """Wait, on a thread of this worker, for pushes the control plane lets through (its
        ``PushGo`` over the push channel at ``address``, ``push_channel``); False without a
        communicator. Between pushes the thread is blocked on a socket: no GPU work is pending and
        the GIL is free, so scoring runs as without it."""
        comm = self._rp_comm
        if comm is None:
            return False
        self._rp_stop_listening()
        stop = threading.Event()
        thread = threading.Thread(
            target=self._rp_listen_loop,
            args=(comm, address, authkey, stop),
            name="rp-push-listener",
            daemon=True,
        )
        self._rp_listener, self._rp_listen_stop = thread, stop
        thread.start()
        return True

    def _rp_stop_listening(self) -> None:
        # The thread sees the flag within a second; the control plane also closes the channel.
        if self._rp_listen_stop is not None:
            self._rp_listen_stop.set()
        self._rp_listen_stop = None

    def _rp_listen_loop(
        self, comm: Communicator, address: str, authkey: bytes, stop: threading.Event
    ) -> None:
        if comm.device.type == "cuda":
            torch.cuda.set_device(comm.device)  # the device is per thread
        try:
            channel = WorkerChannel(address, authkey, comm.rank)
        except Exception as exc:  # the control plane gave up on us: pushes go over HTTP
            log.warning("could not join the push channel (%s); pushes go over HTTP", exc)
            return
        try:
            while True:
                raw = channel.recv(None, stop)
                while raw == COMING:  # a header arrived: the go follows once the push is admitted
                    raw = channel.recv(None, stop, spin_s=SPIN_S)
                if raw is None:
                    return
                go = PushGo.model_validate_json(raw)
                if self._rp_comm is not comm or not self._rp_data_push(comm, channel, go):
                    return
        except ChannelClosed as exc:
            log.info("stopped waiting for pushes: %s", exc)
        except Exception:
            log.exception("the push listener failed; pushes go over HTTP until the group is formed again")
        finally:
            channel.close()

    def _rp_data_push(self, comm: Communicator, channel: WorkerChannel, go: PushGo) -> bool:
        """One push: the ready reduction, the transfer, the report, the commit reduction. Returns
        whether to wait for the next one (False once the group is unusable)."""
        entered = time.monotonic()
        layout = None if go.error else self._rp_layout(None, go.bucket_bytes, go.layout_id)
        refusal = go.error or (None if layout else f"layout {go.layout_id} is not cached in this worker")
        if refusal is None and layout is not None and not go.apply:  # atomic: is there room to stage it?
            refusal = self.rp_staging_problem(sum(b.nbytes for b in layout[1]))
        got = Received()

        agreed: float | None = None
        ready_posting: float | None = None  # this worker's side of the ready reduction: called,
        ready_posted: float | None = None  # and enqueued
        posted_signalled = RESET_CACHE_AT != "posted"  # only that moment of the cache reset waits for it

        def signal_posted() -> None:
            # the control plane sends the engine's cache reset now, while the bytes move
            nonlocal posted_signalled
            if posted_signalled:
                return
            posted_signalled = True
            try:
                channel.send(POSTED)
            except ChannelClosed as exc:  # the control plane is gone: nothing to reset for
                log.debug("push %d: could not signal the first receive: %s", go.seq, exc)

        def report(ok: bool, *, refused: bool = False, error: str | None = None) -> None:
            signal_posted()  # a refusal or an early failure never leaves the control plane waiting
            times = {"worker_in": entered, "worker_out": time.monotonic()}
            if ready_posting is not None and ready_posted is not None:
                times["worker_ready_posting"] = ready_posting
                times["worker_ready_posted"] = ready_posted
            if agreed is not None:
                times["worker_agreed"] = agreed
            if got.posting_at is not None and got.posted_at is not None:
                times["worker_posting"] = got.posting_at
                times["worker_posted"] = got.posted_at
            partial = got.applied_any and not ok
            msg = PushLoaded(
                ok=ok,
                partial=partial,
                refused=refused,
                bytes=got.bytes,
                in_place_bytes=got.in_place_bytes,
                error=error,
                times=times,
            )
            self._rp_push_outcome = (go.seq, msg)
            channel.send(msg.model_dump_json().encode())

        try:
            agreement = comm.max_flag(1 if refusal else 0)
        except Exception as exc:  # communication failed: the trainer died or timed out
            if self._rp_comm is comm:
                self.rp_close_communicator()
            report(False, error=str(exc))
            return False
        ready_posting, ready_posted = comm.flag_calling, comm.flag_enqueued
        if agreement != 0:  # every rank agrees before a byte moves
            report(False, refused=True, error=refusal or "another replica refused the push")
            return True
        agreed = time.monotonic()  # the ready reduction is done: every rank accepted
        assert layout is not None
        metas, plan = layout
        self._rp_kept = {} if go.apply and self._rp_keeps() else None
        load = self._rp_load_kept if go.apply else None
        try:
            receive_buckets(
                comm,
                metas,
                go.bucket_bytes,
                comm.world_size - 1,
                load,
                out=got,
                plan=plan,
                place=self.rp_place,
                on_posted=signal_posted,
            )
        except Exception as exc:  # communication failed: the trainer died or timed out
            if self._rp_comm is comm:
                self.rp_close_communicator()
            report(False, error=str(exc))
            return False
        if got.error is not None:
            report(False, error=got.error)
        else:
            self._rp_staged = None if go.apply else got.staged
            report(True)
        # the control plane commits (or not) and says so; the trainer learns it in one reduction
        try:
            raw = channel.recv(comm.timeout.total_seconds(), spin_s=SPIN_S)
        except (TimeoutError, ChannelClosed):  # no verdict: the trainer learns of a failure at once
            raw = None
        committed = raw is not None and PushVerdict.model_validate_json(raw).committed
        # False when some replica failed: the trainer forms a new group
        return comm.max_flag(0 if committed else 1) == 0

    def rp_push_outcome(self, seq: int, timeout_s: float) -> dict[str, Any]:
        """What the listener reported for push ``seq`` (for the control plane when the store is gone);
        waits for it, bounded. Unknown → a failure that may have overwritten weights."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            outcome = self._rp_push_outcome
            if outcome is not None and outcome[0] == seq:
                return outcome[1].model_dump()
            if self._rp_listener is None or not self._rp_listener.is_alive():
                break
            time.sleep(0.01)
        return PushLoaded(
            ok=False, partial=True, error=f"push {seq}: the worker reported no outcome"
        ).model_dump()

    # ---- persistence (the server's --weights-dir) ----------------------------------------------
    def rp_persist_to(self, directory: str, base: str = "") -> None:
        """From now on keep host copies of loaded weights and persist them into ``directory``;
        ``base`` is the fingerprint of the base model they are pushed onto (saved with them)."""
        self._rp_store = WeightsStore(Path(directory), base)

    def _rp_keeps(self) -> bool:
        return self._rp_store is not None and self.rp_local_rank() == 0

    def _rp_load_kept(self, weights: list[tuple[str, torch.Tensor]]) -> None:
        """Load, then copy to host what was loaded (the tensors are views of a bucket reused next)."""
        self.rp_load(weights)
        if self._rp_kept is not None:
            with torch.no_grad():
                for name, tensor in weights:
                    self._rp_kept[name] = tensor.detach().to("cpu", copy=True)

    def rp_persist(self, version: int) -> bool:
        """Write this update's host copies into the store's union, in a background thread (disk I/O
        stays off the engine's loop). Returns whether this worker writes (the replica's first)."""
        kept, self._rp_kept = self._rp_kept, None
        store = self._rp_store
        if store is None or kept is None or not self._rp_keeps():
            return False
        previous = self._rp_writer

        def write() -> None:
            if previous is not None:
                previous.join()  # versions land in order
            try:
                store.save(version, kept)
                log.info("persisted version %d (%d parameters) in %s", version, len(kept), store.dir)
            except Exception:
                log.exception("persisting version %d failed; a restart cannot be restored to it", version)

        self._rp_writer = threading.Thread(target=write, name=f"rp-persist-v{version}", daemon=True)
        self._rp_writer.start()
        return True

    def rp_persist_pending(self) -> bool:
        return self._rp_writer is not None and self._rp_writer.is_alive()

    def rp_restore(self, version: int) -> int:
        """Load the persisted union of ``version`` through the engine's own loader (HF names, full
        tensors: vLLM fuses and shards them itself). Returns the number of parameters restored.

        Raises ``LookupError`` naming the version found when it is not ``version``."""
        store = self._rp_store
        if store is None:
            raise LookupError("this worker persists no weights (no --weights-dir)")
        loaded = store.load()
        if loaded is None:
            raise LookupError(f"no persisted weights in {store.dir}")
        saved, tensors = loaded
        if saved != version:
            raise LookupError(f"the persisted weights are version {saved}, not {version}")
        device = self.rp_device()
        with torch.no_grad():
            # one tensor at a time on the device: restoring needs no more memory than one parameter
            for name, tensor in tensors.items():
                self.rp_load([(name, tensor.to(device))])
        return len(tensors)

    # ---- sleep and wake (sleep.py) ----------------------------------------------------------------
    def rp_load_checkpoint(self, model_dir: str) -> list[str]:
        """Load the base checkpoint's weights again (after a level-2 sleep discarded them), one tensor
        at a time through the engine's own loader; the names loaded."""
        loaded: list[str] = []
        device = self.rp_device()
        if self._rp_copy_plan is not None:
            self._rp_copy_plan.forget()  # the weights were discarded: learn their places again
        with torch.no_grad():
            for name, tensor in iter_checkpoint(Path(model_dir)):
                if self.rp_accepts(name):
                    self.rp_load([(name, tensor.to(device))])
                    loaded.append(name)
        if not loaded:
            raise LookupError(f"no safetensors weights found in {model_dir}")
        return loaded

    def rp_accepts(self, name: str) -> bool:
        """Whether ``rp_load`` takes a checkpoint tensor of this name (vLLM's loader skips what it
        does not use by itself)."""
        return True

    def rp_staging_problem(self, nbytes: int) -> str | None:
        """Why this worker cannot stage ``nbytes`` for an atomic push (``staging.py``), or None."""
        device = self.rp_device()
        free = self.rp_cuda_free_bytes()
        cached = 0
        if device.type == "cuda":
            cached = int(torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device))
        where = f"GPU {device.index}" if device.type == "cuda" else "this server's host memory"
        return staging_problem(nbytes, where=where, free=free, cached=cached, limit=staging_limit_from_env())

    def rp_cuda_free_bytes(self) -> int | None:
        """Free memory of this worker's GPU (``cudaMemGetInfo``); None off CUDA."""
        device = self.rp_device()
        if device.type != "cuda":
            return None
        return int(torch.cuda.mem_get_info(device)[0])

    # ---- verification ----------------------------------------------------------------------------
    def rp_param_checksums(self) -> dict[str, Any]:
        """SHA-256 of every live parameter's bytes, under the engine's own parameter names (vLLM's
        are fused and sharded: ``qkv_proj``, ``gate_up_proj``), with dtype and shape. Costs a device →
        host copy of the weights: a diagnostic, not for the hot path."""
        with torch.no_grad():
            return {"rank": self.rp_local_rank(), "checksums": digests(self.rp_model().named_parameters())}


def _adapter_root() -> Path:
    """Where this worker writes adapters: tmpfs where there is one (they are small and short-lived)."""
    base = os.environ.get("REWARDPLANE_ADAPTER_DIR") or (
        "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()
    )
    return Path(base) / f"rewardplane-adapters-{os.getpid()}"


def write_peft_adapter(path: Path, tensors: dict[str, torch.Tensor], adapter: AdapterConfig) -> None:
    """``adapter_config.json`` + ``adapter_model.safetensors`` as PEFT saves them (names under
    ``base_model.model.``), the form vLLM's ``LoRARequest`` loads."""
    from safetensors.torch import save_file

    path.mkdir(parents=True, exist_ok=True)
    config = peft_adapter_config(list(tensors), adapter)
    (path / "adapter_config.json").write_text(json.dumps(config))
    save_file(
        {PEFT_PREFIX + n: t.detach().to("cpu").contiguous() for n, t in tensors.items()},
        str(path / "adapter_model.safetensors"),
    )


def _plain_parameter_names(model: torch.nn.Module) -> None:
    """With LoRA enabled vLLM wraps each adaptable layer (the pooling head too), so its weight
    becomes ``...qkv_proj.base_layer.weight``; the models' ``load_weights`` (and vLLM's
    ``AutoWeightsLoader``, which walks children and direct parameters) look parameters up under the
    plain names. Once, and only where there are wrappers: the model and every module with a loader
    report plain names, and each wrapper shows its wrapped layer's direct parameters and children as
    its own — so pushes and checksums work as without LoRA. (vLLM's own LoRA code walks
    ``named_modules``, which this leaves alone.)"""
    if getattr(model, "_rp_plain_names", False):
        return
    wrappers = [m for m in model.modules() if isinstance(getattr(m, "base_layer", None), torch.nn.Module)]
    if wrappers:
        for module in model.modules():
            if module is model or hasattr(module, "load_weights"):
                module.named_parameters = _plain_named_parameters(module)  # type: ignore[method-assign]
        for wrapper in wrappers:
            base: torch.nn.Module = wrapper.base_layer  # type: ignore[assignment]
            wrapper.named_parameters = base.named_parameters  # type: ignore[method-assign]
            wrapper.named_children = base.named_children  # type: ignore[method-assign]
    model._rp_plain_names = True  # type: ignore[assignment]


def _plain_named_parameters(module: torch.nn.Module) -> Any:
    def named_parameters(*args: Any, **kwargs: Any) -> Iterator[tuple[str, torch.nn.Parameter]]:
        for name, param in torch.nn.Module.named_parameters(module, *args, **kwargs):
            yield name.replace(".base_layer.", "."), param

    return named_parameters


class HFWeightSyncWorker(RewardWeightSyncExtension):
    """The extension hosted in the transformers engine's own process."""

    def __init__(self, model: torch.nn.Module, device: torch.device) -> None:
        self._model = model
        self._device = device
        self._params: dict[str, torch.Tensor] = dict(model.named_parameters())
        self._lora = LoraHooks(model)

    def rp_model(self) -> torch.nn.Module:
        return self._model

    def rp_device(self) -> torch.device:
        return self._device

    def rp_local_rank(self) -> int:
        return 0

    @torch.no_grad()
    def rp_load(self, weights: list[tuple[str, torch.Tensor]]) -> None:
        for name, tensor in weights:
            self._params[name].data.copy_(tensor)  # copy_ casts, e.g. a bf16 push into an fp32 head

    def _rp_parameter_view(self, name: str) -> torch.Tensor | None:
        param = self._params.get(name)  # the parameter itself, under the pushed name
        return None if param is None else param.detach()

    def rp_named_parameters(self) -> dict[str, torch.Tensor] | None:
        return self._params  # in this process: read in place, never copied

    def _rp_peer_view(self, name: str) -> torch.Tensor | None:
        return self._rp_parameter_view(name)

    def rp_set_adapter(
        self,
        tensors: dict[str, torch.Tensor],
        adapter: AdapterConfig,
        adapter_id: int,
        times: dict[str, float],
    ) -> str | None:
        with torch.no_grad():
            self._lora.set({n: t.to(self._device) for n, t in tensors.items()}, adapter)
        times["adapter_added"] = time.monotonic()
        return None

    def rp_clear_adapter(self) -> None:
        self._lora.clear()

    def rp_accepts(self, name: str) -> bool:
        return name in self._params  # a checkpoint may hold buffers or tied copies too

    def manifest(self) -> dict[str, ParamMeta]:
        return {
            n: ParamMeta(name=n, dtype=str(p.dtype), shape=tuple(p.shape)) for n, p in self._params.items()
        }
