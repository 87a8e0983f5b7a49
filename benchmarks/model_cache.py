"""What the node cache saves a replica's start: the model fetcher (``python -m
rewardplane.modelfetch``, a replica's ``fetch-model`` init container) downloading a model from an
S3-compatible store, against the same fetch finding it in the node cache (checked by sha256, the
default, or by sizes only).

A replica's time to Ready is this fetch plus the server's start (loading the weights), which is
the same with and without the cache; the real-node e2e suite measures both together on a tiny
model. The store is moto's server on this machine (the tests' S3 server, ``scripts/setup.sh``
makes its virtualenv), so the download runs at loopback speed: over a real network to a real
store the download is slower and the cache saves more.

    python benchmarks/model_cache.py                 # a 1 GiB model in 4 files, 3 rounds
    python benchmarks/model_cache.py --gib 4 --files 8 --rounds 2 --out model_cache.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from rewardplane.protocol.model_sources import FetchProgress, cache_key, parse_source
from rewardplane.testing.storage_servers import S3Server

BUCKET, PREFIX = "models", "bench-rm"


def write_model(root: Path, total_bytes: int, files: int) -> Path:
    """Incompressible shards (what the fetcher moves is bytes; their meaning does not matter)."""
    root.mkdir(parents=True)
    per_file = total_bytes // files
    chunk = os.urandom(16 << 20)
    for i in range(files):
        with open(root / f"model-{i:05d}-of-{files:05d}.safetensors", "wb") as f:
            left = per_file
            while left:
                f.write(chunk[: min(left, len(chunk))])
                left -= min(left, len(chunk))
    (root / "config.json").write_text(json.dumps({"architectures": ["LlamaForSequenceClassification"]}))
    return root


def fetch(s3: S3Server, cache: Path, verify: str) -> tuple[float, str]:
    """One fetcher process: its wall time and the phase it ended in (done or cached)."""
    source = f"s3://{BUCKET}/{PREFIX}"
    key = cache_key(parse_source(source), s3.url)
    cmd = [sys.executable, "-m", "rewardplane.modelfetch", "--source", source, "--endpoint", s3.url]
    cmd += ["--cache-dir", str(cache), "--key", key, "--verify", verify, "--termination-log", os.devnull]
    t0 = time.perf_counter()
    done = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, **s3.env()}, timeout=3600)
    took = time.perf_counter() - t0
    if done.returncode != 0:
        raise SystemExit(f"the fetcher failed ({done.returncode}): {done.stderr[-2000:]}")
    progress = FetchProgress.last_in(done.stdout)
    return took, progress.phase if progress else "?"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gib", type=float, default=1.0, help="model size in GiB (default 1)")
    ap.add_argument("--files", type=int, default=4, help="files the model is split into (default 4)")
    ap.add_argument("--rounds", type=int, default=3, help="fetches per case (default 3); medians reported")
    ap.add_argument("--out", type=Path, default=None, help="write the figures as JSON here (default $OUT)")
    args = ap.parse_args()
    total = int(args.gib * 2**30)
    with tempfile.TemporaryDirectory(prefix="model-cache-bench-") as tmp, S3Server() as s3:
        model = write_model(Path(tmp) / "model", total, args.files)
        s3.upload_directory(model, BUCKET, PREFIX)
        shutil.rmtree(model)  # the store holds it now; the disk is for the caches
        cases: dict[str, list[float]] = {
            "download": [],
            "cached, sha256 checked": [],
            "cached, sizes checked": [],
        }
        for r in range(args.rounds):
            cache = Path(tmp) / f"cache-{r}"
            took, phase = fetch(s3, cache, "sha256")
            assert phase == "done", phase
            cases["download"].append(took)
            for name, verify in (("cached, sha256 checked", "sha256"), ("cached, sizes checked", "size")):
                took, phase = fetch(s3, cache, verify)
                assert phase == "cached", phase
                cases[name].append(took)
            shutil.rmtree(cache)
    medians = {name: statistics.median(times) for name, times in cases.items()}
    base = medians["download"]
    print(f"\nmodel fetch, {total / 1e9:.2f} GB in {args.files} files, {args.rounds} rounds (median s):")
    print(f"{'case':26} {'seconds':>8} {'GB/s':>7} {'÷ download':>11}")
    for name, s in medians.items():
        print(f"{name:26} {s:8.2f} {total / 1e9 / s:7.2f} {s / base:11.3f}")
    result: dict[str, Any] = {
        "bytes": total,
        "files": args.files,
        "rounds": args.rounds,
        "seconds": cases,
        "median_s": medians,
        "ratio_to_download": {name: s / base for name, s in medians.items()},
        "machine": f"{platform.node()} {os.cpu_count()} cores",
        "commit": os.environ.get("RP_COMMIT", ""),
        "date": time.strftime("%Y-%m-%d"),
    }
    out = args.out or (Path(os.environ["OUT"]) / "model_cache.json" if os.environ.get("OUT") else None)
    if out is not None:
        out.write_text(json.dumps(result, indent=2))
        print(f"wrote {out}")


if __name__ == "__main__":
    main()
