"""The weights as a vLLM GPU worker holds them: its model (``model_runner``), device and rank, its
loader (learned by the copy plan), and its LoRA manager (``adapters.VLLMAdapters``)."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any, Protocol, cast

import torch

from rewardplane.protocol.slices import Region
from rewardplane.server.weight_sync.copy_plan import CopyPlan
from rewardplane.server.weight_sync.expert_names import expert_splitter
from rewardplane.server.weight_sync.worker.adapters import VLLMAdapters
from rewardplane.server.weight_sync.worker.state import PushedAdapter


class _VLLMModel(Protocol):
    """What vLLM models add to ``torch.nn.Module`` (untyped there): their own weight loader."""

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> Any: ...


class VLLMHost:
    """``WorkerHost`` over vLLM's worker, which provides ``model_runner``, ``device`` and ``rank``
    (and ``add_lora``/``remove_lora`` for adapters)."""

    def __init__(self, worker: Any) -> None:
        self.worker = worker
        # Where each pushed name lands in vLLM's parameters (copy_plan.py), learned on first load.
        self.copy_plan: CopyPlan | None = None
        self.adapters = VLLMAdapters(worker)

    def model(self) -> torch.nn.Module:
        # get_model() unwraps vLLM's CUDA-graph wrappers; load_weights lives on the model itself.
        model: torch.nn.Module = self.worker.model_runner.get_model()
        _plain_parameter_names(model)
        return model

    def device(self) -> torch.device:
        return torch.device(self.worker.device)

    def local_rank(self) -> int:
        return int(getattr(self.worker, "rank", 0))

    def load(self, weights: list[tuple[str, torch.Tensor]]) -> None:
        # vLLM's loader takes HF names and full tensors; it fuses q/k/v, gate/up and shards for TP.
        # The copy plan learns from it where each name lands and then copies there directly.
        # Experts fused by transformers 5 reach the loader under their checkpoint names.
        plan = self.copy_plan
        if plan is None:
            model = self.model()
            split = expert_splitter(model)
            plan = self.copy_plan = CopyPlan(
                lambda w: cast("_VLLMModel", model).load_weights(weights=split(w)), model
            )
        plan.load(weights)

    def parameter_view(self, name: str) -> torch.Tensor | None:
        # the parameter view the copy plan learned for the name
        plan = self.copy_plan
        return None if plan is None else plan.target(name)

    def slice_of(self, name: str) -> tuple[Region | None, torch.Tensor] | None:
        plan = self.copy_plan
        return None if plan is None else plan.slice_of(name)

    def peer_view(self, name: str) -> torch.Tensor | None:
        """The parameter slice a push copied ``name`` into (the copy plan), where it has been pushed
        since the replica started and the loader only copied it (tensor parallelism shards instead)."""
        plan = self.copy_plan
        return None if plan is None else plan.held(name)

    def named_parameters(self) -> dict[str, torch.Tensor] | None:
        return None  # fused, sharded, and not sent back over vLLM's RPC: a peer send reads in the worker

    def accepts(self, name: str) -> bool:
        return True  # vLLM's loader skips what it does not use by itself

    def forget_places(self) -> None:
        if self.copy_plan is not None:
            self.copy_plan.forget()

    def set_adapter(self, adapter: PushedAdapter) -> str | None:
        return self.adapters.set(adapter)

    def clear_adapter(self) -> None:
        self.adapters.drop()


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
