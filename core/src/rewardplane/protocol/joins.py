"""How long a server waits to join a trainer's group, and how a pending join is cancelled.

``POST /init_communicator`` starts a join and answers at once; the server's workers then wait in
the trainer's TCPStore rendezvous. A server takes one join at a time, and a join holds the
replica's weight sync (not its scoring) until it forms or is given up:

- ``timeout_s`` above the server's maximum (``--max-join-timeout-s``, ``settings.MAX_JOIN_TIMEOUT_S``)
  is refused with 400 naming the maximum;
- a join that has not formed ``JOIN_GRACE_S`` after its ``timeout_s`` is abandoned: the server
  stops waiting, forgets that attempt (a worker thread still blocked in the rendezvous leaves the
  group it forms, if it ever does) and takes a new join, a close or a sleep;
- ``POST /close_communicator`` cancels a pending join the same way, and its answer
  (``CloseCommunicatorResponse``) names the join it cancelled. With a ``group_id``
  (``CloseCommunicatorRequest``) it acts only on that group: a server joining or in another
  group, or in none, is left as it is (``closed`` false). An operator that took over a push its
  predecessor left in the rendezvous cancels the replicas' joins this way, without touching a
  group they joined since.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

# The ``detail.code`` of a join refused (409) because a weight update is running: a caller that then
# finds no update running asks again at once (the update ended between the two calls).
UPDATE_IN_PROGRESS = "update_in_progress"
# The ``detail.code`` of an announce refused (409) because the trainer never joined the group the
# replica was asked to join: the operator then fails the push naming the trainer, not the replica.
TRAINER_ABSENT = "trainer_absent"

# The rendezvous's own timeouts (TCPStore connect, process-group creation) overrun timeout_s by a
# few seconds; past this much more the join is abandoned whatever the workers still do.
JOIN_GRACE_S = 5.0


class CancelledJoin(BaseModel):
    """A pending join that ``POST /close_communicator`` cancelled."""

    host: str
    port: int
    group_id: str
    pending_s: float = Field(description="How long the join had been waiting for the trainer.")


class CloseCommunicatorRequest(BaseModel):
    """Body of ``POST /close_communicator`` (optional: no body, or no ``group_id``, closes whatever
    group the server is in or joining)."""

    model_config = ConfigDict(extra="forbid")  # a misspelt field is a 422, not a default

    group_id: str | None = Field(
        default=None,
        description="Close only this group (the group_id of its /init_communicator): a server joining or in "
        "another group, or in none, changes nothing and answers closed=false.",
    )


class CloseCommunicatorResponse(BaseModel):
    """Answer of ``POST /close_communicator``: the group is left, and a pending join cancelled."""

    status: str = "ok"
    closed: bool = Field(
        default=True,
        description="False when the request named a group_id this server was neither in nor joining: "
        "nothing was changed.",
    )
    cancelled_join: CancelledJoin | None = Field(
        default=None,
        description="The join that was still waiting for the trainer, now cancelled; null if none.",
    )
