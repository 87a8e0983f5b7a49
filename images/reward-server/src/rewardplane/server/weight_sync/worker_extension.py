"""The weight-sync worker extension, shared by both engines.

vLLM mixes this class into every GPU worker (``worker_extension_cls``) and reaches its methods
with ``collective_rpc``; the transformers engine instantiates ``HFWeightSyncWorker`` directly. The
control plane names these methods in one place (``worker_calls.py``). Each is synchronous, runs
where the weights live, returns plain data (vLLM carries it between processes), and hands the work
to one of the parts under ``worker/`` (``worker/parts.py``)."""

from __future__ import annotations

import faulthandler
import signal
import threading
import time
from typing import Any

import torch

from rewardplane.protocol import ParamMeta, SendWeightsRequest
from rewardplane.protocol.slices import Region
from rewardplane.server.engines.lora_hooks import LoraHooks
from rewardplane.server.weight_sync.worker.group import GroupJoin
from rewardplane.server.weight_sync.worker.parts import WorkerParts
from rewardplane.server.weight_sync.worker.persistence import load_checkpoint
from rewardplane.server.weight_sync.worker.state import PushedAdapter, WorkerHost
from rewardplane.server.weight_sync.worker.vllm_host import VLLMHost
from rewardplane.transport.checksums import digests

# vLLM imports this module in its engine-core process (where the weights live): as in the API
# server, `kill -USR1 <pid>` then prints every thread's stack — the way to see where a stuck engine
# or weight update waits. Only where nobody else handles SIGUSR1.
if (
    threading.current_thread() is threading.main_thread()
    and signal.getsignal(signal.SIGUSR1) == signal.SIG_DFL
):
    faulthandler.register(signal.SIGUSR1, all_threads=True)

# vLLM builds its worker without calling this class's __init__: the parts are built on first use.
_BUILD_LOCK = threading.Lock()


class RewardWeightSyncExtension:
    """Receive flat buckets from the trainer and load them; serve pushed adapters; send to peers;
    persist and restore; checksum. vLLM loads this class into its GPU worker."""

    _rp_built: WorkerParts | None = None

    def rp_host(self) -> WorkerHost:
        """The engine that holds the weights: vLLM's worker, which this class is mixed into."""
        return VLLMHost(self)

    @property
    def rp_parts(self) -> WorkerParts:
        parts = self._rp_built
        if parts is None:
            with _BUILD_LOCK:
                if self._rp_built is None:
                    self._rp_built = WorkerParts.build(self.rp_host())
                parts = self._rp_built
        return parts

    # ---- the group ---------------------------------------------------------------------------
    def rp_join_start(self, attempt_id: str, join: dict[str, Any]) -> None:
        """Start joining the group ``join`` names (a ``GroupJoin``'s fields), on a thread of its own."""
        self.rp_parts.joins.start(attempt_id, GroupJoin(**join))

    def rp_join_poll(self, attempt_id: str) -> dict[str, Any]:
        return self.rp_parts.joins.poll(attempt_id)

    def rp_join_abandon(self, attempt_id: str) -> bool:
        return self.rp_parts.joins.abandon(attempt_id)

    def rp_init_communicator(self, join: dict[str, Any]) -> int:
        """Join at once, on the calling thread (``rp_join_start`` joins on a thread of its own)."""
        return self.rp_parts.receiver.join(GroupJoin(**join))

    def rp_close_communicator(self) -> None:
        self.rp_parts.receiver.close()

    # ---- pushes ------------------------------------------------------------------------------
    def rp_receive(
        self,
        metadata: list[dict[str, Any]] | None,
        bucket_bytes: int,
        apply: bool,
        layout_key: str,
        agree_slicing: bool = False,
    ) -> dict[str, Any]:
        return self.rp_parts.receiver.receive(metadata, bucket_bytes, apply, layout_key, agree_slicing)

    def rp_listen(self, address: str, authkey: bytes) -> bool:
        return self.rp_parts.listener.listen(address, authkey)

    def rp_push_outcome(self, seq: int, timeout_s: float) -> dict[str, Any]:
        return self.rp_parts.listener.outcome(seq, timeout_s)

    def rp_staging_problem(self, nbytes: int) -> str | None:
        return self.rp_parts.staging.problem(nbytes)

    def rp_cuda_free_bytes(self) -> int | None:
        return self.rp_parts.staging.cuda_free_bytes()

    def rp_apply_staged(self, metadata: list[dict[str, Any]]) -> None:
        self.rp_parts.slices.apply_staged(metadata)

    def rp_drop_staged(self) -> None:
        self.rp_parts.slices.drop_staged()

    def rp_apply_adapter(
        self, metadata: list[dict[str, Any]], adapter: dict[str, Any], adapter_id: int
    ) -> dict[str, Any]:
        return self.rp_parts.adapters.apply(metadata, adapter, adapter_id)

    def rp_clear_adapter(self) -> None:
        self.rp_parts.state.host.clear_adapter()

    # ---- persistence and restore -------------------------------------------------------------
    def rp_persist_to(self, directory: str, base: str = "", ranks: int = 1) -> None:
        self.rp_parts.persistence.persist_to(directory, base, ranks)

    def rp_persist(self, version: int) -> bool:
        return self.rp_parts.persistence.persist(version)

    def rp_persist_pending(self) -> bool:
        return self.rp_parts.persistence.pending()

    def rp_restore(self, version: int) -> int:
        return self.rp_parts.persistence.restore(version)

    def rp_load_checkpoint(self, model_dir: str) -> list[str]:
        parts = self.rp_parts
        parts.slices.forget_places()  # the weights were discarded: learn their places again
        return load_checkpoint(parts.state, model_dir)

    # ---- reading the weights back ------------------------------------------------------------
    def rp_model(self) -> torch.nn.Module:
        return self.rp_parts.state.host.model()

    def rp_load(self, weights: list[tuple[str, torch.Tensor]]) -> None:
        self.rp_parts.state.host.load(weights)

    def rp_local_rank(self) -> int:
        return self.rp_parts.state.host.local_rank()

    def rp_named_parameters(self) -> dict[str, torch.Tensor] | None:
        return self.rp_parts.state.host.named_parameters()

    def rp_param_checksums(self) -> dict[str, Any]:
        """SHA-256 of every live parameter's bytes, under the engine's own parameter names (vLLM's
        are fused and sharded: ``qkv_proj``, ``gate_up_proj``), with dtype and shape. Costs a device →
        host copy of the weights: a diagnostic, not for the hot path."""
        host = self.rp_parts.state.host
        with torch.no_grad():
            return {"rank": host.local_rank(), "checksums": digests(host.model().named_parameters())}

    def rp_peer_send_problem(self, names: list[str]) -> str | None:
        return self.rp_parts.peer.problem(names)

    def rp_peer_send_start(self, metadata: list[dict[str, Any]], send: dict[str, Any]) -> None:
        self.rp_parts.peer.start(metadata, SendWeightsRequest(**send))

    def rp_peer_send_outcome(self) -> tuple[bool, str] | None:
        return self.rp_parts.peer.outcome()


class HFHost:
    """``WorkerHost`` over a transformers model in this process: no tensor parallelism, so every
    pushed name is one whole parameter, read and written in place."""

    def __init__(self, model: torch.nn.Module, device: torch.device) -> None:
        self._model = model
        self._device = device
        self.params: dict[str, torch.Tensor] = dict(model.named_parameters())
        self._lora = LoraHooks(model)

    def model(self) -> torch.nn.Module:
        return self._model

    def device(self) -> torch.device:
        return self._device

    def local_rank(self) -> int:
        return 0

    @torch.no_grad()
    def load(self, weights: list[tuple[str, torch.Tensor]]) -> None:
        for name, tensor in weights:
            self.params[name].data.copy_(tensor)  # copy_ casts, e.g. a bf16 push into an fp32 head

    def parameter_view(self, name: str) -> torch.Tensor | None:
        param = self.params.get(name)  # the parameter itself, under the pushed name
        return None if param is None else param.detach()

    def slice_of(self, name: str) -> tuple[Region | None, torch.Tensor] | None:
        view = self.parameter_view(name)  # no tensor parallelism here: the whole parameter
        return None if view is None else (None, view)

    def peer_view(self, name: str) -> torch.Tensor | None:
        return self.parameter_view(name)

    def named_parameters(self) -> dict[str, torch.Tensor] | None:
        return self.params  # in this process: read in place, never copied

    def accepts(self, name: str) -> bool:
        return name in self.params  # a checkpoint may hold buffers or tied copies too

    def forget_places(self) -> None:
        """Nothing learned: the parameters are the model's own tensors."""

    def set_adapter(self, adapter: PushedAdapter) -> str | None:
        with torch.no_grad():
            self._lora.set({n: t.to(self._device) for n, t in adapter.tensors.items()}, adapter.config)
        adapter.times["adapter_added"] = time.monotonic()
        return None

    def clear_adapter(self) -> None:
        self._lora.clear()


class HFWeightSyncWorker(RewardWeightSyncExtension):
    """The extension hosted in the transformers engine's own process."""

    def __init__(self, model: torch.nn.Module, device: torch.device) -> None:
        self._hf = HFHost(model, device)
        self._rp_built = WorkerParts.build(self._hf)  # here: the engine calls it from several threads

    def rp_host(self) -> WorkerHost:
        return self._hf

    def manifest(self) -> dict[str, ParamMeta]:
        return {
            n: ParamMeta(name=n, dtype=str(p.dtype), shape=tuple(p.shape)) for n, p in self._hf.params.items()
        }
