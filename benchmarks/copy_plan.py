"""CPU time of loading a push into vLLM: the model's own ``load_weights`` against the copy plan
(``rewardplane.server.weight_sync.copy_plan``), on vLLM's real ``LlamaForSequenceClassification`` (or
another family's ``<Family>ForSequenceClassification``: ``--arch qwen2``, ``qwen3``, ``gemma2``,
``mistral``, ``qwen3_moe``, ``mixtral``; ``rewardplane.tinymodel.FAMILIES``).

The tensors are small CPU tensors, so the figures are the Python time per call that a GPU push
spends beside the copies themselves (the copies are the same either way). Each call gets one
"bucket": ``--per-bucket`` consecutive tensors, about what a 1 GiB bucket of a 7B model holds.
The parameters after every call are checked bit for bit against a second model loaded by vLLM's
loader alone.

    python benchmarks/copy_plan.py                           # where vLLM is installed
    PYTHONPATH=<vllm sources> python benchmarks/copy_plan.py --force-cpu-platform
        # a CPU-only machine with vLLM's Python sources (no CUDA build): platform forced to CPU,
        # vLLM's model inspection run in-process
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from rewardplane.server.weight_sync.copy_plan import CopyPlan
from rewardplane.server.weight_sync.expert_names import expert_splitter
from rewardplane.testing.servers import free_port
from rewardplane.tinymodel import FAMILIES, family_config


def force_cpu_platform() -> None:
    import vllm.model_executor.models.registry as registry
    import vllm.platforms as platforms
    from vllm.platforms.cpu import CpuPlatform

    platforms._current_platform = CpuPlatform()
    registry._run_in_subprocess = lambda fn: fn()


def checkpoint(root: Path, arch: str, layers: int) -> Path:
    """A config-only checkpoint of a small ``<Family>ForSequenceClassification`` of family ``arch``:
    vLLM builds it with random weights."""
    config = family_config(
        arch,
        vocab_size=512,
        hidden_size=64,
        intermediate_size=128,
        num_layers=layers,
        num_heads=4,
        num_kv_heads=2,
    )
    config.save_pretrained(root)
    return root


def build_models(ckpt: Path, stack: contextlib.ExitStack) -> tuple[torch.nn.Module, torch.nn.Module]:
    from vllm.config import ModelConfig, VllmConfig, set_current_vllm_config
    from vllm.distributed import init_distributed_environment, initialize_model_parallel
    from vllm.model_executor.model_loader.utils import initialize_model

    model_config = ModelConfig(
        model=str(ckpt), runner="pooling", dtype="bfloat16", enforce_eager=True, skip_tokenizer_init=True
    )
    config = VllmConfig(model_config=model_config)
    stack.enter_context(set_current_vllm_config(config))  # held while the models load
    init_distributed_environment(
        world_size=1,
        rank=0,
        local_rank=0,
        distributed_init_method=f"tcp://127.0.0.1:{free_port()}",
        backend="gloo",
    )
    initialize_model_parallel(1, 1)
    with torch.device("cpu"):
        planned = initialize_model(vllm_config=config)
        config.compilation_config.static_forward_context.clear()  # layer names register once
        reference = initialize_model(vllm_config=config)
    return planned, reference


def trainer_shapes(ckpt: Path) -> list[tuple[str, tuple[int, ...]]]:
    """The checkpoint's names and shapes (q/k/v and gate/up unfused, as a trainer sends them)."""
    from transformers import AutoConfig, AutoModelForSequenceClassification

    with torch.device("meta"):
        hf = AutoModelForSequenceClassification.from_config(AutoConfig.from_pretrained(ckpt))
    return [(n, tuple(p.shape)) for n, p in hf.named_parameters()]


def push(shapes: list[tuple[str, tuple[int, ...]]], seed: int) -> list[tuple[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [(n, torch.randn(*s, generator=g).to(torch.bfloat16)) for n, s in shapes]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--arch", choices=list(FAMILIES), default="llama", help="the decoder family")
    ap.add_argument("--layers", type=int, default=32, help="decoder layers (a 7B Llama has 32)")
    ap.add_argument("--per-bucket", type=int, default=25, help="tensors per load call")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--force-cpu-platform", action="store_true")
    ap.add_argument("--out", type=Path, default=None, help="write the figures as JSON here")
    args = ap.parse_args()
    if args.force_cpu_platform:
        force_cpu_platform()
    ckpt = checkpoint(Path(tempfile.mkdtemp(prefix="copy-plan-")), args.arch, args.layers)
    shapes = trainer_shapes(ckpt)
    stack = contextlib.ExitStack()
    planned, reference = build_models(ckpt, stack)
    # as the vLLM worker loads (weight_sync/worker/vllm_host.py): fused experts split per expert
    split = expert_splitter(planned)
    plan = CopyPlan(lambda w: planned.load_weights(split(w)), planned)  # type: ignore[operator]

    def loader(weights: list[tuple[str, torch.Tensor]]) -> None:
        reference.load_weights(split(weights))  # type: ignore[operator]

    def buckets(weights: list[tuple[str, torch.Tensor]]) -> list[list[tuple[str, torch.Tensor]]]:
        return [weights[i : i + args.per_bucket] for i in range(0, len(weights), args.per_bucket)]

    times: dict[str, list[float]] = {"loader": [], "plan": []}
    for rep in range(args.reps + 1):  # the first push teaches the plan (and warms both up)
        weights = push(shapes, rep)
        for bucket in buckets(weights):
            for label, load in (("loader", loader), ("plan", plan.load)):
                start = time.perf_counter()
                load(bucket)
                if rep:
                    times[label].append(time.perf_counter() - start)
        for (name, a), (_, b) in zip(planned.named_parameters(), reference.named_parameters(), strict=True):
            if not torch.equal(a, b):
                raise SystemExit(f"push {rep}: {name} differs between the plan and vLLM's loader")
    n_tensors = len(shapes)
    med = {k: 1000 * statistics.median(v) for k, v in times.items()}
    result: dict[str, Any] = {
        "model": type(planned).__name__,
        "layers": args.layers,
        "tensors": n_tensors,
        "per_bucket": args.per_bucket,
        "learned": len(plan.direct_names),
        "left_to_loader": [n for n, _ in shapes if n not in plan.direct_names],
        "loader_ms_per_bucket": round(med["loader"], 4),
        "plan_ms_per_bucket": round(med["plan"], 4),
        "ratio_plan_over_loader": round(med["plan"] / med["loader"], 4),
        "bit_identical": True,
    }
    print(f"vLLM {type(planned).__name__}, {args.layers} layers, {n_tensors} tensors")
    print(f"  learned by the plan      : {len(plan.direct_names)} of {n_tensors} names")
    # fused 3-D experts reach the loader split per expert (views the plan does not follow)
    print(f"  left to vLLM's loader    : {' '.join(result['left_to_loader']) or '-'}")
    print(
        f"  loader, per bucket of {args.per_bucket} : {med['loader']:.3f} ms (median of {len(times['loader'])})"
    )
    print(f"  plan,   per bucket of {args.per_bucket} : {med['plan']:.3f} ms")
    print(f"  ratio plan / loader      : {med['plan'] / med['loader']:.3f}   (parameters bit-identical)")
    if args.out:
        args.out.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
