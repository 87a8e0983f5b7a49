"""Sleep and wake of a reward server (``POST /sleep``, ``POST /wake``; control plane, token).

A server sleeps between reward phases so a colocated actor can use its GPU memory:

- level 1 offloads the weights to host memory (vLLM: its sleep mode; transformers: the
  parameters move to the CPU) and frees the KV cache; a wake copies them back — the same weights.
- level 2 discards the weights. A wake reloads them: the base checkpoint from ``--model`` plus
  the pushed weights saved in ``--weights-dir`` (or the saved weights alone when they cover every
  parameter). When the served version cannot be rebuilt that way, the replica wakes ``broken``
  and refuses to score until a full push (or a restore) brings the weights back — it never
  scores with weights other than those it served before the sleep.

While asleep, scoring answers 503 (the message names ``/wake``) and anything that changes the
weights (a push, a restore, a peer send) answers 409: wake first. ``/health`` answers 200 with
``state: "sleeping"`` and the level, so the operator shows the model ``Sleeping``. Sleeping waits
(bounded by ``timeout_s``) for scoring in flight; a request is never cut off. Both calls are
idempotent: sleeping at the level the server already sleeps at, or waking an awake server,
changes nothing and says so (``changed: false``).
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictFloat

SleepLevel = Literal[1, 2]
SleepState = Literal["awake", "sleeping"]
STATE_SLEEPING = "sleeping"  # the replica state /health and /runtime_version report while asleep
DEFAULT_SLEEP_TIMEOUT_S = 120.0


class SleepRequest(BaseModel):
    """Body of ``POST /sleep``."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    level: SleepLevel = Field(
        default=1, description="1: offload the weights to host memory; 2: discard them (reloaded on wake)."
    )
    timeout_s: StrictFloat = Field(
        default=DEFAULT_SLEEP_TIMEOUT_S,
        gt=0,
        le=3600,
        description="How long to wait for scoring in flight to finish before giving up (503).",
    )


class WakeRequest(BaseModel):
    """Body of ``POST /wake`` (optional)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    timeout_s: StrictFloat = Field(default=DEFAULT_SLEEP_TIMEOUT_S, gt=0, le=3600)
    reload: StrictBool = Field(
        default=True,
        description="After a level-2 sleep: rebuild the served weights (the checkpoint read from disk, then "
        "saved pushes). False: take the memory back only; the server answers 503 until the next full push "
        "fills it (a colocated trainer that pushes right after the wake).",
    )


class SleepResponse(BaseModel):
    """Answer of ``/sleep`` and ``/wake``: the state the server is in now.

    ``changed`` is false when the server already was in the state asked for. ``seconds``: how long
    the transition took on the server. ``weights``: ``"serving"`` after a wake that restored the
    weights, ``"broken"`` when a level-2 wake could not (``detail`` says why and what to do),
    ``"asleep"`` while sleeping. ``device_bytes_freed``: device memory the sleep released, as the
    engine measures it (``None`` where it cannot tell)."""

    state: SleepState
    level: SleepLevel | None = None
    changed: bool = True
    seconds: float = 0.0
    version: int = 0
    weights: Literal["serving", "asleep", "broken", "updating"] = "serving"
    device_bytes_freed: int | None = None
    detail: str | None = None
