"""Pushes over the same-host transport on CPU (shared memory in ``/dev/shm``): real servers, real
trainer processes, ``backend="ipc"``. The push suites of the other transports run here unchanged
over it — full, head-only, LoRA-merged, adapter and delta pushes; atomic and streamed pushes with
the trainer killed mid-push; persistence and restore; two trainer ranks into two workers — each
checked to have gone over shared memory. Then what is refused, and how."""

from __future__ import annotations

import functools
import glob
import os
import threading
import uuid
from collections.abc import Iterator

import httpx
import pytest
import torch

import tests.integration.test_adapter_sync as adapter_suite
import tests.integration.test_delta_push as delta_suite
import tests.integration.test_sharded_push as sharded_suite
import tests.integration.test_weight_sync as push_suite
from rewardplane.sdk.push.wire import http as http_wire
from rewardplane.testing.servers import free_port
from rewardplane.transport.comm import CommunicatorError, create_store
from rewardplane.transport.group import open_group
from rewardplane.transport.placement import Place
from rewardplane.transport.same_host import SHM_DIR, SameHostCommunicator
from rewardplane.transport.same_host_board import FLAG_VALUE_LIMIT
from tests.fixtures.models import TEXTS
from tests.integration.test_weight_sync import TOKEN


@pytest.fixture
def ipc(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[str]]:
    """Every push of the suites below over ``backend="ipc"``; yields the transports the trainer's
    groups were formed with, which must all be the same-host one."""
    formed: list[str] = []
    groups: set[str] = set()
    real_open = http_wire.open_group

    def spy(*args, **kwargs):
        comm = real_open(*args, **kwargs)
        formed.append(comm.backend)
        groups.add(str(getattr(comm, "group_id", "")))
        return comm

    monkeypatch.setattr(http_wire, "open_group", spy)
    ipc_sync_for = functools.partial(push_suite.sync_for, backend="ipc")
    for suite in (push_suite, delta_suite, adapter_suite):
        monkeypatch.setattr(suite, "sync_for", ipc_sync_for)
    monkeypatch.setattr(
        push_suite, "run_dying_trainer", functools.partial(push_suite.run_dying_trainer, backend="ipc")
    )
    yield formed
    assert formed and set(formed) == {"ipc"}, formed
    # only this test's groups: tests running beside it (pytest -n) stage their own files
    left = {f for g in groups for f in glob.glob(os.path.join(SHM_DIR, f"rewardplane-{g}-*"))}
    assert not left, f"staging files left in {SHM_DIR}: {sorted(left)}"


@pytest.fixture
def server(server_factory, tiny_model_dir):
    return server_factory(tiny_model_dir, token=TOKEN)


@pytest.fixture
def lora_server(server_factory, tiny_model_dir):
    return server_factory(tiny_model_dir, token=TOKEN, enable_lora=True, max_lora_rank=adapter_suite.MAX_RANK)


def test_full_push(ipc, server, tiny_model_dir):
    push_suite.test_full_push_scores_equal_trainer_and_version_served(server, tiny_model_dir)


def test_head_only_push(ipc, server, tiny_model_dir):
    push_suite.test_head_only_push_changes_only_the_head(server, tiny_model_dir)


def test_lora_merged_push(ipc, server, tiny_model_dir):
    push_suite.test_lora_merged_push_then_fresh_adapters(server, tiny_model_dir)


def test_adapter_push(ipc, lora_server, tiny_model_dir):
    adapter_suite.test_adapter_push_serves_the_peft_model_over_untouched_base_weights(
        lora_server, tiny_model_dir
    )


def test_two_replicas_one_push(ipc, server_factory, tiny_model_dir):
    push_suite.test_two_replicas_one_push(server_factory, tiny_model_dir, per_server_groups=False)


def test_bad_metadata_rejected_before_any_receive(ipc, server, tiny_model_dir):
    push_suite.test_bad_metadata_rejected_before_any_receive(server, tiny_model_dir)


def test_delta_push_persistence_and_restore(ipc, server_factory, tiny_model_dir, tmp_path, caplog):
    """Delta pushes into two replicas, one saving its pushes, restored and pushed again: bit for
    bit (``/param_checksums``) at every step."""
    delta_suite.test_delta_push_moves_only_changed_tensors_and_falls_back_after_a_restore(
        server_factory, tiny_model_dir, tmp_path, caplog
    )


@pytest.mark.parametrize("atomic", [False, True])
def test_trainer_killed_mid_push(ipc, server, tiny_model_dir, atomic):
    """Atomic: the old version keeps serving; streamed: 503 until the next full push (which goes
    over shared memory again)."""
    push_suite.test_trainer_killed_mid_broadcast(server, tiny_model_dir, atomic)


def test_two_trainer_ranks_into_two_workers(server_factory, tiny_model_dir, tmp_path):
    pair = server_factory.several(tiny_model_dir, {"token": TOKEN}, {"token": TOKEN})
    results = sharded_suite._push(tmp_path, pair, tiny_model_dir, layout="tp", versions=[1, 2], backend="ipc")
    for r in results:
        assert r is not None and r.get("error") is None and r["pushed"] == [1, 2], r
        assert r["backend"] == "ipc", r
    sent = results[0]["sent_by"]
    assert min(sent) > 0.35 * sum(sent), sent  # both ranks send their own part
    sharded_suite._serves(pair, tiny_model_dir, 2)


# ---- refusals ----------------------------------------------------------------------------------


def _place(host: str, gpu: str | None = None, name: str = "node-a") -> Place:
    return Place(host=host, name=name, gpu=gpu, pid=1, pid_ns=1)


def test_ipc_across_hosts_is_refused_before_the_push_naming_nccl(server, tiny_model_dir, monkeypatch):
    """The server's rank reports another host (as a server on another node would): the trainer's
    group refuses the same-host transport, naming NCCL, and the server keeps serving version 0."""
    from rewardplane.transport import group

    real = group.local_place
    monkeypatch.setattr(
        group, "local_place", lambda device, asked="auto": _place("another-boot/ipc:1", name="node-b")
    )
    try:
        sync = push_suite.sync_for(server, backend="ipc")
        with pytest.raises(Exception, match="nccl") as err:
            sync.push(dict(torch.nn.Linear(2, 2).state_dict()), version=1)
        assert "one host" in str(err.value)
    finally:
        monkeypatch.setattr(group, "local_place", real)
        sync.close()
    body = httpx.post(f"{server.url}/score", json={"input": TEXTS[:1], "normalize": False}, timeout=30).json()
    assert body["version"] == 0


def _pair_rank(port: int, rank: int, timeout_s: float, group_id: str = "default") -> SameHostCommunicator:
    """Rank ``rank`` of a two-rank same-host group on CPU; rank 1 (the sender) hosts the store."""
    store = create_store("127.0.0.1", port, is_master=rank == 1, world_size=2, timeout_s=10)
    return SameHostCommunicator(
        store,
        rank=rank,
        world_size=2,
        device=torch.device("cpu"),
        places=[_place("h"), _place("h")],
        timeout_s=timeout_s,
        group_id=group_id,
    )


def test_a_staging_buffer_that_cannot_be_opened_names_the_pod_field():
    """A receiver that does not see the trainer's shared memory (no shared IPC namespace, e.g. two
    Pods): the error names hostIPC, or one Pod with both containers."""
    port = free_port()
    errors: list[BaseException] = []

    def receiver() -> None:
        comm = _pair_rank(port, 0, timeout_s=10)
        try:
            comm.broadcast(torch.empty(1024, dtype=torch.uint8), 1)
        except BaseException as exc:
            errors.append(exc)

    sender = _pair_rank(port, 1, timeout_s=3)
    real_new_slot = sender._new_slot

    def hidden_slot(nbytes: int):
        slot = real_new_slot(nbytes)
        os.unlink(slot.path)  # gone before the receiver opens it: as from another IPC namespace
        slot.path = None
        return slot

    sender._new_slot = hidden_slot  # type: ignore[method-assign]
    t = threading.Thread(target=receiver)
    t.start()
    with pytest.raises(CommunicatorError):  # the receiver never acknowledges
        sender.broadcast(torch.ones(1024, dtype=torch.uint8), 1)
    t.join(timeout=20)
    assert errors and isinstance(errors[0], CommunicatorError), errors
    assert "hostIPC: true" in str(errors[0]) and "one Pod" in str(errors[0])
    sender.close()


def test_status_reductions_agree_round_after_round_through_the_shared_flags():
    """Two ranks' reductions over the signal boards, more rounds than the flag ring holds, with
    values too large for a flag's word (a note in the store): every round gives both the max, and
    no file is left in shared memory."""
    port, group_id = free_port(), f"flags-{uuid.uuid4().hex[:8]}"
    rounds = [(0, 0), (1, 0), (0, 1), (FLAG_VALUE_LIMIT + 5, 3), (2, FLAG_VALUE_LIMIT)] * 4
    out: dict[int, list[int]] = {}

    def rank0() -> None:
        comm = _pair_rank(port, 0, timeout_s=10, group_id=group_id)
        out[0] = [comm.max_flag(a) for a, _ in rounds]
        comm.close()

    comm = _pair_rank(port, 1, timeout_s=10, group_id=group_id)
    t = threading.Thread(target=rank0)
    t.start()
    out[1] = [comm.max_flag(b) for _, b in rounds]
    t.join(timeout=30)
    comm.close()
    assert out[0] == out[1] == [max(a, b) for a, b in rounds]
    assert not glob.glob(os.path.join(SHM_DIR, f"rewardplane-{group_id}-*"))


def test_auto_on_cpu_keeps_gloo():
    """On CPU ``auto`` stays gloo; shared memory is asked for (``backend="ipc"``)."""
    port = free_port()
    store = create_store("127.0.0.1", port, is_master=True, world_size=2, timeout_s=10)
    out: dict[str, str] = {}

    def other() -> None:
        client = create_store("127.0.0.1", port, is_master=False, world_size=2, timeout_s=10)
        out["rank0"] = open_group(
            client, rank=0, world_size=2, device=torch.device("cpu"), timeout_s=10
        ).backend

    t = threading.Thread(target=other)
    t.start()
    comm = open_group(store, rank=1, world_size=2, device=torch.device("cpu"), timeout_s=10)
    t.join(timeout=20)
    assert comm.backend == out["rank0"] == "gloo"
    comm.close()


# ---- the colocated cycle --------------------------------------------------------------------------


def test_colocated_cycle_reads_no_checkpoint_after_a_level_2_sleep(server_factory, tiny_model_dir, tmp_path):
    """sleep (level 2) → train → wake without reload → full push over shared memory → score →
    sleep, twice, in one ``with pusher.awake(2, reload=False)`` block each. The checkpoint is gone
    from disk before the first wake: the server never needs it. A wake that does reload says so."""
    import shutil

    from tests.fixtures.trainer import logits, perturbed

    ckpt = tmp_path / "ckpt"
    shutil.copytree(tiny_model_dir, ckpt)
    server = server_factory(ckpt, token=TOKEN)
    url, auth = server.url, {"Authorization": f"Bearer {TOKEN}"}
    sync = push_suite.sync_for(server, backend="ipc")
    try:
        model = perturbed(tiny_model_dir, seed=3)
        sync.push(model.state_dict(), version=1)  # the group forms while awake
        assert httpx.post(f"{url}/sleep", json={"level": 2}, headers=auth, timeout=60).status_code == 200
        shutil.rmtree(ckpt)  # nothing on disk to reload from
        for version in (2, 3):
            with torch.no_grad():  # the training step, while the server sleeps
                for p in model.parameters():
                    p.mul_(1.0 + 0.05 * torch.randn_like(p))
            with sync.awake(2, reload=False) as awake:
                woke = next(iter(awake.woken.values()))
                assert (woke.state, woke.weights) == ("awake", "broken") and "reload false" in (
                    woke.detail or ""
                )
                assert httpx.post(f"{url}/score", json={"input": TEXTS[:1]}, timeout=30).status_code == 503
                sync.push(model.state_dict(), version=version)
                got, served_version = push_suite.served(server)
                assert served_version == version and push_suite.close(
                    got, logits(model, tiny_model_dir, TEXTS)
                )
            health = httpx.get(f"{url}/health", timeout=10).json()
            assert (health["state"], health["sleep_level"]) == ("sleeping", 2)
        assert sync.open().comm.backend == "ipc"
        woke = httpx.post(f"{url}/wake", headers=auth, timeout=60).json()  # reload: the checkpoint is gone
        assert woke["weights"] == "broken" and "push the full weights" in woke["detail"], woke
    finally:
        sync.close()
