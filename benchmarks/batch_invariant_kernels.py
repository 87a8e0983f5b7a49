"""What batch-invariant mode (``--deterministic``, ``VLLM_BATCH_INVARIANT=1``) costs, kernel family by
kernel family.

One GPU, vLLM offline (``vllm.LLM(..., runner="pooling")``, the engine settings of
``benchmarks/scoring_gpu.py``'s offline phase, which are the reward server's, its worker extension
included), the same random-weight ``LlamaForSequenceClassification`` (``--size``, sizes as
``scoring_gpu.py``'s ``SIZES``) and the same token-id prompts (lengths uniform in [``--min-len``,
``--max-len``]), run once per mode (``--modes``), each in its own fresh process (vLLM reads the
variable when its engine starts): ``off`` (default kernels), ``on`` (batch-invariant as the reward
server runs it: linear layers on cuBLASLt without split-K on compute capability 9.0 and later,
``server/engines/vllm_deterministic.py``) and ``on-triton`` (as vLLM ships it: linear layers on its
Triton persistent matmul, ``REWARDPLANE_DETERMINISTIC_GEMM=triton``). Each batch-invariant mode is
compared with ``off``. In each process:
In each process:

1. warm-up: ``--profile-prompts`` prompts, not measured;
2. throughput: ``--rounds`` rounds of ``--time-prompts`` fresh prompts each (prefix caching stays
   on, as in the server, so no prompt is ever seen twice), no profiler; the figure is the median;
3. kernels: ``--profile-prompts`` further fresh prompts between ``LLM.start_profile()`` and
   ``LLM.stop_profile()`` (vLLM's torch profiler, ``ProfilerConfig(profiler="torch")``): the same
   engine steps in both modes (same prompts, same scheduler limits). The worker's trace is read
   (events with ``cat == "kernel"``: GPU time summed by kernel name), then deleted.

Kernels are grouped into families (cuBLAS/CUTLASS GEMMs, the Triton ``matmul_kernel_persistent``
that replaces them in batch-invariant mode, FlashAttention, RMSNorm, ...); the table gives each
family's GPU time in both modes, the difference and its share of the total difference, followed by
the kernels that differ most. What batch-invariant mode changes in vLLM 0.24 (read from
``vllm/model_executor/layers/batch_invariant.py`` and the places that test ``VLLM_BATCH_INVARIANT``):
linear layers go through a Triton persistent matmul with fixed tiles (``linear_batch_invariant``,
``matmul_kernel_persistent``) instead of cuBLAS; ``aten::mm``/``addmm``/``matmul``/``linear`` are
overridden too on SM80 only (on Hopper cuBLASLt gets ``CUBLASLT_WORKSPACE_SIZE=1``: no split-K);
``bmm``, ``softmax``, ``log_softmax`` and ``mean.dim`` get Triton kernels; RMSNorm its Triton
kernel (with a residual: vLLM's fused CUDA kernel); FlashAttention runs with ``num_splits=1`` and
without its ahead-of-time scheduler; cascade attention and custom all-reduce are off.

    bash scripts/gpu-run.sh bench batch_invariant_kernels --size 1.4b     # ~8 min on one H100 (3 modes)
    python benchmarks/batch_invariant_kernels.py --size 7b --rounds 1     # ~8-10 min
    python benchmarks/batch_invariant_kernels.py --compare-traces OFF.json[.gz] ON.json[.gz]   # CPU

Writes ``--out`` (default ``$OUT/batch_invariant_kernels.json`` where ``OUT`` is set): the
card, vLLM's version, ``$RP_COMMIT``, the date, both modes' throughput, startup, step counts,
per-family and per-kernel GPU times.
"""

from __future__ import annotations

import argparse
import contextlib
import glob
import gzip
import json
import os
import sys
import time
from collections.abc import Iterable
from pathlib import Path
from statistics import median
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.scoring_gpu import (  # noqa: E402
    SIZES,
    add_engine_arguments,
    check_engine_arguments,
    engine_flags,
    make_prompts,
    offline_batch_limits,
    offline_scorer,
    phase_build,
    run_in_own_group,
    vllm_kwargs,
    wait_gpu_free,
)
from rewardplane.protocol.settings import DETERMINISTIC_GEMM  # noqa: E402

# mode -> the child's environment: off (default kernels); on: batch-invariant as the reward server
# runs it (``--deterministic``: linear layers on cuBLASLt without split-K from compute capability
# 9.0); on-triton: batch-invariant as vLLM ships it (linear layers on its Triton matmul)
MODES: dict[str, dict[str, str]] = {
    "off": {"VLLM_BATCH_INVARIANT": "0"},
    "on": {"VLLM_BATCH_INVARIANT": "1", DETERMINISTIC_GEMM.name: "auto"},
    "on-triton": {"VLLM_BATCH_INVARIANT": "1", DETERMINISTIC_GEMM.name: "triton"},
}

# Kernel families, first match wins (case-insensitive substrings of the kernel's name). Order
# matters: FlashAttention 3's kernels are ``cutlass::device_kernel<flash::...>`` (attention before
# GEMMs), the KV-cache write is ``reshape_and_cache_flash_kernel`` (before attention), inductor's
# fused RMSNorm is ``triton_red_fused_..._mean_..._rsqrt`` (before the generic Triton family).
FAMILIES: list[tuple[str, tuple[str, ...]]] = [
    ("KV-cache write", ("reshape_and_cache",)),
    ("Triton matmul_kernel_persistent (batch-invariant GEMM)", ("matmul_kernel_persistent",)),
    ("Triton bmm_kernel (batch-invariant)", ("bmm_kernel",)),
    ("attention (FlashAttention)", ("flash::", "flashattn", "flash_fwd", "flash_attn", "fmha", "merge_attn")),
    ("GEMM (cuBLAS / CUTLASS)", ("nvjet", "xmma", "gemm", "cublas", "cutlass", "splitk", "gemv")),
    ("RMSNorm", ("rms_norm", "rmsnorm", "rsqrt")),
    ("softmax / log_softmax", ("softmax",)),
    ("mean (Triton mean_kernel)", ("mean_kernel",)),
    ("activation (SiLU * mul)", ("silu", "act_and_mul")),
    ("rotary embedding", ("rotary",)),
    ("elementwise / copy / index", ("elementwise", "copy", "fill", "catarray", "index", "gather", "scatter")),
    ("other Triton (torch.compile)", ("triton",)),
]
OTHER = "other"
# Families that do the same work in the two modes, summed for a like-for-like line.
GEMM_FAMILIES = (
    "GEMM (cuBLAS / CUTLASS)",
    "Triton matmul_kernel_persistent (batch-invariant GEMM)",
    "Triton bmm_kernel (batch-invariant)",
)


def family(name: str) -> str:
    low = name.lower()
    for fam, keys in FAMILIES:
        if any(k in low for k in keys):
            return fam
    return OTHER


# ---- trace parsing -----------------------------------------------------------------------------


def load_trace(path: Path) -> dict[str, Any]:
    opener: Any = gzip.open if path.name.endswith(".gz") else open
    with opener(path, "rt", encoding="utf-8") as f:
        data = json.load(f)
    if isinstance(data, list):  # a bare event list is valid Chrome trace format too
        return {"traceEvents": data}
    if not isinstance(data, dict) or not isinstance(data.get("traceEvents"), list):
        raise ValueError(f"{path}: not a Chrome/Kineto trace (no traceEvents list)")
    return data


def aggregate(trace: dict[str, Any]) -> dict[str, Any]:
    """GPU kernel time by kernel name (µs, summed over ``cat == "kernel"`` events), the engine steps
    the worker annotated (``execute_context_...``), the GPU span and memcpy/memset time."""
    kernels: dict[str, dict[str, float]] = {}
    steps = 0
    step_tokens = 0
    first, last = float("inf"), float("-inf")
    mem_us = 0.0
    for ev in trace["traceEvents"]:
        if not isinstance(ev, dict):
            continue
        cat, name = ev.get("cat"), str(ev.get("name", ""))
        if cat == "kernel":
            dur = float(ev.get("dur", 0.0))
            k = kernels.setdefault(name, {"us": 0.0, "n": 0})
            k["us"] += dur
            k["n"] += 1
            ts = float(ev.get("ts", 0.0))
            first, last = min(first, ts), max(last, ts + dur)
        elif cat in ("gpu_memcpy", "gpu_memset"):
            mem_us += float(ev.get("dur", 0.0))
        elif cat == "user_annotation" and name.startswith("execute_context_"):
            steps += 1
            # execute_context_<requests>(<tokens>)_generation_<requests>(<tokens>)
            with contextlib.suppress(ValueError, IndexError):
                step_tokens += int(name.split("(", 1)[1].split(")", 1)[0])
    return {
        "kernels": kernels,
        "kernel_us": sum(k["us"] for k in kernels.values()),
        "kernel_launches": int(sum(k["n"] for k in kernels.values())),
        "gpu_span_us": (last - first) if kernels else 0.0,
        "memcpy_memset_us": mem_us,
        "steps": steps,
        "step_tokens": step_tokens,
    }


def by_family(kernels: dict[str, dict[str, float]]) -> dict[str, float]:
    out: dict[str, float] = {}
    for name, k in kernels.items():
        fam = family(name)
        out[fam] = out.get(fam, 0.0) + k["us"]
    return out


def compare(off: dict[str, Any], on: dict[str, Any], top: int = 12) -> dict[str, Any]:
    """Per family and per kernel: ms in each mode, on − off, share of the total difference."""
    f_off, f_on = by_family(off["kernels"]), by_family(on["kernels"])
    total_off, total_on = sum(f_off.values()), sum(f_on.values())
    total_diff = total_on - total_off
    order = [fam for fam, _ in FAMILIES] + [OTHER]
    families = []
    for fam in order:
        a, b = f_off.get(fam, 0.0), f_on.get(fam, 0.0)
        if a == 0.0 and b == 0.0:
            continue
        families.append(
            {
                "family": fam,
                "off_ms": a / 1e3,
                "on_ms": b / 1e3,
                "diff_ms": (b - a) / 1e3,
                "share_of_diff": (b - a) / total_diff if total_diff else None,
            }
        )
    g_off = sum(f_off.get(f, 0.0) for f in GEMM_FAMILIES)
    g_on = sum(f_on.get(f, 0.0) for f in GEMM_FAMILIES)
    gemm = {
        "off_ms": g_off / 1e3,
        "on_ms": g_on / 1e3,
        "diff_ms": (g_on - g_off) / 1e3,
        "share_of_diff": (g_on - g_off) / total_diff if total_diff else None,
    }
    names = set(off["kernels"]) | set(on["kernels"])
    rows = []
    for n in names:
        a = off["kernels"].get(n, {}).get("us", 0.0)
        b = on["kernels"].get(n, {}).get("us", 0.0)
        rows.append(
            {
                "kernel": n,
                "family": family(n),
                "off_ms": a / 1e3,
                "on_ms": b / 1e3,
                "diff_ms": (b - a) / 1e3,
                "off_launches": int(off["kernels"].get(n, {}).get("n", 0)),
                "on_launches": int(on["kernels"].get(n, {}).get("n", 0)),
            }
        )
    rows.sort(key=lambda r: -abs(r["diff_ms"]))
    return {
        "total_off_ms": total_off / 1e3,
        "total_on_ms": total_on / 1e3,
        "total_diff_ms": total_diff / 1e3,
        "families": families,
        "all_gemms": gemm,
        "kernels_top": rows[:top],
    }


def short(name: str, width: int) -> str:
    return name if len(name) <= width else name[: width - 3] + "..."


def print_comparison(cmp: dict[str, Any], off: dict[str, Any], on: dict[str, Any]) -> None:
    print("\n==== GPU kernel time by family (profiled steps), default (off) vs batch-invariant (on) ====")
    print(
        f"steps profiled: off {off['steps']} ({off['step_tokens']} tokens), on {on['steps']} "
        f"({on['step_tokens']} tokens); kernel launches: off {off['kernel_launches']}, on {on['kernel_launches']}"
    )
    if off["steps"] != on["steps"] or off["step_tokens"] != on["step_tokens"]:
        print("WARNING: the two modes profiled different engine steps; compare per-token figures with care")
    w = 56
    print(f"{'family':<{w}} {'off ms':>9} {'on ms':>9} {'on-off ms':>10} {'share of diff':>13}")
    for r in cmp["families"]:
        share = "-" if r["share_of_diff"] is None else f"{100 * r['share_of_diff']:.1f}%"
        print(f"{r['family']:<{w}} {r['off_ms']:>9.2f} {r['on_ms']:>9.2f} {r['diff_ms']:>+10.2f} {share:>13}")
    g = cmp["all_gemms"]
    share = "-" if g["share_of_diff"] is None else f"{100 * g['share_of_diff']:.1f}%"
    print(
        f"{'= all GEMMs (cuBLAS/CUTLASS + Triton persistent + bmm)':<{w}} {g['off_ms']:>9.2f} "
        f"{g['on_ms']:>9.2f} {g['diff_ms']:>+10.2f} {share:>13}"
    )
    print(
        f"{'total kernel time':<{w}} {cmp['total_off_ms']:>9.2f} {cmp['total_on_ms']:>9.2f} "
        f"{cmp['total_diff_ms']:>+10.2f} {'100.0%' if cmp['total_diff_ms'] else '-':>13}"
    )
    print(
        f"{'GPU span (first kernel start to last kernel end)':<{w}} {off['gpu_span_us'] / 1e3:>9.2f} "
        f"{on['gpu_span_us'] / 1e3:>9.2f} {(on['gpu_span_us'] - off['gpu_span_us']) / 1e3:>+10.2f}"
    )
    print("\nkernels that differ most (ms; launches off/on):")
    for r in cmp["kernels_top"]:
        print(
            f"  {r['diff_ms']:>+9.2f}  off {r['off_ms']:>8.2f} ({r['off_launches']:>5})  "
            f"on {r['on_ms']:>8.2f} ({r['on_launches']:>5})  [{r['family']}]  {short(r['kernel'], 110)}"
        )


# ---- one mode, in its own process ----------------------------------------------------------------


def find_trace(trace_dir: Path, timeout_s: float = 120.0) -> Path:
    """The worker's trace file, once it exists and has stopped growing (stop_profile returns after
    the export, but a slow disk gets a bounded wait)."""
    deadline = time.monotonic() + timeout_s
    last_size = -1
    while time.monotonic() < deadline:
        found = sorted(glob.glob(str(trace_dir / "*.pt.trace.json*")))
        found = [f for f in found if not f.endswith(".tmp")]
        if len(found) > 1:
            raise RuntimeError(f"expected one trace in {trace_dir}, found {found}")
        if found:
            size = os.path.getsize(found[0])
            if size > 0 and size == last_size:
                return Path(found[0])
            last_size = size
        time.sleep(1.0)
    raise RuntimeError(
        f"no complete torch profiler trace in {trace_dir} after {timeout_s:.0f}s: "
        f"{os.listdir(trace_dir) if trace_dir.exists() else 'directory missing'}"
    )


def phase_measure(model_dir: Path, work: Path, mode: str, args: argparse.Namespace) -> dict[str, Any]:
    import vllm
    from vllm import LLM
    from vllm.config import ProfilerConfig

    want = MODES[mode]
    if any(os.environ.get(k) != v for k, v in want.items()):
        raise RuntimeError(f"mode {mode} needs {want} in this process's environment")
    prompts = json.loads((work / "prompts.json").read_text())
    trace_dir = work / f"traces-{mode}"
    if trace_dir.exists():
        for f in trace_dir.iterdir():
            f.unlink()
    trace_dir.mkdir(parents=True, exist_ok=True)
    profiler = ProfilerConfig(
        profiler="torch",
        torch_profiler_dir=str(trace_dir),
        torch_profiler_with_stack=False,  # small traces: no Python stacks
        torch_profiler_record_shapes=False,
        torch_profiler_dump_cuda_time_total=False,  # no key_averages table at stop (slow, unused)
        torch_profiler_use_gzip=True,
    )
    t0 = time.perf_counter()
    llm = LLM(**vllm_kwargs(model_dir, args), profiler_config=profiler)
    startup = time.perf_counter() - t0
    limits = offline_batch_limits(llm)
    run = offline_scorer(llm)

    run(prompts["warmup"])
    round_seconds, round_tokens = [], []
    scores: list[list[float]] = []
    for i, batch in enumerate(prompts["rounds"]):
        t0 = time.perf_counter()
        out = run(batch)
        round_seconds.append(time.perf_counter() - t0)
        round_tokens.append(sum(map(len, batch)))
        if i == 0:
            scores = out
        print(f"[{mode}] round {i + 1}: {round_tokens[-1] / round_seconds[-1]:,.0f} tok/s", flush=True)

    result: dict[str, Any] = {
        "mode": mode,
        "vllm_batch_invariant": want,
        "vllm_version": vllm.__version__,
        "startup_s": startup,
        "batch_limits": limits,
        "round_seconds": round_seconds,
        "round_tokens": round_tokens,
        "tok_s": median(t / s for t, s in zip(round_tokens, round_seconds, strict=True)),
        "scores": scores,
        "profiled_prompts": len(prompts["profile"]),
        "profiled_tokens": sum(map(len, prompts["profile"])),
    }
    # The throughput above stands on its own: a profiler that fails is reported, not fatal.
    try:
        llm.start_profile()
        t0 = time.perf_counter()
        run(prompts["profile"])
        result["profiled_call_s"] = time.perf_counter() - t0
        llm.stop_profile()
        trace = find_trace(trace_dir)
        result["trace_bytes"] = trace.stat().st_size
        agg = aggregate(load_trace(trace))
        if args.keep_traces:
            print(f"[{mode}] trace kept: {trace}", flush=True)
        else:
            trace.unlink()
        if not agg["kernels"]:
            raise RuntimeError(
                "the trace holds no GPU kernel events (cat == 'kernel'): the torch profiler recorded no "
                "CUDA activity (is CUPTI available to torch?)"
            )
        result.update(agg)
    except Exception as exc:
        result["profile_error"] = f"{type(exc).__name__}: {exc}"
        print(f"[{mode}] profiling FAILED: {result['profile_error']}", flush=True)
    return result


# ---- orchestration -------------------------------------------------------------------------------


def child(
    phase: str, work: Path, model_dir: Path, args: argparse.Namespace, env: dict[str, str], extra: list[str]
) -> dict[str, Any]:
    """Run one phase of this script in a fresh process (own session, killed as a group afterwards),
    bounded by ``--phase-timeout``; its result is ``work/<phase>[-mode].json``."""
    tag = phase + (f"-{extra[extra.index('--mode') + 1]}" if "--mode" in extra else "")
    result = work / f"{tag}.json"
    log = work / f"{tag}.log"
    result.unlink(missing_ok=True)
    cmd = [
        sys.executable,
        os.path.abspath(__file__),
        "--phase",
        phase,
        "--workdir",
        str(work),
        "--model-dir",
        str(model_dir),
        "--size",
        args.size,
        "--max-len",
        str(args.max_len),
        "--gpu-memory-utilization",
        str(args.gpu_memory_utilization),
        *engine_flags(args),
        *(["--keep-traces"] if args.keep_traces else []),
        *extra,
    ]
    t0 = time.perf_counter()
    rc = run_in_own_group(cmd, log, args.phase_timeout, env)
    if rc is None and result.exists():  # done, but stuck on its way out (vLLM's shutdown): killed above
        print(
            f"warning: {tag} wrote its result but did not exit within {args.phase_timeout:.0f}s", flush=True
        )
    elif rc != 0 or not result.exists():
        why = f"timed out after {args.phase_timeout:.0f}s" if rc is None else f"exit {rc}"
        raise RuntimeError(f"{tag} failed ({why}); log {log}:\n{log.read_text(errors='replace')[-6000:]}")
    out: dict[str, Any] = json.loads(result.read_text())
    out["wall_s"] = time.perf_counter() - t0
    return out


def max_abs(a: Iterable[list[float]], b: Iterable[list[float]]) -> float:
    return max(
        (abs(x - y) for ra, rb in zip(a, b, strict=True) for x, y in zip(ra, rb, strict=True)), default=0.0
    )


def bench(args: argparse.Namespace) -> dict[str, Any]:
    work = args.workdir / args.size
    work.mkdir(parents=True, exist_ok=True)
    model_dir = work / "model"
    env = dict(os.environ)
    env.setdefault("VLLM_USE_FLASHINFER_SAMPLER", "0")  # FlashInfer is not in the device bundle
    env.setdefault("PYTHONUNBUFFERED", "1")
    built_file = work / "build.json"
    if args.reuse_models and built_file.exists() and (model_dir / "config.json").exists():
        built = json.loads(built_file.read_text())
        print(f"[{args.size}] reusing the model in {model_dir}", flush=True)
    else:
        print(f"[{args.size}] building a random-weight model in {model_dir}", flush=True)
        built = child("build", work, model_dir, args, env, [])
    lo, hi = args.min_len, args.max_len
    prompts = {
        "warmup": make_prompts(args.profile_prompts, lo, hi, seed=2),
        "rounds": [make_prompts(args.time_prompts, lo, hi, seed=100 + i) for i in range(args.rounds)],
        "profile": make_prompts(args.profile_prompts, lo, hi, seed=3),
    }
    (work / "prompts.json").write_text(json.dumps(prompts))
    print(
        f"[{args.size}] {built['params'] / 1e9:.2f}B params on {built.get('card')}; {args.rounds} round(s) of "
        f"{args.time_prompts} prompts, {args.profile_prompts} profiled, lengths U[{lo}, {hi}]",
        flush=True,
    )
    results: dict[str, dict[str, Any]] = {}
    meta_vllm = None
    for mode in args.mode_list:
        wait_gpu_free()
        menv = {**env, **MODES[mode]}
        r = child("measure", work, model_dir, args, menv, ["--mode", mode])
        results[mode] = r
        meta_vllm = r.get("vllm_version")
        line = f"[{args.size}] {mode}: {r['tok_s']:,.0f} tok/s (rounds {[round(s, 2) for s in r['round_seconds']]} s; "
        line += f"startup {r['startup_s']:.0f}s); "
        if "profile_error" in r:
            line += f"profiling failed: {r['profile_error']}"
        else:
            line += (
                f"profiled {r['steps']} steps, {r['kernel_us'] / 1e3:.1f} ms of kernels, "
                f"trace {r['trace_bytes'] / 2**20:.1f} MiB"
            )
        print(line, flush=True)
    out: dict[str, Any] = {
        "meta": {
            "size": args.size,
            "shape": SIZES[args.size],
            "params": built["params"],
            "card": built.get("card"),
            "commit": os.environ.get("RP_COMMIT"),
            "date": time.strftime("%Y-%m-%d", time.gmtime()),
            "vllm": meta_vllm,
        },
        "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "modes": {
            m: {k: v for k, v in r.items() if k not in ("scores", "kernels")} for m, r in results.items()
        },
        "kernels": {m: r.get("kernels", {}) for m, r in results.items()},
    }
    # each batch-invariant mode against the default one: throughput, scores, kernels
    out["throughput"], out["comparison"], out["scores_max_abs_diff_vs_off"] = {}, {}, {}
    off = results.get("off")
    for mode, on in results.items():
        if off is None or mode == "off":
            continue
        out["throughput"][mode] = {
            "off_tok_s": off["tok_s"],
            "on_tok_s": on["tok_s"],
            "on_vs_off": on["tok_s"] / off["tok_s"],
            "cost": 1.0 - on["tok_s"] / off["tok_s"],
        }
        out["scores_max_abs_diff_vs_off"][mode] = max_abs(off["scores"], on["scores"])
        if "profile_error" not in off and "profile_error" not in on:
            out["comparison"][mode] = compare(off, on, args.top)
            print(f"\n######## mode {mode} against off")
            print_comparison(out["comparison"][mode], off, on)
    print(f"\n==== throughput, same prompts ({args.rounds} round(s) of {args.time_prompts}) ====")
    for m, r in results.items():
        profiled = f"{r['profiled_call_s']:.2f} s" if "profiled_call_s" in r else "-"
        line = (
            f"  {m:>9}: {r['tok_s']:>10,.0f} tok/s  rounds {[round(s, 3) for s in r['round_seconds']]} s  "
            f"profiled call {profiled}  startup {r['startup_s']:.0f} s"
        )
        if m in out["throughput"]:
            t, cmp = out["throughput"][m], out["comparison"].get(m)
            kernels = (
                f"{cmp['total_on_ms'] / cmp['total_off_ms']:.3f}" if cmp and cmp["total_off_ms"] else "-"
            )
            line += (
                f"\n             {m} / off = {t['on_vs_off']:.3f} (cost {100 * t['cost']:.1f}%; goal <= 5%: "
                f"{'met' if t['cost'] <= 0.05 else 'missed'}); kernel time {m} / off = {kernels}; largest "
                f"|score {m} - score off| = {out['scores_max_abs_diff_vs_off'][m]:.4f}"
            )
        print(line)
    return out


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--size", default="1.4b", choices=sorted(SIZES), help="model size (default 1.4b)")
    p.add_argument(
        "--modes", default="off,on,on-triton", help="which modes, in this order (default off,on,on-triton)"
    )
    p.add_argument("--time-prompts", type=int, default=2048, help="prompts per throughput round")
    p.add_argument("--rounds", type=int, default=3, help="throughput rounds (fresh prompts each; median)")
    p.add_argument(
        "--profile-prompts", type=int, default=256, help="prompts profiled (and warm-up prompts before)"
    )
    p.add_argument("--min-len", type=int, default=64)
    p.add_argument("--max-len", type=int, default=1024, help="longest prompt; also max_model_len")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.85)
    add_engine_arguments(p)  # as the scoring benchmark's (its vllm_kwargs reads them)
    p.add_argument("--top", type=int, default=12, help="kernels listed by difference")
    p.add_argument("--keep-traces", action="store_true", help="keep the trace files (default: deleted)")
    p.add_argument("--reuse-models", action="store_true", help="use a model built earlier in --workdir")
    p.add_argument("--phase-timeout", type=float, default=600.0, help="bound on each process (s)")
    p.add_argument("--workdir", type=Path, default=Path("/tmp/rp-batch-invariant-kernels"))
    p.add_argument(
        "--out",
        type=Path,
        default=Path(os.environ["OUT"]) / "batch_invariant_kernels.json" if os.environ.get("OUT") else None,
        help="result JSON file (default $OUT/batch_invariant_kernels.json where OUT is set)",
    )
    p.add_argument(
        "--compare-traces",
        nargs=2,
        type=Path,
        metavar=("OFF_TRACE", "ON_TRACE"),
        help="no GPU: print the comparison of two saved traces (.json or .json.gz) and exit",
    )
    # internal: one phase in this process
    p.add_argument("--phase", choices=["build", "measure"], help=argparse.SUPPRESS)
    p.add_argument("--mode", choices=sorted(MODES), help=argparse.SUPPRESS)
    p.add_argument("--model-dir", type=Path, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    args.mode_list = [m.strip() for m in args.modes.split(",") if m.strip()]
    bad = [m for m in args.mode_list if m not in MODES]
    if bad or not args.mode_list:
        p.error(f"--modes: unknown {bad}; choose from {', '.join(MODES)}")
    if args.rounds < 1 or args.time_prompts < 1 or args.profile_prompts < 1:
        p.error("--rounds, --time-prompts and --profile-prompts must be >= 1")
    if not 1 <= args.min_len <= args.max_len:
        p.error("need 1 <= --min-len <= --max-len")
    check_engine_arguments(p, args)
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    if args.compare_traces:
        off, on = (aggregate(load_trace(t)) for t in args.compare_traces)
        cmp = compare(off, on, args.top)
        print_comparison(cmp, off, on)
        if args.out is not None:
            args.out.parent.mkdir(parents=True, exist_ok=True)
            args.out.write_text(json.dumps({"comparison": cmp}, indent=2))
        return 0
    if args.phase:
        work = args.workdir
        if args.phase == "build":
            result = phase_build(args.model_dir, args.size, args.max_len)
            (work / "build.json").write_text(json.dumps(result))
        else:
            result = phase_measure(args.model_dir, work, args.mode, args)
            (work / f"measure-{args.mode}.json").write_text(json.dumps(result))
        return 0
    out = bench(args)
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(out, indent=2))
        print(f"\nwrote {args.out}", flush=True)
    failed = [m for m, r in out["modes"].items() if "profile_error" in r]
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
