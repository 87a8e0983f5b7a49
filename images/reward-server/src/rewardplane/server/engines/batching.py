"""Dynamic batching: pure planning of length-sorted micro-batches under a token budget."""

from __future__ import annotations

from collections.abc import Sequence


def plan_micro_batches(lengths: Sequence[int], *, max_tokens: int, max_items: int) -> list[list[int]]:
    """Group item indices into micro-batches, sorted by length so padding stays small.

    The budget counts padded tokens (``len(batch) * longest``): that is what the forward pass
    costs. An item longer than the budget still runs, alone.
    """
    order = sorted(range(len(lengths)), key=lambda i: lengths[i])
    batches: list[list[int]] = []
    current: list[int] = []
    longest = 0
    for i in order:
        n = max(1, lengths[i])
        new_longest = max(longest, n)
        if current and (new_longest * (len(current) + 1) > max_tokens or len(current) >= max_items):
            batches.append(current)
            current, new_longest = [], n
        current.append(i)
        longest = new_longest
    if current:
        batches.append(current)
    return batches
