"""What a weight push carries and how a sequence is pooled: names shared by every layer."""

from __future__ import annotations

from enum import Enum


class RewardModelTrainingMode(str, Enum):
    """Which parameters a weight push carries."""

    HEAD_ONLY = "head_only"
    """Only the score/classifier head (backbone frozen)."""
    LORA = "lora"
    """LoRA-trained model, merged into the backbone before sync (merge → sync → reinit)."""
    FULL = "full"
    """Every parameter, backbone and head."""
    ADAPTER = "adapter"
    """Only the LoRA A/B tensors (plus trained non-LoRA parameters such as the head), applied by the
    server as a LoRA adapter over untouched base weights (``protocol.adapters``)."""

    @classmethod
    def _missing_(cls, value: object) -> RewardModelTrainingMode:
        # Enum's own error ("'headonly' is not a valid RewardModelTrainingMode") names no choice
        modes = ", ".join(m.value for m in cls)
        raise ValueError(f"training mode {value!r} is not one of {modes}")


class PoolingType(str, Enum):
    """How a sequence's hidden states become one vector for the head."""

    LAST = "last"
    MEAN = "mean"
    CLS = "cls"
    STEP = "step"  # per-step scores for process reward models; not served yet


class ModelTask(str, Enum):
    """What a reward server runs its model for (``--task``; RewardModel ``spec.model.task``)."""

    SCORE = "score"
    """A score head (``*ForSequenceClassification``): the scoring endpoints."""
    GENERATE = "generate"
    """A causal LM answering chats (an LLM judge): ``POST /v1/chat/completions``."""
