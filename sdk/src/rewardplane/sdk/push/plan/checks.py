"""What a push carries, checked before anything moves (direct and operator-driven pushes alike):
names normalised for the training mode, then the metadata against the served manifest."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TypeVar

from rewardplane.protocol import (
    AdapterConfig,
    ParamMeta,
    RewardModelTrainingMode,
    check_adapter_metadata,
    check_metadata,
)
from rewardplane.protocol.naming import WeightValidationError, normalize_params, validate_for_mode

T = TypeVar("T")


def names_for_mode(
    params: Mapping[str, T],
    mode: RewardModelTrainingMode,
    *,
    served: set[str] | None,
    keep_lora: bool,
    head_patterns: Sequence[str],
    adapter: AdapterConfig | None,
    check_mode: bool = True,
) -> dict[str, T]:
    """Server names → values, validated for ``mode`` (an adapter push keeps its LoRA tensors;
    ``check_mode=False``: a delta push's subset, whose whole push the mode's rules were checked on)."""
    is_adapter = mode is RewardModelTrainingMode.ADAPTER
    if is_adapter and adapter is None:
        raise WeightValidationError(
            "training_mode adapter needs adapter=AdapterConfig(rank, alpha) (rewardplane.sdk.lora.adapter_payload "
            "builds both from a PEFT model)"
        )
    if adapter is not None and not is_adapter:
        raise WeightValidationError(f"adapter= goes with training_mode adapter only, not {mode.value}")
    renamed = normalize_params(params, served=served, keep_lora=keep_lora or is_adapter)
    if not is_adapter and check_mode:
        validate_for_mode(renamed, mode, tuple(head_patterns))
    return renamed


def check_fits(
    metadata: list[ParamMeta],
    manifest: Mapping[str, ParamMeta],
    mode: RewardModelTrainingMode,
    adapter: AdapterConfig | None,
) -> None:
    """Raise ``WeightValidationError`` with what the server would answer 400 for."""
    if mode is RewardModelTrainingMode.ADAPTER:
        assert adapter is not None  # names_for_mode refused it
        # the rank against the server's --max-lora-rank is the server's own check
        problems = check_adapter_metadata(metadata, manifest, adapter, max_rank=adapter.rank)
    else:
        problems = check_metadata(metadata, dict(manifest))
    if problems:
        raise WeightValidationError(
            f"{len(problems)} parameter(s) do not fit the served model; nothing was sent: "
            + "; ".join(problems[:10])
            + (" …" if len(problems) > 10 else "")
        )
