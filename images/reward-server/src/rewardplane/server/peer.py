"""Peer restore: a replica that serves the model's current weights sends them to joining peers.

``POST /send_weights`` makes this server play the trainer's part of a full push: it hosts the
rendezvous, takes the last rank, and broadcasts every parameter of its manifest in flat buckets
over ``rewardplane.transport`` (gloo on CPU, NCCL on GPUs). The operator asks the receivers to
join (``/init_communicator``, host = this server) and to accept a full push of this server's
manifest at the same version (``/update_param_batch``). This brings a new or restarted replica to
the current version without the trainer and without saved weights.

While sending, the server counts as busy: pushes and restores are refused (409), so the weights
cannot change under the broadcast; scoring goes on (sending only reads the parameters).
Engines: those whose parameters live in this process (the transformers engine); a vLLM sender
would need the gather in its workers and is refused with a clear message.
"""

from __future__ import annotations

import asyncio
import logging

import torch

from rewardplane.protocol import SendWeightsRequest
from rewardplane.transport.comm import Communicator, create_store
from rewardplane.transport.transfer import send_buckets

from .control_plane import WeightSyncService
from .errors import Conflict

log = logging.getLogger(__name__)


async def send_weights(service: WeightSyncService, req: SendWeightsRequest) -> None:
    """Check that this server can send ``req.version`` now, then send it in the background."""
    guard = service.guard
    if guard.state != "serving" or guard.version != req.version:
        raise Conflict(
            f"this replica serves version {guard.version} ({guard.state}), not {req.version}; "
            "ask a replica that serves the requested version"
        )
    if service.busy():
        raise Conflict("a weight update is in progress; send after it finishes")
    if service.adapter is not None:  # a peer would get the base alone and serve another function
        raise Conflict(
            f"version {req.version} is a LoRA adapter over the base weights (adapter-only push); adapters are not "
            "sent to peers: push again (the adapter, or merged weights) to bring the replica up"
        )
    found = await service.port.call_workers("rp_named_parameters")
    params = found[0] if len(found) == 1 else None
    if params is None:
        raise Conflict(
            "this engine's parameters live in other processes (vLLM's workers), so it cannot send them to peers; "
            "restore the replica from saved weights or push the full weights again"
        )
    metadata = list(service.manifest.values())
    rank = req.world_size - 1
    group_id = req.group_id or f"peer-v{req.version}"

    def run() -> None:
        store = create_store(
            "0.0.0.0", req.port, is_master=True, world_size=req.world_size, timeout_s=req.timeout_s
        )
        device = next(iter(params.values())).device if params else torch.device("cpu")
        comm = Communicator(
            store,
            rank=rank,
            world_size=req.world_size,
            device=device,
            timeout_s=req.timeout_s,
            group_id=group_id,
        )
        try:
            with torch.no_grad():
                sent = send_buckets(comm, metadata, params, req.bucket_bytes, src=rank)
            # The receivers commit only once every rank agrees that the transfer succeeded.
            failed = comm.max_flag(0)
        except BaseException:
            comm.abort()  # the receivers see the group fail at once instead of waiting it out
            raise
        comm.close()
        if failed:
            log.warning("sent weights version %d, but a receiver reported a failure", req.version)
        else:
            log.info("sent weights version %d to %d peer rank(s): %d bytes", req.version, rank, sent)

    async def guarded() -> None:
        try:
            await asyncio.to_thread(run)
        except Exception:
            # The receivers report their own failure (their update fails); this server's weights
            # were only read, so it keeps serving.
            log.exception("sending weights version %d to peers failed", req.version)

    # Counted as the running update: a push or restore arriving meanwhile is refused (409).
    service._update_task = service._spawn(guarded(), f"send-v{req.version}")
