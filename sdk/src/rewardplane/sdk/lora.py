"""LoRA for reward models: adapter-only sync (``LoraSync``), or merge → sync → reinitialise.

Adapter-only: the servers (LoRA enabled) serve the pushed A/B tensors as a LoRA adapter over
untouched base weights; nothing is merged and training continues on the same model and optimizer.

Merged: servers without LoRA hold plain weights, so a LoRA-trained model is pushed merged. After the
merge the adapters' update lives in the base weights; fresh adapters (B = 0) start from there, so
the model's function is unchanged by the reinit.

Optimizer state: the old adapter parameters are gone after the merge, so their optimizer state
(Adam moments) cannot carry over. ``merge_sync_reinit`` returns the new model; build a new
optimizer over its trainable parameters (``rebuild_optimizer`` keeps the hyper-parameters and
starts with empty state). The head, trained through ``modules_to_save``, is re-wrapped too, so its
state is reset as well.
"""

from __future__ import annotations

import copy
import warnings
from collections.abc import Callable, Mapping
from typing import Any

import torch

from rewardplane.protocol import (
    DEFAULT_SYNC_MODE,
    AdapterConfig,
    RewardModelTrainingMode,
    WeightSyncMode,
    resolve_sync_mode,
)
from rewardplane.protocol.adapters import parse_sync_mode
from rewardplane.protocol.naming import WeightValidationError, is_lora_key

from ._exceptions import WeightSyncError


def merge_for_sync(peft_model: Any) -> tuple[torch.nn.Module, Any]:
    """Merge the adapters into the base model. Returns (merged model, the LoRA config to reinit with)."""
    config = copy.deepcopy(peft_model.peft_config[peft_model.active_adapter])
    merged = peft_model.merge_and_unload()
    return merged, config


def reinit_adapters(merged: torch.nn.Module, config: Any) -> Any:
    """Fresh adapters over the merged weights (the model computes the same function)."""
    from peft import get_peft_model

    config = copy.deepcopy(config)
    return get_peft_model(merged, config)


def merge_sync_reinit(peft_model: Any, push: Callable[[dict[str, torch.Tensor]], Any]) -> Any:
    """Merge, push the merged state dict with ``push``, reinitialise adapters; return the new model.

    ``push`` is e.g. ``lambda sd: pusher.push(sd, version=v, training_mode="lora")``.
    Rebuild the optimizer afterwards (``rebuild_optimizer``): adapter state cannot carry over.
    """
    merged, config = merge_for_sync(peft_model)
    push(merged.state_dict())
    return reinit_adapters(merged, config)


def rebuild_optimizer(old: torch.optim.Optimizer, model: torch.nn.Module) -> torch.optim.Optimizer:
    """Same optimizer class and hyper-parameters over ``model``'s trainable parameters; empty state."""
    params = [p for p in model.parameters() if p.requires_grad]
    return type(old)(params, **old.defaults)


def adapter_payload(peft_model: Any) -> tuple[dict[str, torch.Tensor], AdapterConfig]:
    """What an adapter-only push sends: the active adapter's LoRA A/B tensors plus its
    ``modules_to_save`` (e.g. the head), and its configuration. Raises ``WeightValidationError``
    for adapters the servers cannot apply (DoRA, per-layer ranks or alphas, biases)."""
    from peft import get_peft_model_state_dict

    name = peft_model.active_adapter
    config = peft_model.peft_config[name]
    unsupported = [
        what
        for what, present in (
            ("DoRA (use_dora)", getattr(config, "use_dora", False)),
            ("per-layer ranks (rank_pattern)", bool(getattr(config, "rank_pattern", None))),
            ("per-layer alphas (alpha_pattern)", bool(getattr(config, "alpha_pattern", None))),
            ("adapter biases (bias)", getattr(config, "bias", "none") != "none"),
            ("a non-LoRA adapter", str(getattr(config, "peft_type", "LORA")).split(".")[-1] != "LORA"),
        )
        if present
    ]
    if unsupported:
        raise WeightValidationError(
            f"adapter {name!r} uses {', '.join(unsupported)}, which the servers do not apply as an adapter: "
            "push merged weights (mode='full')"
        )
    adapter = AdapterConfig(
        rank=int(config.r),
        alpha=float(config.lora_alpha),
        use_rslora=bool(getattr(config, "use_rslora", False)),
    )
    tensors = dict(get_peft_model_state_dict(peft_model, adapter_name=name))
    if not any(is_lora_key(k) for k in tensors):
        raise WeightValidationError(f"adapter {name!r} has no LoRA weights to push")
    return tensors, adapter


def adapter_state_dict(peft_model: Any) -> dict[str, torch.Tensor]:
    """The adapter weights (plus modules_to_save such as the head) for adapter-only sync."""
    return adapter_payload(peft_model)[0]


class LoraSync:
    """Push a PEFT LoRA model by the sync mode: adapter-only, or merged (merge → sync → reinit).

    ``mode``: ``full`` (default: merged, works with every server), ``adapter`` (only the LoRA A/B
    tensors and ``modules_to_save``; the servers apply them as a LoRA adapter over untouched base
    weights — the RewardModel must enable LoRA), or ``auto`` (``adapter`` when every server serves
    adapters — asked once, ``client.max_lora_rank() > 0`` — else ``full``; ``lora_enabled``
    overrides the question).

    ``fallback_to_full`` (default True): when an adapter push fails, a warning is given once and this
    object pushes merged weights from then on. With False the push raises ``WeightSyncError``
    saying what to do. ``client`` is a ``WeightPusher`` or a ``RewardModelHandle`` (cluster mode:
    ``auto`` then follows the RewardModel's ``spec.lora.enabled``).
    """

    def __init__(
        self,
        client: Any,
        *,
        mode: WeightSyncMode | str = DEFAULT_SYNC_MODE,
        fallback_to_full: bool = True,
        lora_enabled: bool | None = None,
        push_options: Mapping[str, Any] | None = None,
    ) -> None:
        self.client = client
        self.push_options = dict(push_options or {})  # passed to every push (e.g. timeout_s, trainer_host)
        self.requested = parse_sync_mode(mode)
        if self.requested is WeightSyncMode.AUTO and lora_enabled is None:
            lora_enabled = int(client.max_lora_rank()) > 0
        self.mode = resolve_sync_mode(
            self.requested, lora_enabled=bool(lora_enabled), learner_world_size=_learner_world_size()
        )
        self.fallback_to_full = fallback_to_full
        self.fallback_reason: str | None = None  # why this handle pushes merged weights, once it fell back

    def _push(self, params: dict[str, torch.Tensor], version: int, **kwargs: Any) -> Any:
        kwargs = {**self.push_options, **kwargs}
        if hasattr(self.client, "push_weights"):  # RewardModelHandle: through the operator
            return self.client.push_weights(params, version, **kwargs)
        return self.client.push(params, version=version, **kwargs)

    def sync(self, peft_model: Any, version: int) -> Any:
        """Push; returns the model to keep training (the same one after an adapter push, a new one
        with fresh adapters after a merged push — rebuild the optimizer then, ``rebuild_optimizer``)."""
        if self.mode is WeightSyncMode.ADAPTER:
            try:
                tensors, adapter = adapter_payload(peft_model)
                self._push(tensors, version, training_mode=RewardModelTrainingMode.ADAPTER, adapter=adapter)
                return peft_model
            except Exception as exc:
                reason = f"{type(exc).__name__}: {exc}"
                if not self.fallback_to_full:
                    raise WeightSyncError(
                        f"adapter-only sync of version {version} failed ({reason}). Enable LoRA on the RewardModel "
                        "(spec.lora.enabled, with maxRank >= the adapter's rank), or push merged weights "
                        "(mode='full'), or allow the fallback (fallback_to_full=True)"
                    ) from exc
                warnings.warn(
                    f"adapter-only sync failed ({reason}); falling back to full (merged) sync for the rest of the "
                    "run with this handle",
                    stacklevel=2,
                )
                self.fallback_reason = reason
                self.mode = WeightSyncMode.FULL
        return merge_sync_reinit(
            peft_model, lambda sd: self._push(sd, version, training_mode=RewardModelTrainingMode.LORA)
        )


def _learner_world_size() -> int:
    """Processes of this learner (torch.distributed), 1 when it is not initialised."""
    import torch.distributed as dist

    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
