"""Peer restore: a replica that serves the model's current weights sends them to joining peers.

``POST /send_weights`` makes this server play the trainer's part of a full push: it hosts the
rendezvous, takes the last rank, and broadcasts every parameter of its manifest in flat buckets
over ``rewardplane.transport`` (gloo on CPU, NCCL on GPUs). The operator asks the receivers to
join (``/init_communicator``, host = this server) and to accept a full push of this server's
manifest at the same version (``/update_param_batch``). This brings a new or restarted replica to
the current version without the trainer and without saved weights.

While sending, the server counts as busy: pushes and restores are refused (409), so the weights
cannot change under the broadcast; scoring goes on (sending only reads the parameters). The send
runs in the worker that holds the parameters, on a thread of its own; this process starts it and
polls for its end. On vLLM the worker reads each parameter back from where a push copied it
(``CopyPlan.held``): a replica whose weights all came by a push since it started, at tensor-parallel
size 1, can send; others are refused up front with the reason.
"""

from __future__ import annotations

import asyncio
import logging
import time

from rewardplane.protocol import SendWeightsRequest
from rewardplane.server.errors import Conflict
from rewardplane.server.weight_sync.control_state import ControlPlaneState

log = logging.getLogger(__name__)

POLL_S = 0.1  # how often the end of a send is asked for (a worker call each)


async def send_weights(service: ControlPlaneState, req: SendWeightsRequest) -> None:
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
    names = list(service.manifest)
    problems = await service.calls.peer_send_problems(names)
    if len(problems) != 1:
        raise Conflict(
            f"this replica is tensor-parallel ({len(problems)} workers, each holding a shard): it cannot send its "
            "weights to peers yet; restore the replica from saved weights (persistDir) or push the full weights again"
        )
    if problems[0] is not None:
        raise Conflict(
            f"this replica cannot send its weights to peers: {problems[0]}; restore the replica from saved weights "
            "(persistDir) or push the full weights again"
        )
    if service.busy():  # a push may have arrived while the workers were asked
        raise Conflict("a weight update is in progress; send after it finishes")
    metadata = [m.model_dump(mode="json") for m in service.manifest.values()]
    limit_s = 3 * req.timeout_s + 30  # the rendezvous and every collective are bounded by timeout_s
    started: asyncio.Future[None] = asyncio.get_running_loop().create_future()

    async def send() -> None:
        try:
            await service.calls.peer_send_start(metadata, req)
        except BaseException as e:  # cancelled too (a server stopping): the request must not wait forever
            started.set_exception(e if isinstance(e, Exception) else Conflict("the server is stopping"))
            if not isinstance(e, Exception):
                raise
            return
        started.set_result(None)
        deadline = time.monotonic() + limit_s
        try:
            while time.monotonic() < deadline:
                outcome = (await service.calls.peer_send_outcomes())[0]
                if outcome is not None:
                    ok, detail = outcome
                    if ok:
                        log.info("sent weights version %d to peers: %s", req.version, detail)
                    else:
                        # the receivers report their own failure; this replica only read its weights
                        log.warning("sending weights version %d to peers failed: %s", req.version, detail)
                    return
                await asyncio.sleep(POLL_S)
            log.error("sending weights version %d to peers did not end within %.0f s", req.version, limit_s)
        except Exception:
            log.exception("following the send of weights version %d to peers failed", req.version)

    # Counted as the running update from here on, with no await between the check above and this:
    # a push or restore arriving meanwhile is refused (409), so the weights cannot change under the send.
    service.update_task = service.spawn(send(), f"send-v{req.version}")
    await started  # a send the worker could not start fails this request
