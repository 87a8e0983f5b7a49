"""The RewardModel status: its phases, condition types and replica states, and typed read models.

The operator computes the status as plain JSON (what the API server stores); readers (the SDK,
the CLI) parse it with :meth:`RewardModelStatus.parse` instead of looking up string keys.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from rewardplane.protocol import STATE_SLEEPING as STATE_SLEEPING  # a replica state, defined with /sleep

PHASE_PENDING = "Pending"
PHASE_PROGRESSING = "Progressing"
PHASE_READY = "Ready"
PHASE_DEGRADED = "Degraded"
PHASE_FAILED = "Failed"
PHASE_SLEEPING = "Sleeping"  # every replica is ready and asleep (POST /sleep): wake it to score

AVAILABLE = "Available"
PROGRESSING = "Progressing"
WEIGHTS_IN_SYNC = "WeightsInSync"
DEGRADED = "Degraded"
CONDITION_TYPES = (AVAILABLE, PROGRESSING, WEIGHTS_IN_SYNC, DEGRADED)

# Replica states a server reports on /health besides "serving".
STATE_BROKEN = "broken"
STATE_STALE = "stale"


class _Status(BaseModel):
    # camelCase as stored; unknown fields ignored so an older reader accepts a newer operator's status.
    model_config = ConfigDict(populate_by_name=True, extra="ignore", frozen=True)


class EndpointStatus(_Status):
    """One replica as ``status.endpoints`` lists it."""

    replica: int = 0
    pod: str = ""
    node: str = ""
    url: str = ""
    # The address this replica's NCCL uses (spec.transport.interface's, else the Pod's IP).
    nccl_address: str = Field(default="", alias="ncclAddress")
    group_port: int = Field(default=0, alias="groupPort")
    rank_offset: int = Field(default=0, alias="rankOffset")
    world_size: int = Field(default=1, alias="worldSize")
    state: str = ""
    ready: bool = False
    restarts: int = 0
    weights_version: int | None = Field(default=None, alias="weightsVersion")
    sleep_level: int | None = Field(default=None, alias="sleepLevel")


class Condition(_Status):
    type: str
    status: str
    reason: str = ""
    message: str = ""
    observed_generation: int | None = Field(default=None, alias="observedGeneration")


# status.reason when a replica restarted and nothing (no saved copy, no healthy replica on the
# model's version) can restore it: only a push brings the weights back.
WEIGHTS_LOST = "WeightsLost"


class RewardModelStatus(_Status):
    phase: str = PHASE_PENDING
    reason: str = ""  # why the phase is what it is (the REASON column)
    message: str = ""
    observed_generation: int | None = Field(default=None, alias="observedGeneration")
    ready_replicas: int = Field(default=0, alias="readyReplicas")
    replicas: int = 0
    weights_version: int = Field(default=0, alias="weightsVersion")
    conditions: list[Condition] = Field(default_factory=list)
    endpoints: list[EndpointStatus] = Field(default_factory=list)

    @classmethod
    def parse(cls, status: Mapping[str, Any] | None) -> RewardModelStatus:
        return cls.model_validate(dict(status or {}))

    def condition(self, type_: str) -> Condition | None:
        return next((c for c in self.conditions if c.type == type_), None)

    def ready_endpoints(self) -> list[EndpointStatus]:
        """Ready replicas with a URL, in replica order."""
        return sorted((e for e in self.endpoints if e.ready and e.url), key=lambda e: e.replica)
