"""The weight-sync control plane: what the authenticated endpoints (``routes.control_router``)
do, driven through the engine's ``WeightSyncPort``. Requests are validated before any byte moves;
the receive runs in the background while the trainer broadcasts; the version is bumped only after
the whole update. Built once per server by ``app.build_app``."""

from __future__ import annotations

from typing import Any

from rewardplane.protocol import (
    CancelledJoin,
    InitCommunicatorRequest,
    ParamMeta,
    SendWeightsRequest,
    UpdateParamBatchRequest,
)
from rewardplane.server.engines.engine import ServedAdapter, WeightSyncPort
from rewardplane.server.weight_sync.control_data_plane import DataPlanePushes
from rewardplane.server.weight_sync.control_http import AnnouncedPushes, GroupMembership
from rewardplane.server.weight_sync.control_restore import Restores
from rewardplane.server.weight_sync.control_state import ControlPlaneState
from rewardplane.server.weight_sync.peer import send_weights
from rewardplane.server.weight_sync.persistence import WeightsStore


class WeightSyncService:
    """The control plane of one replica: what it holds between requests (``control_state``), the
    group and pushes announced over HTTP (``control_http``), pushes started from the data plane
    (``control_data_plane``), restores (``control_restore``) and sends to peers (``peer``)."""

    def __init__(self, state: ControlPlaneState) -> None:
        self.state = state
        self.data_plane = DataPlanePushes(self.state)
        self.group = GroupMembership(self.state, self.data_plane)
        self.announced = AnnouncedPushes(self.state)
        self.restores = Restores(self.state)

    # ---- what it serves ----------------------------------------------------------------------
    @property
    def port(self) -> WeightSyncPort:
        return self.state.port

    @property
    def manifest(self) -> dict[str, ParamMeta]:
        return self.state.manifest

    @property
    def adapter(self) -> ServedAdapter | None:
        return self.state.adapter

    @property
    def last_error(self) -> str | None:
        return self.state.last_error

    @property
    def last_update(self) -> dict[str, Any] | None:
        return self.state.last_update

    def busy(self) -> bool:
        return self.state.busy()

    def failed_idle(self) -> bool:
        return self.state.failed_idle()

    def background_count(self) -> int:
        return self.state.background_count()

    # ---- the group and pushes ----------------------------------------------------------------
    async def init_communicator(self, req: InitCommunicatorRequest) -> None:
        await self.group.init_communicator(req)

    async def close(self, group_id: str | None = None) -> tuple[bool, CancelledJoin | None]:
        return await self.group.close(group_id)

    async def update(self, req: UpdateParamBatchRequest) -> int:
        return await self.announced.update(req)

    # ---- saved weights and peers -------------------------------------------------------------
    async def restore(self, version: int, timeout_s: float) -> int:
        return await self.restores.restore(version, timeout_s)

    async def restorable(self, version: int) -> WeightsStore:
        return await self.restores.restorable(version)

    async def load_saved(self, version: int) -> int:
        return await self.restores.load_saved(version)

    async def param_checksums(self) -> tuple[int, list[Any]]:
        return await self.restores.param_checksums()

    async def send_weights(self, req: SendWeightsRequest) -> None:
        await send_weights(self.state, req)
