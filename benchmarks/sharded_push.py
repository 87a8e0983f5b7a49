"""Sharded-push benchmark (GPU, four GPUs): a full push of a ~7B-parameter bf16 reward model into one
vLLM server with tensor parallel size 2 (GPUs 0 and 1), from one trainer process (GPU 2, a plain
``WeightPusher``) against two trainer processes (GPUs 2 and 3, an NCCL trainer group of 2, one
``WeightPusher(trainer_group=...)``), each holding half of every 2-D tensor along dim 0 as a
``TensorPiece`` (FSDP2's ``Shard(0)`` layout; tensors with an odd dim 0, the head and the 1-D norms
are passed whole and sent by one rank). Same server, same weights.

    python benchmarks/sharded_push.py --server-args=--enforce-eager                # 7B, NVLink
    python benchmarks/sharded_push.py --size small --server-args=--enforce-eager   # ~0.4B, quick
    python benchmarks/sharded_push.py --transports nvlink,sockets --server-args=--enforce-eager
        # also over NCCL's socket transport (NCCL_P2P_DISABLE, NCCL_SHM_DISABLE, NCCL_IB_DISABLE on
        # the server and the trainers: a fresh server for that part); --sockets says the same
    bash scripts/gpu-run.sh bench-sharded --sockets --server-args=--enforce-eager  # device machines

Per transport, four phases: one sender, then two, each first broadcasting every tensor to the whole
group (``REWARDPLANE_PUSH_SLICING=never``: both TP workers receive every byte), then sliced
(``always``: each TP worker receives only its slice of each tensor, point to point, from the sender
holding it). Each phase: one warm-up push (announced over HTTP, broadcast: the workers learn and
publish their slices), then ``--reps`` timed full pushes; a push's time is trainer rank 0's wall time
of ``pusher.push(...)`` (every rank starts it after a barrier of the trainer group); GB/s = the
model's bytes ÷ that time. Goals (issue): two senders ÷ one ≤ 0.6 in time over NVLink, ≥ 1.8× the
bytes/s over sockets; the ratios are taken against one sender broadcasting (and, beside it, against
one sender sliced). The server reports which wire each phase's last push took. Each phase's line
also shows rank 0's time outside the publisher (its push time less ``last_stats["total_s"]``, the
header → commit) and, with two ranks, the trainer's steps in it: ``parts`` (describing the rank's
parts), ``plan`` (the ranks agreeing on the plan), ``done`` (telling the other rank the end).

Every phase is verified: the server's ``GET /param_checksums`` after each phase's last push equal
those after the first phase's, the same weights (each phase's warm-up pushes other weights
first). Prints a table; writes JSON to $OUT/sharded_push-<size>.json when OUT is set.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import httpx
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.weight_sync import SIZES, TOKEN, build_trainer_model, make_checkpoint  # noqa: E402
from rewardplane.testing.pushers import loopback_pusher  # noqa: E402
from rewardplane.testing.servers import free_port, wait_healthy  # noqa: E402

SERVER_GPUS = "0,1"  # the TP=2 server
TRAINER_GPUS = (2, 3)  # rank 0 (and the one sender), rank 1
# NCCL's socket transport, the path between hosts without RDMA (as tests/gpu/test_nccl_sync.py):
# set alike on the server and the trainers; NCCL logs each connection so the run can show which
SOCKETS_ENV = {
    "NCCL_P2P_DISABLE": "1",
    "NCCL_SHM_DISABLE": "1",
    "NCCL_IB_DISABLE": "1",
    "NCCL_DEBUG": "INFO",
    "NCCL_DEBUG_SUBSYS": "INIT,NET",
}
TRANSPORTS = ("nvlink", "sockets")
# (name, trainer ranks, REWARDPLANE_PUSH_SLICING): "one" is the baseline every ratio is taken against
PHASES = (("one", 1, "never"), ("one-sliced", 1, "always"), ("two", 2, "never"), ("two-sliced", 2, "always"))
WARM_SEED, SEED = 1, 2  # the warm-up pushes other weights than the timed ones: the check sees a change
FILL_CHUNK = 1 << 26


# ---- the trainer processes -------------------------------------------------------------------


def fill(tensors: Mapping[str, torch.Tensor], seed: int) -> None:
    """Overwrite every tensor with values of ``(seed, its index by name, element index)``: the same
    bits on any GPU (integer arithmetic, no random generator), uniform in ±0.02."""
    for i, key in enumerate(sorted(tensors)):
        flat = tensors[key].view(-1)
        for start in range(0, flat.numel(), FILL_CHUNK):
            stop = min(flat.numel(), start + FILL_CHUNK)
            idx = torch.arange(start, stop, device=flat.device, dtype=torch.int64)
            h = (idx * 2654435761 + seed * 1000003 + i * 7919) % 65521
            flat[start:stop].copy_(h.to(torch.float32).mul_(0.04 / 65521).sub_(0.02))


def halves(full: Mapping[str, torch.Tensor], rank: int, world: int) -> dict[str, Any]:
    """Rank ``rank``'s state dict: its share along dim 0 of every tensor of 2 or more dimensions whose
    dim 0 divides evenly (a view: refilling ``full`` refills it), every other tensor whole."""
    from rewardplane.sdk import TensorPiece

    out: dict[str, Any] = {}
    for key, t in full.items():
        if world > 1 and t.dim() >= 2 and t.shape[0] % world == 0:
            out[key] = TensorPiece.even(t.chunk(world, 0)[rank], 0, rank, world)
        else:
            out[key] = t
    return out


def wait_serving(url: str, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline:
            raise TimeoutError(f"{url} did not become healthy in {timeout_s:.0f}s")
        time.sleep(1.0)


def trainer_main(cfg: dict[str, Any]) -> int:
    """One trainer process (``--trainer JSON``): builds the model on its GPU, waits for the server,
    pushes a warm-up version, then ``reps`` timed versions; writes its timings to ``out.<rank>``."""
    import torch.distributed as dist

    from rewardplane.protocol import RewardModelTrainingMode as Mode
    from rewardplane.sdk.push.plan.layout import local_parts, plan_senders

    rank, world = int(cfg["rank"]), int(cfg["world"])
    # "gpu": None runs on the CPU over gloo (a dry run of this script's plumbing, no timings to keep)
    device = torch.device("cpu") if cfg["gpu"] is None else torch.device("cuda", int(cfg["gpu"]))
    if device.type == "cuda":
        torch.cuda.set_device(device)
    group = None
    if world > 1:
        dist.init_process_group(
            "nccl" if device.type == "cuda" else "gloo",
            init_method=f"tcp://127.0.0.1:{cfg['master_port']}",
            rank=rank,
            world_size=world,
            device_id=device if device.type == "cuda" else None,
            timeout=datetime.timedelta(seconds=float(cfg["timeout_s"])),
        )
        group = dist.group.WORLD
    model = build_trainer_model(Path(cfg["ckpt"]), device)
    full = model.state_dict()
    fill(full, WARM_SEED)
    state = halves(full, rank, world)
    result: dict[str, Any] = {
        "rank": rank,
        "world": world,
        "gpu_name": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "bytes": sum(t.numel() * t.element_size() for t in full.values()),
        "params": sum(t.numel() for t in full.values()),
    }
    if world > 1 and rank == 0:  # what each rank sends (the plan every rank computes alike)
        plan = plan_senders([local_parts(halves(full, r, world))[1] for r in range(world)])
        result["sent_by"] = [plan.sent_by(r) for r in range(world)]
    wait_serving(cfg["url"], float(cfg["health_timeout_s"]))
    pusher = loopback_pusher(
        [cfg["url"]],
        TOKEN,
        group_port=int(cfg["group_port"]),
        device=device,
        bucket_bytes=int(cfg["bucket_bytes"]),
        connect_timeout_s=120,
        timeout_s=float(cfg["timeout_s"]),
        trainer_group=group,
    )

    def timed(version: int) -> float:
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        if group is not None:
            dist.barrier(group=group)
        start = time.perf_counter()
        pusher.push(state, version=version, training_mode=Mode.FULL)
        return time.perf_counter() - start

    def last_stats() -> dict[str, float]:
        if pusher.sharded is not None:
            return dict(pusher.sharded.last_stats)
        return dict(pusher.open().last_stats)

    version = int(cfg["first_version"])
    try:
        result["warmup_s"] = timed(version)
        fill(full, SEED)  # the timed pushes' weights (the pieces are views of these tensors)
        times, stats = [], []
        for _ in range(int(cfg["reps"])):
            version += 1
            times.append(timed(version))
            if rank == 0:
                stats.append(last_stats())
        result.update(times_s=times, stats=stats, last_version=version)
    finally:
        pusher.close()
    Path(f"{cfg['out']}.{rank}").write_text(json.dumps(result))
    if group is not None:
        dist.destroy_process_group()
    return 0


# ---- the benchmark ---------------------------------------------------------------------------


def spawn_trainers(
    world: int, base: dict[str, Any], env: dict[str, str], work: Path, name: str
) -> list[tuple[subprocess.Popen[bytes], Path]]:
    """Start the trainer processes of one phase (they wait for the server themselves)."""
    master_port = free_port()
    procs = []
    for rank in range(world):
        cfg = {**base, "rank": rank, "world": world, "gpu": TRAINER_GPUS[rank], "master_port": master_port}
        log = work / f"{name}.{rank}.log"
        with log.open("wb") as f:
            p = subprocess.Popen(
                [sys.executable, str(Path(__file__).resolve()), "--trainer", json.dumps(cfg)],
                env=env,
                cwd=ROOT,
                stdout=f,
                stderr=subprocess.STDOUT,
            )
        procs.append((p, log))
    return procs


def finish_trainers(
    procs: list[tuple[subprocess.Popen[bytes], Path]], out: Path, timeout_s: float
) -> dict[str, Any]:
    """Wait (bounded) for every trainer; rank 0's results, or raise with the logs' tails."""
    deadline = time.monotonic() + timeout_s
    failed = []
    for p, log in procs:
        try:
            rc = p.wait(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            rc = p.wait()
        if rc != 0:
            failed.append(f"{log.name} exited {rc}:\n{log.read_text(errors='replace')[-6000:]}")
    if failed:
        for p, _ in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
        raise RuntimeError("a trainer process failed:\n" + "\n---\n".join(failed))
    return json.loads(Path(f"{out}.0").read_text())


def param_checksums(url: str) -> tuple[int, list[dict[str, Any]]]:
    """The served version and every worker's {rank, checksums} (sorted by rank)."""
    r = httpx.get(f"{url}/param_checksums", headers={"Authorization": f"Bearer {TOKEN}"}, timeout=900)
    r.raise_for_status()
    body = r.json()
    return int(body["version"]), sorted(body["workers"], key=lambda w: w["rank"])


def last_wire(url: str) -> str:
    """How the server received the last push: ``sliced`` or ``broadcast``."""
    r = httpx.get(f"{url}/get_num_background_tasks", headers={"Authorization": f"Bearer {TOKEN}"}, timeout=30)
    r.raise_for_status()
    return str(r.json()["last_update"].get("wire", "broadcast"))


def socket_connections(text: str) -> dict[str, int]:
    """NCCL's connection lines (NCCL_DEBUG=INFO): how many went over its socket transport."""
    lines = [ln for ln in text.splitlines() if "Channel" in ln and " via " in ln]
    sockets = sum("via NET/Socket" in ln for ln in lines)
    return {"via_socket": sockets, "other": len(lines) - sockets}


# rank 0's steps outside the publisher's header → commit (ShardedPusher.last_stats; one sender: none)
TRAINER_PHASES = ("parts_s", "plan_s", "done_s")


def summary(r: dict[str, Any], nbytes: int) -> dict[str, Any]:
    times = r["times_s"]
    med = statistics.median(times)
    stats = r["stats"]
    return {
        "times_s": times,
        "median_s": med,
        "gbps": nbytes / 1e9 / med,
        "warmup_s": r["warmup_s"],
        "last_stats": stats[-1] if stats else {},
        # medians over the timed pushes: rank 0's push time less the publisher's, and its parts
        "outside_publish_s": statistics.median(t - st["total_s"] for t, st in zip(times, stats, strict=True))
        if stats
        else None,
        "trainer_phases_s": {
            k: statistics.median(st[k] for st in stats) for k in TRAINER_PHASES if stats and k in stats[0]
        },
        "sent_by": r.get("sent_by"),
    }


def trainer_line(phase: dict[str, Any]) -> str:
    """Rank 0's time outside the publisher, and the trainer's steps in it (ms, medians)."""
    if phase.get("outside_publish_s") is None:
        return ""
    steps = ", ".join(f"{k[:-2]} {1000 * v:.2f}" for k, v in phase["trainer_phases_s"].items())
    return f"; outside publish {1000 * phase['outside_publish_s']:.2f} ms" + (f" ({steps})" if steps else "")


def run_transport(
    transport: str,
    args: argparse.Namespace,
    ckpt: Path,
    work: Path,
    versions: Iterator[int],
) -> dict[str, Any]:
    """A fresh server; one sender, then two senders into it; the checksums compared."""
    from benchmarks.weight_sync import launch_on_dummy_weights

    extra = SOCKETS_ENV if transport == "sockets" else {}
    env = {**os.environ, **extra}
    server = launch_on_dummy_weights(
        ckpt,
        work,
        SERVER_GPUS,
        args.server_args,
        env=extra,
        engine="vllm",
        tensor_parallel_size=2,
        gpu_memory_utilization=args.gpu_memory_utilization,
        max_model_len=1024,
    )
    out: dict[str, Any] = {"transport": transport}
    try:

        def base(name: str) -> dict[str, Any]:
            first = next(versions)
            for _ in range(args.reps):
                next(versions)
            return {
                "url": server.url,
                "ckpt": str(ckpt),
                "group_port": free_port(),
                "bucket_bytes": args.bucket_mib << 20,
                "reps": args.reps,
                "first_version": first,
                "timeout_s": args.phase_timeout,
                "health_timeout_s": args.startup_timeout,
                "out": str(work / f"{transport}-{name}.json"),
            }

        # one sender, then two, each broadcasting and then sliced (each receiving TP worker gets only
        # its slice of every tensor, point to point); the first phase's trainer builds its model
        # while the server starts
        sums: dict[str, list[dict[str, Any]]] = {}
        for i, (name, senders, slicing) in enumerate(PHASES):
            cfg = base(name)
            phase_env = {**env, "REWARDPLANE_PUSH_SLICING": slicing}
            procs = spawn_trainers(senders, cfg, phase_env, work, f"{transport}-{name}")
            if i == 0:
                t0 = time.perf_counter()
                try:
                    wait_healthy(server, args.startup_timeout, poll_s=1.0)
                except BaseException:
                    for p, _ in procs:
                        p.kill()
                    raise
                out["server_start_s"] = time.perf_counter() - t0
            got = finish_trainers(procs, Path(cfg["out"]), args.phase_timeout)
            nbytes = int(got["bytes"])
            out.update(gpu=got["gpu_name"], bytes=nbytes, params=got["params"])
            version, sums[name] = param_checksums(server.url)
            assert version == got["last_version"], (
                f"the server serves {version}, the {name} phase pushed {got['last_version']}"
            )
            out[name] = {**summary(got, nbytes), "wire": last_wire(server.url)}
            print(
                f"[{transport}] {name:<11}: {1000 * out[name]['median_s']:.1f} ms median ({out[name]['wire']})"
                + trainer_line(out[name]),
                flush=True,
            )
        base_s = out["one"]["median_s"]
        for name, _, _ in PHASES[1:]:
            out[name]["ratio_to_one"] = out[name]["median_s"] / base_s
        out["ratio_two_over_one"] = out["two-sliced"]["median_s"] / base_s
        out["ratio_two_over_one_sliced"] = out["two-sliced"]["median_s"] / out["one-sliced"]["median_s"]
        out["speedup_bytes_per_s"] = base_s / out["two-sliced"]["median_s"]
        first = sums["one"]
        out["checksums_equal"] = all(v == first for v in sums.values())
        out["parameters_checked"] = sum(len(w["checksums"]) for w in first)
        if transport == "sockets":
            logs = server.log() + "".join(p.read_text(errors="replace") for p in work.glob("sockets-*.log"))
            out["nccl_connections"] = socket_connections(logs)
        if not out["checksums_equal"]:
            differ = [
                (name, w1["rank"], n)
                for name, got_sums in sums.items()
                for w1, w2 in zip(first, got_sums, strict=False)
                for n in w1["checksums"]
                if w1["checksums"][n] != w2["checksums"].get(n)
            ]
            raise AssertionError(f"[{transport}] the phases left different bytes: {differ[:8]}")
        return out
    finally:
        server.stop()


def commit() -> str:
    """RP_COMMIT when set (a copy of the tree on a GPU machine may carry another .git), else git's."""
    if os.environ.get("RP_COMMIT"):
        return os.environ["RP_COMMIT"]
    try:
        return subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True, check=True
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def save(results: dict[str, Any], size: str) -> None:
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], f"sharded_push-{size}.json").write_text(json.dumps(results, indent=2))


def print_table(results: dict[str, Any]) -> None:
    phases: dict[str, Any] = results["transports"]
    first = next(iter(phases.values()))
    gb = first["bytes"] / 1e9
    print(
        f"\n== sharded push, vLLM TP=2 on GPUs {SERVER_GPUS}, {results['size']} "
        f"({first['params'] / 1e9:.2f}B params, {gb:.2f} GB), {first['gpu']}, {results['reps']} reps =="
    )
    print(
        f"{'transport':<10}{'senders':>8}{'wire':>10}{'median ms':>12}{'GB/s':>9}{'warm-up ms':>12}   sent by rank (GB)"
    )
    for name, p in phases.items():
        for key, senders, _ in PHASES:
            ph = p[key]
            sent = ", ".join(f"{b / 1e9:.2f}" for b in ph["sent_by"]) if ph.get("sent_by") else "all"
            print(
                f"{name:<10}{senders:>8}{ph['wire']:>10}{1000 * ph['median_s']:>12.1f}{ph['gbps']:>9.1f}"
                f"{1000 * ph['warmup_s']:>12.1f}   {sent}"
            )
        goal = "goal <= 0.6" if name == "nvlink" else "goal: speed-up >= 1.8"
        print(
            f"{name:<10} two sliced / one broadcast: time {p['ratio_two_over_one']:.3f}, bytes/s "
            f"x{p['speedup_bytes_per_s']:.2f} ({goal}); two sliced / one sliced: "
            f"{p['ratio_two_over_one_sliced']:.3f}; checksums identical: {p['checksums_equal']} "
            f"({p['parameters_checked']} parameters)"
        )
        if "nccl_connections" in p:
            c = p["nccl_connections"]
            print(f"{name:<10} NCCL connections via NET/Socket: {c['via_socket']}, other: {c['other']}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    ap.add_argument("--size", choices=sorted(SIZES), default="7b")
    ap.add_argument("--reps", type=int, default=3, help="timed pushes per sender count (after 1 warm-up)")
    ap.add_argument("--bucket-mib", type=int, default=1024)
    ap.add_argument(
        "--transports",
        default="nvlink",
        help="comma-separated, each with a fresh server: nvlink (NCCL's default transports), sockets",
    )
    ap.add_argument("--sockets", action="store_true", help="same as --transports nvlink,sockets")
    ap.add_argument(
        "--gpu-memory-utilization", type=float, default=0.5, help="the vLLM server's memory fraction"
    )
    ap.add_argument(
        "--server-args", default="", help="extra server flags, e.g. --enforce-eager (faster start)"
    )
    ap.add_argument("--startup-timeout", type=float, default=600, help="seconds for the server to start")
    ap.add_argument("--phase-timeout", type=float, default=420, help="seconds for one phase's trainers")
    ap.add_argument("--trainer", help=argparse.SUPPRESS)  # internal: run one trainer process
    args = ap.parse_args()
    if args.trainer:
        return trainer_main(json.loads(args.trainer))
    transports = [t.strip() for t in args.transports.split(",") if t.strip()]
    if args.sockets and "sockets" not in transports:
        transports.append("sockets")
    unknown = sorted(set(transports) - set(TRANSPORTS))
    if unknown:
        ap.error(f"unknown transports {unknown}; choose from {list(TRANSPORTS)}")
    if torch.cuda.device_count() < 4:
        print("needs 4 GPUs: the TP=2 server on GPUs 0-1, the trainers on GPUs 2 and 3")
        return 2
    work = Path(tempfile.mkdtemp(prefix="sharded-push-"))
    ckpt = make_checkpoint(args.size, work)
    results: dict[str, Any] = {
        "size": args.size,
        "reps": args.reps,
        "bucket_bytes": args.bucket_mib << 20,
        "server_args": args.server_args,
        "commit": commit(),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "transports": {},
    }
    versions = iter(range(1, 1 << 30))
    for transport in transports:
        phase = run_transport(transport, args, ckpt, work, versions)
        results["transports"][transport] = phase
        results["machine"] = phase["gpu"]
        save(results, args.size)  # each phase survives a run cut short later
    ratio = results["transports"].get("nvlink", {}).get("ratio_two_over_one")
    speedup = results["transports"].get("sockets", {}).get("speedup_bytes_per_s")
    results["goals"] = {
        "nvlink_two_over_one_le_0.6": None if ratio is None else ratio <= 0.6,
        "sockets_speedup_ge_1.8": None if speedup is None else speedup >= 1.8,
    }
    save(results, args.size)
    print(json.dumps(results, indent=1))
    print_table(results)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
