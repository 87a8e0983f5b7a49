"""Process reward model scoring on one GPU, in one run, for random-weight PRMs of the
Qwen2.5-Math-PRM shape (``Qwen2ForProcessRewardModel``: a Qwen2 backbone, a two-layer head, two
logits per token) at ~1.5B and ~7B parameters:

    PRM scoring over HTTP (the reward server's /score)  ÷  vLLM offline (``LLM.encode``, STEP)   goal >= 0.95
    incremental (steps 1..k cached, step k+1 scored)    ÷  rescoring steps 1..k+1 in full       (lower is better)
    step scores: server vs offline, server vs transformers (bf16, fp32 head), as log-odds gaps

on the same solutions: ``--solutions`` random-word solutions of U[``--min-steps``, ``--max-steps``]
steps of U[``--min-words``, ``--max-words``] words each, after a question of 40 words. The server
inserts the step tags itself (``<extra_0>`` after each step); the offline engine gets the very token
ids the server scores (the server's own ``rewardplane.server.http.steps.build_solution``).

Phases, each in a fresh process with the GPU to itself, one after the other: build (the model,
once per size: a warm machine keeps it; the token ids; transformers' scores of a subset, bf16 with
an fp32 head), vLLM offline (STEP pooling), the reward server with ``--prm-pooling step`` and with
``--prm-pooling token`` (every token's row, the server selects), and incremental scoring on the
token server (prefix caching on: vLLM turns it off for STEP pooling). Engine settings as the
server's (bf16, fp32 head, no chunked prefill, same memory fraction and max length).

    python benchmarks/scoring_prm.py --enforce-eager   # 1.5b and 7b; eager engines start faster
    python benchmarks/scoring_prm.py --sizes 7b        # one size per call
    python benchmarks/scoring_prm.py --quick           # a tiny PRM, 64 solutions, --enforce-eager

Prints a table and the goal met or missed; writes ``scoring_prm.json`` to ``$OUT`` (or ``--out``)
with the card, vLLM's version, ``$RP_COMMIT`` and the date.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import os
import random
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from scoring_gpu import error_summary, free_port, run_in_own_group, score_gaps, wait_gpu_free, wait_healthy

from rewardplane.testing.processes import stop_process

TAG = "<extra_0>"
GOAL_VS_OFFLINE = 0.95
# Qwen2.5-Math-1.5B's and Qwen2.5-Math-PRM-7B's shapes (vocabulary: Qwen2's 151936 rows)
SIZES: dict[str, dict[str, int]] = {
    "tiny": {"hidden": 256, "layers": 2, "heads": 4, "kv_heads": 2, "intermediate": 512, "vocab": 1024},
    "1.5b": {"hidden": 1536, "layers": 28, "heads": 12, "kv_heads": 2, "intermediate": 8960, "vocab": 151936},
    "7b": {"hidden": 3584, "layers": 28, "heads": 28, "kv_heads": 4, "intermediate": 18944, "vocab": 151936},
}
QUESTION_WORDS = 40
DEVICE = "cuda"  # where the build and the transformers reference run


# ---- solutions -------------------------------------------------------------------------------


def make_solutions(args: argparse.Namespace, seed: int) -> list[dict[str, Any]]:
    """Random-word solutions: ``{"prompt": question, "steps": [...]}``."""
    from rewardplane.tinymodel import corpus_lines

    words = sorted({w for line in corpus_lines() for w in line.split()})
    rng = random.Random(seed)

    def text(n: int) -> str:
        return " ".join(rng.choice(words) for _ in range(n))

    return [
        {
            "prompt": "Question: " + text(QUESTION_WORDS) + "\n",
            "steps": [
                text(rng.randint(args.min_words, args.max_words))
                for _ in range(rng.randint(args.min_steps, args.max_steps))
            ],
        }
        for _ in range(args.solutions)
    ]


def token_ids(model_dir: Path, solutions: list[dict[str, Any]]) -> list[dict[str, list[int]]]:
    """The ids and tag positions the server scores, from its own step-insertion code."""
    from transformers import AutoTokenizer

    from rewardplane.server.http.steps import build_solution, step_spans

    tok = AutoTokenizer.from_pretrained(model_dir)
    tag_id = tok.convert_tokens_to_ids(TAG)
    assert isinstance(tag_id, int)  # one token: the tokenizer was built with it
    out = []
    for i, s in enumerate(solutions):
        sol = build_solution(
            tok, s["prompt"], s["steps"], step_spans(s["steps"], "\n\n"), tag_id=tag_id, tag=TAG, index=i
        )
        out.append({"ids": sol.ids, "tags": sol.tags})
    return out


def log_odds(rows: list[list[float]]) -> list[float]:
    from rewardplane.protocol.steps import good_log_odds

    return [good_log_odds(r, 1) for r in rows]


# ---- phases (each in its own process) ---------------------------------------------------------


def phase_build(args: argparse.Namespace) -> dict[str, Any]:
    """The model (built once per size: a warm machine keeps it), the token ids of the solutions, and
    transformers' step scores of the first ``--hf-solutions`` (one process: the reference needs no
    start of its own)."""
    import torch

    from rewardplane.tinymodel import build_tiny_process_reward_model

    built = Path(args.model_dir) / "built.json"
    if not built.exists():
        s = SIZES[args.size]
        with torch.device(DEVICE):  # random init on the GPU: seconds instead of minutes at 7B
            build_tiny_process_reward_model(
                args.model_dir,
                hidden_size=s["hidden"],
                num_layers=s["layers"],
                num_heads=s["heads"],
                num_kv_heads=s["kv_heads"],
                intermediate_size=s["intermediate"],
                vocab_size=s["vocab"],
                max_position_embeddings=max(args.max_len, 4096),
                dtype="bfloat16",
                seed=0,
            )
        built.write_text(json.dumps({"params": _params(Path(args.model_dir))}))
    path = args.workdir / "solutions.json"
    data = json.loads(path.read_text())
    data["main"] = token_ids(args.model_dir, data["solutions"])
    data["warmup"] = token_ids(args.model_dir, data["warmup_solutions"])
    from transformers import AutoTokenizer

    data["tag_id"] = AutoTokenizer.from_pretrained(args.model_dir).convert_tokens_to_ids(TAG)
    path.write_text(json.dumps(data))
    return {
        **json.loads(built.read_text()),
        "card": torch.cuda.get_device_name(0) if DEVICE == "cuda" else DEVICE,
        "hf_scores": hf_scores(args, data["main"][: args.hf_solutions]),
    }


def _params(model_dir: Path) -> int:
    from safetensors import safe_open

    params = 0
    for f in model_dir.glob("*.safetensors"):
        with safe_open(str(f), framework="pt") as st:
            params += sum(_numel(st, k) for k in st.keys())  # noqa: SIM118 - safe_open is not a mapping
    return params


def _numel(st: Any, key: str) -> int:
    n = 1
    for d in st.get_slice(key).get_shape():
        n *= int(d)
    return n


def phase_offline(args: argparse.Namespace) -> dict[str, Any]:
    import vllm
    from vllm import LLM, PoolingParams
    from vllm.config import PoolerConfig
    from vllm.inputs import TokensPrompt

    from rewardplane.server.engines.vllm_engine import WORKER_EXTENSION

    data = json.loads((args.workdir / "solutions.json").read_text())
    tag_id = data["tag_id"]
    kw: dict[str, Any] = {
        "model": str(args.model_dir),
        "runner": "pooling",
        "dtype": "bfloat16",
        "max_model_len": args.max_len,
        "gpu_memory_utilization": args.gpu_memory_utilization,
        "hf_overrides": {"head_dtype": "float32"},
        "pooler_config": PoolerConfig(pooling_type="STEP", step_tag_id=tag_id),
        "enable_chunked_prefill": False,
        "disable_log_stats": True,
        "worker_extension_cls": WORKER_EXTENSION,
        "enforce_eager": args.enforce_eager,
    }
    llm = LLM(**kw)

    def run(items: list[dict[str, list[int]]]) -> list[list[float]]:
        outs = llm.encode(
            [TokensPrompt(prompt_token_ids=x["ids"]) for x in items],
            pooling_params=PoolingParams(use_activation=False),
            pooling_task="token_classify",
            use_tqdm=False,
        )
        return [log_odds(o.outputs.data.float().tolist()) for o in outs]

    run(data["warmup"])
    t0 = time.perf_counter()
    scores = run(data["main"])
    seconds = time.perf_counter() - t0
    return {"seconds": seconds, "scores": scores, "vllm_version": vllm.__version__}


def server_cmd(args: argparse.Namespace, port: int, pooling: str) -> list[str]:
    return [
        sys.executable,
        "-m",
        "rewardplane.server",
        "--model",
        str(args.model_dir),
        "--engine",
        "vllm",
        "--port",
        str(port),
        "--model-kind",
        "process",
        "--step-tag",
        TAG,
        "--prm-pooling",
        pooling,
        "--max-model-len",
        str(args.max_len),
        "--gpu-memory-utilization",
        str(args.gpu_memory_utilization),
        *(["--enforce-eager"] if args.enforce_eager else []),
    ]


async def _post_all(url: str, bodies: list[dict[str, Any]], concurrency: int) -> list[dict[str, Any]]:
    import httpx

    sem = asyncio.Semaphore(concurrency)
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(base_url=url, timeout=600, limits=limits) as client:

        async def one(body: dict[str, Any]) -> dict[str, Any]:
            async with sem:
                r = await client.post("/score", json=body)
                r.raise_for_status()
                return dict(r.json())

        return await asyncio.gather(*(one(b) for b in bodies))


def _bodies(solutions: list[dict[str, Any]], per_request: int, **extra: Any) -> list[dict[str, Any]]:
    return [
        {
            "steps": [s["steps"] for s in solutions[i : i + per_request]],
            "prompts": [s["prompt"] for s in solutions[i : i + per_request]],
            "normalize": False,
            **extra,
        }
        for i in range(0, len(solutions), per_request)
    ]


def _step_scores(answers: list[dict[str, Any]]) -> list[list[float]]:
    return [
        [s["score"] for s in d["steps"]] for a in answers for d in sorted(a["data"], key=lambda d: d["index"])
    ]


def phase_server(args: argparse.Namespace) -> dict[str, Any]:
    data = json.loads((args.workdir / "solutions.json").read_text())
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log = args.workdir / f"server-{args.pooling}.log"
    with open(log, "wb") as f:
        proc = subprocess.Popen(server_cmd(args, port, args.pooling), stdout=f, stderr=subprocess.STDOUT)
    try:
        wait_healthy(url, proc, log, 900)
        asyncio.run(_post_all(url, _bodies(data["warmup_solutions"], args.per_request), args.concurrency))
        t0 = time.perf_counter()
        answers = asyncio.run(_post_all(url, _bodies(data["solutions"], args.per_request), args.concurrency))
        seconds = time.perf_counter() - t0
        result: dict[str, Any] = {"seconds": seconds, "scores": _step_scores(answers)}
        if args.pooling == "token":
            result["incremental"] = incremental(url, data["incremental_solutions"], args)
        return result
    finally:
        stop_process(proc, grace_s=20)


def incremental(url: str, solutions: list[dict[str, Any]], args: argparse.Namespace) -> dict[str, Any]:
    """For k = 1..K-1: all solutions' step k+1 scored after steps 1..k (``first_step`` k, the prefix
    cached by the round before) vs the same k+1 steps rescored in full (never read from the cache)."""
    k_max = min(len(s["steps"]) for s in solutions)
    inc_s, full_s, gaps = [], [], []

    def upto(k: int) -> list[dict[str, Any]]:
        return [{"prompt": s["prompt"], "steps": s["steps"][:k]} for s in solutions]

    asyncio.run(_post_all(url, _bodies(upto(1), 1), args.concurrency))  # step 1: the first prefix
    for k in range(1, k_max):
        t0 = time.perf_counter()
        inc = asyncio.run(_post_all(url, _bodies(upto(k + 1), 1, first_step=k), args.concurrency))
        inc_s.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        full = asyncio.run(_post_all(url, _bodies(upto(k + 1), 1), args.concurrency))
        full_s.append(time.perf_counter() - t0)
        gaps += [abs(a[0] - b[-1]) for a, b in zip(_step_scores(inc), _step_scores(full), strict=True)]
    return {
        "steps": k_max,
        "incremental_s": inc_s,
        "full_s": full_s,
        "ratio": sum(inc_s) / sum(full_s),
        "score_gap_max": max(gaps),
    }


def hf_scores(args: argparse.Namespace, items: list[dict[str, list[int]]]) -> list[list[float]]:
    """transformers' step log-odds of ``items``, the model held as both engines hold it (bf16
    backbone, fp32 head), one solution at a time."""
    import torch

    from rewardplane.server.engines.prm_model import Qwen2ForProcessRewardModel

    # transformers wraps .to with functools.wraps, whose stub is not a method: self is not bound
    model = Qwen2ForProcessRewardModel.from_pretrained(args.model_dir, dtype=torch.bfloat16).to(DEVICE)  # type: ignore[arg-type]
    model.eval()
    model.score.to(torch.float32)
    scores = []
    with torch.inference_mode():
        for x in items:
            logits = model(input_ids=torch.tensor([x["ids"]], device=DEVICE)).logits[0].float().cpu()
            scores.append(log_odds(logits[x["tags"]].tolist()))
    del model
    if DEVICE == "cuda":
        torch.cuda.empty_cache()
    return scores


PHASES = {"build": phase_build, "offline": phase_offline, "server": phase_server}


# ---- the driver ------------------------------------------------------------------------------


def run_phase(name: str, args: argparse.Namespace, extra: list[str] | None = None) -> dict[str, Any]:
    tag = name + ("-" + extra[-1] if extra else "")
    cmd = [
        sys.executable,
        os.path.abspath(__file__),
        "--phase",
        name,
        "--size",
        args.size,
        "--model-dir",
        str(args.model_dir),
        "--workdir",
        str(args.workdir),
        "--max-len",
        str(args.max_len),
        "--gpu-memory-utilization",
        str(args.gpu_memory_utilization),
        "--concurrency",
        str(args.concurrency),
        "--per-request",
        str(args.per_request),
        "--hf-solutions",
        str(args.hf_solutions),
        *(["--enforce-eager"] if args.enforce_eager else []),
        *(extra or []),
    ]
    log = args.workdir / f"{tag}.log"
    result = args.workdir / f"{tag}.json"
    result.unlink(missing_ok=True)
    wait_gpu_free()
    rc = run_in_own_group(cmd, log, args.phase_timeout)
    if not result.exists():
        raise RuntimeError(
            f"phase {tag} failed (exit {rc}); log {log}:\n{log.read_text(errors='replace')[-4000:]}"
        )
    return dict(json.loads(result.read_text()))


def flat(rows: list[list[float]]) -> list[list[float]]:
    return [[x] for r in rows for x in r]


def bench_size(size: str, args: argparse.Namespace) -> dict[str, Any]:
    args.size = size
    args.workdir = Path(args.root) / size
    args.workdir.mkdir(parents=True, exist_ok=True)
    args.model_dir = args.workdir / "model"
    solutions = make_solutions(args, seed=1)
    warmup = make_solutions(argparse.Namespace(**{**vars(args), "solutions": 16}), seed=2)
    # every incremental solution has --max-steps steps: each round k scores all of them
    inc = make_solutions(
        argparse.Namespace(
            **{**vars(args), "solutions": args.incremental_solutions, "min_steps": args.max_steps}
        ),
        seed=3,
    )
    (args.workdir / "solutions.json").write_text(
        json.dumps({"solutions": solutions, "warmup_solutions": warmup, "incremental_solutions": inc})
    )
    info = run_phase("build", args)  # adds the token ids to solutions.json
    hf = info.pop("hf_scores")
    row: dict[str, Any] = {"size": size, **info}
    main_ids = json.loads((args.workdir / "solutions.json").read_text())["main"]
    tokens = sum(len(x["ids"]) for x in main_ids)
    steps = sum(len(x["tags"]) for x in main_ids)
    row.update(solutions=len(solutions), steps=steps, tokens=tokens)
    offline = run_phase("offline", args)
    row.update(offline_s=offline["seconds"], vllm_version=offline["vllm_version"])
    for pooling in ("step", "token"):
        try:
            srv = run_phase("server", args, ["--pooling", pooling])
        except RuntimeError as exc:
            row[f"server_{pooling}_error"] = error_summary(exc)
            print(f"[{size}] server --prm-pooling {pooling} failed:\n{error_summary(exc)}", flush=True)
            continue
        row[f"server_{pooling}_s"] = srv["seconds"]
        row[f"server_{pooling}_vs_offline"] = offline["seconds"] / srv["seconds"]
        row[f"server_{pooling}_vs_offline_gaps"] = score_gaps(flat(srv["scores"]), flat(offline["scores"]))
        if "incremental" in srv:
            row["incremental"] = srv["incremental"]
    row["offline_vs_hf_gaps"] = score_gaps(flat(offline["scores"][: len(hf)]), flat(hf))
    return row


def print_table(rows: list[dict[str, Any]]) -> None:
    print(
        "\nsize  params  solutions/steps/tokens  offline s  server(step) ÷ offline  server(token) ÷ offline  "
        "incremental ÷ full  offline vs hf (median/max log-odds gap)"
    )
    for r in rows:
        inc = r.get("incremental", {}).get("ratio")
        g = r["offline_vs_hf_gaps"]
        print(
            f"{r['size']:5} {r['params'] / 1e9:5.2f}B  {r['solutions']}/{r['steps']}/{r['tokens']}  "
            f"{r['offline_s']:8.2f}  {r.get('server_step_vs_offline', float('nan')):10.3f}  "
            f"{r.get('server_token_vs_offline', float('nan')):10.3f}  "
            f"{inc if inc is not None else float('nan'):10.3f}  {g['median']:.4f}/{g['max']:.4f}"
        )
    for r in rows:
        got = r.get("server_step_vs_offline")
        ok = got is not None and got >= GOAL_VS_OFFLINE
        print(
            f"goal {r['size']}: server (STEP) ÷ offline >= {GOAL_VS_OFFLINE}: {got} -> {'met' if ok else 'MISSED'}"
        )


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", default="1.5b,7b")
    p.add_argument("--quick", action="store_true", help="the tiny PRM, 64 solutions, --enforce-eager")
    p.add_argument("--solutions", type=int, default=512)
    p.add_argument("--min-steps", type=int, default=4)
    p.add_argument("--max-steps", type=int, default=12)
    p.add_argument("--min-words", type=int, default=15)
    p.add_argument("--max-words", type=int, default=60)
    p.add_argument("--incremental-solutions", type=int, default=64)
    p.add_argument("--hf-solutions", type=int, default=64)
    p.add_argument("--concurrency", type=int, default=64)
    p.add_argument("--per-request", type=int, default=4, help="solutions per /score request")
    p.add_argument("--max-len", type=int, default=4096)
    p.add_argument("--gpu-memory-utilization", type=float, default=0.85)
    p.add_argument("--enforce-eager", action="store_true")
    p.add_argument("--phase-timeout", type=float, default=900)
    p.add_argument("--root", default="/tmp/rp-bench-prm")
    p.add_argument("--out", default=os.environ.get("OUT"))
    # one phase's process
    p.add_argument("--phase", choices=sorted(PHASES))
    p.add_argument("--size", default="tiny")
    p.add_argument("--model-dir", type=Path)
    p.add_argument("--workdir", type=Path)
    p.add_argument("--pooling", default="step")
    args = p.parse_args(argv)
    if args.quick:
        args.sizes, args.solutions, args.enforce_eager = "tiny", 64, True
        args.incremental_solutions, args.hf_solutions, args.max_len = 16, 16, 1024
        args.max_steps, args.max_words = 8, 30  # solutions well inside the tiny model's length
        args.gpu_memory_utilization = min(args.gpu_memory_utilization, 0.5)
    return args


def main(argv: list[str] | None = None) -> int:
    os.environ.setdefault("VLLM_USE_FLASHINFER_SAMPLER", "0")
    args = parse(argv)
    if args.phase:
        tag = args.phase + (f"-{args.pooling}" if args.phase == "server" else "")
        result = PHASES[args.phase](args)
        (args.workdir / f"{tag}.json").write_text(json.dumps(result))
        return 0
    rows: list[dict[str, Any]] = []
    meta = {
        "commit": os.environ.get("RP_COMMIT"),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "argv": sys.argv[1:],
    }
    for size in [s for s in args.sizes.split(",") if s]:
        try:
            rows.append(bench_size(size, args))
        except RuntimeError as exc:
            print(f"[{size}] failed:\n{error_summary(exc)}", flush=True)
            continue
        print_table(rows[-1:])
        if args.out:  # after each size: a run stopped at a time limit keeps the sizes it finished
            Path(args.out).mkdir(parents=True, exist_ok=True)
            (Path(args.out) / "scoring_prm.json").write_text(
                json.dumps({"meta": meta, "rows": rows}, indent=2)
            )
    if len(rows) > 1:
        print_table(rows)
    return 0 if rows else 1


if __name__ == "__main__":
    raise SystemExit(main())
