"""Adapter-only weight sync: the sync modes a trainer picks from, the adapter's configuration the
announce carries, and how announced names pair up. Pure logic (the checks against the served
model: ``weights.check_adapter_metadata``).

Wire names: a LoRA pair for the served linear ``<module>.weight`` travels as
``<module>.lora_A.weight`` (shape ``[rank, in]``) and ``<module>.lora_B.weight`` (``[out, rank]``);
the served layer then computes ``base(x) + B(A(x)) * scaling`` — PEFT's LoRA, base untouched.
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from enum import Enum

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt

LORA_PAIR = re.compile(r"^(?P<module>.+)\.lora_(?P<half>A|B)\.weight$")


class WeightSyncMode(str, Enum):
    """How a LoRA-trained model reaches the servers."""

    FULL = "full"
    """Merge the adapters, push every parameter (merge → sync → reinit). Works everywhere."""
    ADAPTER = "adapter"
    """Push only the LoRA tensors (and the head); the server serves them as a LoRA adapter."""
    AUTO = "auto"
    """``adapter`` where the servers serve LoRA adapters (RewardModel ``spec.lora.enabled``), else ``full``."""


DEFAULT_SYNC_MODE = WeightSyncMode.FULL


def parse_sync_mode(mode: WeightSyncMode | str) -> WeightSyncMode:
    """A sync mode from its name; a clear error for anything else."""
    try:
        return WeightSyncMode(mode)
    except ValueError:
        raise ValueError(f"sync mode {mode!r} is not one of {[m.value for m in WeightSyncMode]}") from None


def resolve_sync_mode(
    mode: WeightSyncMode | str, *, lora_enabled: bool, learner_world_size: int = 1
) -> WeightSyncMode:
    """``full`` or ``adapter`` for a requested mode; ``auto`` follows whether the servers serve LoRA.

    An explicit ``adapter`` is kept even where LoRA is off: the push then fails (and falls back to
    ``full`` when the caller allows it), which says more than silently pushing merged weights. A
    learner of several processes (``learner_world_size`` > 1) must sync ``full``: resolving to
    ``adapter`` there is an error, raised before training starts."""
    requested = parse_sync_mode(mode)
    if requested is WeightSyncMode.AUTO:
        resolved = WeightSyncMode.ADAPTER if lora_enabled else WeightSyncMode.FULL
    else:
        resolved = requested
    if resolved is WeightSyncMode.ADAPTER and learner_world_size > 1:
        # seed 004: a multi-process learner (rank 0 pushes for all) syncs full weights only (v1)
        raise ValueError(
            f"sync mode {requested.value} resolves to adapter, but the learner has {learner_world_size} processes "
            "(torch.distributed): multi-process learners push merged weights only — use mode='full'"
        )
    return resolved


class AdapterConfig(BaseModel):
    """What the server needs besides the tensors to apply a LoRA adapter (PEFT's ``LoraConfig``)."""

    model_config = ConfigDict(frozen=True)

    rank: StrictInt = Field(ge=1, description="LoRA rank r (A is [r, in], B is [out, r])")
    alpha: float = Field(
        gt=0, description="lora_alpha; scaling = alpha / r (alpha / sqrt(r) with use_rslora)"
    )
    use_rslora: StrictBool = False

    @property
    def scaling(self) -> float:
        return self.alpha / (math.sqrt(self.rank) if self.use_rslora else self.rank)


def lora_pairs(names: Sequence[str]) -> tuple[dict[str, tuple[str | None, str | None]], list[str]]:
    """Announced names split into ``{module: (A name, B name)}`` and the other (plain) names."""
    pairs: dict[str, tuple[str | None, str | None]] = {}
    plain: list[str] = []
    for name in names:
        m = LORA_PAIR.match(name)
        if m is None:
            plain.append(name)
            continue
        a, b = pairs.get(m["module"], (None, None))
        pairs[m["module"]] = (name, b) if m["half"] == "A" else (a, name)
    return pairs, plain
