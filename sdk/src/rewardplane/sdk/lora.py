"""LoRA for reward models: merge → sync → reinitialise fresh adapters.

Why: the servers hold plain (merged) weights, so a LoRA-trained model is pushed merged. After the
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
from collections.abc import Callable
from typing import Any

import torch

from rewardplane.protocol import RewardModelTrainingMode
from rewardplane.protocol.naming import is_lora_key


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

    ``push`` is e.g. ``lambda sd: client.sync_weights(sd, version=v, training_mode="lora")``.
    Rebuild the optimizer afterwards (``rebuild_optimizer``): adapter state cannot carry over.
    """
    merged, config = merge_for_sync(peft_model)
    push(merged.state_dict())
    return reinit_adapters(merged, config)


def rebuild_optimizer(old: torch.optim.Optimizer, model: torch.nn.Module) -> torch.optim.Optimizer:
    """Same optimizer class and hyper-parameters over ``model``'s trainable parameters; empty state."""
    params = [p for p in model.parameters() if p.requires_grad]
    return type(old)(params, **old.defaults)


def adapter_state_dict(peft_model: Any) -> dict[str, torch.Tensor]:
    """The adapter weights (plus modules_to_save such as the head) for adapter-only sync."""
    from peft import get_peft_model_state_dict

    return dict(get_peft_model_state_dict(peft_model))


class LoraSync:
    """Adapter-only sync with fallback to full (merged) sync.

    ``mode``: ``adapter`` (requires the server to take adapters), ``full`` (merge → sync → reinit),
    or ``auto`` (adapter, falling back). When adapter sync fails and ``fallback_to_full`` is set, a
    warning is emitted and this object uses full sync for the rest of the run; without fallback
    the error is raised.
    """

    def __init__(self, client: Any, *, mode: str = "full", fallback_to_full: bool = True) -> None:
        if mode not in ("full", "adapter", "auto"):
            raise ValueError(f"mode must be full, adapter or auto, got {mode!r}")
        self.client = client
        self.mode = "adapter" if mode == "auto" else mode
        self.fallback_to_full = fallback_to_full

    def sync(self, peft_model: Any, version: int) -> Any:
        """Push; returns the model to keep training (a new one after a merge)."""
        if self.mode == "adapter":
            try:
                sd = adapter_state_dict(peft_model)
                if not any(is_lora_key(k) for k in sd):
                    raise ValueError("the model has no LoRA adapter weights")
                self.client.sync_weights(
                    sd, version=version, training_mode=RewardModelTrainingMode.LORA, keep_lora=True
                )
                return peft_model
            except Exception as exc:
                if not self.fallback_to_full:
                    raise RuntimeError(
                        f"adapter-only sync failed ({exc}); the server cannot take adapters: use mode='full' "
                        "or fallback_to_full=True"
                    ) from exc
                warnings.warn(
                    f"adapter-only sync failed ({exc}); falling back to full (merged) sync for the rest of the run",
                    stacklevel=2,
                )
                self.mode = "full"
        return merge_sync_reinit(
            peft_model,
            lambda sd: self.client.sync_weights(
                sd, version=version, training_mode=RewardModelTrainingMode.LORA
            ),
        )
