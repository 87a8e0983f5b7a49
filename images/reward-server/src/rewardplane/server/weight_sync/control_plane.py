"""The weight-sync control plane: what the authenticated endpoints (``routes.control_router``)
do, driven through the engine's ``WeightSyncPort``. Requests are validated before any byte moves;
the receive runs in the background while the trainer broadcasts; the version is bumped only after
the whole update. Built once per server by ``app.build_app``."""

from __future__ import annotations

from rewardplane.server.weight_sync.control_http import AnnouncedPushes
from rewardplane.server.weight_sync.control_restore import Restores


class WeightSyncService(AnnouncedPushes, Restores):
    """The control plane of one replica: the group (``control_http``), pushes announced over HTTP
    (``control_http``) or started from the data plane (``control_data_plane``), restores
    (``control_restore``), over the state they share (``control_state``)."""
