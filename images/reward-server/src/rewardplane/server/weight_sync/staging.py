"""Whether an atomic push's staging fits: an atomic push receives the whole update into fresh
buffers before swapping it in under the lock, and on a GPU those buffers sit outside the engine's
memory fraction. A push that cannot fit is refused before any byte moves (a named 409), instead of
failing its allocation mid-receive, which the trainer would only see as a timeout."""

from __future__ import annotations

from rewardplane.protocol import settings

GIB = 1 << 30
# Room kept beside the staged buffers: NCCL's own buffers, the allocator's rounding, a scoring batch.
STAGING_MARGIN_BYTES = 256 << 20


def staging_limit_from_env() -> int | None:
    """``--staging-max-bytes`` (``settings.STAGING_MAX_BYTES``, in the environment the workers
    inherit): a cap on what one atomic push may stage on this server (e.g. to bound host memory on
    a CPU server); unset: the device's free memory alone decides."""
    return settings.STAGING_MAX_BYTES.get()


SMALLER_FRACTION = (
    "give the engine a smaller memory fraction (--gpu-memory-utilization; RewardModel "
    "spec.gpu.memoryFraction) to leave room for it"
)


def staging_problem(
    needed: int,
    *,
    where: str,
    free: int | None,
    cached: int = 0,
    limit: int | None = None,
    what: str | None = None,
    advice: str | None = None,
) -> str | None:
    """Why staging ``needed`` bytes on ``where`` would fail, or None. ``free``: the device's free
    memory (None: not a GPU); ``cached``: what the allocator holds unused, which it reuses before
    asking the device (a second atomic push reuses the first one's buffers); ``limit``: the
    operator's cap. ``what`` stages and the ``advice`` against it: an atomic push's by default."""
    what = what or (
        f"an atomic push stages the whole update ({needed / GIB:.2f} GiB) on {where} before swapping it in"
    )
    advice = advice or (
        "push it streamed instead (atomic=False: scoring waits during the transfer, no copy is staged), "
        f"or {SMALLER_FRACTION}"
    )
    if limit is not None and needed > limit:
        return (
            f"{what}, over this server's limit of {limit / GIB:.2f} GiB (--staging-max-bytes, "
            f"{settings.STAGING_MAX_BYTES.name}); {advice}"
        )
    if free is None:
        return None
    available = free + cached
    if needed + STAGING_MARGIN_BYTES > available:
        return (
            f"{what}, but only {available / GIB:.2f} GiB are free there (the engine keeps its memory "
            f"fraction; {STAGING_MARGIN_BYTES >> 20} MiB are kept for NCCL and scoring); {advice}"
        )
    return None
