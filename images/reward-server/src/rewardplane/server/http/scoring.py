"""Pure functions between the engine's raw head outputs and what the endpoints return."""

from __future__ import annotations

import math
from collections.abc import Sequence

from rewardplane.protocol import Score


def activation(logits: Sequence[float]) -> list[float]:
    """The head's activation: sigmoid for one label, softmax over the labels for several."""
    if len(logits) == 1:
        x = logits[0]
        # numerically stable sigmoid
        if x >= 0:
            return [1.0 / (1.0 + math.exp(-x))]
        e = math.exp(x)
        return [e / (1.0 + e)]
    m = max(logits)
    exps = [math.exp(v - m) for v in logits]
    total = sum(exps)
    return [v / total for v in exps]


def to_score(logits: Sequence[float], *, normalize: bool) -> Score:
    """One label → a float; several → a vector. ``normalize=False`` is the raw head output."""
    values = activation(logits) if normalize else [float(v) for v in logits]
    return values[0] if len(values) == 1 else values
