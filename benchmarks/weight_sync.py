"""Weight-sync benchmark (GPU, two or more GPUs): a full push of a ~7B-parameter bf16 reward model
into a running server, end to end (call → the server serves the new version), against a raw NCCL
broadcast of the same bytes between the same GPUs in the same run; plus head-only push latency.

    python benchmarks/weight_sync.py                 # ~7B (Llama-2-7B shape), 3 timed pushes
    python benchmarks/weight_sync.py --size small    # ~0.4B, for a quick check

Server: the transformers engine on GPU 0 with --load-format dummy (random weights built on the
GPU, bf16 backbone, fp32 head). Trainer: this process, on GPU 1. Prints a table; writes JSON to
$OUT/weight_sync.json when OUT is set.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from rewardplane.sdk.comm import Communicator, create_store  # noqa: E402
from rewardplane.sdk.direct_sync import DirectWeightSync  # noqa: E402
from rewardplane.sdk.naming import select_head  # noqa: E402
from rewardplane.sdk.protocol import RewardModelTrainingMode as Mode  # noqa: E402
from rewardplane.tinymodel import train_tokenizer  # noqa: E402
from tests.fixtures.servers import free_port, start_server  # noqa: E402

SIZES = {
    # Llama-2-7B's shape: 6.6B parameters in the backbone
    "7b": dict(hidden_size=4096, intermediate_size=11008, num_hidden_layers=32, num_attention_heads=32,
               num_key_value_heads=32, vocab_size=32000),
    "small": dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
                  num_key_value_heads=2, vocab_size=32000),
}
TOKEN = "bench"

RAW_PEER = r"""
import sys, torch
from rewardplane.sdk.comm import Communicator, create_store
port, nbytes, chunk, reps = map(int, sys.argv[1:5])
dev = torch.device("cuda", 0)
store = create_store("127.0.0.1", port, is_master=False, world_size=2, timeout_s=120)
comm = Communicator(store, rank=0, world_size=2, device=dev, timeout_s=120, group_id="raw")
buf = torch.empty(chunk, dtype=torch.uint8, device=dev)
for _ in range(reps + 1):
    comm.max_flag(0)
    for off in range(0, nbytes, chunk):
        comm.broadcast(buf[: min(chunk, nbytes - off)], 1)
    comm.synchronize()
comm.max_flag(0)
"""


def raw_broadcast_s(nbytes: int, chunk: int, reps: int, trainer: torch.device) -> list[float]:
    """Time broadcasting ``nbytes`` GPU1 → GPU0 in ``chunk``-sized pieces (no packing, no HTTP)."""
    port = free_port()
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="0")
    peer = subprocess.Popen([sys.executable, "-c", RAW_PEER, str(port), str(nbytes), str(chunk), str(reps)], env=env)
    try:
        store = create_store("127.0.0.1", port, is_master=True, world_size=2, timeout_s=120)
        comm = Communicator(store, rank=1, world_size=2, device=trainer, timeout_s=120, group_id="raw")
        buf = torch.randint(0, 255, (chunk,), dtype=torch.uint8, device=trainer)
        times = []
        for rep in range(reps + 1):
            comm.max_flag(0)  # both sides ready
            start = time.perf_counter()
            for off in range(0, nbytes, chunk):
                comm.broadcast(buf[: min(chunk, nbytes - off)], 1)
            comm.synchronize()
            if rep:  # the first round warms up
                times.append(time.perf_counter() - start)
        comm.max_flag(0)
        comm.close()
        return times
    finally:
        peer.wait(timeout=120)


def make_checkpoint(size: str, root: Path) -> Path:
    """A config-only checkpoint (plus tokenizer): the server builds random weights from it."""
    from transformers import LlamaConfig

    out = root / f"llama-{size}-seqcls"
    out.mkdir(parents=True, exist_ok=True)
    tok = train_tokenizer()
    tok.save_pretrained(out)
    cfg = LlamaConfig(**SIZES[size], num_labels=1, pad_token_id=tok.pad_token_id, max_position_embeddings=4096,
                      architectures=["LlamaForSequenceClassification"], tie_word_embeddings=False)
    cfg.save_pretrained(out)
    return out


def build_trainer_model(ckpt: Path, device: torch.device) -> torch.nn.Module:
    from transformers import AutoConfig, AutoModelForSequenceClassification

    with device:
        model = AutoModelForSequenceClassification.from_config(AutoConfig.from_pretrained(ckpt), dtype=torch.bfloat16)
    return model.eval().requires_grad_(False)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--size", choices=sorted(SIZES), default="7b")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--bucket-mib", type=int, default=1024)
    ap.add_argument("--head-reps", type=int, default=20)
    args = ap.parse_args()
    if torch.cuda.device_count() < 2:
        print("needs two GPUs: server on GPU 0, trainer on GPU 1")
        return 2
    trainer = torch.device("cuda", 1)
    torch.cuda.set_device(trainer)
    work = Path(tempfile.mkdtemp(prefix="ws-bench-"))
    ckpt = make_checkpoint(args.size, work)
    bucket_bytes = args.bucket_mib << 20

    server = start_server(ckpt, work, token=TOKEN, device="cuda", dtype="bfloat16", load_format="dummy",
                          startup_timeout_s=600, env_extra={"CUDA_VISIBLE_DEVICES": "0"})
    results: dict[str, object] = {"size": args.size, "gpu": torch.cuda.get_device_name(trainer),
                                  "bucket_bytes": bucket_bytes}
    try:
        model = build_trainer_model(ckpt, trainer)
        params = model.state_dict()
        nbytes = sum(t.numel() * t.element_size() for t in params.values())
        nparams = sum(t.numel() for t in params.values())
        results.update(params=nparams, bytes=nbytes)

        sync = DirectWeightSync([server.url], group_port=free_port(), token=TOKEN, trainer_host="127.0.0.1",
                                device=trainer, bucket_bytes=bucket_bytes, connect_timeout_s=300, timeout_s=600)
        t0 = time.perf_counter()
        sync.sync(params, version=1)  # forms the group, warms allocators
        results["first_push_s"] = time.perf_counter() - t0
        full = []
        stats = []
        for i in range(args.reps):
            torch.cuda.synchronize(trainer)
            t0 = time.perf_counter()
            sync.sync(params, version=2 + i)
            full.append(time.perf_counter() - t0)
            stats.append(dict(sync.open().last_stats))
        head = select_head(params)
        head_times = []
        for i in range(args.head_reps):
            t0 = time.perf_counter()
            sync.sync(head, version=100 + i, training_mode=Mode.HEAD_ONLY)
            head_times.append(time.perf_counter() - t0)
        served = httpx.get(f"{server.url}/runtime_version").json()
        assert served["version"] == 100 + args.head_reps - 1, served
        # the pushed weights are the ones that score: compare with the trainer's own model
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(ckpt)
        text = "The reward model reads a prompt and a completion and returns a score."
        got = httpx.post(f"{server.url}/score", json={"input": [text], "normalize": False}, timeout=60).json()
        with torch.inference_mode():
            enc = tok(text, return_tensors="pt").to(trainer)
            h = model.model(**enc).last_hidden_state[0, -1]
            ref = float(model.score.float()(h.float()))
        results["score_check"] = {"served": got["data"][0]["score"], "trainer": ref}
        sync.close()
    finally:
        server.stop()
        loaded = [line for line in server.log().splitlines() if "loaded" in line]
        print("\n".join([line for line in loaded if "(full" in line][-3:] + loaded[-2:]))
    del model, params
    torch.cuda.empty_cache()

    raw_bucketed = raw_broadcast_s(nbytes, bucket_bytes, args.reps, trainer)
    raw_single = raw_broadcast_s(nbytes, nbytes, args.reps, trainer) if nbytes < (40 << 30) else []

    gb = nbytes / 1e9
    med_full = statistics.median(full)
    med_raw = statistics.median(raw_bucketed)
    results.update(
        full_push_s=full, full_push_median_s=med_full, full_push_gbps=gb / med_full,
        raw_bucketed_s=raw_bucketed, raw_bucketed_gbps=gb / med_raw,
        raw_single_s=raw_single, raw_single_gbps=(gb / statistics.median(raw_single)) if raw_single else None,
        ratio_vs_raw_bucketed=med_raw / med_full,
        ratio_vs_raw_single=(statistics.median(raw_single) / med_full) if raw_single else None,
        head_only_ms_median=1000 * statistics.median(head_times), head_only_ms_p90=1000 * sorted(head_times)[
            int(0.9 * (len(head_times) - 1))],
        push_breakdown=stats,
    )
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], "weight_sync.json").write_text(json.dumps(results, indent=2))
    print(json.dumps({k: v for k, v in results.items() if k != "push_breakdown"}, indent=1))
    print(f"\n== weight sync, {args.size} ({nparams / 1e9:.2f}B params, {gb:.2f} GB), {results['gpu']} ==")
    print(f"raw NCCL broadcast, {args.bucket_mib} MiB pieces : {gb / med_raw:7.1f} GB/s  ({1000 * med_raw:.1f} ms)")
    if raw_single:
        print(f"raw NCCL broadcast, one tensor     : {results['raw_single_gbps']:7.1f} GB/s")
    print(f"full push, call -> served           : {gb / med_full:7.1f} GB/s  ({1000 * med_full:.1f} ms)")
    print(f"ratio full push / raw (same pieces) : {results['ratio_vs_raw_bucketed']:.3f}   (goal >= 0.9)")
    if raw_single:
        print(f"ratio full push / raw (one tensor)  : {results['ratio_vs_raw_single']:.3f}")
    print(f"head-only push, call -> served      : {results['head_only_ms_median']:.2f} ms median (goal <= 20 ms)")
    print("breakdown of the last full push    : " + ", ".join(f"{k}={1000 * v:.1f}ms" for k, v in stats[-1].items()
                                                           if k.endswith("_s")))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
