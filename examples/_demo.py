"""What the top-level examples share: the texts they score and reading a one-label model's scores.
Each example imports it as a sibling module (``python examples/<x>.py`` puts this folder first on
the path)."""

from __future__ import annotations

from rewardplane.protocol import Score

TEXTS = ["The answer is clear, correct and kind.", "no idea lol", "Here is a careful step-by-step proof."]


def one_label(scores: list[Score]) -> list[float]:
    """The scores of a one-label model (the tiny one): a float per text, where several labels
    would give a list per text."""
    out = []
    for s in scores:
        if isinstance(s, list):
            raise TypeError(f"expected one score per text, got {len(s)} labels")
        out.append(s)
    return out
