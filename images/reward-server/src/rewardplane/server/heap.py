"""Freed memory stays with the server (glibc's malloc), so a large request body does not fault its
pages in anew each time.

A 10 MB body passes through several 10 MB buffers on the event loop (uvicorn's, the joined body,
the parsed text). glibc gives such buffers back to the kernel when they are freed (mmap'd chunks,
and the heap's top beyond its trim threshold), so the next body faults every page in again: 2,560
faults per 10 MB buffer at ~3 µs each in a VM, ~20 ms of blocked event loop per body and two
thirds of the server's CPU for it (benchmarks/README.md, "Reward server under 10 MB inputs").
Tuned, buffers up to ``MMAP_THRESHOLD`` come from the heap and up to ``TRIM_THRESHOLD`` of freed
heap stays mapped for the next body: the price is that much RSS kept after a burst of large bodies.
"""

from __future__ import annotations

import ctypes
import os

# mallopt parameters, from glibc's malloc.h
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
# glibc's largest mmap threshold on 64-bit, and the trim threshold its own dynamic tuning goes up
# to (twice that): what glibc would reach by itself, but only after the first buffers of each
# size were freed and never high enough to keep the ~4 buffers one large body needs.
MMAP_THRESHOLD = 32 << 20
TRIM_THRESHOLD = 64 << 20
# glibc's own environment variables for these: when an operator set them, they rule.
ENV_OVERRIDES = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_")


def keep_freed_memory() -> str:
    """Tune glibc's malloc as the module says; returns what was done, for the server's log."""
    if any(name in os.environ for name in ENV_OVERRIDES):
        return "malloc thresholds left as the environment sets them (MALLOC_*_THRESHOLD_)"
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return "malloc left as it is (not glibc)"
    # mallopt returns 1 on success (0 where unsupported, e.g. musl's stub)
    if mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD) != 1 or mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD) != 1:
        return "malloc left as it is (mallopt refused the thresholds)"
    return (
        f"malloc keeps freed memory: buffers up to {MMAP_THRESHOLD >> 20} MiB from the heap, "
        f"up to {TRIM_THRESHOLD >> 20} MiB of it kept for the next large body"
    )
