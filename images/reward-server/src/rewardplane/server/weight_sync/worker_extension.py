"""The weight-sync worker extension, shared by both engines.

vLLM mixes this class into every GPU worker (``worker_extension_cls``) and reaches its methods
with ``collective_rpc``; the transformers engine instantiates ``HFWeightSyncWorker`` directly. The
methods are synchronous and run where the weights live; each returns plain data.
"""

from __future__ import annotations

import faulthandler
import signal
import threading
import time

import torch

from rewardplane.protocol import AdapterConfig, ParamMeta
from rewardplane.protocol.slices import Region
from rewardplane.server.engines.lora_hooks import LoraHooks
from rewardplane.server.weight_sync.worker.adapters import AdapterPart
from rewardplane.server.weight_sync.worker.checksums import ChecksumPart
from rewardplane.server.weight_sync.worker.join import JoinPart
from rewardplane.server.weight_sync.worker.listener import DataPushListener
from rewardplane.server.weight_sync.worker.peer_send import PeerSendPart

# vLLM imports this module in its engine-core process (where the weights live): as in the API
# server, `kill -USR1 <pid>` then prints every thread's stack — the way to see where a stuck engine
# or weight update waits. Only where nobody else handles SIGUSR1.
if (
    threading.current_thread() is threading.main_thread()
    and signal.getsignal(signal.SIGUSR1) == signal.SIG_DFL
):
    faulthandler.register(signal.SIGUSR1, all_threads=True)


class RewardWeightSyncExtension(JoinPart, DataPushListener, AdapterPart, PeerSendPart, ChecksumPart):
    """Receive flat buckets from the trainer and load them; serve pushed adapters; send to peers;
    persist and restore; checksum. Each concern is a part under ``worker/``; vLLM loads this class."""


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

    def _rp_slice_of(self, name: str) -> tuple[Region | None, torch.Tensor] | None:
        view = self._rp_parameter_view(name)  # no tensor parallelism here: the whole parameter
        return None if view is None else (None, view)

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
