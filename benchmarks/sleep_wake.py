"""Sleep and wake of a vLLM reward server on one GPU: memory freed, sleep and wake latency, scores
before vs after — for a ~1.4B random ``LlamaForSequenceClassification`` (bf16, fp32 head).

One server (``--engine vllm --enable-sleep-mode``) on the first visible GPU. Memory is read from
outside the server, by this process (``torch.cuda.mem_get_info``; this process's own CUDA context
is the same in every reading). Baselines of the same run: the GPU memory the server holds awake
(free before it started − free once it serves), and its cold start (launch → healthy).

For each level (1: weights offloaded to host memory; 2: weights discarded, the wake reloads the
checkpoint from local disk) and each of ``--cycles`` cycles: score ``--prompts`` texts, sleep, read
memory, wake, read memory, score again. Latencies are what the client waits for (``POST /sleep`` /
``POST /wake``, HTTP included), p50 over the cycles; the server's own figure is kept too. Once per
level, ``/param_checksums`` before and after says whether every live parameter came back bit for bit.

    bash scripts/gpu-run.sh bench-sleep                       # ~4-5 minutes on an H100
    python benchmarks/sleep_wake.py --cycles 3 --out benchmarks/results/sleep_wake-1.35b-H100-<date>-<commit>.json
"""

from __future__ import annotations

import argparse
import json
import math
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import httpx

from rewardplane.testing.gpus import visible_gpus
from rewardplane.testing.servers import launch_server, wait_healthy

TOKEN = "bench-sleep-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
# ~1.35B parameters: the scoring benchmark's (benchmarks/scoring_gpu.py) 1.4b size
# a Llama's sizes (build_tiny_reward_model's keywords; all ints)
SIZE_1_4B: dict[str, Any] = {
    "hidden_size": 2048,
    "num_layers": 24,
    "num_heads": 16,
    "num_kv_heads": 8,
    "intermediate_size": 6656,
}
WORDS = ["reward", "model", "policy", "answer", "helpful", "honest", "careful", "question", "step", "sea"]
GiB = 2**30


def build_model(out: Path) -> int:
    from rewardplane.tinymodel import build_tiny_reward_model

    if not (out / "config.json").exists():
        build_tiny_reward_model(
            out,
            vocab_size=32000,
            max_position_embeddings=2048,
            head_std=SIZE_1_4B["hidden_size"] ** -0.5,  # unit-scale scores
            dtype="bfloat16",
            seed=0,
            **SIZE_1_4B,
        )
    from safetensors import safe_open

    count = 0
    for path in out.glob("*.safetensors"):
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 - safe_open is not a mapping
                count += math.prod(f.get_slice(name).get_shape())
    return count


def free_bytes() -> int:
    import torch

    torch.cuda.synchronize(0)
    return int(torch.cuda.mem_get_info(0)[0])


def control(url: str, path: str, body: dict[str, Any] | None = None) -> tuple[dict[str, Any], float]:
    start = time.perf_counter()
    r = httpx.post(url + path, json=body, headers=AUTH, timeout=900)
    took = time.perf_counter() - start
    if r.status_code != 200:
        raise RuntimeError(f"{path} answered {r.status_code}: {r.text[:2000]}")
    return r.json(), took


def scores(url: str, texts: list[str]) -> list[float]:
    r = httpx.post(url + "/score", json={"input": texts, "normalize": False, "truncate": True}, timeout=600)
    if r.status_code != 200:
        raise RuntimeError(f"/score answered {r.status_code}: {r.text[:2000]}")
    return [float(d["score"]) for d in sorted(r.json()["data"], key=lambda d: d["index"])]


def checksums(url: str) -> Any:
    r = httpx.get(url + "/param_checksums", headers=AUTH, timeout=900)
    if r.status_code != 200:
        raise RuntimeError(f"/param_checksums answered {r.status_code}: {r.text[:2000]}")
    return r.json()["workers"]


def run(args: argparse.Namespace) -> dict[str, Any]:
    import torch

    work = args.workdir
    work.mkdir(parents=True, exist_ok=True)
    model_dir = work / "llama-1.4b"
    t0 = time.perf_counter()
    params = build_model(model_dir)
    print(f"model: {params / 1e9:.2f}B parameters, built in {time.perf_counter() - t0:.0f}s", flush=True)
    rng = random.Random(0)
    texts = [" ".join(rng.choice(WORDS) for _ in range(rng.randint(32, 400))) for _ in range(args.prompts)]

    gpu = visible_gpus(0)
    total = int(torch.cuda.mem_get_info(0)[1])
    free_idle = free_bytes()
    start = time.perf_counter()
    server = launch_server(
        model_dir,
        work,
        token=TOKEN,
        engine="vllm",
        gpu_memory_utilization=args.gpu_memory_utilization,
        max_model_len=1024,
        enable_sleep_mode=True,
        env_extra={"CUDA_VISIBLE_DEVICES": gpu, "VLLM_USE_FLASHINFER_SAMPLER": "0"},
    )
    try:
        wait_healthy(server, args.startup_timeout, poll_s=0.5)
        cold_start = time.perf_counter() - start
        url = server.url
        reference = scores(url, texts)
        free_awake = free_bytes()
        held = free_idle - free_awake
        print(f"cold start {cold_start:.1f}s; server holds {held / GiB:.2f} GiB awake", flush=True)
        levels: dict[str, Any] = {}
        for level in args.levels:
            before_sums = checksums(url)
            sleep_s, wake_s, server_sleep_s, server_wake_s = [], [], [], []
            used_asleep, used_woken, diffs = [], [], []
            for cycle in range(args.cycles):
                before = scores(url, texts)
                free_before = free_bytes()
                answer, took = control(url, "/sleep", {"level": level})
                sleep_s.append(took)
                server_sleep_s.append(answer["seconds"])
                free_asleep = free_bytes()
                answer, took = control(url, "/wake")
                if answer["weights"] != "serving":
                    raise RuntimeError(f"level {level}: the wake did not restore the weights: {answer}")
                wake_s.append(took)
                server_wake_s.append(answer["seconds"])
                used_asleep.append(total - free_asleep)
                used_woken.append(total - free_bytes())
                after = scores(url, texts)
                diffs.append(max(abs(a - b) for a, b in zip(after, before, strict=True)))
                print(
                    f"level {level} cycle {cycle}: freed {(free_asleep - free_before) / GiB:.2f} GiB, "
                    f"sleep {sleep_s[-1] * 1000:.0f} ms, wake {wake_s[-1] * 1000:.0f} ms, "
                    f"max |score diff| {diffs[-1]:.2e}",
                    flush=True,
                )
            same_weights = checksums(url) == before_sums
            levels[str(level)] = {
                "used_awake_gib": round((total - free_awake) / GiB, 3),
                "used_asleep_gib": round(statistics.median(used_asleep) / GiB, 3),
                "used_after_wake_gib": round(statistics.median(used_woken) / GiB, 3),
                "freed_gib": round((statistics.median(used_woken) - statistics.median(used_asleep)) / GiB, 3),
                # the share of what the server holds awake that a sleep gives back
                "freed_of_held": round((total - free_awake - statistics.median(used_asleep)) / held, 3)
                if held > 0
                else None,
                "sleep_s_p50": round(statistics.median(sleep_s), 4),
                "wake_s_p50": round(statistics.median(wake_s), 4),
                "server_sleep_s_p50": round(statistics.median(server_sleep_s), 4),
                "server_wake_s_p50": round(statistics.median(server_wake_s), 4),
                "wake_of_cold_start": round(statistics.median(wake_s) / cold_start, 4),
                "max_abs_score_diff": max(diffs),
                "max_abs_score_diff_vs_first": max(
                    abs(a - b) for a, b in zip(scores(url, texts), reference, strict=True)
                ),
                "weights_bit_identical": same_weights,
                "cycles": args.cycles,
            }
        return {
            "benchmark": "sleep_wake",
            "gpu": torch.cuda.get_device_name(0),
            "gpu_total_gib": round(total / GiB, 2),
            "params": params,
            "dtype": "bfloat16 (fp32 head)",
            "gpu_memory_utilization": args.gpu_memory_utilization,
            "prompts": args.prompts,
            "cold_start_s": round(cold_start, 2),
            "held_awake_gib": round(held / GiB, 3),
            "levels": levels,
            "command": " ".join([Path(sys.argv[0]).name, *sys.argv[1:]]),
        }
    finally:
        server.stop()  # returns once vLLM's engine core (in the server's session) is gone too


def print_table(result: dict[str, Any]) -> None:
    print(
        f"\n{result['gpu']}, {result['params'] / 1e9:.2f}B params, memory fraction "
        f"{result['gpu_memory_utilization']}, cold start {result['cold_start_s']} s, "
        f"held awake {result['held_awake_gib']} GiB"
    )
    print(
        "level | used awake | asleep | after wake | freed (of held) | sleep p50 | wake p50 | max |diff| | same weights"
    )
    for level, r in result["levels"].items():
        print(
            f"{level:>5} | {r['used_awake_gib']:>7.2f} GiB | {r['used_asleep_gib']:>6.2f} | "
            f"{r['used_after_wake_gib']:>10.2f} | {r['freed_gib']:>6.2f} GiB ({r['freed_of_held']}) | "
            f"{r['sleep_s_p50'] * 1000:>6.0f} ms | {r['wake_s_p50'] * 1000:>5.0f} ms | "
            f"{r['max_abs_score_diff']:.1e} | {r['weights_bit_identical']}"
        )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--levels", type=lambda s: [int(x) for x in s.split(",")], default=[1, 2])
    p.add_argument("--cycles", type=int, default=3)
    p.add_argument("--prompts", type=int, default=64)
    p.add_argument("--gpu-memory-utilization", type=float, default=0.5)
    p.add_argument("--startup-timeout", type=float, default=600.0)
    p.add_argument("--workdir", type=Path, default=Path("/tmp/rp-sleep-bench"))
    p.add_argument("--out", type=Path, default=None, help="write the JSON figures here")
    args = p.parse_args(argv)
    if any(level not in (1, 2) for level in args.levels) or args.cycles < 1:
        p.error("--levels takes 1 and/or 2 (e.g. 1,2); --cycles at least 1")
    result = run(args)
    print_table(result)
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=2) + "\n")
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
