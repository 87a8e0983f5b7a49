"""Adapter-only push against a merged full push of the same LoRA model (``weight_sync.py --mode
adapter``): one LoRA-enabled server on GPU 0, the trainer on GPU 1.

Steps: the trainer's base weights are pushed once (the server starts from random dummy weights);
then ``reps`` adapter pushes (LoRA A/B of every projection plus the head, ``training_mode=adapter``)
and ``reps`` merged pushes of the same model (``training_mode=lora``: every parameter, the adapter
merged in), each call → served. Scores of the same texts after each kind, and their largest
difference, show both serve the same function. Prints a table; JSON to
$OUT/weight_sync-adapter-<engine>.json when OUT is set.
"""

from __future__ import annotations

import argparse
import copy
import itertools
import json
import os
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import torch

from rewardplane.protocol import RewardModelTrainingMode as Mode
from rewardplane.sdk.lora import adapter_payload
from rewardplane.testing.pushers import loopback_pusher
from rewardplane.testing.servers import wait_healthy

TEXTS = [
    "The reward model reads a prompt and a completion and returns a score.",
    "The assistant answered the question clearly and politely.",
    "Here is a careful explanation of gradient descent, step by step, with an example.",
    "I cannot help with that request, but here is a safer alternative you might consider.",
    "def add(a, b): return a + b",
    "Thank you!",
    "The capital of France is Paris.",
    "Sure! First, preheat the oven. Then mix flour, sugar and eggs; bake for twenty minutes.",
]
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def scores(url: str) -> list[float]:
    body = httpx.post(f"{url}/score", json={"input": TEXTS, "normalize": False}, timeout=120).json()
    return [float(d["score"]) for d in sorted(body["data"], key=lambda d: d["index"])]


def timed(
    push: Callable[[int], None],
    reps: int,
    versions: itertools.count[int],
    trainer: torch.device,
    after: Callable[[int], None] | None = None,
) -> list[float]:
    """``reps`` pushes, each timed call -> served; ``after(version)`` runs after each, untimed."""
    out = []
    for _ in range(reps):
        torch.cuda.synchronize(trainer)
        version = next(versions)
        t0 = time.perf_counter()
        push(version)
        out.append(time.perf_counter() - t0)
        if after is not None:
            after(version)
    return out


def step_ms(timeline: dict[str, float]) -> dict[str, float]:
    """How long each server step of an adapter push took (ms), from the update's timeline: the
    receive (staged), waiting for the lock, then the worker's steps (build or write, vLLM's add, dropping the
    previous adapter, the plain parameters) and the cache reset up to the commit."""
    order = [
        "server0.announce_arrived",
        "server0.returned",
        "server0.locked",
        "server0.adapter_unpacked",
        "server0.adapter_built",
        "server0.adapter_written",
        "server0.adapter_added",
        "server0.adapter_previous_dropped",
        "server0.adapter_plain_loaded",
        "server0.committed",
        "trainer.served",
    ]
    present = [k for k in order if k in timeline]
    return {
        f"{a.removeprefix('server0.')} -> {b.removeprefix('server0.')}": round(timeline[b] - timeline[a], 3)
        for a, b in itertools.pairwise(present)
    }


def run(
    args: argparse.Namespace,
    ckpt: Path,
    work: Path,
    token: str,
    build_trainer_model: Callable[[Path, torch.device], torch.nn.Module],
) -> int:
    from peft import LoraConfig, get_peft_model

    from benchmarks.weight_sync import launch_on_dummy_weights, median_timeline, timeline

    trainer = torch.device("cuda", 1)
    torch.cuda.set_device(trainer)
    opts: dict[str, Any] = {
        "engine": args.engine,
        "enable_lora": True,
        "max_lora_rank": max(16, args.lora_rank),
    }
    if args.engine == "hf":
        opts["device"] = "cuda"
    else:
        opts.update(gpu_memory_utilization=args.gpu_memory_utilization, max_model_len=1024)
    server = launch_on_dummy_weights(ckpt, work, 0, args.server_args, token=token, **opts)
    versions = itertools.count(1)
    results: dict[str, object] = {
        "size": args.size,
        "engine": args.engine,
        "gpu": torch.cuda.get_device_name(trainer),
    }
    sync = None
    try:
        wait_healthy(server, 900, poll_s=1.0)
        sync = loopback_pusher(
            [server.url],
            token,
            device=trainer,
            bucket_bytes=args.bucket_mib << 20,
            connect_timeout_s=300,
            timeout_s=600,
        )
        base = build_trainer_model(ckpt, trainer)
        sync.push(base.state_dict(), version=next(versions))  # the server now holds the trainer's base
        model = get_peft_model(
            base,
            LoraConfig(
                r=args.lora_rank,
                lora_alpha=2 * args.lora_rank,
                target_modules=TARGETS,
                modules_to_save=["score"],
            ),
        )
        torch.manual_seed(0)
        with torch.no_grad():  # as if trained: non-zero B, a changed head
            for name, p in model.named_parameters():
                if "lora_B" in name:
                    p.normal_(0.0, 0.02)
                if "modules_to_save" in name:
                    p.add_(torch.randn_like(p) * 0.2 * p.shape[-1] ** -0.5)
        tensors, adapter = adapter_payload(model)
        tensors = {k: v.detach() for k, v in tensors.items()}
        merged = {k: v.detach() for k, v in copy.deepcopy(model).merge_and_unload().state_dict().items()}

        def adapter_push(v: int) -> None:
            sync.push(tensors, version=v, training_mode=Mode.ADAPTER, adapter=adapter)

        def merged_push(v: int) -> None:
            sync.push(merged, version=v, training_mode=Mode.LORA)

        adapter_push(next(versions))  # warm-up: layouts announced, adapter machinery loaded
        timelines: list[dict[str, float]] = []

        def record(version: int) -> None:
            assert sync is not None
            timelines.append(timeline([server.url], dict(sync.open().last_stats), version))

        adapter_s = timed(adapter_push, args.reps, versions, trainer, after=record)
        adapter_timeline = median_timeline(timelines)
        adapter_scores = scores(server.url)
        merged_push(next(versions))
        merged_s = timed(merged_push, args.reps, versions, trainer)
        merged_scores = scores(server.url)
        nbytes = {
            "adapter": sum(t.numel() * t.element_size() for t in tensors.values()),
            "merged": sum(t.numel() * t.element_size() for t in merged.values()),
        }
        diff = max(abs(a - b) for a, b in zip(adapter_scores, merged_scores, strict=True))
        results.update(
            # how the server's workers hand the adapter to vLLM: built in memory (the directory
            # only where vLLM's internals differ; the server's log says so)
            adapter_loads="memory",
            lora_rank=args.lora_rank,
            bytes=nbytes,
            adapter_push_s=adapter_s,
            merged_push_s=merged_s,
            adapter_median_ms=1000 * statistics.median(adapter_s),
            adapter_timeline_ms=adapter_timeline,
            adapter_steps_ms=step_ms(adapter_timeline),
            merged_median_ms=1000 * statistics.median(merged_s),
            scores_adapter=adapter_scores,
            scores_merged=merged_scores,
            max_abs_score_diff=diff,
        )
    finally:
        if sync is not None:
            sync.close()
        server.stop()
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], f"weight_sync-adapter-{args.engine}.json").write_text(
            json.dumps(results, indent=2)
        )
    print(json.dumps(results, indent=1))
    a, m = results["adapter_median_ms"], results["merged_median_ms"]
    assert isinstance(a, float) and isinstance(m, float)
    print(
        f"\n== adapter vs merged push, {args.engine} engine, {args.size}, LoRA r={args.lora_rank} on {len(TARGETS)} "
        f"projections, adapters loaded from {results['adapter_loads']}, {results['gpu']} =="
    )
    print(f"  adapter push, call -> served : {a:8.2f} ms median ({nbytes['adapter'] / 1e6:.2f} MB)")
    print(f"  merged push, call -> served  : {m:8.2f} ms median ({nbytes['merged'] / 1e6:.2f} MB)")
    print(f"  merged / adapter             : {m / a:.2f}x")
    steps = results["adapter_steps_ms"]
    assert isinstance(steps, dict)
    print("  adapter push, server steps (median timeline, ms):")
    for step, ms in steps.items():
        print(f"    {step:<44} {ms:8.2f}")
    print(
        f"  max |score diff| adapter vs merged: {results['max_abs_score_diff']:.6f} over {len(TEXTS)} texts"
    )
    return 0
