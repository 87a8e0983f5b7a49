"""Admission: a replica run by the operator takes traffic only once the operator admits it.

A server started with ``--require-admission`` (the operator starts every replica that way) begins
*unadmitted*: it answers ``/health`` (the startup and liveness probes), the control plane and
``/runtime_version``, but ``GET /ready`` (the readiness probe, so the Service's endpoints) answers
503 and every scoring route answers 503. The operator admits it (``POST /admission``, token) once
it serves the model's weights version: at once when it already does, or after a restore from
saved weights or from a peer. Admission lives in the server process, so a container that restarts
(on base weights) is unadmitted again before it answers its first request: no endpoint of the
Service ever points at a replica that came back on older weights than the model serves.

An admission names the version it admits: the server refuses (409) when it serves another one, so
a push that committed between the operator's look and its call is never admitted by mistake. The
operator also takes an admission back (``admit: false``) from a replica that a completed push left
behind (one that did not answer when the push was planned).

A server started without ``--require-admission`` (direct mode, no operator) is admitted from the
start, and ``/ready`` answers like ``/health``.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt


class AdmissionRequest(BaseModel):
    """Body of ``POST /admission``."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    version: StrictInt = Field(
        ge=0,
        description="The model's weights version: admitted only while the replica serves exactly this one.",
    )
    admit: StrictBool = Field(
        default=True,
        description="False takes the admission back (the replica leaves the Service's endpoints).",
    )


class AdmissionResponse(BaseModel):
    """What the replica is now: admitted or not, at which weights version."""

    admitted: bool
    version: int
    changed: bool = Field(description="False when the replica already was as asked.")


class ReadyResponse(BaseModel):
    """``GET /ready``: 200 while the replica takes traffic, 503 (with the reason) while it does not."""

    ready: bool
    admitted: bool
    version: int
    state: str
    reason: str | None = None
