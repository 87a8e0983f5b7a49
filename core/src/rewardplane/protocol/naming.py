"""HF/PEFT → server parameter names, and what each training mode must (not) carry. Pure logic.

The normalisation: strip ``base_model.model.`` (PEFT), drop ``.base_layer``
(PEFT's wrapped linear), ``model.model.`` → ``model.``, bare ``layers.`` → ``model.layers.``.
PEFT's ``modules_to_save`` copies of the head are taken as the head; their frozen originals are
dropped.
"""

from __future__ import annotations

import re
import warnings
from collections.abc import Iterable, Mapping
from typing import TypeVar

from .errors import RewardplaneError
from .modes import RewardModelTrainingMode

T = TypeVar("T")

DEFAULT_HEAD_PATTERNS: tuple[str, ...] = ("score.", "classifier.", "lm_head.")
_LORA_KEY = re.compile(r"(^|\.)lora_(A|B|embedding_A|embedding_B|magnitude_vector)(\.|$)")


class WeightValidationError(RewardplaneError, ValueError):
    """The parameters do not fit the training mode; nothing was sent."""


def normalize_name(name: str) -> str | None:
    """The server's name for a trainer-side name, or None for a key that must not be sent."""
    if ".original_module." in name:
        return None  # PEFT keeps the frozen original head beside the trained copy
    clean = name
    while clean.startswith("base_model.model."):
        clean = clean[len("base_model.model.") :]
    clean = clean.replace(".base_layer", "").replace(".modules_to_save.default", "")
    if clean.startswith("model.model."):
        clean = clean[len("model.") :]
    if clean.startswith("layers."):
        clean = f"model.{clean}"
    return clean


def is_lora_key(name: str) -> bool:
    return bool(_LORA_KEY.search(name))


def is_head_key(name: str, patterns: Iterable[str] = DEFAULT_HEAD_PATTERNS) -> bool:
    return any(name.startswith(p) or f".{p}" in name for p in patterns)


def resolve_against_manifest(name: str, served: set[str]) -> str:
    """Where the server's manifest is known, map a leftover wrapper prefix (e.g. custom HF
    ``model.score.weight``) onto the served name; otherwise keep the name."""
    if name in served:
        return name
    if name.startswith("model.") and name[len("model.") :] in served:
        return name[len("model.") :]
    return name


def normalize_params(
    params: Mapping[str, T], *, served: set[str] | None = None, keep_lora: bool = False
) -> dict[str, T]:
    out: dict[str, T] = {}
    for key, value in params.items():
        if is_lora_key(key) and not keep_lora:
            raise WeightValidationError(
                f"{key!r} is an unmerged LoRA weight: merge the adapters first "
                "(rewardplane.sdk.lora.merge_for_sync(model), i.e. merge_and_unload()), or use adapter sync"
            )
        clean = normalize_name(key)
        if clean is None:
            continue
        if served is not None:
            clean = resolve_against_manifest(clean, served)
        if clean in out:
            raise WeightValidationError(
                f"two keys normalise to {clean!r} (one is {key!r}); send each parameter once"
            )
        out[clean] = value
    return out


def select_head(params: Mapping[str, T], patterns: Iterable[str] = DEFAULT_HEAD_PATTERNS) -> dict[str, T]:
    """Only the head's parameters: what a head_only push carries."""
    pats = tuple(patterns)
    return {k: v for k, v in params.items() if is_head_key(normalize_name(k) or k, pats)}


def validate_for_mode(
    names: Iterable[str], mode: RewardModelTrainingMode, patterns: Iterable[str] = DEFAULT_HEAD_PATTERNS
) -> None:
    """Per-mode rules: head_only carries the head and nothing else; full and lora
    (merged) carry the backbone; a missing head there is only a warning, as the seed says."""
    pats = tuple(patterns)
    names = list(names)
    if not names:
        raise WeightValidationError(
            "no parameters to push: pass the model's state_dict (or the head for head_only)"
        )
    head = [n for n in names if is_head_key(n, pats)]
    backbone = [n for n in names if not is_head_key(n, pats)]
    if mode == RewardModelTrainingMode.HEAD_ONLY:
        if not head:
            raise WeightValidationError(
                f"head_only needs the head's weights (names matching {list(pats)}); none were given"
            )
        if backbone:
            raise WeightValidationError(
                f"head_only got {len(backbone)} backbone parameter(s) (e.g. {backbone[0]!r}); pass only the head "
                "(rewardplane.sdk.select_head(state_dict)) or push with training_mode=full"
            )
        return
    if not backbone:
        raise WeightValidationError(
            f"{mode.value} needs the backbone's weights but only head weights were given; "
            "use training_mode=head_only to push just the head"
        )
    if not head:
        warnings.warn(
            f"{mode.value} push has no head weights (names matching {list(pats)}): the reward head on the "
            "server keeps its current values",
            stacklevel=3,
        )
