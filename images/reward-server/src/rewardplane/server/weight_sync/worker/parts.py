"""The worker's parts, built once over one engine's ``WorkerHost``: each gets the state and the
parts it works with, and nothing else."""

from __future__ import annotations

from dataclasses import dataclass

from rewardplane.server.weight_sync.worker.adapters import Adapters
from rewardplane.server.weight_sync.worker.join import Joins
from rewardplane.server.weight_sync.worker.listener import DataPushListener
from rewardplane.server.weight_sync.worker.peer_send import PeerSender
from rewardplane.server.weight_sync.worker.persistence import Persistence
from rewardplane.server.weight_sync.worker.receive import Receiver
from rewardplane.server.weight_sync.worker.slices import Slices
from rewardplane.server.weight_sync.worker.staging import Staging
from rewardplane.server.weight_sync.worker.state import WorkerHost, WorkerState


@dataclass(frozen=True)
class WorkerParts:
    state: WorkerState
    persistence: Persistence
    staging: Staging
    slices: Slices
    receiver: Receiver
    joins: Joins
    listener: DataPushListener
    adapters: Adapters
    peer: PeerSender

    @classmethod
    def build(cls, host: WorkerHost) -> WorkerParts:
        state = WorkerState(host)
        persistence = Persistence(state)
        staging = Staging(state, persistence)
        slices = Slices(state, persistence, staging)
        receiver = Receiver(state, persistence, slices)
        return cls(
            state=state,
            persistence=persistence,
            staging=staging,
            slices=slices,
            receiver=receiver,
            joins=Joins(state, receiver),
            listener=DataPushListener(state, receiver),
            adapters=Adapters(state),
            peer=PeerSender(host),
        )
