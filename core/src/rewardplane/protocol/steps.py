"""Process reward models (PRMs): how a solution's steps are marked, scored and combined. Pure logic
shared by the server (which scores) and the SDK (which credits the steps).

A PRM reads a whole solution once, with a step-tag token after each step, and gives each tag a
probability that the step is good (Qwen2.5-Math-PRM: the softmax of two logits, label 1 = good).
The raw score of a step is its log-odds, ``log(p / (1 - p))``: ``sigmoid(raw) == p``, so the two
forms carry the same information and an aggregate over probabilities has one raw form too.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from enum import Enum

from pydantic import BaseModel, ConfigDict, Field, StrictInt


class ModelKind(str, Enum):
    """What a reward model scores (``--model-kind``; RewardModel ``spec.model.kind``)."""

    SEQUENCE = "sequence"
    """One score per text (a score head on the last token)."""
    PROCESS = "process"
    """One score per step of a solution (a PRM: a token-classification head read at step tags)."""


class StepAggregation(str, Enum):
    """How a solution's step scores become one (what a single-scalar consumer such as GRPO takes)."""

    MIN = "min"
    """The weakest step: a solution is as good as its worst step (the usual choice for math)."""
    MEAN = "mean"
    LAST = "last"
    PRODUCT = "product"
    """The probability that every step is good, the steps taken as independent."""


DEFAULT_STEP_SEPARATOR = "\n\n"


class ProcessRewardConfig(BaseModel):
    """How a PRM server marks and combines steps (its flags; ``ModelInfo.process``)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    step_tag: str = Field(min_length=1, description="The token placed after each step, e.g. <extra_0>.")
    step_separator: str = Field(
        default=DEFAULT_STEP_SEPARATOR,
        min_length=1,
        description="What separates steps in a solution sent as one text.",
    )
    good_label: StrictInt = Field(default=1, ge=0, description="The head's label meaning a good step.")
    aggregation: StepAggregation | None = Field(
        default=None, description="Default aggregate of a solution's steps; None: a request must name one."
    )


class StepScore(BaseModel):
    """One step's score. ``span``: its characters ``[start, end)`` in the solution as sent (a list of
    steps counts as the steps joined by the server's separator). ``tokens``: its tokens ``[start,
    end)`` in the scored sequence, the step tag at ``end - 1``."""

    index: int
    score: float
    span: tuple[int, int]
    tokens: tuple[int, int]


def split_steps(text: str, separator: str) -> list[tuple[str, tuple[int, int]]]:
    """The steps of a text with separators and their character spans; blank pieces (a trailing
    separator, two in a row) are not steps."""
    steps: list[tuple[str, tuple[int, int]]] = []
    start = 0
    for piece in text.split(separator):
        end = start + len(piece)
        if piece.strip():
            steps.append((piece, (start, end)))
        start = end + len(separator)
    return steps


def step_spans(steps: Sequence[str], separator: str) -> list[tuple[int, int]]:
    """Character spans of ``steps`` in the steps joined by ``separator``."""
    spans, start = [], 0
    for s in steps:
        spans.append((start, start + len(s)))
        start += len(s) + len(separator)
    return spans


def good_log_odds(logits: Sequence[float], good_label: int) -> float:
    """The raw score of a step: the log-odds of the good label (one logit: the logit itself)."""
    if len(logits) == 1:
        return float(logits[0])
    others = [v for i, v in enumerate(logits) if i != good_label]
    m = max(others)
    return float(logits[good_label]) - (m + math.log(sum(math.exp(v - m) for v in others)))


def probability(log_odds: float) -> float:
    if log_odds >= 0:
        return 1.0 / (1.0 + math.exp(-log_odds))
    e = math.exp(log_odds)
    return e / (1.0 + e)


def log_odds(p: float) -> float:
    """The inverse of :func:`probability`; ±inf at 1 and 0."""
    if p <= 0.0:
        return -math.inf
    if p >= 1.0:
        return math.inf
    return math.log(p) - math.log1p(-p)


def aggregate(probabilities: Sequence[float], how: StepAggregation) -> float:
    """One score from a solution's step probabilities."""
    if not probabilities:
        raise ValueError("a solution without steps has no aggregate")
    if how == StepAggregation.MIN:
        return min(probabilities)
    if how == StepAggregation.MEAN:
        return sum(probabilities) / len(probabilities)
    if how == StepAggregation.LAST:
        return probabilities[-1]
    return math.prod(probabilities)
