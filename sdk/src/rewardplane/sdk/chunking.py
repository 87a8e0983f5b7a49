"""Deterministic contiguous chunking of a batch over several servers, pure logic.

For ``N`` items and ``S`` servers: ``chunk_size = ceil(N / S)``; server ``i`` gets items
``[i * chunk_size, (i + 1) * chunk_size)`` (clamped to ``N``) in their original order. A server
whose chunk is empty gets no request, and ``N == 0`` means no request at all. The split depends
only on ``N`` and ``S``, so the same batch always lands on the same servers, and outputs are put
back together in the original order.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TypeVar

T = TypeVar("T")


def chunk_size(n: int, servers: int) -> int:
    """``ceil(n / servers)``; 0 when ``n == 0``."""
    _check(n, servers)
    return -(-n // servers)


def contiguous_chunks(n: int, servers: int) -> list[range]:
    """One range per server (``len == servers``), contiguous and in order; some may be empty.

    Server ``i`` owns ``range(i * cs, min((i + 1) * cs, n))`` with ``cs = ceil(n / servers)``.
    Index ``i`` of the result is server ``i``, so callers keep the server ↔ chunk pairing; skip
    empty ranges (see :func:`assignments`) to send no request to those servers.
    """
    cs = chunk_size(n, servers)
    return [range(min(i * cs, n), min((i + 1) * cs, n)) for i in range(servers)]


def assignments(n: int, servers: int) -> list[tuple[int, range]]:
    """``(server_index, chunk)`` for every non-empty chunk; empty for ``n == 0``."""
    return [(i, r) for i, r in enumerate(contiguous_chunks(n, servers)) if len(r)]


def split_range(r: range, max_size: int) -> list[range]:
    """Cut one contiguous chunk into consecutive pieces of at most ``max_size`` items.

    Used when a server's chunk is larger than what one request may carry.
    """
    if max_size < 1:
        raise ValueError(f"max_size must be >= 1, got {max_size}")
    if r.step != 1:
        raise ValueError(f"only contiguous ranges (step 1) can be split, got {r}")
    return [range(s, min(s + max_size, r.stop)) for s in range(r.start, r.stop, max_size)]


def split(items: Sequence[T], servers: int) -> list[list[T]]:
    """The items of each server's chunk (``len == servers``; empty lists for idle servers)."""
    return [list(items[r.start : r.stop]) for r in contiguous_chunks(len(items), servers)]


def reassemble(chunks: Sequence[range], outputs: Sequence[Sequence[T]], n: int | None = None) -> list[T]:
    """Put per-chunk outputs back in the original order.

    ``chunks[k]`` is the range that produced ``outputs[k]``; the chunks may come in any order but
    must tile ``0..n`` exactly once. A chunk whose output has the wrong length, or a gap/overlap,
    raises ``ValueError`` rather than returning misaligned scores.
    """
    if len(chunks) != len(outputs):
        raise ValueError(f"{len(chunks)} chunks but {len(outputs)} outputs")
    total = sum(len(r) for r in chunks) if n is None else n
    result: list[T | None] = [None] * total
    filled = [False] * total
    for r, out in zip(chunks, outputs, strict=True):
        if len(out) != len(r):
            raise ValueError(
                f"chunk [{r.start}, {r.stop}) expected {len(r)} outputs, got {len(out)}: the server "
                "answered for a different number of inputs"
            )
        if r.start < 0 or r.stop > total:
            raise ValueError(f"chunk [{r.start}, {r.stop}) lies outside 0..{total}")
        for i, value in zip(r, out, strict=True):
            if filled[i]:
                raise ValueError(f"item {i} is covered by more than one chunk")
            filled[i] = True
            result[i] = value
    if not all(filled):
        missing = filled.index(False)
        raise ValueError(f"item {missing} is covered by no chunk (of {total} items)")
    return result  # type: ignore[return-value]  # every slot was filled above


def _check(n: int, servers: int) -> None:
    if n < 0:
        raise ValueError(f"number of items must be >= 0, got {n}")
    if servers < 1:
        raise ValueError(f"number of servers must be >= 1, got {servers}: configure at least one endpoint")
