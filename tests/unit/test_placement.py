"""Which transport a push group's places call for (``transport.placement.choose_transport``), and
the refusals a user of a colocated trainer meets before anything starts."""

from __future__ import annotations

import pytest

from rewardplane.transport.placement import Place, PlacementError, choose_transport

HOST_A, HOST_B = "boot-a/ipc:1", "boot-b/ipc:1"


def at(host: str = HOST_A, gpu: str | None = None, name: str = "node-a") -> Place:
    return Place(host=host, name=name, gpu=gpu, pid=1, pid_ns=1)


def test_auto_picks_the_same_gpu_transport_where_ranks_share_a_gpu() -> None:
    assert choose_transport("auto", [at(gpu="GPU-0"), at(gpu="GPU-0")]) == "ipc"
    # a TP=2 replica on the trainer's two GPUs: rank i beside sender i
    assert (
        choose_transport("auto", [at(gpu="GPU-0"), at(gpu="GPU-1"), at(gpu="GPU-0"), at(gpu="GPU-1")])
        == "ipc"
    )


def test_auto_keeps_nccl_between_gpus_and_gloo_on_cpu() -> None:
    assert choose_transport("auto", [at(gpu="GPU-0"), at(gpu="GPU-1")]) == "nccl"
    assert choose_transport("auto", [at(HOST_A, "GPU-0"), at(HOST_B, "GPU-9", "node-b")]) == "nccl"
    assert choose_transport("auto", [at(), at()]) == "gloo"


def test_ipc_on_one_host_is_granted_on_gpu_and_cpu() -> None:
    assert choose_transport("ipc", [at(), at()]) == "ipc"
    assert choose_transport("ipc", [at(gpu="GPU-0"), at(gpu="GPU-1")]) == "ipc"


def test_nccl_with_two_ranks_on_one_gpu_is_refused_naming_the_same_gpu_transport() -> None:
    with pytest.raises(PlacementError) as err:
        choose_transport("nccl", [at(gpu="GPU-0"), at(gpu="GPU-1"), at(gpu="GPU-0")])
    text = str(err.value)
    assert "ranks 0 and 2" in text and "GPU-0" in text and "backend ipc" in text and "same-GPU" in text


def test_ipc_across_hosts_is_refused_naming_nccl() -> None:
    with pytest.raises(PlacementError) as err:
        choose_transport("ipc", [at(HOST_A, "GPU-0"), at(HOST_B, "GPU-1", "node-b")])
    text = str(err.value)
    assert "backend nccl" in text and "node-a" in text and "node-b" in text


def test_one_gpu_in_two_ipc_namespaces_names_the_pod_field() -> None:
    """Two Pods on one node and GPU without hostIPC: neither NCCL nor CUDA IPC can join them."""
    pods = [at("boot-a/ipc:1", "GPU-0", "trainer-pod"), at("boot-a/ipc:2", "GPU-0", "reward-pod")]
    for backend in ("auto", "nccl", "ipc"):
        with pytest.raises(PlacementError) as err:
            choose_transport(backend, pods)  # type: ignore[arg-type]
        assert "hostIPC: true" in str(err.value) and "one Pod" in str(err.value), backend


def test_nccl_on_cpu_is_refused() -> None:
    with pytest.raises(PlacementError, match="gloo"):
        choose_transport("nccl", [at(), at()])


def test_one_ranks_request_holds_for_the_group() -> None:
    """A trainer asking for ``ipc`` through the operator meets replicas asked for nothing: every
    rank, whichever it is, builds the transport the trainer asked for."""
    group = [at(), at(), at()]
    group[0] = Place(host=HOST_A, name="trainer", gpu=None, pid=1, pid_ns=1, asked="ipc")
    assert choose_transport("ipc", group) == "ipc"  # the trainer
    assert choose_transport("auto", group) == "ipc"  # each replica
    group[0] = Place(host=HOST_A, name="trainer", gpu="GPU-0", pid=1, pid_ns=1, asked="gloo")
    assert choose_transport("auto", [group[0], at(gpu="GPU-1")]) == "gloo"


def test_ranks_asking_for_different_transports_are_refused_naming_them() -> None:
    group = [Place(host=HOST_A, name="trainer", gpu=None, pid=1, pid_ns=1, asked="ipc"), at()]
    with pytest.raises(PlacementError) as err:
        choose_transport("gloo", group)
    assert "rank 0: ipc" in str(err.value) and "this rank: gloo" in str(err.value)


def test_a_place_reads_what_an_older_or_newer_peer_published() -> None:
    older = '{"host": "h", "name": "n", "gpu": null, "pid": 1, "pid_ns": 2}'
    assert Place.from_json(older).asked == "auto"
    newer = '{"host": "h", "name": "n", "gpu": null, "pid": 1, "pid_ns": 2, "asked": "ipc", "numa": 1}'
    assert Place.from_json(newer) == Place(host="h", name="n", gpu=None, pid=1, pid_ns=2, asked="ipc")


def test_ranks_speaking_different_same_host_messages_are_refused_before_the_push() -> None:
    """A trainer whose rewardplane predates the reward server's (or the other way round): the
    same-host transport's store messages differ, so each side would wait for keys the other never
    writes until its timeout. Refused at once, naming the fix; NCCL and gloo do not care."""
    old = Place.from_json('{"host": "boot-a/ipc:1", "name": "t", "gpu": "GPU-0", "pid": 1, "pid_ns": 1}')
    new = Place(host=HOST_A, name="server", gpu="GPU-0", pid=2, pid_ns=1, ipc_wire=2)
    with pytest.raises(PlacementError, match="same rewardplane version") as err:
        choose_transport("auto", [new, old])
    assert "rank 0: 2" in str(err.value) and "rank 1: 1" in str(err.value)
    assert (
        choose_transport(
            "auto", [new, Place(host=HOST_A, name="t", gpu="GPU-0", pid=1, pid_ns=1, ipc_wire=2)]
        )
        == "ipc"
    )
    assert (
        choose_transport("auto", [Place(host=HOST_A, name="t", gpu="GPU-1", pid=1, pid_ns=1), new]) == "nccl"
    )
