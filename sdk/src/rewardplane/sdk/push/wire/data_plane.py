"""The trainer's side of pushes started from the data plane (docs/weight-sync.md).

Once every server accepted a layout over HTTP in the current group, the next pushes of it start
with a ``PushHeader`` written into the group's store — the servers wait on it — instead of an HTTP
announce; accept/refuse and the commit are agreed in the group's status reductions, so a push has
no HTTP request on its path. The servers' reasons for a refusal or failure come from the store.
"""

from __future__ import annotations

import torch.distributed as dist

from rewardplane.protocol import PushHeader, PushKeys, PushVerdict, RewardModelTrainingMode
from rewardplane.sdk.push.plan.slices import SliceBook, Slicing, slicing_of
from rewardplane.transport.comm import Communicator
from rewardplane.transport.signals import StoreClosed, put, wait_value


class DataPlaneStarter:
    """Writes push headers into the group's store (``Communicator.store``) and reads the verdicts of
    the replicas (named by their rank offsets)."""

    def __init__(
        self, store: dist.Store, replicas: list[int], receivers: int, slicing: Slicing | None = None
    ) -> None:
        self.store = store
        self.replicas = list(replicas)
        # sliced pushes: what each of the ``receivers`` (the servers' ranks) keeps of each layout
        self.slices = SliceBook(store, receivers, slicing)
        self.seq = 0
        self._layouts: set[str] = set()
        self._listening = False

    @classmethod
    def for_group(cls, comm: Communicator, replicas: list[int]) -> DataPlaneStarter:
        """The starter of a push group whose servers' ranks start at ``replicas``: its trainer
        ranks come after every server's, and it slices where its transport allows."""
        return cls(comm.store, replicas, comm.first_sender, slicing_of(comm))

    def learned(self, layout: str) -> None:
        """Every server accepted ``layout`` over HTTP (and its workers cached it)."""
        self._layouts.add(layout)

    def forget(self, layout: str) -> None:
        self._layouts.discard(layout)

    def usable(self, layout: str) -> bool:
        """Whether a push of ``layout`` can start from the data plane: every server knows it and
        waits for headers (older servers never do: they keep getting HTTP announces)."""
        if layout not in self._layouts:
            return False
        if not self._listening:
            keys = [PushKeys.listening(r) for r in self.replicas]
            try:
                self._listening = bool(self.store.check(keys))
            except dist.DistError:
                return False
        return self._listening

    def start(
        self,
        *,
        version: int,
        layout: str,
        bucket_bytes: int,
        training_mode: RewardModelTrainingMode,
        atomic: bool,
        timeout_s: float,
        sliced: bool = False,
        base_version: int | None = None,
    ) -> int:
        """Write the next header; returns its sequence number."""
        seq = self.seq
        header = PushHeader(
            seq=seq,
            version=version,
            layout_id=layout,
            bucket_bytes=bucket_bytes,
            training_mode=training_mode,
            atomic=atomic,
            timeout_s=timeout_s,
            sliced=sliced,
            base_version=base_version,
        )
        put(self.store, PushKeys.header(seq), header)
        self.seq += 1
        return seq

    def verdicts(self, seq: int, timeout_s: float) -> dict[int, PushVerdict]:
        """Each replica's verdict on push ``seq`` (those that answer within ``timeout_s``)."""
        out: dict[int, PushVerdict] = {}
        for replica in self.replicas:
            try:
                raw = wait_value(self.store, PushKeys.verdict(seq, replica), timeout_s)
            except (TimeoutError, StoreClosed):
                continue
            if raw is not None:
                out[replica] = PushVerdict.model_validate_json(raw)
        return out


def describe(verdicts: dict[int, PushVerdict], replicas: list[int]) -> str:
    """One line naming each replica's reason (a replica that said nothing is named too)."""
    parts = [
        f"replica at rank {r}: {verdicts[r].error or verdicts[r].code}"
        if r in verdicts
        else f"replica at rank {r}: no answer"
        for r in replicas
        if r not in verdicts or not verdicts[r].committed
    ]
    return "; ".join(parts) or "no reason given"
