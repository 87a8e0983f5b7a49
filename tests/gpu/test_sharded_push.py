"""Pushes from a two-rank trainer (``WeightPusher(trainer_group=...)``) into a tensor-parallel vLLM
replica: TP=2 on GPUs 0-1, trainer ranks 0 and 1 on GPUs 2 and 3 (an NCCL trainer group of their
own, world size 4 in the push group: the replica's workers are ranks 0-1, the trainer's 2-3).

Each trainer rank holds FSDP2's ``Shard(0)`` layout of the model as ``TensorPiece`` slices (rows
``ceil(n/2)`` apiece, so the one-row head sits whole on rank 0 and rank 1's piece of it is empty)
and sends its own rows. The weights are a checkpoint plus a seeded change computed on the CPU, the
same bits in the trainers and here: the replica's every parameter is checked bit for bit
(``/param_checksums``), its scores against the transformers model. Full, head-only, LoRA (merged)
and atomic pushes; a rank killed mid-push (atomic: the old version keeps serving; streamed: broken,
scoring refused, until a full push repairs it); a second TP=2 replica that saves its pushes
(``--weights-dir``) takes them sliced and is restored, shard by shard, after a restart.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Mapping
from datetime import timedelta
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch

from rewardplane.testing.pushers import loopback_pusher
from rewardplane.testing.servers import ServerHandle, free_port
from tests.gpu.vllm_support import (
    TOKEN,
    Trainer,
    assert_same_parameters,
    check_after_push,
    fill_prefix_cache,
    load_trainer_model,
    lora_config,
    server_checksums,
    vllm_llama_checksums,
)

pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.timeout(1800), pytest.mark.gpus(4)]

# the replicas fixture (tests/gpu/conftest.py) starts the TP=2 replica here
PLACEMENTS = [{"gpu": "0,1", "tensor_parallel_size": 2}]
TRAINER_GPUS = (2, 3)  # trainer rank r on this process's device TRAINER_GPUS[r]
ROOT = Path(__file__).resolve().parents[2]

# A weights spec: {"full": seed, "head": seed, "lora": seed}, applied in that order to the checkpoint
# (each optional): every parameter scaled by 1 + 0.1·noise; a new head; merged LoRA adapters (and a
# changed head: modules_to_save).
Weights = Mapping[str, int]


# ---- the weights: the same bits in the trainers and in this process ---------------------------


def build_model(model_dir: Path, weights: Weights) -> Any:
    """The trainer's model for ``weights`` on the CPU (bf16 backbone, fp32 head), on one CPU thread and
    with the global generator forked: the same bits in every process."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with torch.random.fork_rng(devices=[]), torch.no_grad():
            model = load_trainer_model(model_dir, "cpu")
            if "full" in weights:
                g = torch.Generator().manual_seed(weights["full"])
                for p in model.parameters():
                    p.mul_((1.0 + 0.1 * torch.randn(p.shape, generator=g)).to(p.dtype))
            if "head" in weights:
                g = torch.Generator().manual_seed(weights["head"])
                head = model.score.weight
                head.copy_(torch.randn(head.shape, generator=g) * head.shape[1] ** -0.5)
            if "lora" in weights:
                model = merged_lora(model, weights["lora"])
        return model.eval()
    finally:
        torch.set_num_threads(threads)


def merged_lora(model: Any, seed: int) -> Any:
    """As test_vllm_tp's LoRA push: adapters on every projection, a trained head, merged."""
    from peft import get_peft_model

    torch.manual_seed(seed)  # PEFT draws lora_A from the global generator (forked by the caller)
    peft_model = get_peft_model(model, lora_config())
    g = torch.Generator().manual_seed(seed + 1)
    for name, p in peft_model.named_parameters():
        if "lora_B" in name:
            p.copy_(torch.randn(p.shape, generator=g) * 0.05)
        if "modules_to_save" in name:
            p.add_(torch.randn(p.shape, generator=g) * 0.2 * p.shape[-1] ** -0.5)
    return peft_model.merge_and_unload()


def pushed_state(model: Any, mode: str) -> dict[str, torch.Tensor]:
    from rewardplane.protocol.naming import select_head

    state = model.state_dict()
    return select_head(state) if mode == "head_only" else state


def fsdp_pieces(
    state: Mapping[str, torch.Tensor], rank: int, world: int, device: torch.device
) -> dict[str, Any]:
    """Rank ``rank``'s FSDP2 ``Shard(0)`` rows of every tensor, on ``device``: ``ceil(n/world)`` rows
    apiece, the last ranks' pieces short or empty."""
    from rewardplane.sdk import TensorPiece

    out: dict[str, Any] = {}
    for key, t in state.items():
        n = t.shape[0]
        rows = -(-n // world)
        start, stop = min(rank * rows, n), min((rank + 1) * rows, n)
        out[key] = TensorPiece(t[start:stop].contiguous().to(device), 0, start, tuple(t.shape))
    return out


# ---- the trainer processes ---------------------------------------------------------------------

TRAINER_SCRIPT = "import json, sys\nfrom tests.gpu.test_sharded_push import trainer_main\ntrainer_main(json.loads(sys.argv[1]))\n"


def trainer_main(cfg: dict[str, Any]) -> None:
    """One rank of the trainer: ``cfg["pushes"]`` in order, each ``{version, mode, weights}``, plus
    ``die`` on the push where this rank exits (17) after its third bucket. Writes ``out.<rank>``."""
    import torch.distributed as dist

    from rewardplane.sdk.push.plan.layout import local_parts, plan_senders

    rank = int(cfg["rank"])
    # "gpu": None runs on the CPU over gloo (a dry run of this plumbing against a CPU server)
    device = torch.device("cpu") if cfg["gpu"] is None else torch.device("cuda", int(cfg["gpu"]))
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(
        "nccl" if device.type == "cuda" else "gloo",
        init_method=f"tcp://127.0.0.1:{cfg['master_port']}",
        rank=rank,
        world_size=2,
        device_id=device if device.type == "cuda" else None,
        timeout=timedelta(seconds=300),
    )
    # sent_by: per push, the bytes each rank sends (the layout every rank computes alike)
    result: dict[str, Any] = {"rank": rank, "pushed": [], "sent_by": [], "error": None}
    pusher = loopback_pusher(
        [cfg["url"]],
        TOKEN,
        group_port=int(cfg["group_port"]),
        device=device,
        bucket_bytes=1 << 16,  # tens of buckets: a rank can die mid-push
        timeout_s=float(cfg["timeout_s"]),
        connect_timeout_s=60,  # also bounds the replica's receive: a dead rank is given up on within it
        atomic=bool(cfg["atomic"]),
        trainer_group=dist.group.WORLD,
    )
    try:
        pusher.open_group()  # a collective: the group forms before any rank's comm is touched below
        for push in cfg["pushes"]:
            model = build_model(Path(cfg["model_dir"]), push["weights"])
            state = pushed_state(model, push["mode"])
            pieces = fsdp_pieces(state, rank, 2, device)
            plan = plan_senders(
                [local_parts(fsdp_pieces(state, r, 2, torch.device("cpu")))[1] for r in (0, 1)]
            )
            result["sent_by"].append([plan.sent_by(r) for r in (0, 1)])
            if push.get("die") == rank:
                die_after_buckets(pusher, 3, device)
            result["pushed"].append(pusher.push(pieces, version=push["version"], training_mode=push["mode"]))
    except Exception as exc:
        result["error"] = f"{type(exc).__name__}: {exc}"
    Path(f"{cfg['out']}.{rank}").write_text(json.dumps(result))
    if result["error"] is None:
        pusher.close()
        dist.destroy_process_group()
    os._exit(0)  # a survivor of a killed pair must not wait on the dead rank at exit


def die_after_buckets(pusher: Any, n: int, device: torch.device) -> None:
    """This rank's process exits after its ``n``-th bucket (broadcast or sliced): the buckets
    enqueued so far are waited for first, so they reach the replica (a streamed push has then
    written some parameters)."""
    comm = pusher.sharded.comm
    assert comm is not None, "the push group is not formed"
    sent = [0]

    def counted(real: Any) -> Any:
        def dying(*args: Any) -> None:
            real(*args)
            sent[0] += 1
            if sent[0] == n:
                if device.type == "cuda":
                    torch.cuda.synchronize(device)
                print("dying", flush=True)
                os._exit(17)

        return dying

    comm.broadcast_group = counted(comm.broadcast_group)
    comm.exchange = counted(comm.exchange)


def run_trainers(
    url: str,
    model_dir: Path,
    out: Path,
    pushes: list[dict[str, Any]],
    *,
    atomic: bool = False,
    timeout_s: float = 120,
) -> tuple[list[dict[str, Any] | None], list[int], str]:
    """Both trainer ranks, to the end: (each rank's result or None, exit codes, their output)."""
    cfg = {
        "url": url,
        "model_dir": str(model_dir),
        "pushes": pushes,
        "atomic": atomic,
        "timeout_s": timeout_s,
        "group_port": free_port(),
        "master_port": free_port(),
        "out": str(out),
    }
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", TRAINER_SCRIPT, json.dumps({**cfg, "rank": r, "gpu": TRAINER_GPUS[r]})],
            cwd=ROOT,  # the script imports this module as tests.gpu.test_sharded_push
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for r in (0, 1)
    ]
    logs, codes = [], []
    deadline = time.monotonic() + timeout_s + 300  # start-up, the group, every push
    for p in procs:
        try:
            logs.append(p.communicate(timeout=max(1.0, deadline - time.monotonic()))[0])
        except subprocess.TimeoutExpired:
            p.kill()
            logs.append(p.communicate()[0] + "\n[killed: did not finish in time]")
        codes.append(p.returncode)
    results: list[dict[str, Any] | None] = []
    for r in (0, 1):
        path = Path(f"{out}.{r}")
        results.append(json.loads(path.read_text()) if path.exists() else None)
    return results, codes, "\n--- rank 1 ---\n".join(log[-6000:] for log in logs)


def pushed_ok(url: str, model_dir: Path, out: Path, pushes: list[dict[str, Any]], **kw: Any) -> None:
    results, codes, logs = run_trainers(url, model_dir, out, pushes, **kw)
    want = [p["version"] for p in pushes]
    assert codes == [0, 0], f"trainer exit codes {codes}:\n{logs}"
    for r in results:
        assert r is not None and r["error"] is None and r["pushed"] == want, f"{results}\n{logs}"
    for push, sent in zip(pushes, results[0]["sent_by"] if results[0] else [], strict=True):
        if push["mode"] == "head_only":  # the one-row head: rank 0 holds it whole, rank 1 an empty piece
            assert sent[0] > 0 and sent[1] == 0, sent
        else:  # both ranks send about half
            assert min(sent) > 0.4 * sum(sent), sent


# ---- the checks ----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def url(replicas: list[ServerHandle]) -> str:
    return replicas[0].url


@pytest.fixture(scope="module")
def model_dir(tiny_seqcls_1label: Path) -> Path:
    return tiny_seqcls_1label


@pytest.fixture
def version(url: str) -> int:
    """The version the replica serves now (each test pushes the next ones)."""
    return int(httpx.get(f"{url}/runtime_version", timeout=30).json()["version"])


def check_serves(url: str, model_dir: Path, weights: Weights, version: int, before: float, what: str) -> None:
    """The replica serves ``version``: every shard bit for bit the weights', scores the trainer's."""
    from transformers import AutoTokenizer

    model = build_model(model_dir, weights)
    got_version, got = server_checksums(url)
    assert got_version == version, f"{what}: the checksums are of version {got_version}"
    assert_same_parameters(got, vllm_llama_checksums(model.state_dict(), tp_size=2), what)
    trainer = Trainer(model, AutoTokenizer.from_pretrained(model_dir), None, torch.device("cpu"), url)
    check_after_push(trainer, version, before, what)


def wait_settled(url: str, timeout_s: float = 240) -> dict[str, Any]:
    """/runtime_version once the replica has given up on the push (its receive ends after the
    group's timeout; an atomic push keeps serving meanwhile, so its background task is waited for)."""
    deadline = time.monotonic() + timeout_s
    state: dict[str, Any] = {}
    auth = {"Authorization": f"Bearer {TOKEN}"}
    while time.monotonic() < deadline:
        state = httpx.get(f"{url}/runtime_version", timeout=30).json()
        tasks = httpx.get(f"{url}/get_num_background_tasks", headers=auth, timeout=30).json()
        if state["state"] != "updating" and tasks["num_background_tasks"] == 0:
            return state
        time.sleep(0.5)
    return state


def test_full_push_from_two_ranks(url: str, model_dir: Path, version: int, tmp_path: Path) -> None:
    before = fill_prefix_cache(url)
    weights = {"full": 31}
    pushed_ok(
        url, model_dir, tmp_path / "out", [{"version": version + 1, "mode": "full", "weights": weights}]
    )
    check_serves(url, model_dir, weights, version + 1, before, "full, two ranks")


def test_head_only_push_from_two_ranks(url: str, model_dir: Path, version: int, tmp_path: Path) -> None:
    before = fill_prefix_cache(url)
    full, head = {"full": 32}, {"full": 32, "head": 33}
    pushes = [
        {"version": version + 1, "mode": "full", "weights": full},
        {"version": version + 2, "mode": "head_only", "weights": head},  # the head only: rank 0's rows
    ]
    pushed_ok(url, model_dir, tmp_path / "out", pushes)
    check_serves(url, model_dir, head, version + 2, before, "head_only, two ranks")


def test_lora_merged_push_from_two_ranks(url: str, model_dir: Path, version: int, tmp_path: Path) -> None:
    before = fill_prefix_cache(url)
    weights = {"full": 34, "lora": 35}
    pushed_ok(
        url, model_dir, tmp_path / "out", [{"version": version + 1, "mode": "lora", "weights": weights}]
    )
    check_serves(url, model_dir, weights, version + 1, before, "lora (merged), two ranks")


def test_sliced_pushes_from_two_ranks_land_bit_for_bit(
    url: str, model_dir: Path, version: int, tmp_path: Path
) -> None:
    # the first push of the layout is broadcast (the TP workers learn and publish their slices); the
    # next ones send each worker only its slice of each tensor, from the rank holding those rows
    before = fill_prefix_cache(url)
    last = {"full": 44}
    pushes = [
        {"version": version + 1, "mode": "full", "weights": {"full": 41}},
        {"version": version + 2, "mode": "full", "weights": {"full": 42}},
        {"version": version + 3, "mode": "lora", "weights": {"full": 42, "lora": 43}},
        {"version": version + 4, "mode": "full", "weights": last},
    ]
    pushed_ok(url, model_dir, tmp_path / "out", pushes)
    auth = {"Authorization": f"Bearer {TOKEN}"}
    update = httpx.get(f"{url}/get_num_background_tasks", headers=auth, timeout=30).json()["last_update"]
    assert update["wire"] == "sliced" and update["via"] == "data_plane", update
    check_serves(url, model_dir, last, version + 4, before, "sliced full push, two ranks")


def test_atomic_pushes_from_two_ranks(url: str, model_dir: Path, version: int, tmp_path: Path) -> None:
    # the first is applied through the loader at the swap (the workers publish their slices); the
    # second is staged in each worker's slices and copied into the parameters at the swap
    before = fill_prefix_cache(url)
    weights = {"full": 35}
    pushes = [
        {"version": version + 1, "mode": "full", "weights": {"full": 36}},
        {"version": version + 2, "mode": "full", "weights": weights},
    ]
    pushed_ok(url, model_dir, tmp_path / "out", pushes, atomic=True)
    auth = {"Authorization": f"Bearer {TOKEN}"}
    update = httpx.get(f"{url}/get_num_background_tasks", headers=auth, timeout=30).json()["last_update"]
    assert update["wire"] == "sliced" and update["in_place_bytes"] == 0, update
    check_serves(url, model_dir, weights, version + 2, before, "atomic sliced, two ranks")


def killed_mid_push(url: str, model_dir: Path, out: Path, version: int, *, atomic: bool) -> None:
    """Version + 1 pushed whole, then rank 1 dies three buckets into version + 2."""
    pushes = [
        {"version": version + 1, "mode": "full", "weights": {"full": 37}},
        {"version": version + 2, "mode": "full", "weights": {"full": 38}, "die": 1},
    ]
    results, codes, logs = run_trainers(url, model_dir, out, pushes, atomic=atomic, timeout_s=30)
    assert codes[1] == 17 and "dying" in logs, f"rank 1 did not die as planned ({codes}, {results}):\n{logs}"
    rank0 = results[0]
    assert rank0 is not None, f"rank 0 wrote no result:\n{logs}"
    assert rank0["pushed"] == [version + 1] and rank0["error"], f"rank 0: {rank0}\n{logs}"


def test_a_rank_killed_mid_push_leaves_an_atomic_replica_on_the_old_version(
    url: str, model_dir: Path, version: int, tmp_path: Path, replicas: list[ServerHandle]
) -> None:
    killed_mid_push(url, model_dir, tmp_path / "out", version, atomic=True)
    state = wait_settled(url)
    assert replicas[0].process.poll() is None, "the replica died with the trainer rank"
    assert (state["version"], state["state"]) == (version + 1, "serving"), state
    got_version, got = server_checksums(url)
    assert got_version == version + 1
    model = build_model(model_dir, {"full": 37})
    assert_same_parameters(got, vllm_llama_checksums(model.state_dict(), tp_size=2), "atomic, after the kill")
    r = httpx.post(f"{url}/score", json={"input": ["still serving"], "normalize": False}, timeout=60)
    assert r.status_code == 200 and r.json()["version"] == version + 1, r.text


def test_a_rank_killed_mid_push_breaks_a_streamed_replica_until_a_full_push(
    url: str, model_dir: Path, version: int, tmp_path: Path, replicas: list[ServerHandle]
) -> None:
    before = fill_prefix_cache(url)
    killed_mid_push(url, model_dir, tmp_path / "out", version, atomic=False)
    state = wait_settled(url)
    assert replicas[0].process.poll() is None, "the replica died with the trainer rank"
    assert state["state"] == "broken", state
    r = httpx.post(f"{url}/score", json={"input": ["refused"], "normalize": False}, timeout=60)
    assert r.status_code == 503, f"a broken replica answered {r.status_code}: {r.text[:500]}"
    # a full push from a new pair of ranks repairs it
    weights = {"full": 39}
    pushes = [{"version": version + 3, "mode": "full", "weights": weights}]
    pushed_ok(url, model_dir, tmp_path / "repair", pushes)
    check_serves(url, model_dir, weights, version + 3, before, "full push after a broken one")


def _saved_versions(weights: Path, ranks: int) -> list[int | None]:
    """Each TP worker's saved version (``version.rank<k>-of-<n>.json``), None where it saved none."""
    out: list[int | None] = []
    for k in range(ranks):
        path = weights / f"version.rank{k}-of-{ranks}.json"
        out.append(json.loads(path.read_text()).get("version") if path.exists() else None)
    return out


def test_a_persisting_replica_takes_sliced_pushes_and_a_restart_restores_them(
    model_dir: Path, tmp_path: Path
) -> None:
    """A TP=2 replica with ``--weights-dir`` (the operator's podCopy and persistDir) beside the
    module's: its second full push is sliced, each worker saves its own ranges, and after a restart
    ``/restore_weights`` puts every shard back bit for bit."""
    from tests.gpu.vllm_support import start_vllm_server, stop, wait_ready

    weights = tmp_path / "weights"
    (tmp_path / "first").mkdir()
    server = wait_ready(
        start_vllm_server(
            model_dir, tmp_path / "first", gpu="0,1", tensor_parallel_size=2, weights_dir=weights
        )
    )
    last = {"full": 52, "head": 53}
    try:
        before = fill_prefix_cache(server.url)
        pushes = [
            {"version": 1, "mode": "full", "weights": {"full": 51}},
            {"version": 2, "mode": "full", "weights": {"full": 52}},
            {"version": 3, "mode": "head_only", "weights": last},
        ]
        pushed_ok(server.url, model_dir, tmp_path / "out", pushes[:2])
        auth = {"Authorization": f"Bearer {TOKEN}"}
        tasks = httpx.get(f"{server.url}/get_num_background_tasks", headers=auth, timeout=30).json()
        assert tasks["last_update"]["wire"] == "sliced", tasks["last_update"]
        pushed_ok(server.url, model_dir, tmp_path / "out-head", pushes[2:])
        check_serves(server.url, model_dir, last, 3, before, "persisting replica, before the restart")
        deadline = time.monotonic() + 120
        while _saved_versions(weights, 2) != [3, 3]:
            assert time.monotonic() < deadline, f"saved versions {_saved_versions(weights, 2)}, not [3, 3]"
            time.sleep(0.1)
    finally:
        stop(server)
    (tmp_path / "restarted").mkdir()
    restarted = wait_ready(
        start_vllm_server(
            model_dir, tmp_path / "restarted", gpu="0,1", tensor_parallel_size=2, weights_dir=weights
        )
    )
    try:
        assert int(httpx.get(f"{restarted.url}/runtime_version", timeout=30).json()["version"]) == 0
        base = fill_prefix_cache(restarted.url)
        auth = {"Authorization": f"Bearer {TOKEN}"}
        ok = httpx.post(f"{restarted.url}/restore_weights", json={"version": 3}, headers=auth, timeout=300)
        assert ok.status_code == 200, ok.text
        check_serves(restarted.url, model_dir, last, 3, base, "restored, TP=2")
    finally:
        stop(restarted)
