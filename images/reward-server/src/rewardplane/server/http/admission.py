"""Whether this replica takes traffic: the server's side of ``rewardplane.protocol.admission``.

Held in the process on purpose: a container that restarts comes back unadmitted, on its base
weights, and stays out of the Service's endpoints until the operator has checked (or restored) the
version it serves.
"""

from __future__ import annotations

import logging

from rewardplane.protocol import AdmissionRequest, AdmissionResponse, ReadyResponse
from rewardplane.server.errors import Conflict, Unavailable
from rewardplane.server.locking import WeightsGuard

log = logging.getLogger(__name__)


class Admission:
    def __init__(self, guard: WeightsGuard, *, required: bool) -> None:
        self.guard = guard
        self.required = required
        self.admitted = not required

    def change(self, req: AdmissionRequest) -> AdmissionResponse:
        """Admit at ``req.version`` (409 when the replica serves another version or is broken), or
        take the admission back."""
        g = self.guard
        before = self.admitted
        if not req.admit:
            self.admitted = not self.required
        else:
            if g.version != req.version:
                raise Conflict(
                    f"not admitted: this replica serves weights version {g.version}, not {req.version}; "
                    "restore it to the model's version first (saved weights or a peer), or push"
                )
            if g.state == "broken":
                raise Conflict(
                    f"not admitted: this replica's weights are broken ({g.broken_reason}); "
                    "a full push repairs it"
                )
            self.admitted = True
        if self.admitted != before:
            log.info(
                "%s at weights version %d", "admitted" if self.admitted else "admission taken back", g.version
            )
        return AdmissionResponse(admitted=self.admitted, version=g.version, changed=self.admitted != before)

    def _unadmitted(self) -> str:
        return (
            f"this replica is not admitted yet: it serves weights version {self.guard.version} and waits "
            "for the operator to confirm (or restore) the model's version; send the request to a ready "
            "replica (the SDK and the Service do)"
        )

    def refusal(self) -> str | None:
        """Why this replica takes no traffic now (None: it does)."""
        if not self.admitted:
            return self._unadmitted()
        if self.guard.state == "broken":
            return f"this replica's weights are broken ({self.guard.broken_reason}); a full push repairs it"
        return None

    def check_scoring(self) -> None:
        """503 for a scoring request while unadmitted (the guard refuses broken and sleeping itself)."""
        if not self.admitted:
            raise Unavailable(self._unadmitted())

    def ready(self) -> ReadyResponse:
        g = self.guard
        reason = self.refusal()
        return ReadyResponse(
            ready=reason is None, admitted=self.admitted, version=g.version, state=g.state, reason=reason
        )
