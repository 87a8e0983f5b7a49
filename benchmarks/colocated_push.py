"""Colocated-push benchmark (one GPU): the trainer (this process) and a vLLM reward server on the
same GPU, pushes over the same-host transport (CUDA IPC), side by side in one run with:

- (a) a full push, call → served, against one device-to-device copy of the same bytes in this
  process (the physical limit), measured here in the same run, and beside the same tensors copied
  one by one from another process through CUDA IPC (``ipc_copy.py``: a per-tensor receive's floor);
- (b) vLLM 0.24's own IPC weight transfer (``weight_transfer_config`` backend ipc, per-tensor and
  packed), pushing the same model from this process into a ``vllm.LLM`` on the same GPU,
  ``start_weight_update`` → ``finish_weight_update``;
- (c) head-only push latency;
- (d) the colocated cycle (sleep level 2 → train step → wake without reload → full push → score →
  sleep), each step's time and the GPU memory in use after it (nvidia-smi);
- ``/param_checksums`` bit for bit after the full, LoRA-merged and head-only pushes.

    python benchmarks/colocated_push.py                       # 7B push, cycle at 1.4B and 7B
    python benchmarks/colocated_push.py --quick               # 0.4B only, few reps: a smoke run
    python benchmarks/colocated_push.py --sizes 7b --reps 10 --cycle-sizes 1.4b,7b

Servers load random weights (``--load-format dummy``) from a config-only checkpoint
(``weight_sync.make_checkpoint``). Prints each figure as it is measured, and a summary; writes
JSON to ``--out`` (default ``$OUT/colocated_push.json`` when OUT is set). Every part runs on its
own: one that fails is recorded with its error and the rest still run.
"""

from __future__ import annotations

import argparse
import base64
import itertools
import json
import os
import pickle
import secrets
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Iterator
from multiprocessing.connection import Listener
from pathlib import Path
from typing import Any

import httpx
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.ipc_copy import cross_process_copy  # noqa: E402
from benchmarks.weight_sync import SIZES, build_trainer_model, make_checkpoint, timed_pushes  # noqa: E402
from rewardplane.protocol import RewardModelTrainingMode as Mode  # noqa: E402
from rewardplane.protocol.naming import select_head  # noqa: E402
from rewardplane.sdk.push.pusher import WeightPusher  # noqa: E402
from rewardplane.testing.gpus import gpu_memory_used_mib, visible_gpus  # noqa: E402
from rewardplane.testing.pushers import loopback_pusher  # noqa: E402
from rewardplane.testing.servers import ServerHandle, wait_healthy  # noqa: E402

TOKEN = "bench"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
GOAL_COPY_RATIO = 1.25
GOAL_VS_VLLM = 20.0
GOAL_HEAD_MS = 0.5
TEXT = "The reward model reads a prompt and a completion and returns a score."

# vLLM's own IPC engine: a vllm.LLM in a child process on the same GPU, driven over a pipe.
VLLM_PEER = r"""
import os, sys
os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")  # its IPC handles travel pickled
from multiprocessing.connection import Client
ckpt, port, key, mem = sys.argv[1], int(sys.argv[2]), bytes.fromhex(sys.argv[3]), float(sys.argv[4])
conn = Client(("127.0.0.1", port), authkey=key)
try:
    from vllm import LLM
    llm = LLM(model=ckpt, runner="pooling", load_format="dummy", dtype="bfloat16", gpu_memory_utilization=mem,
              enforce_eager=True, max_model_len=1024, weight_transfer_config={"backend": "ipc"})
except BaseException as exc:
    conn.send(("error", f"{type(exc).__name__}: {exc}"))
    raise
conn.send(("ready", None))
while True:
    op, arg = conn.recv()
    try:
        if op == "start":
            llm.start_weight_update(is_checkpoint_format=True)
        elif op == "update":
            llm.update_weights({"update_info": arg})
        elif op == "finish":
            llm.finish_weight_update()
        elif op == "stop":
            conn.send(("ok", None))
            break
        conn.send(("ok", None))
    except BaseException as exc:
        conn.send(("error", f"{type(exc).__name__}: {exc}"))
"""


# vLLM's IPC engine imports ray at the top for its ray send mode, which the callable mode used here
# never calls; where ray is not installed (its wheel is too large to carry to the device) this
# stands in for the import: ray reported as not running, anything else absent.
RAY_PLACEHOLDER = """
def is_initialized():
    return False


def __getattr__(name):
    raise AttributeError(f"ray is a placeholder here (not installed): ray.{name}")
"""


def log(msg: str) -> None:
    print(msg, flush=True)


def part(results: dict[str, Any], name: str, fn: Callable[[], Any]) -> Any:
    """Run one part of the benchmark; its failure is recorded under ``name`` and the run goes on."""
    t0 = time.perf_counter()
    try:
        out = fn()
        results[name] = out
        log(f"== {name}: done in {time.perf_counter() - t0:.1f}s")
        return out
    except Exception as exc:
        results[name] = {"error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()[-3000:]}
        log(f"== {name}: FAILED after {time.perf_counter() - t0:.1f}s: {type(exc).__name__}: {exc}")
        traceback.print_exc()
        return None


def device_copy(params: dict[str, torch.Tensor], reps: int) -> dict[str, float]:
    """One device-to-device copy of the pushed bytes in this process: a flat buffer into another
    (the limit), and tensor by tensor into a flat buffer (what a per-tensor receive does)."""
    dev = next(iter(params.values())).device
    nbytes = sum(t.numel() * t.element_size() for t in params.values())
    src = torch.empty(nbytes, dtype=torch.uint8, device=dev)
    dst = torch.empty_like(src)
    flat, per_tensor = [], []
    views = []
    at = 0
    for t in params.values():
        n = t.numel() * t.element_size()
        views.append((t.reshape(-1).view(torch.uint8), dst[at : at + n]))
        at += n
    for rep in range(reps + 1):
        torch.cuda.synchronize(dev)
        t0 = time.perf_counter()
        dst.copy_(src)
        torch.cuda.synchronize(dev)
        t1 = time.perf_counter()
        for s, d in views:
            d.copy_(s)
        torch.cuda.synchronize(dev)
        t2 = time.perf_counter()
        if rep:
            flat.append(t1 - t0)
            per_tensor.append(t2 - t1)
    del src, dst, views
    torch.cuda.empty_cache()
    out = {
        "bytes": nbytes,
        "flat_copy_ms_median": 1000 * statistics.median(flat),
        "per_tensor_copy_ms_median": 1000 * statistics.median(per_tensor),
        "flat_copy_tb_per_s": nbytes / statistics.median(flat) / 1e12,
    }
    log(
        f"   device copy of {nbytes / 1e9:.2f} GB: flat {out['flat_copy_ms_median']:.2f} ms, per tensor "
        f"{out['per_tensor_copy_ms_median']:.2f} ms"
    )
    return out


def start_server(ckpt: Path, work: Path, args: argparse.Namespace) -> ServerHandle:
    from benchmarks.weight_sync import launch_on_dummy_weights

    handle = launch_on_dummy_weights(
        ckpt,
        work,
        0,
        args.server_args,
        token=TOKEN,
        engine="vllm",
        gpu_memory_utilization=args.gpu_memory_utilization,
        max_model_len=1024,
        enable_sleep_mode=True,
    )
    wait_healthy(handle, 900, poll_s=1.0)
    return handle


def pusher(url: str, args: argparse.Namespace) -> WeightPusher:
    return loopback_pusher(
        [url],
        TOKEN,
        device=torch.device("cuda", 0),
        backend="auto",
        bucket_bytes=args.bucket_mib << 20,
        connect_timeout_s=120,
        timeout_s=600,
    )


def checksums_match(url: str, state: dict[str, torch.Tensor], what: str) -> dict[str, Any]:
    """``/param_checksums`` of the server against the trainer's tensors, as vLLM fuses them and in
    the dtypes it holds them: the trainer's bf16 head is compared widened to vLLM's fp32 head (the
    loader's cast, exact; ``as_served``), never as its bf16 bytes, which cannot match."""
    from tests.gpu.vllm_support import as_served, vllm_llama_checksums

    r = httpx.get(f"{url}/param_checksums", headers=AUTH, timeout=900)
    r.raise_for_status()
    body = r.json()
    version = body["version"]
    got = {w["rank"]: {n: tuple(v) for n, v in w["checksums"].items()} for w in body["workers"]}
    served, widened = as_served(state, got[0])
    want = vllm_llama_checksums(served)
    differ = [
        n for n, v in want[0].items() if not n.startswith("lm_head.") and tuple(got[0].get(n, ())) != tuple(v)
    ]
    ok = not differ
    log(
        f"   /param_checksums after {what} (v{version}): "
        f"{'bit for bit' if ok else f'{len(differ)} differ: {differ[:3]}'}; widened to the served dtype: {widened}"
    )
    return {
        "version": version,
        "bit_for_bit": ok,
        "differ": differ[:10],
        "compared": len(want[0]),
        "widened": widened,
    }


def served_score(url: str) -> float:
    body = httpx.post(f"{url}/score", json={"input": [TEXT], "normalize": False}, timeout=120).json()
    return float(body["data"][0]["score"])


def trainer_scores(model: torch.nn.Module, ckpt: Path) -> dict[str, float]:
    """The trainer's score of ``TEXT`` as it runs (bf16 backbone, the head applied in fp32) and an
    fp32 reference (a copy of the model upcast), to set the served score beside: on a random-weight
    model the engines' bf16 kernels differ visibly, so the served score's gap to the trainer is only
    meaningful next to the trainer's own gap to fp32. The trainer's model is not changed (an
    in-place ``.float()`` of its head would give it a new storage and a new layout)."""
    import copy

    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(ckpt)
    dev = next(model.parameters()).device
    enc = tok(TEXT, return_tensors="pt").to(dev)
    ref = copy.deepcopy(model).to(torch.float32)  # outside inference mode, as a module copy must be
    with torch.inference_mode():
        h = model.model(**enc).last_hidden_state[0, -1]  # type: ignore[operator]
        weight: torch.Tensor = model.score.weight  # type: ignore[union-attr,assignment]
        bf16 = float(torch.nn.functional.linear(h.float(), weight.float()).squeeze())
        fp32 = float(ref(**enc).logits[0, 0])
    del ref
    torch.cuda.empty_cache()
    return {"trainer": bf16, "fp32_reference": fp32}


def perturb(model: torch.nn.Module, scale: float = 0.02) -> None:
    """A training step's worth of change, in place (the trainer's storages stay)."""
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(1.0 + scale * torch.randn_like(p))


def rewardplane_pushes(
    url: str, model: torch.nn.Module, ckpt: Path, args: argparse.Namespace, versions: Iterator[int]
) -> dict[str, Any]:
    sync = pusher(url, args)
    try:
        params = model.state_dict()
        out: dict[str, Any] = timed_pushes(
            sync, params, versions, args.reps, args.head_reps, torch.device("cuda", 0), [url], args.warmup
        )
        out["transport"] = str(getattr(sync.open().comm, "backend", "?"))
        full = out["full_push_median_s"]
        log(
            f"   full push ({out['transport']}): {1000 * full:.2f} ms median; first (opens the handles) "
            f"{1000 * out['first_push_s']:.1f} ms; head-only {out['head_only_ms_median']:.3f} ms median"
        )
        # where a push's time goes: trainer and server stamps on one clock, ms after the call
        log(f"   full push timeline (ms): {json.dumps(out['timeline_ms'])}")
        log(f"   head-only timeline (ms): {json.dumps(out['head_only_timeline_ms'])}")
        last = out["breakdown"][-1] if out["breakdown"] else {}
        log(f"   trainer's breakdown of the last full push: {json.dumps(last)}")
        out["checksums_full"] = checksums_match(url, params, "full pushes")
        # every parameter changed in place, head included, then a full push: the served version
        # must hold the new bytes (the unchanged timed pushes above cannot tell stale from fresh)
        perturb(model)
        sync.push(model.state_dict(), version=next(versions))
        out["checksums_changed_full"] = checksums_match(
            url, model.state_dict(), "a full push of changed weights"
        )
        # of that full push's bytes, how many the worker received straight into vLLM's parameters
        # (the rest went through its loader, bucket by bucket)
        update = httpx.get(f"{url}/get_num_background_tasks", headers=AUTH, timeout=10).json()
        last = update.get("last_update") or {}
        out["full_push_in_place"] = {"bytes": last.get("bytes"), "in_place_bytes": last.get("in_place_bytes")}
        log(f"   a full push received in place: {last.get('in_place_bytes')} of {last.get('bytes')} bytes")
        out["score_after_push"] = {**trainer_scores(model, ckpt), "served": served_score(url)}
        log(f"   score after it: {json.dumps(out['score_after_push'])}")
        head = select_head(model.state_dict())
        with torch.no_grad():
            for t in head.values():
                t.add_(0.01 * torch.randn_like(t))
        sync.push(head, version=next(versions), training_mode=Mode.HEAD_ONLY)
        out["checksums_head_only"] = checksums_match(url, model.state_dict(), "a head-only push")
        return out
    finally:
        sync.close()


def lora_merged_push(
    url: str, model: torch.nn.Module, args: argparse.Namespace, versions: Iterator[int]
) -> dict[str, Any]:
    """Two LoRA-merged pushes (their merged tensors are new each time: the staging ring)."""
    from peft import LoraConfig, get_peft_model

    from rewardplane.sdk.lora import merge_sync_reinit

    sync = pusher(url, args)
    config = LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj", "down_proj"])
    times = []
    try:
        for _ in range(2):
            peft_model = get_peft_model(model, config)
            with torch.no_grad():
                for name, p in peft_model.named_parameters():
                    if "lora_B" in name:
                        p.normal_(0.0, 0.01)
            version = next(versions)

            def push(sd: Any, version: int = version) -> None:
                t0 = time.perf_counter()
                sync.push(sd, version=version, training_mode=Mode.LORA)
                times.append(time.perf_counter() - t0)

            model = merge_sync_reinit(peft_model, push).merge_and_unload()
        log(f"   LoRA-merged pushes: {[round(1000 * t, 1) for t in times]} ms")
        return {
            "push_ms": [1000 * t for t in times],
            "checksums": checksums_match(url, model.state_dict(), "LoRA-merged"),
        }
    finally:
        sync.close()


def control(url: str, path: str, body: dict[str, Any] | None = None) -> dict[str, Any]:
    r = httpx.post(url + path, json=body, headers=AUTH, timeout=900)
    if r.status_code != 200:
        raise RuntimeError(f"{path} answered {r.status_code}: {r.text[:1000]}")
    return r.json()


def colocated_cycle(
    url: str, model: torch.nn.Module, args: argparse.Namespace, versions: Iterator[int]
) -> dict[str, Any]:
    """sleep(2) → train → wake (no reload) → full push → score → sleep, ``args.cycles`` times."""
    sync = pusher(url, args)
    steps: list[dict[str, Any]] = []

    def step(cycle: int, name: str, t0: float) -> None:
        torch.cuda.synchronize(0)
        steps.append(
            {
                "cycle": cycle,
                "step": name,
                "ms": 1000 * (time.perf_counter() - t0),
                "used_mib": gpu_memory_used_mib(0),
            }
        )
        log(
            f"   cycle {cycle} {name:6s} {steps[-1]['ms']:9.1f} ms   GPU memory in use {steps[-1]['used_mib']} MiB"
        )

    try:
        sync.push(model.state_dict(), version=next(versions))  # the group formed, handles opened
        step(-1, "awake", time.perf_counter())
        for cycle in range(args.cycles):
            t0 = time.perf_counter()
            control(url, "/sleep", {"level": 2})
            step(cycle, "sleep", t0)
            t0 = time.perf_counter()
            perturb(model)
            step(cycle, "train", t0)
            t0 = time.perf_counter()
            woke = control(url, "/wake", {"reload": False})
            step(cycle, "wake", t0)
            t0 = time.perf_counter()
            sync.push(model.state_dict(), version=next(versions))
            step(cycle, "push", t0)
            t0 = time.perf_counter()
            served_score(url)
            step(cycle, "score", t0)
            if woke.get("weights") != "broken":
                log(f"   note: the wake answered {woke}")
        control(url, "/sleep", {"level": 2})
        step(args.cycles, "sleep", time.perf_counter())
        medians = {
            name: statistics.median(s["ms"] for s in steps if s["step"] == name and s["cycle"] >= 0)
            for name in ("sleep", "train", "wake", "push", "score")
        }
        return {"steps": steps, "median_ms": medians}
    finally:
        sync.close()


def vllm_native(ckpt: Path, params: dict[str, torch.Tensor], args: argparse.Namespace) -> dict[str, Any]:
    """vLLM 0.24's own IPC engine, per tensor and packed, into a vllm.LLM on this GPU. Its module
    imports ray at the top for its ray send mode; the callable send mode used here does not touch
    it, so where ray is not installed an empty placeholder module stands in (recorded)."""
    import importlib.util

    placeholder = importlib.util.find_spec("ray") is None
    env = dict(os.environ, CUDA_VISIBLE_DEVICES=visible_gpus(0), VLLM_ALLOW_INSECURE_SERIALIZATION="1")
    if placeholder:  # here and in vLLM's processes (they may be spawned): a folder on the path
        stub = Path(tempfile.mkdtemp(prefix="ray-placeholder-"))
        (stub / "ray").mkdir()
        (stub / "ray" / "__init__.py").write_text(RAY_PLACEHOLDER)
        sys.path.insert(0, str(stub))
        env["PYTHONPATH"] = os.pathsep.join([str(stub), env.get("PYTHONPATH", "")])
    from vllm.distributed.weight_transfer.ipc_engine import IPCWeightTransferEngine

    key = secrets.token_bytes(16)
    listener = Listener(("127.0.0.1", 0), authkey=key)
    port = listener.address[1]
    child = subprocess.Popen(
        [sys.executable, "-c", VLLM_PEER, str(ckpt), str(port), key.hex(), str(args.gpu_memory_utilization)],
        env=env,
    )
    try:
        conn = listener.accept()
        if not conn.poll(900):
            raise TimeoutError("vllm.LLM did not start within 900 s")
        status, detail = conn.recv()
        if status != "ready":
            raise RuntimeError(f"vllm.LLM failed to start: {detail}")

        def call(op: str, arg: Any = None) -> None:
            conn.send((op, arg))
            if not conn.poll(600):
                raise TimeoutError(f"vllm.LLM did not answer {op} within 600 s")
            status, detail = conn.recv()
            if status != "ok":
                raise RuntimeError(f"vllm.LLM {op}: {detail}")

        def send(info: Any) -> None:
            fields = {
                "names": info.names,
                "dtype_names": info.dtype_names,
                "shapes": info.shapes,
                "packed": info.packed,
                "ipc_handles_pickled": base64.b64encode(pickle.dumps(info.ipc_handles)).decode(),
            }
            if info.tensor_sizes is not None:
                fields["tensor_sizes"] = info.tensor_sizes
            call("update", fields)

        out: dict[str, Any] = {"ray_placeholder": placeholder}
        for packed in (False, True):
            times = []
            for rep in range(args.reps + 1):
                torch.cuda.synchronize(0)
                t0 = time.perf_counter()
                call("start")
                IPCWeightTransferEngine.trainer_send_weights(
                    iter(params.items()), {"send_mode": send, "packed": packed}
                )
                call("finish")
                if rep:
                    times.append(time.perf_counter() - t0)
            name = "packed" if packed else "per_tensor"
            out[name] = {
                "push_ms": [1000 * t for t in times],
                "push_ms_median": 1000 * statistics.median(times),
            }
            log(f"   vLLM's own IPC engine, {name}: {out[name]['push_ms_median']:.1f} ms median")
        call("stop")
        return out
    finally:
        listener.close()
        try:
            child.wait(timeout=60)
        except subprocess.TimeoutExpired:
            child.kill()
            child.wait(timeout=30)


def same_gpu_log_lines(text: str, after: int = 25) -> list[str]:
    """What the server logged about the same-GPU receive: its CUDA graphs (a capture that failed,
    with its traceback) and what of a repeat push went through vLLM's loader, and why."""
    lines = text.splitlines()
    out: list[str] = []
    for i, line in enumerate(lines):
        if any(k in line for k in ("CUDA graph", "went through the loader", "copy plan:")):
            out.extend(lines[i : i + after])
    return out[:200]


def run_size(size: str, args: argparse.Namespace, work: Path, cycle: bool) -> dict[str, Any]:
    log(f"\n######## {size} ########")
    res: dict[str, Any] = {"size": size}
    ckpt = make_checkpoint(size, work)
    model = build_trainer_model(ckpt, torch.device("cuda", 0))
    params = model.state_dict()
    res["tensors"] = len(params)
    res["bytes"] = sum(t.numel() * t.element_size() for t in params.values())
    res["memory_trainer_only_mib"] = gpu_memory_used_mib(0)
    versions = itertools.count(1)
    push_part = size in args.sizes
    if push_part:
        part(res, "device_copy", lambda: device_copy(params, max(args.reps, 5)))
        # the same bytes copied tensor by tensor from another process: a per-tensor receive's floor
        part(res, "cross_process_copy", lambda: cross_process_copy(params, max(args.reps, 5)))
    server: ServerHandle | None = None
    try:
        t0 = time.perf_counter()
        server = start_server(ckpt, work, args)
        res["server_start_s"] = time.perf_counter() - t0
        res["memory_trainer_and_server_mib"] = gpu_memory_used_mib(0)
        url = server.url
        if push_part:
            part(res, "rewardplane", lambda: rewardplane_pushes(url, model, ckpt, args, versions))
            if not args.no_lora:
                part(res, "lora_merged", lambda: lora_merged_push(url, model, args, versions))
        if cycle:
            part(res, "cycle", lambda: colocated_cycle(url, model, args, versions))
    finally:
        if server is not None:
            res["server_log_same_gpu"] = same_gpu_log_lines(server.log())
            for line in res["server_log_same_gpu"]:
                log(f"   server: {line}")
            server.stop()
    if push_part and not args.no_vllm_native:
        part(res, "vllm_native", lambda: vllm_native(ckpt, model.state_dict(), args))
    return res  # the trainer's model goes with this frame


def ratios(res: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    copy = res.get("device_copy", {}).get("flat_copy_ms_median")
    rp = res.get("rewardplane", {})
    full = rp.get("full_push_median_s")
    if copy and full:
        out["a_full_push_over_device_copy"] = 1000 * full / copy
        out["a_goal"] = GOAL_COPY_RATIO
    native = res.get("vllm_native", {})
    best = min(
        (v["push_ms_median"] for v in native.values() if isinstance(v, dict) and "push_ms_median" in v),
        default=None,
    )
    if best and full:
        out["b_vllm_ipc_best_over_rewardplane"] = best / (1000 * full)
        out["b_goal"] = GOAL_VS_VLLM
    if "head_only_ms_median" in rp:
        out["c_head_only_ms"] = rp["head_only_ms_median"]
        out["c_goal_ms"] = GOAL_HEAD_MS
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default="7b", help="comma-separated sizes for (a)-(c): " + ",".join(SIZES))
    ap.add_argument("--cycle-sizes", default="1.4b,7b", help="sizes for the colocated cycle (d); empty: none")
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument(
        "--warmup",
        type=int,
        default=3,
        help="untimed full pushes after the first: the copy plan learns on the first, the worker "
        "keeps a bucket's targets from the second and replays its copies as a CUDA graph from the third",
    )
    ap.add_argument("--head-reps", type=int, default=20)
    ap.add_argument("--cycles", type=int, default=3)
    ap.add_argument("--bucket-mib", type=int, default=1024)
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.25, help="each vLLM's share of the GPU")
    ap.add_argument("--server-args", default="--enforce-eager", help="extra reward-server flags")
    ap.add_argument("--no-vllm-native", action="store_true", help="skip (b)")
    ap.add_argument("--no-lora", action="store_true", help="skip the LoRA-merged pushes")
    ap.add_argument("--quick", action="store_true", help="a smoke run: 0.4B only, 2 reps, 1 cycle")
    ap.add_argument("--out", default=None, help="JSON result (default $OUT/colocated_push.json)")
    args = ap.parse_args()
    if args.quick:
        args.sizes, args.cycle_sizes, args.reps, args.head_reps, args.cycles = "0.4b", "0.4b", 2, 5, 1
        args.warmup = 1
    args.sizes = [s.strip() for s in args.sizes.split(",") if s.strip()]
    cycle_sizes = [s.strip() for s in args.cycle_sizes.split(",") if s.strip()]
    unknown = sorted(set(args.sizes + cycle_sizes) - set(SIZES))
    if unknown:
        print(f"unknown size(s) {unknown}; choose from {sorted(SIZES)}")
        return 2
    if not torch.cuda.is_available():
        print("needs a CUDA GPU: the trainer and the reward server share GPU 0")
        return 2
    torch.cuda.set_device(0)
    out_path = args.out or (
        os.path.join(os.environ["OUT"], "colocated_push.json") if os.environ.get("OUT") else None
    )
    results: dict[str, Any] = {
        "gpu": torch.cuda.get_device_name(0),
        "torch": torch.__version__,
        "args": {k: v for k, v in vars(args).items()},
        "date_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        # $RP_COMMIT first: on the device machines the tree travels without the commit it came from
        "commit": os.environ.get("RP_COMMIT")
        or subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=ROOT
        ).stdout.strip(),
        "runs": [],
    }
    try:
        import vllm

        results["vllm"] = vllm.__version__
    except Exception as exc:
        results["vllm"] = f"not importable: {exc}"
    work = Path(tempfile.mkdtemp(prefix="colocated-"))
    for size in dict.fromkeys(args.sizes + cycle_sizes):
        res = run_size(size, args, work, cycle=size in cycle_sizes)
        res["ratios"] = ratios(res)
        results["runs"].append(res)
        if out_path:
            Path(out_path).write_text(json.dumps(results, indent=2, default=str))
    log("\n######## summary ########")
    for res in results["runs"]:
        log(f"{res['size']}: {json.dumps(res['ratios'])}")
        if "cycle" in res and isinstance(res["cycle"], dict) and "median_ms" in res["cycle"]:
            log(
                f"   cycle medians (ms): {json.dumps({k: round(v, 1) for k, v in res['cycle']['median_ms'].items()})}"
            )
    if out_path:
        log(f"wrote {out_path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
