"""What every part of the worker extension stands on: the worker's state, and the accessors each
engine provides (vLLM's worker attributes by default; the transformers engine overrides them)."""

from __future__ import annotations

import threading
from collections.abc import Iterable, Iterator
from typing import Any, Protocol, cast

import torch

from rewardplane.protocol import Bucket, ParamMeta, PushLoaded
from rewardplane.protocol.slices import Region
from rewardplane.server.weight_sync.copy_plan import CopyPlan
from rewardplane.server.weight_sync.persistence import HostCopy, WeightsStore
from rewardplane.transport.comm import Communicator


class _VLLMModel(Protocol):
    """What vLLM models add to ``torch.nn.Module`` (untyped there): their own weight loader."""

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> Any: ...


class WorkerBase:
    """The worker's weight-sync state and its accessors. vLLM workers provide ``model_runner``,
    ``device`` and ``rank``; other hosts override the ``rp_`` accessors."""

    _rp_comm: Communicator | None = None
    _rp_staged: list[tuple[Bucket, torch.Tensor]] | None = None
    # Persistence (--weights-dir): host copies, under HF names, of what the running update loaded
    # (every worker keeps its own: the whole tensor, or the range a tensor-parallel worker keeps).
    _rp_store: WeightsStore | None = None
    _rp_kept: dict[str, HostCopy] | None = None
    _rp_writer: threading.Thread | None = None
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

    def _rp_slice_of(self, name: str) -> tuple[Region | None, torch.Tensor] | None:
        """What this worker keeps of ``name`` and where; None where only the loader can load it."""
        plan = self._rp_copy_plan
        return None if plan is None else plan.slice_of(name)

    def _rp_forget_places(self) -> None:
        """The parameters were discarded (and are loaded again): what was learned of where each
        pushed name lands is void."""
        if self._rp_copy_plan is not None:
            self._rp_copy_plan.forget()

    def _rp_stop_listening(self) -> None:
        # The listener thread sees the flag within a second; the control plane also closes the channel.
        if self._rp_listen_stop is not None:
            self._rp_listen_stop.set()
        self._rp_listen_stop = None


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
