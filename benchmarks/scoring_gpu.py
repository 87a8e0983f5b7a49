"""Scoring throughput on one GPU, measured in one run, as three ratios:

    server over HTTP (many concurrent clients)  ÷  vLLM offline (``LLM.classify``)   goal >= 0.95 (0.97 at 7b)
    server over HTTP                            ÷  ``vllm serve`` over HTTP, same load  goal >= 1.0
    server over HTTP                            ÷  transformers, padded batches of 64  goal >= 2

on the same token-id prompts (lengths uniform in [64, 1024], 2048 of them), for random-weight
``LlamaForSequenceClassification`` models of ~0.4B, ~1.4B and ~7B (Llama-7B's shape) parameters.

Every measurement runs in its own fresh process, one after the other on the same GPU (vLLM
offline, the reward server ``python -m rewardplane.server --engine vllm``, ``vllm serve
--runner pooling``, then transformers), so each has the GPU to itself; with ``--interleave`` the
reward server and ``vllm serve`` share it, half the memory each, and take turns on every prompt
set, so the GPU's drift between phases stays out of their ratio. vLLM engines get identical
settings (bf16, fp32 head, LAST pooling, same memory fraction, same max length, no chunked
prefill, and ``vllm serve`` the batch limits the offline engine picked, as the reward server
does): the server ÷ ``vllm serve`` ratio compares the two HTTP front ends over one engine. Both
servers get the same requests (token ids, ``/pooling`` for the reward server, ``/classify`` for
``vllm serve``, raw scores) from the same client at the same concurrency. Prefix caching stays
on (the default) but no engine sees a prompt twice: the warm-up uses other prompts, and each of
the ``--rounds`` repeats of the headline measurement (default 5) its own fresh prompt set, the
same sets for every engine. For the headline round the reward server's own metrics
(``rewardplane:request_stage_seconds``) give each request's mean time per stage (parse, engine;
tokenize for texts) and the rest of its latency beside them.

Rounds and goals. Every per-round figure (each engine's tokens/s, each ratio) is stored and
printed as its median with min, quartiles and max (``round_spread.py``); ratios are taken round by
round, on the same prompt set. A goal is met only when the lower quartile of at least 5 rounds
meets it: a median over the bound with a quartile under it is a figure a re-run misses about as
often as it meets it. Server ÷ ``vllm serve`` is judged only with ``--interleave`` (both up at
once, the order alternating by round), for scoring and the judge alike.

Environments. Throughput moves between hosts with the code unchanged (``vllm serve``'s judge by
1.8x between two H200 hosts), so each measured process tree (reward server, ``vllm serve``, the offline and
transformers phases) is read from ``/proc`` right after its first measured round
(``server_env.py``): the event loop and HTTP parser its API processes loaded, how many processes
answer HTTP, each process's role, start method, CPU affinity and last CPU (and which of them shared
a physical core), the vLLM/torch/Python environment variables it was started with, and the
versions of vllm, torch, transformers, tokenizers, uvicorn, uvloop, httptools, h11, fastapi,
starlette, pydantic, pyzmq, msgspec and the wheels only ``vllm serve`` loads
(prometheus-fastapi-instrumentator, model-hosting-container-standards, watchfiles,
prometheus-client) as its interpreter resolves them; ``meta.host`` holds the
CPU model, the CPUs allowed and the load. A ratio between two processes whose records differ in
the loop, the parser, the number of API processes, a version, the CPUs a role may use or such an
environment variable is not reported: the row holds ``<ratio>_refused`` with each difference, and
its goal is listed as not judged (``env_diff.py``). During each server's headline round the
physical core of each of its processes' main threads and of the client's is sampled every 50 ms:
``<server>_same_core`` holds, per pair, the share of the round they spent on one core (two
hyperthreads of a core slow each other; nothing pins either server's processes). Each phase's
wall time is in ``phase_wall_s``, the run's in ``meta.wall_s``.

Usage (GPU machine, vLLM importable, ``VLLM_USE_FLASHINFER_SAMPLER=0`` is set for you;
``vllm serve`` also needs watchfiles, model-hosting-container-standards, jmespath, supervisor
and prometheus-fastapi-instrumentator, which ``vllm.LLM`` does not):

    python benchmarks/scoring_gpu.py --sizes 0.4b,1.4b,7b --judge-sizes 0.4b --interleave --phase-timeout 540
                                                         # the figures' run (gpu-run.sh bench-score's default)
    python benchmarks/scoring_gpu.py --sizes 1.4b        # one size per call fits a 10-minute limit
    python benchmarks/scoring_gpu.py --quick             # 0.4b, 512 prompts, --enforce-eager

LLM judge (``--judge-sizes``, off by default): a random-weight ``LlamaForCausalLM`` of each size
named (32000-word vocabulary, a chat template), served by the reward server in generate mode
(``--task generate``) and by ``vllm serve --runner generate`` with the same engine settings (bf16,
memory fraction, max length, the reward server's batch limits), each sent the same
``/v1/chat/completions`` requests at the same concurrency (with ``--interleave`` both up at once,
half the memory fraction each, taking turns by round): ``--judge-prompts`` chats of one user
message of U[``--min-len``, ``--max-len``] random words (one token each), greedy, exactly
``--judge-output-tokens`` answer tokens each (``max_tokens``; the special tokens' rows of the LM
head are zero, so greedy decoding never picks end-of-sequence; ``ignore_eos`` is sent too). Goal:
server ÷ ``vllm serve`` (output tokens/s, lower quartile of the rounds) >= 1.0. Every answer's
``usage.completion_tokens`` is checked, and the share of identical greedy answers reported.

    python benchmarks/scoring_gpu.py --sizes '' --judge-sizes 1.4b    # the judge only

A server that answers nothing for ``--stall-timeout`` seconds (60) while requests wait fails its
phase at once, naming how many requests it answered and the longest prompt of each one it left;
the other phases still run.

Prints a final table and each goal met or missed; writes ``scoring_gpu.json`` to ``$OUT`` (or
``--out``) when set, with the card, vLLM's version, ``$RP_COMMIT`` and the date.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import gc
import json
import os
import random
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Coroutine, Iterator, Sequence
from pathlib import Path
from statistics import median, pstdev
from typing import Any, NamedTuple, TypedDict, TypeVar

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as a script: the repository root for benchmarks.*
    sys.path.insert(0, str(ROOT))

from benchmarks import env_diff, server_env  # noqa: E402
from benchmarks.round_spread import MIN_ROUNDS, Spread, goal_verdict, spread  # noqa: E402
from rewardplane.protocol.settings import LAST_TOKEN_ONLY  # noqa: E402
from rewardplane.testing.processes import stop_process  # noqa: E402

SIZES: dict[str, dict[str, int]] = {
    # ~0.39B: the model of the device README's measurement
    "0.4b": {"hidden": 896, "layers": 24, "heads": 14, "kv_heads": 2, "intermediate": 4864},
    # ~1.35B
    "1.4b": {"hidden": 2048, "layers": 24, "heads": 16, "kv_heads": 8, "intermediate": 6656},
    # ~6.6B: Llama-7B's shape (multi-head attention, no grouped KV)
    "7b": {"hidden": 4096, "layers": 32, "heads": 32, "kv_heads": 32, "intermediate": 11008},
}
VOCAB = 32000
# Goals (issue #28): server ÷ offline per size (default for sizes not listed), server ÷ vllm serve,
# server ÷ transformers.
GOAL_VS_OFFLINE = {"0.4b": 0.95, "1.4b": 0.95, "7b": 0.97}
GOAL_VS_OFFLINE_DEFAULT = 0.95
GOAL_VS_SERVE = 1.0
GOAL_VS_HF = 2.0
SERVED_NAME = "reward-model"
# vLLM offline with vLLM's own model (every row), beside the offline phase with the pooled rows
EVERY_ROW_PHASE = "offline-every-row"
# The judge's tokenizer: these special tokens, then one word per further id ("w4" ... "w31999"), so a
# prompt of n random words is n tokens and every generated id decodes to text.
SPECIAL_TOKENS = ("<pad>", "<s>", "</s>", "<unk>")
WORD = "w{}"
# One message's text between <s> and </s>, then <s> opening the answer: 3 tokens around a message.
JUDGE_CHAT_TEMPLATE = (
    "{% for m in messages %}<s>{{ m['content'] }}</s>{% endfor %}{% if add_generation_prompt %}<s>{% endif %}"
)
CHAT_ROOM = 16  # judge engines' max_model_len: longest prompt + answer + this (the template's tokens)
T = TypeVar("T")


class Prompts(TypedDict):
    """Token-id prompts (``prompts.json``): the measured set, the warm-up set, one fresh set per
    further ``--items-per-request`` value, and one fresh set per further round (``--rounds``: the
    headline measurement repeated on new prompts, since a repeated prompt would hit the prefix
    cache)."""

    main: list[list[int]]
    warmup: list[list[int]]
    extra: list[list[list[int]]]
    rounds: list[list[list[int]]]


# ---- phases (each runs in a fresh process) ---------------------------------------------------


def llama_config(size: str, max_len: int, tokenizer: Any, **extra: Any) -> Any:
    """``size``'s ``LlamaConfig``: VOCAB ids, an untied head, ``tokenizer``'s special ids."""
    from transformers import LlamaConfig

    s = SIZES[size]
    return LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=s["hidden"],
        intermediate_size=s["intermediate"],
        num_hidden_layers=s["layers"],
        num_attention_heads=s["heads"],
        num_key_value_heads=s["kv_heads"],
        max_position_embeddings=max(max_len, 2048),
        tie_word_embeddings=False,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        **extra,
    )


def save_model(
    model: Any, tokenizer: Any, model_dir: Path, max_shard_size: str | None = None
) -> dict[str, Any]:
    import torch

    params = sum(p.numel() for p in model.parameters())
    model.save_pretrained(model_dir, **({"max_shard_size": max_shard_size} if max_shard_size else {}))
    tokenizer.save_pretrained(model_dir)
    return {"params": params, "card": torch.cuda.get_device_name(0)}


def phase_build(
    model_dir: Path, size: str, max_len: int, max_shard_size: str | None = None
) -> dict[str, Any]:
    import torch
    from transformers import LlamaForSequenceClassification

    from rewardplane.tinymodel import train_tokenizer

    tokenizer = train_tokenizer()
    # num_labels: a documented PretrainedConfig argument that transformers 5's typed __init__ omits
    config = llama_config(size, max_len, tokenizer, num_labels=1)
    torch.manual_seed(0)
    with torch.device("cuda"):  # random init on the GPU: seconds instead of minutes for 1.4B
        # transformers wraps .to with functools.wraps, whose stub is not a method: self is not bound
        model = LlamaForSequenceClassification(config).to(torch.bfloat16)  # type: ignore[arg-type]
        with torch.no_grad():
            model.score.weight.normal_(0.0, SIZES[size]["hidden"] ** -0.5)  # unit-scale scores
    return save_model(model, tokenizer, model_dir, max_shard_size)


def word_tokenizer() -> Any:  # -> transformers.PreTrainedTokenizerFast
    """VOCAB tokens: SPECIAL_TOKENS, then one word per id, split on whitespace, with the judge's chat
    template; decoding joins words with spaces."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {t: i for i, t in enumerate(SPECIAL_TOKENS)}
    vocab.update({WORD.format(i): i for i in range(len(SPECIAL_TOKENS), VOCAB)})
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="<pad>", bos_token="<s>", eos_token="</s>", unk_token="<unk>"
    )
    tokenizer.chat_template = JUDGE_CHAT_TEMPLATE
    return tokenizer


def phase_build_judge(model_dir: Path, size: str, model_len: int) -> dict[str, Any]:
    """A random-weight ``LlamaForCausalLM`` whose greedy answers never end early (the special tokens'
    LM-head rows are zero: a logit of 0 never beats the largest of 31,996 random ones), and the batch
    limits the reward server picks for it on this card (``vllm serve`` gets the same)."""
    import torch
    import vllm
    from transformers import LlamaForCausalLM

    from rewardplane.protocol import ModelTask
    from rewardplane.server.config import ServerConfig
    from rewardplane.server.engines.vllm_engine import build_engine_args

    tokenizer = word_tokenizer()
    config = llama_config(size, model_len, tokenizer)
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = LlamaForCausalLM(config).to(torch.bfloat16)  # type: ignore[arg-type]
        with torch.no_grad():
            model.lm_head.weight[: len(SPECIAL_TOKENS)] = 0.0
    out = save_model(model, tokenizer, model_dir)
    served = build_engine_args(
        ServerConfig(model=str(model_dir), engine="vllm", task=ModelTask.GENERATE), model_len
    )
    limits = {"max_num_batched_tokens": served.max_num_batched_tokens, "max_num_seqs": served.max_num_seqs}
    out.update(batch_limits=limits, vllm_version=vllm.__version__)
    return out


def vllm_kwargs(model_dir: Path, args: argparse.Namespace) -> dict[str, Any]:
    """The engine settings the reward server uses (vllm_engine.build_engine_args), for offline."""
    from vllm.config import PoolerConfig

    from rewardplane.server.engines.vllm_engine import WORKER_EXTENSION

    kw: dict[str, Any] = {
        "model": str(model_dir),
        "runner": "pooling",
        "dtype": "bfloat16",
        "max_model_len": args.max_len,
        "gpu_memory_utilization": args.gpu_memory_utilization,
        "hf_overrides": {"head_dtype": "float32"},
        "pooler_config": PoolerConfig(pooling_type="LAST"),
        "disable_log_stats": True,
        "served_model_name": "reward-model",
        # as the server: whole prompts per step (see vllm_engine.build_engine_args)
        "enable_chunked_prefill": False,
        # as the server: its worker extension, which also picks the batch-invariant linear layers'
        # matmul (server/engines/vllm_deterministic.py)
        "worker_extension_cls": WORKER_EXTENSION,
    }
    if args.enforce_eager:
        kw["enforce_eager"] = True
    if args.compilation_config:
        kw["compilation_config"] = json.loads(args.compilation_config)
    return kw


def offline_batch_limits(llm: Any) -> dict[str, int]:
    """The batch limits vLLM picked for offline use on this card (``vllm serve`` gets the same
    ones); empty where this vLLM does not expose them (then vllm serve keeps its own, recorded)."""
    with contextlib.suppress(AttributeError):
        sched = llm.llm_engine.vllm_config.scheduler_config
        return {"max_num_batched_tokens": sched.max_num_batched_tokens, "max_num_seqs": sched.max_num_seqs}
    return {}


def offline_scorer(llm: Any) -> Callable[[list[list[int]]], list[list[float]]]:
    """Raw scores of token-id prompts from an offline ``LLM`` (no activation, as the server's)."""
    from vllm import PoolingParams
    from vllm.inputs import TokensPrompt

    def run(batch: list[list[int]]) -> list[list[float]]:
        outs = llm.classify(
            [TokensPrompt(prompt_token_ids=ids) for ids in batch],
            pooling_params=PoolingParams(use_activation=False),
            use_tqdm=False,
        )
        return [list(map(float, o.outputs.probs)) for o in outs]

    return run


def timed_rounds(
    run: Callable[[list[list[int]]], list[list[float]]], prompts: Prompts
) -> tuple[list[list[float]], list[float]]:
    """The headline set's scores, and the seconds of each round: the headline set, then each further
    round's fresh set (``run`` returns once its scores are in)."""
    seconds: list[float] = []
    scores: list[list[float]] = []
    for i, batch in enumerate([prompts["main"], *prompts.get("rounds", [])]):
        t0 = time.perf_counter()
        out = run(batch)
        seconds.append(time.perf_counter() - t0)
        if i == 0:
            scores = out
    return scores, seconds


def phase_offline(model_dir: Path, prompts: Prompts, args: argparse.Namespace) -> dict[str, Any]:
    from vllm import LLM

    t0 = time.perf_counter()
    llm = LLM(**vllm_kwargs(model_dir, args))
    startup = time.perf_counter() - t0
    # the batch limits vLLM picked for offline use on this card: vllm serve gets the same ones
    limits = offline_batch_limits(llm)
    run = offline_scorer(llm)

    run(prompts["warmup"])
    scores, round_seconds = timed_rounds(run, prompts)
    import vllm

    return {
        "seconds": round_seconds[0],
        "round_seconds": round_seconds,
        "startup_s": startup,
        "scores": scores,
        "batch_limits": limits,
        "vllm_version": vllm.__version__,
        # this process and its engine core, read while the engine is still up
        "environment": server_env.describe(os.getpid(), None),
    }


def phase_hf(model_dir: Path, prompts: Prompts, args: argparse.Namespace) -> dict[str, Any]:
    import torch
    from transformers import AutoModelForSequenceClassification

    device = torch.device("cuda")
    model = (
        AutoModelForSequenceClassification.from_pretrained(model_dir, dtype=torch.bfloat16).to(device).eval()
    )
    pad = int(model.config.pad_token_id or 0)

    @torch.inference_mode()
    def run(all_ids: list[list[int]]) -> list[list[float]]:
        out: list[list[float]] = []
        for i in range(0, len(all_ids), args.hf_batch):  # prompt order: padding as it comes
            batch = all_ids[i : i + args.hf_batch]
            width = max(len(x) for x in batch)
            ids = torch.full((len(batch), width), pad, dtype=torch.long)
            mask = torch.zeros((len(batch), width), dtype=torch.long)
            for r, x in enumerate(batch):
                ids[r, : len(x)] = torch.tensor(x)
                mask[r, : len(x)] = 1
            logits = model(input_ids=ids.to(device), attention_mask=mask.to(device)).logits
            out.extend(logits.float().cpu().tolist())
        torch.cuda.synchronize()
        return out

    run(prompts["warmup"][: args.hf_batch])
    torch.cuda.synchronize()
    scores, round_seconds = timed_rounds(run, prompts)
    return {
        "seconds": round_seconds[0],
        "round_seconds": round_seconds,
        "scores": scores,
        "environment": server_env.describe(os.getpid(), None),
    }


# ---- the server, measured from this process ---------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_healthy(url: str, proc: subprocess.Popen[bytes], log: Path, timeout_s: float) -> None:
    import httpx

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(
                f"server exited with {proc.returncode}:\n{log.read_text(errors='replace')[-4000:]}"
            )
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(1.0)
    raise RuntimeError(
        f"server not healthy within {timeout_s:.0f}s:\n{log.read_text(errors='replace')[-4000:]}"
    )


class Target(TypedDict):
    """What one HTTP server under test is sent: ``POST url+path`` with ``{"input": [ids...], **body}``;
    each item's scores are ``data[i][field]``."""

    name: str
    url: str
    path: str
    body: dict[str, Any]
    field: str


def settle_heap() -> None:
    """Take every object alive now out of the garbage collector's sight (``gc.freeze``), as vLLM's
    own server does after its start. The harness holds every round's prompts, millions of token ids
    in lists; without this the allocations at the start of a round set off a full collection over
    them (~0.45 s on an H200 host, 2048 prompts × 5 rounds), which the client, and offline the
    engine's caller, spends before its first request."""
    gc.collect()
    gc.freeze()


def bounded(coro: Coroutine[Any, Any, T], timeout_s: float) -> T:
    """``coro`` run to its end in a fresh event loop, within ``timeout_s``."""
    return asyncio.run(asyncio.wait_for(coro, timeout_s))


STALL_S = 60.0  # no answer for this long while requests wait: the server has stalled


class Stalled(RuntimeError):
    """A server stopped answering: requests were in flight and none was answered for a while.
    ``unanswered``: the requests without an answer, by their index in the round."""

    def __init__(self, message: str, unanswered: list[int]) -> None:
        super().__init__(message)
        self.unanswered = unanswered


async def send_all(
    endpoint: str,
    bodies: list[dict[str, Any]],
    concurrency: int,
    parse: Callable[[Any], T],
    done_at: list[float] | None = None,
    stall_s: float = STALL_S,
) -> tuple[float, list[T]]:
    """POST every body to ``endpoint`` with at most ``concurrency`` in flight: the seconds it took
    and ``parse`` of each answer's JSON, in the bodies' order. ``done_at``: filled with each
    answer's arrival, in seconds after the start, in the bodies' order. Raises ``Stalled`` (and
    cancels the rest) once ``stall_s`` pass without an answer: a round takes seconds, so a server
    that stops answering is named within a minute instead of holding the phase to its bound."""
    import httpx

    from rewardplane.sdk._aio import gather_or_cancel
    from rewardplane.sdk.http_pool import ShardedAsyncClient, json_body

    results: list[Any] = [None] * len(bodies)
    sem = asyncio.Semaphore(concurrency)
    answered = 0
    done = [False] * len(bodies)
    progress = asyncio.Event()

    async def watchdog() -> None:
        while answered < len(bodies):
            try:
                await asyncio.wait_for(progress.wait(), stall_s)
            except TimeoutError:
                raise Stalled(
                    f"{endpoint} stalled: {answered} of {len(bodies)} requests answered, "
                    f"none in the last {stall_s:g} s",
                    [i for i, d in enumerate(done) if not d],
                ) from None
            progress.clear()

    # The SDK's client: one httpx pool of 256 connections costs ~2x the client CPU per request
    # (benchmarks/http_client.py), which capped this benchmark rather than the server.
    async with ShardedAsyncClient(max_connections=concurrency, timeout=httpx.Timeout(600.0)) as client:

        async def one(i: int) -> None:
            nonlocal answered
            async with sem:
                r = await client.post(endpoint, **json_body(bodies[i]))
                if r.status_code != 200:
                    raise RuntimeError(f"{endpoint} answered {r.status_code}: {r.text[:500]}")
                results[i] = parse(r.json())
                if done_at is not None:
                    done_at[i] = time.perf_counter() - t0
                answered += 1
                done[i] = True
                progress.set()

        if done_at is not None:
            done_at[:] = [0.0] * len(bodies)
        t0 = time.perf_counter()
        # the SDK's fan-out: the requests start in turn, so the first is sent before the last is built
        await gather_or_cancel([watchdog(), *(one(i) for i in range(len(bodies)))])
        seconds = time.perf_counter() - t0
    return seconds, results


def answer_profile(done_at: Sequence[float], tokens: Sequence[int], seconds: float) -> dict[str, float]:
    """When a round's answers arrived, against a steady rate: the first answer; the times by which
    10%, 50% and 90% of the tokens were answered; the rate between the 10% and 90% marks
    (``steady_tok_s``); and ``outside_steady_s``, the round's seconds beyond what all its tokens
    take at that rate (the ramp before the engine is full, and the tail after the last full
    step). ``done_at[i]`` and ``tokens[i]``: request i's answer time (s after the start) and its
    prompt tokens."""
    order = sorted(zip(done_at, tokens, strict=True))
    total = sum(tokens)
    marks: dict[float, tuple[float, int]] = {}  # fraction -> (time, tokens answered by then)
    answered = 0
    for t, n in order:
        answered += n
        for q in (0.1, 0.5, 0.9):
            if q not in marks and answered >= q * total:
                marks[q] = (t, answered)
    (t10, n10), (t50, _), (t90, n90) = marks[0.1], marks[0.5], marks[0.9]
    steady = (n90 - n10) / (t90 - t10) if t90 > t10 else float("nan")
    return {
        "first_answer_s": order[0][0],
        "t10_s": t10,
        "t50_s": t50,
        "t90_s": t90,
        "steady_tok_s": steady,
        "outside_steady_s": seconds - total / steady if steady == steady else float("nan"),
    }


async def drive(
    target: Target,
    prompts: list[list[int]],
    per_request: int,
    concurrency: int,
    profile: dict[str, float] | None = None,
    stall_s: float = STALL_S,
) -> tuple[float, list[list[float]]]:
    """Send every prompt in requests of ``per_request`` with at most ``concurrency`` in flight;
    ``profile``: filled with ``answer_profile`` of the round; ``Stalled`` as ``send_all``."""
    chunks = [prompts[i : i + per_request] for i in range(0, len(prompts), per_request)]
    field = target["field"]

    def scores(answer: Any) -> list[list[float]]:
        return [d[field] for d in sorted(answer["data"], key=lambda d: d["index"])]

    bodies = [{"input": chunk, **target["body"]} for chunk in chunks]
    done_at: list[float] = []
    try:
        seconds, results = await send_all(
            target["url"] + target["path"], bodies, concurrency, scores, done_at, stall_s
        )
    except Stalled as exc:  # which prompts the server left: a length it cannot finish shows here
        longest = [max(map(len, chunks[i])) for i in exc.unanswered[:8]]
        more = ", ..." if len(exc.unanswered) > 8 else ""
        raise Stalled(
            f"{exc}; the longest prompt of each unanswered request, in tokens: "
            f"{', '.join(map(str, longest))}{more}",
            exc.unanswered,
        ) from None
    if profile is not None:
        profile.update(answer_profile(done_at, [sum(map(len, c)) for c in chunks], seconds))
    return seconds, [row for chunk in results for row in chunk]


class Answer(NamedTuple):
    """One chat completion: its text and OpenAI's token counts."""

    text: str
    completion_tokens: int
    prompt_tokens: int


def judge_answer(body: Any) -> Answer:
    (choice,) = body["choices"]
    usage = body["usage"]
    return Answer(choice["message"]["content"], int(usage["completion_tokens"]), int(usage["prompt_tokens"]))


def judge_bodies(chats: list[str], output_tokens: int) -> list[dict[str, Any]]:
    """One ``/v1/chat/completions`` request per chat text: greedy, ``output_tokens`` answer tokens
    (``ignore_eos``: vLLM's; the reward server ignores unknown fields, and the model never ends early)."""
    return [
        {
            "model": SERVED_NAME,
            "messages": [{"role": "user", "content": chat}],
            "max_tokens": output_tokens,
            "temperature": 0,
            "ignore_eos": True,
        }
        for chat in chats
    ]


def process_cpu_s(root: int) -> dict[str, float]:
    """CPU seconds (user + system) of ``root`` and each of its descendants (Linux /proc), by
    "pid:name": whether the API process, the engine core or the client is saturated."""
    tick = os.sysconf("SC_CLK_TCK")
    out: dict[str, float] = {}
    todo = [root]
    while todo:
        pid = todo.pop()
        try:
            stat = Path(f"/proc/{pid}/stat").read_text()
            name = stat[stat.index("(") + 1 : stat.rindex(")")]
            fields = stat[stat.rindex(")") + 2 :].split()
            out[f"{pid}:{name}"] = (int(fields[11]) + int(fields[12])) / tick
            for task in Path(f"/proc/{pid}/task").iterdir():
                todo.extend(int(c) for c in (task / "children").read_text().split())
        except (OSError, ValueError):
            continue
    return out


def metrics_text(url: str) -> str:
    import httpx

    return httpx.get(f"{url}/metrics", timeout=30).text


def stage_totals(text: str) -> dict[str, tuple[float, float]]:
    """The reward server's ``/metrics``: (seconds, requests) summed per stage of a scoring request
    (``rewardplane:request_stage_seconds``), and ``e2e`` for /pooling's whole latency."""
    from prometheus_client.parser import text_string_to_metric_families

    sums: dict[str, float] = {}
    counts: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name.startswith("rewardplane:request_stage_seconds"):
                key = sample.labels.get("stage", "")
            elif (
                sample.name.startswith("rewardplane:e2e_request_latency_seconds")
                and sample.labels.get("endpoint") == "/pooling"
            ):
                key = "e2e"
            else:
                continue
            if sample.name.endswith("_sum"):
                sums[key] = sample.value
            elif sample.name.endswith("_count"):
                counts[key] = sample.value
    return {k: (sums[k], counts.get(k, 0.0)) for k in sums}


def stage_times(
    before: dict[str, tuple[float, float]], after: dict[str, tuple[float, float]]
) -> dict[str, dict[str, float]]:
    """What the requests between two scrapes spent per stage: total seconds, requests, mean ms; and
    ``other``: the mean e2e latency less the stages' means (waiting on the event loop, validation,
    the answer's encoding and sending)."""
    out: dict[str, dict[str, float]] = {}
    for stage, (total, n) in after.items():
        t0, n0 = before.get(stage, (0.0, 0.0))
        if n > n0:
            out[stage] = {"seconds": total - t0, "requests": n - n0, "mean_ms": 1e3 * (total - t0) / (n - n0)}
    if "e2e" in out:
        staged = sum(v["mean_ms"] for k, v in out.items() if k != "e2e")
        out["other"] = {"mean_ms": out["e2e"]["mean_ms"] - staged}
    return out


def describe_stages(stages: dict[str, dict[str, float]]) -> str:
    return "; ".join(f"{k} {v['mean_ms']:.2f} ms" for k, v in stages.items()) or "no stage metrics"


class Timed(NamedTuple):
    """One round timed: its seconds and result; the busy fraction (CPU s / wall s) over it of each
    process of the server and of this client (~1.0: that process set the pace); and for each pair
    of them the share of the round their main threads spent on one physical core."""

    seconds: float
    result: Any
    busy: dict[str, float]
    same_core: dict[str, float]


def timed_with_cpu(proc: subprocess.Popen[bytes], run: Callable[[], tuple[float, Any]]) -> Timed:
    """``run()`` against the server ``proc``, timed, with its CPU use and placement (``Timed``)."""
    before, client_before = process_cpu_s(proc.pid), time.process_time()
    with server_env.CoreSharing(proc.pid) as sharing:
        seconds, result = run()
    after, client_after = process_cpu_s(proc.pid), time.process_time()
    busy = {name: round((after[name] - before[name]) / seconds, 3) for name in after if name in before}
    busy[server_env.CoreSharing.CLIENT] = round((client_after - client_before) / seconds, 3)
    return Timed(seconds, result, busy, sharing.shares())


def judge_model_len(args: argparse.Namespace) -> int:
    """The judge engines' max_model_len: the longest chat, its template's tokens and the answer, and
    as much again for the prompt. vllm serve refuses, before tokenizing, a prompt of more characters
    than the input tokens allowed × the tokenizer's longest token (``_text_len_check``); the word
    tokenizer's tokens leave out the spaces between them, so a 1024-token chat has more characters
    than that bound unless the limit has room. Both engines get the same limit."""
    return 2 * args.max_len + CHAT_ROOM + args.judge_output_tokens


def add_engine_arguments(p: argparse.ArgumentParser) -> None:
    """The vLLM engine settings a benchmark applies to every engine it starts (``engine_flags``,
    ``vllm_kwargs``); check them with ``check_engine_arguments``."""
    p.add_argument(
        "--enforce-eager", action="store_true", help="no torch.compile / CUDA graphs (faster start)"
    )
    p.add_argument(
        "--compilation-config",
        default="",
        help="vLLM's compilation config (JSON) for every vLLM engine the benchmark starts, e.g. "
        "'{\"cudagraph_capture_sizes\": [512, 1024, 2048]}'",
    )


def check_engine_arguments(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Refuse a compilation config that is not a JSON object before anything starts."""
    if not args.compilation_config:
        return
    try:
        config = json.loads(args.compilation_config)
    except json.JSONDecodeError as exc:
        p.error(f"--compilation-config is not JSON ({exc}): {args.compilation_config!r}")
    if not isinstance(config, dict):
        p.error(f"--compilation-config must be a JSON object, got {args.compilation_config!r}")


def engine_flags(args: argparse.Namespace) -> list[str]:
    """The vLLM engine settings of this run as flags, the same for every engine started as a
    process (the reward server, ``vllm serve``, the offline phase); ``vllm_kwargs`` applies them
    offline."""
    flags = ["--enforce-eager"] if args.enforce_eager else []
    if args.compilation_config:
        flags += ["--compilation-config", args.compilation_config]
    return flags


def server_cmd(model_dir: Path, port: int, args: argparse.Namespace, judge: bool = False) -> list[str]:
    """The reward server on the vLLM engine (``judge``: in generate mode, an LLM judge)."""
    cmd = [
        sys.executable,
        "-m",
        "rewardplane.server",
        "--engine",
        "vllm",
        "--model",
        str(model_dir),
        "--port",
        str(port),
        "--gpu-memory-utilization",
        str(args.gpu_memory_utilization),
        "--max-model-len",
        str(judge_model_len(args) if judge else args.max_len),
        "--log-level",
        "warning",
    ]
    if judge:
        cmd += ["--task", "generate"]
    return cmd + engine_flags(args)  # extra vLLM engine arguments: the server passes them to vLLM


SERVE_SETTINGS = {
    "server": "the reward server's batch limits (scoring: and no chunked prefill)",
    "own": "its own default batch limits (scoring: and chunked prefill)",
}


def vllm_serve_cmd(
    model_dir: Path, port: int, args: argparse.Namespace, limits: dict[str, int], judge: bool = False
) -> list[str]:
    """``vllm serve MODEL`` (vLLM's own CLI entry point) serving the same model as the reward server:
    bf16, the same memory fraction and max length; scoring (``--runner pooling``) with an fp32 head
    and LAST pooling, a judge (``--runner generate``). With ``--vllm-serve-settings server`` (the
    default) it also gets the reward server's batch limits and, scoring, no chunked prefill: the
    two HTTP front ends over the same engine. With ``own`` those are left to ``vllm serve``'s
    defaults: what a user who runs ``vllm serve`` instead gets."""
    cmd = [
        sys.executable,
        "-m",
        "vllm.entrypoints.cli.main",
        "serve",
        str(model_dir),
        "--runner",
        "generate" if judge else "pooling",
        "--dtype",
        "bfloat16",
        "--max-model-len",
        str(judge_model_len(args) if judge else args.max_len),
        "--gpu-memory-utilization",
        str(args.gpu_memory_utilization),
    ]
    same_engine = args.vllm_serve_settings == "server"
    if not judge:
        cmd += [
            "--hf-overrides",
            json.dumps({"head_dtype": "float32"}),
            "--pooler-config",
            json.dumps({"pooling_type": "LAST"}),
        ]
        if same_engine:
            cmd.append("--no-enable-chunked-prefill")
    cmd += [
        "--served-model-name",
        SERVED_NAME,
        "--disable-log-stats",
        "--disable-uvicorn-access-log",
        "--uvicorn-log-level",
        "warning",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
    ]
    for key, value in limits.items() if same_engine else ():  # max_num_batched_tokens, max_num_seqs
        cmd += ["--" + key.replace("_", "-"), str(value)]
    return cmd + engine_flags(args)


class PhaseFailed(RuntimeError):
    """One server's phase failed: the message names the server and carries its log's tail."""


def phase_failed(kind: str, exc: BaseException, log: Path) -> PhaseFailed:
    return PhaseFailed(
        f"the {kind} phase failed ({type(exc).__name__}: {exc!r}); server log {log}:\n"
        f"{log.read_text(errors='replace')[-12000:]}"
    )


def server_log(work: Path, kind: str, port: int) -> Path:
    return work / f"{kind}-{port}.log"


@contextlib.contextmanager
def serving(
    kind: str, cmd: list[str], port: int, work: Path, args: argparse.Namespace
) -> Iterator[tuple[subprocess.Popen[bytes], float]]:
    """Start ``cmd``, one HTTP server on ``port`` (``kind``: "server", the reward server, or
    "vllm-serve"), and yield the process and its startup seconds once it is healthy. A failure to
    start, or of the body, raises with the tail of the server's log; the server's whole process group
    is killed on the way out."""
    log = server_log(work, kind, port)
    t0 = time.perf_counter()
    with open(log, "wb") as f:
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        wait_healthy(f"http://127.0.0.1:{port}", proc, log, args.phase_timeout)
        yield proc, time.perf_counter() - t0
    except PhaseFailed:  # another server's, started beside this one (--interleave)
        raise
    except Exception as exc:
        # The reward server and its engine core print every thread's stack on SIGUSR1: see where it
        # waits (vllm serve installs no such handler).
        if proc.poll() is None and kind == "server":
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.pid, signal.SIGUSR1)
            time.sleep(3)
        elif proc.poll() is not None:
            print(f"the {kind} process exited with {proc.returncode}", flush=True)
        raise phase_failed(kind, exc, log) from exc
    finally:
        stop_process(proc, grace_s=60)
        try:  # vLLM's engine core lives in the server's process group
            os.killpg(proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass


class HttpServer(NamedTuple):
    """One HTTP server of the scoring benchmark before it starts: its command, port, request target
    and the request sizes it is measured at."""

    kind: str  # "server" (the reward server) or "vllm-serve"
    cmd: list[str]
    port: int
    target: Target
    sizes: list[int]


def http_server(
    kind: str, model_dir: Path, args: argparse.Namespace, limits: dict[str, int] | None = None
) -> HttpServer:
    """The reward server (``/pooling``, every request size) or ``vllm serve`` (``/classify``, raw
    scores, the headline size only) on a free port."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    if kind == "server":
        target: Target = {"name": kind, "url": url, "path": "/pooling", "body": {}, "field": "data"}
        return HttpServer(kind, server_cmd(model_dir, port, args), port, target, args.items_per_request_list)
    # raw scores (use_activation off), as the reward server and the offline run return them
    body = {"model": SERVED_NAME, "use_activation": False}
    target = {"name": kind, "url": url, "path": "/classify", "body": body, "field": "probs"}
    cmd = vllm_serve_cmd(model_dir, port, args, limits or {})
    return HttpServer(kind, cmd, port, target, args.items_per_request_list[:1])


def scored(
    srv: HttpServer,
    prompts_: list[list[int]],
    per_request: int,
    args: argparse.Namespace,
    profile: dict[str, float] | None = None,
) -> tuple[float, list[list[float]]]:
    """One round: every prompt scored by ``srv``; its seconds and the scores."""
    round_ = drive(srv.target, prompts_, per_request, args.concurrency, profile, args.stall_timeout)
    return bounded(round_, args.phase_timeout)


def measured_run(
    srv: HttpServer,
    proc: subprocess.Popen[bytes],
    prompts_: list[list[int]],
    per_request: int,
    args: argparse.Namespace,
) -> dict[str, Any]:
    """The measured round of one request size: seconds, scores, CPU busy, when the answers came and
    (the reward server's own metrics; ``vllm serve`` has none) each request's time per stage."""
    url = srv.target["url"]
    profile: dict[str, float] = {}
    scrape = (lambda: stage_totals(metrics_text(url))) if srv.kind == "server" else dict
    before = scrape()
    timed = timed_with_cpu(proc, functools.partial(scored, srv, prompts_, per_request, args, profile))
    return {
        "seconds": timed.seconds,
        "round_seconds": [timed.seconds],
        "scores": timed.result,
        "tokens": sum(map(len, prompts_)),
        "prompts": len(prompts_),
        "cpu_busy": timed.busy,
        "same_core": timed.same_core,
        "answers": profile,
        "stages": stage_times(before, scrape()),
        # right after the load: each process's last CPU is where the round ran it
        "environment": server_env.describe(proc.pid, srv.port),
    }


def other_sizes(
    srv: HttpServer, proc: subprocess.Popen[bytes], prompts: Prompts, args: argparse.Namespace
) -> dict[int, Any]:
    """The measured round of each further request size, on its own fresh prompts (reuse would hit the
    prefix cache)."""
    runs = {}
    for k, per_request in enumerate(srv.sizes[1:]):
        runs[per_request] = {
            **measured_run(srv, proc, prompts["extra"][k], per_request, args),
            "scores": None,
        }
    return runs


def measure_http(
    kind: str,
    model_dir: Path,
    prompts: Prompts,
    args: argparse.Namespace,
    work: Path,
    limits: dict[str, int] | None = None,
) -> dict[str, Any]:
    """Start one HTTP server (``kind``: "server", the reward server, or "vllm-serve"), warm it up, and
    score the prompts at each request size (``vllm serve``: the headline size only)."""
    srv = http_server(kind, model_dir, args, limits)
    with serving(kind, srv.cmd, srv.port, work, args) as (proc, startup):
        scored(srv, prompts["warmup"], srv.sizes[0], args)
        headline = measured_run(srv, proc, prompts["main"], srv.sizes[0], args)
        headline["round_seconds"] += [
            scored(srv, more, srv.sizes[0], args)[0] for more in prompts.get("rounds", [])
        ]
        runs = {srv.sizes[0]: headline, **other_sizes(srv, proc, prompts, args)}
        return {"startup_s": startup, "runs": runs, "command": srv.cmd[1:]}


PAIR = ("server", "vllm-serve")


def pair_order(rounds: int) -> list[tuple[str, str]]:
    """Which of the two servers goes first in each round of ``--interleave``: the reward server in
    the measured round, then the other one first every second round, so neither always runs right
    after the other's load (a warmer GPU, a fuller allocator) over the rounds."""
    return [PAIR if i % 2 == 0 else PAIR[::-1] for i in range(rounds)]


def half_memory(args: argparse.Namespace) -> argparse.Namespace:
    """``args`` with half the memory fraction: two engines up at once on one GPU."""
    return argparse.Namespace(**{**vars(args), "gpu_memory_utilization": args.gpu_memory_utilization / 2})


def charged(kind: str, port: int, work: Path, call: Callable[[], T]) -> T:
    """``call()`` against one of two servers up at once; a failure is that server's, with its log."""
    try:
        return call()
    except Exception as exc:
        raise phase_failed(kind, exc, server_log(work, kind, port)) from exc


@contextlib.contextmanager
def pair_serving(
    cmds: dict[str, tuple[list[str], int]], work: Path, args: argparse.Namespace
) -> Iterator[dict[str, tuple[subprocess.Popen[bytes], float]]]:
    """The reward server and ``vllm serve`` (``cmds``: each one's command and port) up at once, each
    process and its startup seconds; both are stopped on the way out."""
    with contextlib.ExitStack() as stack:
        live = {}
        for kind in PAIR:  # one after the other: each engine sizes its memory with the other idle
            cmd, port = cmds[kind]
            live[kind] = stack.enter_context(serving(kind, cmd, port, work, args))
        yield live


def measure_pair(
    model_dir: Path,
    prompts: Prompts,
    args: argparse.Namespace,
    work: Path,
    limits: dict[str, int],
) -> tuple[dict[str, Any], dict[str, Any]]:
    """``--interleave``: the reward server and ``vllm serve`` up at once on the GPU, each with half the
    memory fraction, and every prompt set scored by both, one right after the other: the two front
    ends are compared minutes apart no more, so the GPU's drift between phases stays out of the
    ratio. Returns measure_http's result for each."""
    half = half_memory(args)
    servers = {
        kind: http_server(kind, model_dir, half, limits if kind == "vllm-serve" else None) for kind in PAIR
    }
    with pair_serving({k: (v.cmd, v.port) for k, v in servers.items()}, work, half) as live:

        def on(kind: str, call: Callable[[], T]) -> T:
            return charged(kind, servers[kind].port, work, call)

        for kind, srv in servers.items():
            on(kind, functools.partial(scored, srv, prompts["warmup"], srv.sizes[0], half))
        sets = [prompts["main"], *prompts.get("rounds", [])]
        runs: dict[str, dict[str, Any]] = {}
        for i, order in enumerate(pair_order(len(sets))):
            for kind in order:
                srv, (proc, _) = servers[kind], live[kind]
                if i == 0:
                    runs[kind] = on(
                        kind, functools.partial(measured_run, srv, proc, sets[0], srv.sizes[0], half)
                    )
                else:
                    seconds, _ = on(kind, functools.partial(scored, srv, sets[i], srv.sizes[0], half))
                    runs[kind]["round_seconds"].append(seconds)
        out = {}
        for kind, (proc, startup) in live.items():
            srv = servers[kind]
            rest = on(kind, functools.partial(other_sizes, srv, proc, prompts, half))
            out[kind] = {
                "startup_s": startup,
                "runs": {srv.sizes[0]: runs[kind], **rest},
                "command": srv.cmd[1:],
            }
        return out["server"], out["vllm-serve"]


class JudgeChats(TypedDict):
    """The judge's chat texts: a warm-up set, then one fresh set per round (the first: the headline)."""

    warmup: list[str]
    rounds: list[list[str]]


def judge_cmd(
    kind: str, model_dir: Path, args: argparse.Namespace, limits: dict[str, int]
) -> tuple[list[str], int]:
    """One judge server's command on a free port (``kind``: "server", the reward server in generate
    mode, or "vllm-serve" with ``--runner generate``)."""
    port = free_port()
    if kind == "server":
        return server_cmd(model_dir, port, args, judge=True), port
    return vllm_serve_cmd(model_dir, port, args, limits, judge=True), port


def judge_answers(port: int, chats_: list[str], args: argparse.Namespace) -> tuple[float, list[Answer]]:
    """One round: every chat sent to the judge on ``port``; its seconds and the answers."""
    bodies = judge_bodies(chats_, args.judge_output_tokens)
    endpoint = f"http://127.0.0.1:{port}/v1/chat/completions"
    round_ = send_all(endpoint, bodies, args.concurrency, judge_answer, stall_s=args.stall_timeout)
    return bounded(round_, args.phase_timeout)


def judge_round(
    out: dict[str, Any], proc: subprocess.Popen[bytes], port: int, chats_: list[str], args: argparse.Namespace
) -> None:
    """One measured round added to a judge server's ``out``; the first also keeps the answers' texts,
    the CPU busy and the environment."""
    timed = timed_with_cpu(proc, functools.partial(judge_answers, port, chats_, args))
    answers: list[Answer] = timed.result
    k = args.judge_output_tokens
    out["rounds"].append(
        {
            "seconds": timed.seconds,
            "requests": len(answers),
            "output_tokens": sum(a.completion_tokens for a in answers),
            "prompt_tokens": sum(a.prompt_tokens for a in answers),
            # answers whose usage.completion_tokens is not the K asked for
            "wrong_length": sum(a.completion_tokens != k for a in answers),
        }
    )
    if len(out["rounds"]) == 1:
        out.update(
            texts=[a.text for a in answers],
            cpu_busy=timed.busy,
            same_core=timed.same_core,
            environment=server_env.describe(proc.pid, port),
        )


def measure_judge(
    kind: str,
    model_dir: Path,
    chats: JudgeChats,
    args: argparse.Namespace,
    work: Path,
    limits: dict[str, int],
) -> dict[str, Any]:
    """Start one judge server, warm it up, and send each round's chats."""
    cmd, port = judge_cmd(kind, model_dir, args, limits)
    with serving(kind, cmd, port, work, args) as (proc, startup):
        judge_answers(port, chats["warmup"], args)
        out: dict[str, Any] = {"startup_s": startup, "command": cmd[1:], "rounds": []}
        for round_chats in chats["rounds"]:
            judge_round(out, proc, port, round_chats, args)
        return out


def measure_judge_pair(
    model_dir: Path, chats: JudgeChats, args: argparse.Namespace, work: Path, limits: dict[str, int]
) -> tuple[dict[str, Any], dict[str, Any]]:
    """``--interleave`` for the judge: both judge servers up at once, half the memory fraction each,
    every round's chats sent to both back to back, the order alternating by round. Returns
    measure_judge's result for each."""
    half = half_memory(args)
    cmds = {kind: judge_cmd(kind, model_dir, half, limits) for kind in PAIR}
    with pair_serving(cmds, work, half) as live:
        out: dict[str, dict[str, Any]] = {
            kind: {"startup_s": startup, "command": cmds[kind][0][1:], "rounds": []}
            for kind, (_, startup) in live.items()
        }
        for kind, (_, port) in cmds.items():
            charged(kind, port, work, functools.partial(judge_answers, port, chats["warmup"], half))
        for i, order in enumerate(pair_order(len(chats["rounds"]))):
            for kind in order:
                port = cmds[kind][1]
                call = functools.partial(
                    judge_round, out[kind], live[kind][0], port, chats["rounds"][i], half
                )
                charged(kind, port, work, call)
        return out["server"], out["vllm-serve"]


# ---- orchestration -----------------------------------------------------------------------------


def make_prompts(n: int, lo: int, hi: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    # ids >= 4 skip the tokenizer's special tokens; the model's vocabulary is VOCAB
    return [[rng.randrange(4, VOCAB) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


def judge_chats(n: int, lo: int, hi: int, seed: int) -> list[str]:
    """``n`` chat texts of U[lo, hi] random words of the judge's vocabulary (one token each)."""
    return [" ".join(WORD.format(i) for i in ids) for ids in make_prompts(n, lo, hi, seed)]


def phase_cmd(
    name: str, model_dir: Path, work: Path, args: argparse.Namespace, extra: list[str] | None = None
) -> list[str]:
    """The command line of one phase in its own process, with the engine settings of this run."""
    return [
        sys.executable,
        os.path.abspath(__file__),
        "--phase",
        name,
        "--model-dir",
        str(model_dir),
        "--workdir",
        str(work),
        "--max-len",
        str(args.max_len),
        "--hf-batch",
        str(args.hf_batch),
        "--gpu-memory-utilization",
        str(args.gpu_memory_utilization),
        *(extra or []),
        *engine_flags(args),
    ]


def run_phase(
    name: str, model_dir: Path, work: Path, args: argparse.Namespace, extra: list[str] | None = None
) -> dict[str, Any]:
    result = work / f"{name}.json"
    cmd = phase_cmd(name, model_dir, work, args, extra)
    log = work / f"{name}.log"
    result.unlink(missing_ok=True)
    t0 = time.perf_counter()
    rc = run_in_own_group(cmd, log, args.phase_timeout)
    if rc is None or not result.exists():
        why = "timed out" if rc is None else f"exit {rc}"
        raise RuntimeError(
            f"phase {name} failed ({why}); log {log}:\n{log.read_text(errors='replace')[-4000:]}"
        )
    out = json.loads(result.read_text())
    if rc != 0:
        # The result is written last, after every measurement: a crash on the way out (vLLM 0.24's
        # shutdown once aborted with "terminate called without an active exception" at 6.6B) does
        # not make its figures wrong. Kept, and said.
        print(
            f"WARNING: phase {name} exited with {rc} after writing its result (kept, exit_status in the "
            f"result); log {log}:\n{log.read_text(errors='replace')[-1500:]}",
            flush=True,
        )
        out["exit_status"] = rc
    out["wall_s"] = time.perf_counter() - t0
    return out


def error_summary(exc: BaseException, head: int = 1500, tail: int = 1500) -> str:
    """What failed (the message's start) and the end of the log it carries."""
    text = str(exc)
    return text if len(text) <= head + tail else f"{text[:head]}\n[…]\n{text[-tail:]}"


def run_in_own_group(
    cmd: list[str], log: Path, timeout_s: float, env: dict[str, str] | None = None
) -> int | None:
    """``cmd`` in a process group of its own, its output to ``log``; its exit status, or None when it
    ran past ``timeout_s``. The whole group is killed on the way out: nothing of the phase (vLLM's
    engine core is a child) stays on the GPU. A log file, not pipes: the engine core could hold a
    pipe open after the phase ends."""
    with open(log, "wb") as f:
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    rc: int | None = None
    try:
        rc = proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        rc = None
    finally:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGKILL)
        if rc is None:
            proc.wait(timeout=30)
    return rc


def score_gaps(a: list[list[float]], b: list[list[float]]) -> dict[str, float]:
    """How far two runs' scores of the same prompts lie apart (every label): the largest gap, its
    99th percentile and median, and the spread of ``b``'s scores for scale. One prompt's rounding
    outlier has a large max over a small p99; a real difference moves the median too."""
    gaps = sorted(abs(x - y) for ra, rb in zip(a, b, strict=True) for x, y in zip(ra, rb, strict=True))
    if not gaps:
        raise ValueError("no scores to compare: both runs scored no prompt")
    return {
        "max": gaps[-1],
        "p99": gaps[min(len(gaps) - 1, int(0.99 * len(gaps)))],
        "median": median(gaps),
        "sd": pstdev(y for rb in b for y in rb),
    }


def gap_fields(name: str, a: list[list[float]], b: list[list[float]]) -> dict[str, Any]:
    """A result row's fields for ``name`` (e.g. ``server_vs_offline``): the gaps, and the largest
    alone under the key older result files have (``_max_abs_diff``), computed once."""
    gaps = score_gaps(a, b)
    return {f"{name}_max_abs_diff": gaps["max"], f"{name}_abs_diff": gaps}


def fmt_gaps(gaps: dict[str, float]) -> str:
    return f"median {gaps['median']:.4f}, p99 {gaps['p99']:.4f}, max {gaps['max']:.4f} (sd {gaps['sd']:.3f})"


def wait_gpu_free(timeout_s: float = 60.0, below_mib: int = 2048) -> None:
    """Until the GPUs of this run use less than ``below_mib`` (a killed server's memory can linger a
    moment, and a vLLM engine starting then refuses: less free memory than its fraction)."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES", "")
    query = ["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits"]
    if visible and all(x.strip().isdigit() for x in visible.split(",")):
        query += ["-i", visible]
    deadline = time.monotonic() + timeout_s
    used: list[int] = []
    while time.monotonic() < deadline:
        try:
            out = subprocess.run(query, capture_output=True, text=True, timeout=30, check=True).stdout
            used = [int(x) for x in out.split()]
        except (OSError, subprocess.SubprocessError, ValueError):
            return  # no nvidia-smi: nothing to wait on
        if all(u < below_mib for u in used):
            return
        time.sleep(1.0)
    print(f"warning: GPU memory still in use after {timeout_s:.0f}s: {used} MiB", flush=True)


def goal_vs_offline(size: str) -> float:
    return GOAL_VS_OFFLINE.get(size, GOAL_VS_OFFLINE_DEFAULT)


def built_model(
    phase: str, size: str, label: str, work: Path, args: argparse.Namespace, extra: list[str] | None = None
) -> tuple[Path, dict[str, Any]]:
    """The model folder of ``work`` and what the ``phase`` that built it reported: built now, or
    earlier on this machine (``--reuse-models``)."""
    work.mkdir(parents=True, exist_ok=True)
    model_dir = work / "model"
    built_file = work / f"{phase}.json"
    if args.reuse_models and built_file.exists() and (model_dir / "config.json").exists():
        print(f"{label} reusing the model in {model_dir}", flush=True)
        return model_dir, json.loads(built_file.read_text())
    print(f"{label} building a random-weight model in {model_dir}", flush=True)
    return model_dir, run_phase(phase, model_dir, work, args, ["--size", size, *(extra or [])])


def describe_answers(p: dict[str, float], offline_tok_s: float) -> str:
    """One line of ``answer_profile``: how much of the round ran at the steady rate."""
    return (
        f"first after {p['first_answer_s'] * 1e3:.0f} ms; 10/50/90% of the tokens by "
        f"{p['t10_s']:.2f}/{p['t50_s']:.2f}/{p['t90_s']:.2f} s; steady {p['steady_tok_s']:,.0f} tok/s "
        f"(÷ offline {p['steady_tok_s'] / offline_tok_s:.3f}); {p['outside_steady_s'] * 1e3:.0f} ms of the "
        "round beyond the steady rate (ramp and tail)"
    )


def fmt_rounds(values: list[float]) -> str:
    return f"{min(values):.3f}-{max(values):.3f}" if len(values) > 1 else f"{values[0]:.3f}"


def pooled_rows_gain(
    offline: dict[str, Any], every_row: dict[str, Any], round_tokens: list[int]
) -> dict[str, Any]:
    """vLLM offline with the final layer on the pooled rows (as the server runs it) against vLLM's
    own model on the same prompt sets: throughput ratio per round, its median, and the scores' gap."""
    pooled_s, every_s = offline["round_seconds"], every_row["round_seconds"]
    rounds = [e / p for p, e in zip(pooled_s, every_s, strict=True)]
    return {
        "offline_every_row_tok_s": median(t / x for t, x in zip(round_tokens, every_s, strict=True)),
        "pooled_rows_vs_every_row_rounds": rounds,
        "pooled_rows_vs_every_row": median(rounds),
        **gap_fields("pooled_rows_vs_every_row", offline["scores"], every_row["scores"]),
    }


def bench_size(size: str, args: argparse.Namespace, root: Path, meta: dict[str, Any]) -> dict[str, Any]:
    work = root / size
    model_dir, built = built_model("build", size, f"[{size}]", work, args)
    meta.setdefault("card", built.get("card"))
    n_extra = len(args.items_per_request_list) - 1
    prompts: Prompts = {
        "main": make_prompts(args.prompts, args.min_len, args.max_len, seed=1),
        "warmup": make_prompts(64, args.min_len, args.max_len, seed=2),
        "extra": [
            make_prompts(args.prompts, args.min_len, args.max_len, seed=10 + i) for i in range(n_extra)
        ],
        "rounds": [
            make_prompts(args.prompts, args.min_len, args.max_len, seed=100 + i)
            for i in range(args.rounds - 1)
        ],
    }
    (work / "prompts.json").write_text(json.dumps(prompts))
    settle_heap()
    tokens = sum(map(len, prompts["main"]))
    print(
        f"[{size}] {built['params'] / 1e9:.2f}B params; {args.prompts} prompts, {tokens} tokens", flush=True
    )

    wait_gpu_free()
    offline = run_phase("offline", model_dir, work, args)
    walls: dict[str, float | None] = {"build": built.get("wall_s"), "offline": offline["wall_s"]}
    meta.setdefault("vllm", offline.get("vllm_version"))
    print(
        f"[{size}] vLLM offline: {tokens / offline['seconds']:,.0f} tok/s (startup {offline['startup_s']:.0f}s; "
        f"batch limits {offline['batch_limits']})",
        flush=True,
    )
    # per round (fresh prompts each): tokens/s of each engine and the ratios; the medians are the figures
    round_tokens = [tokens] + [sum(map(len, r)) for r in prompts["rounds"]]
    gain: dict[str, Any] | None = None
    every_row_env = None
    if args.offline_every_row:
        wait_gpu_free()
        every_row = run_phase(EVERY_ROW_PHASE, model_dir, work, args)
        walls[EVERY_ROW_PHASE], every_row_env = every_row["wall_s"], every_row.get("environment")
        gain = pooled_rows_gain(offline, every_row, round_tokens)
        print(
            f"[{size}] vLLM offline, every row ({LAST_TOKEN_ONLY.name}=0): "
            f"{gain['offline_every_row_tok_s']:,.0f} tok/s; pooled rows ÷ every row "
            f"{gain['pooled_rows_vs_every_row']:.3f} (rounds {fmt_rounds(gain['pooled_rows_vs_every_row_rounds'])}); "
            f"max |diff| {gain['pooled_rows_vs_every_row_max_abs_diff']:.4f}",
            flush=True,
        )
    wait_gpu_free()
    serve: dict[str, Any] | None = None
    serve_error = None
    t0 = time.perf_counter()
    if args.interleave and not args.skip_vllm_serve:
        try:
            server, serve = measure_pair(model_dir, prompts, args, work, offline["batch_limits"])
        except Exception as exc:  # the server's figures alone, as without --interleave
            serve_error = f"the interleaved run failed: {error_summary(exc)}"
            print(f"[{size}] {serve_error}", flush=True)
            wait_gpu_free()
    if serve is None:
        server = measure_http("server", model_dir, prompts, args, work)
    walls["server" if serve is None else "server and vllm serve"] = time.perf_counter() - t0
    primary = server["runs"][args.items_per_request_list[0]]
    print(
        f"[{size}] server HTTP: {tokens / primary['seconds']:,.0f} tok/s (startup {server['startup_s']:.0f}s); "
        f"CPU busy: {primary['cpu_busy']}",
        flush=True,
    )
    offline_tok_s = tokens / offline["seconds"]
    print(f"[{size}] server answers: {describe_answers(primary['answers'], offline_tok_s)}", flush=True)
    print(f"[{size}] server stages per request: {describe_stages(primary['stages'])}", flush=True)
    serve_run: dict[str, Any] | None = None
    if not args.skip_vllm_serve and not args.interleave:
        wait_gpu_free()
        t0 = time.perf_counter()
        try:
            serve = measure_http("vllm-serve", model_dir, prompts, args, work, limits=offline["batch_limits"])
        except Exception as exc:  # keep the offline and server figures of this size
            serve_error = error_summary(exc)
            print(f"[{size}] vllm serve FAILED: {serve_error}", flush=True)
        walls["vllm serve"] = time.perf_counter() - t0
    if serve is not None:
        serve_run = serve["runs"][args.items_per_request_list[0]]
        print(
            f"[{size}] vllm serve HTTP: {tokens / serve_run['seconds']:,.0f} tok/s "
            f"(startup {serve['startup_s']:.0f}s); CPU busy: {serve_run['cpu_busy']}",
            flush=True,
        )
        print(
            f"[{size}] vllm serve answers: {describe_answers(serve_run['answers'], offline_tok_s)}",
            flush=True,
        )
    hf = None
    if not args.skip_hf and size in args.hf_sizes.split(","):
        wait_gpu_free()
        hf = run_phase("hf", model_dir, work, args)
        walls["hf"] = hf["wall_s"]
        print(f"[{size}] transformers padded: {tokens / hf['seconds']:,.0f} tok/s", flush=True)

    off_s, srv_s = offline["round_seconds"], primary["round_seconds"]
    row: dict[str, Any] = {
        "kind": "score",
        "size": size,
        "rounds": len(round_tokens),
        "round_tokens": round_tokens,
        "offline_round_s": off_s,
        "server_round_s": srv_s,
        "server_vs_offline_rounds": [o / v for o, v in zip(off_s, srv_s, strict=True)],
        "params": built["params"],
        "shape": SIZES[size],
        "prompts": args.prompts,
        "tokens": tokens,
        "offline_tok_s": median(t / x for t, x in zip(round_tokens, off_s, strict=True)),
        "offline_s": offline["seconds"],
        "offline_batch_limits": offline["batch_limits"],
        "server_tok_s": median(t / x for t, x in zip(round_tokens, srv_s, strict=True)),
        "server_s": primary["seconds"],
        "items_per_request": args.items_per_request_list[0],
        "concurrency": args.concurrency,
        "server_vs_offline": median(o / v for o, v in zip(off_s, srv_s, strict=True)),
        "goal_server_vs_offline": goal_vs_offline(size),
        **gap_fields("server_vs_offline", primary["scores"], offline["scores"]),
        "server_cpu_busy": primary["cpu_busy"],
        "server_same_core": primary.get("same_core"),
        "server_stages": primary["stages"],
        "server_answers": primary["answers"],
        "other_request_sizes": {
            str(k): {
                "tok_s": v["tokens"] / v["seconds"],
                "vs_offline": (v["tokens"] / v["seconds"]) / (tokens / offline["seconds"]),
            }
            for k, v in list(server["runs"].items())[1:]
        },
        "startup_s": {"offline": offline["startup_s"], "server": server["startup_s"]},
        "offline_tok_s_rounds": per_second(round_tokens, off_s),
        "server_tok_s_rounds": per_second(round_tokens, srv_s),
        "interleaved": bool(args.interleave and serve is not None),
        "environments": {"offline": offline.get("environment"), "server": primary.get("environment")},
        "phase_wall_s": walls,
    }
    if every_row_env is not None:
        row["environments"]["offline_every_row"] = every_row_env
    if gain is not None:
        row.update(gain)
    if serve_error is not None:
        row["vllm_serve_error"] = serve_error
    if serve is not None and serve_run is not None:
        row["startup_s"]["vllm_serve"] = serve["startup_s"]
        vs_s = serve_run["round_seconds"]
        row.update(
            {
                "vllm_serve_round_s": vs_s,
                "server_vs_vllm_serve_rounds": [v / x for v, x in zip(vs_s, srv_s, strict=True)],
                "vllm_serve_tok_s": median(t / x for t, x in zip(round_tokens, vs_s, strict=True)),
                "vllm_serve_s": serve_run["seconds"],
                "vllm_serve_tok_s_rounds": per_second(round_tokens, vs_s),
                "vllm_serve_vs_offline_rounds": [o / v for o, v in zip(off_s, vs_s, strict=True)],
                "vllm_serve_vs_offline": median(o / v for o, v in zip(off_s, vs_s, strict=True)),
                "server_vs_vllm_serve": median(v / x for v, x in zip(vs_s, srv_s, strict=True)),
                "goal_server_vs_vllm_serve": GOAL_VS_SERVE,
                **gap_fields("vllm_serve_vs_offline", serve_run["scores"], offline["scores"]),
                "vllm_serve_cpu_busy": serve_run["cpu_busy"],
                "vllm_serve_same_core": serve_run.get("same_core"),
                "vllm_serve_answers": serve_run["answers"],
                "vllm_serve_command": serve["command"],
            }
        )
        row["environments"]["vllm_serve"] = serve_run.get("environment")
    if hf is not None:
        hf_s = hf.get("round_seconds", [hf["seconds"]])
        rounds = [h / x for h, x in zip(hf_s, srv_s, strict=True)]
        row.update(
            {
                "hf_tok_s": median(per_second(round_tokens, hf_s)),
                "hf_tok_s_rounds": per_second(round_tokens, hf_s),
                "hf_s": hf["seconds"],
                "server_vs_hf_rounds": rounds,
                "server_vs_hf": median(rounds),
                "goal_server_vs_hf": GOAL_VS_HF,
                **gap_fields("hf_vs_offline", hf["scores"], offline["scores"]),
            }
        )
        row["environments"]["hf"] = hf.get("environment")
    return summarised(row)


def per_second(amounts: Sequence[float], seconds: Sequence[float]) -> list[float]:
    """Each round's rate: tokens (or requests) over seconds, round by round."""
    return [a / x for a, x in zip(amounts, seconds, strict=True)]


def bench_judge(size: str, args: argparse.Namespace, root: Path, meta: dict[str, Any]) -> dict[str, Any]:
    """The LLM judge at ``size``: the reward server in generate mode and ``vllm serve`` (up at once,
    taking turns, with ``--interleave``; else one after the other)."""
    label, work, k = f"[judge {size}]", root / f"judge-{size}", args.judge_output_tokens
    model_dir, built = built_model("build-judge", size, label, work, args, ["--judge-output-tokens", str(k)])
    meta.setdefault("card", built.get("card"))
    meta.setdefault("vllm", built.get("vllm_version"))
    lo, hi = args.min_len, args.max_len
    chats: JudgeChats = {
        "warmup": judge_chats(args.concurrency, lo, hi, seed=2),  # a full batch: every batch size runs
        "rounds": [judge_chats(args.judge_prompts, lo, hi, seed=1)]
        + [judge_chats(args.judge_prompts, lo, hi, seed=100 + i) for i in range(args.rounds - 1)],
    }
    (work / "chats.json").write_text(json.dumps(chats))
    print(
        f"{label} {built['params'] / 1e9:.2f}B params; {args.judge_prompts} chats of U[{lo}, {hi}] words, "
        f"{k} answer tokens each; batch limits {built['batch_limits']}",
        flush=True,
    )
    wait_gpu_free()
    limits = built["batch_limits"]
    t0 = time.perf_counter()
    server: dict[str, Any] | None = None
    serve: dict[str, Any] | None = None
    serve_error = None
    t0 = time.perf_counter()
    if args.interleave and not args.skip_vllm_serve:
        try:
            server, serve = measure_judge_pair(model_dir, chats, args, work, limits)
        except Exception as exc:  # the server's figures alone, as without --interleave
            serve_error = f"the interleaved run failed: {error_summary(exc)}"
            print(f"{label} {serve_error}", flush=True)
            wait_gpu_free()
    if server is None:
        server = measure_judge("server", model_dir, chats, args, work, limits)
    print_judge_run(label, "server HTTP", server)
    if not args.skip_vllm_serve and not args.interleave:
        wait_gpu_free()
        try:
            serve = measure_judge("vllm-serve", model_dir, chats, args, work, limits)
        except Exception as exc:  # keep the server's figures
            serve_error = error_summary(exc)
            print(f"{label} vllm serve FAILED: {serve_error}", flush=True)
    if serve is not None:
        print_judge_run(label, "vllm serve HTTP", serve)
    walls = {"build": built.get("wall_s"), "servers": time.perf_counter() - t0}
    return {**judge_row(size, built, server, serve, serve_error, args), "phase_wall_s": walls}


def out_tok_s(run: dict[str, Any]) -> list[float]:
    """Output tokens/s of each round of a judge run."""
    return [r["output_tokens"] / r["seconds"] for r in run["rounds"]]


def req_s(run: dict[str, Any]) -> list[float]:
    return [r["requests"] / r["seconds"] for r in run["rounds"]]


def print_judge_run(label: str, what: str, run: dict[str, Any]) -> None:
    wrong = sum(r["wrong_length"] for r in run["rounds"])
    print(
        f"{label} {what}: {median(out_tok_s(run)):,.0f} output tok/s, {median(req_s(run)):,.1f} req/s "
        f"(startup {run['startup_s']:.0f}s); answers not of the length asked: {wrong}; "
        f"CPU busy: {run['cpu_busy']}",
        flush=True,
    )


def greedy_agreement(a: list[str], b: list[str]) -> tuple[float, float]:
    """The share of identical answers, and the mean share of each answer's words before the first
    difference (batching changes bf16 rounding, so long greedy answers drift apart)."""

    def common(x: list[str], y: list[str]) -> float:
        if x == y:
            return 1.0
        n = next((i for i, (u, v) in enumerate(zip(x, y, strict=False)) if u != v), min(len(x), len(y)))
        return n / max(len(x), len(y), 1)

    same = sum(x == y for x, y in zip(a, b, strict=True)) / len(a)
    prefix = sum(common(x.split(), y.split()) for x, y in zip(a, b, strict=True)) / len(a)
    return same, prefix


def judge_row(
    size: str,
    built: dict[str, Any],
    server: dict[str, Any],
    serve: dict[str, Any] | None,
    serve_error: str | None,
    args: argparse.Namespace,
) -> dict[str, Any]:
    """The judge's result row: per round and medians, the ratio and its goal, the sanity checks."""
    srv = out_tok_s(server)
    row: dict[str, Any] = {
        "kind": "judge",
        "size": size,
        "params": built["params"],
        "shape": SIZES[size],
        "prompts": args.judge_prompts,
        "output_tokens": args.judge_output_tokens,
        "concurrency": args.concurrency,
        "max_model_len": judge_model_len(args),
        "batch_limits": built["batch_limits"],
        "rounds": len(srv),
        "server_rounds": server["rounds"],
        "server_out_tok_s": median(srv),
        "server_req_s": median(req_s(server)),
        "server_wrong_length": sum(r["wrong_length"] for r in server["rounds"]),
        "server_cpu_busy": server["cpu_busy"],
        "server_same_core": server.get("same_core"),
        "server_command": server["command"],
        "startup_s": {"server": server["startup_s"]},
        "server_out_tok_s_rounds": srv,
        "interleaved": bool(args.interleave and serve is not None),
        "environments": {"server": server.get("environment")},
    }
    if serve_error is not None:
        row["vllm_serve_error"] = serve_error
    if serve is not None:
        row["environments"]["vllm_serve"] = serve.get("environment")
        row["vllm_serve_out_tok_s_rounds"] = out_tok_s(serve)
        ratios = [x / v for x, v in zip(srv, out_tok_s(serve), strict=True)]
        same, prefix = greedy_agreement(server["texts"], serve["texts"])
        row["startup_s"]["vllm_serve"] = serve["startup_s"]
        row.update(
            {
                "vllm_serve_rounds": serve["rounds"],
                "vllm_serve_out_tok_s": median(out_tok_s(serve)),
                "vllm_serve_req_s": median(req_s(serve)),
                "vllm_serve_wrong_length": sum(r["wrong_length"] for r in serve["rounds"]),
                "server_vs_vllm_serve_rounds": ratios,
                "server_vs_vllm_serve": median(ratios),
                "goal_server_vs_vllm_serve": GOAL_VS_SERVE,
                "greedy_identical": same,
                "greedy_common_prefix": prefix,
                "vllm_serve_cpu_busy": serve["cpu_busy"],
                "vllm_serve_same_core": serve.get("same_core"),
                "vllm_serve_command": serve["command"],
            }
        )
    return summarised(row)


# Each ratio of a result row and the two environments it sets against each other.
RATIO_ENVIRONMENTS = {
    "server_vs_offline": ("server", "offline"),
    "server_vs_vllm_serve": ("server", "vllm_serve"),
    "vllm_serve_vs_offline": ("vllm_serve", "offline"),
    "server_vs_hf": ("server", "hf"),
    "pooled_rows_vs_every_row": ("offline", "offline_every_row"),
}
ENVIRONMENT_NAMES = {
    "server": "the reward server",
    "vllm_serve": "vllm serve",
    "offline": "vLLM offline",
    "offline_every_row": "vLLM offline, every row",
    "hf": "transformers",
}


def summarised(row: dict[str, Any]) -> dict[str, Any]:
    """``row`` with the median and spread of every per-round figure (``X_rounds`` gives
    ``X_spread``), and each ratio between environments that differ in a way that matters taken
    out: ``X_refused`` names the differences instead (``env_diff``)."""
    envs = row.get("environments") or {}
    for key, (a, b) in RATIO_ENVIRONMENTS.items():
        if key not in row or (a not in envs and b not in envs):
            continue  # not measured, or a result file from before the environments were recorded
        why = env_diff.differences(envs.get(a), envs.get(b), (ENVIRONMENT_NAMES[a], ENVIRONMENT_NAMES[b]))
        if why:
            row[f"{key}_refused"] = why
            for suffix in ("", "_rounds"):
                row.pop(key + suffix, None)
    for key, values in list(row.items()):
        numbers = isinstance(values, list) and values and all(isinstance(v, int | float) for v in values)
        if key.endswith("_rounds") and numbers:
            row[key.removesuffix("_rounds") + "_spread"] = spread(values).as_dict()
    return row


def goals(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each goal of each size, judged on its rounds: met only when the lower quartile of at least
    ``MIN_ROUNDS`` rounds meets the bound (``round_spread.goal_verdict``). Not judged: a ratio
    refused for unlike environments (the differences are named), and server ÷ ``vllm serve``
    from servers that ran one after the other instead of taking turns. A goal whose measurement
    did not run is left out."""
    out: list[dict[str, Any]] = []
    for r in rows:
        if r.get("kind") == "judge":
            checks = [("judge: server / vllm serve", "server_vs_vllm_serve", GOAL_VS_SERVE)]
        else:
            checks = [
                ("server / vLLM offline", "server_vs_offline", r["goal_server_vs_offline"]),
                ("server / vllm serve", "server_vs_vllm_serve", GOAL_VS_SERVE),
                ("server / transformers", "server_vs_hf", GOAL_VS_HF),
            ]
        for what, key, bound in checks:
            goal: dict[str, Any] = {"size": r["size"], "goal": what, "bound": bound}
            if f"{key}_refused" in r:
                why = "not judged: environments differ: " + "; ".join(r[f"{key}_refused"])
                out.append({**goal, "value": None, "judged": False, "met": False, "why": why})
                continue
            if key not in r:
                continue
            rounds = r.get(f"{key}_rounds") or [r[key]]
            verdict = goal_verdict(rounds, bound)
            if key == "server_vs_vllm_serve" and r.get("interleaved") is False:
                why = "not judged: the two servers ran one after the other, not taking turns (--interleave)"
                verdict = verdict._replace(judged=False, met=False, why=why)
            out.append({**goal, "value": r[key], **verdict._asdict(), "spread": spread(rounds).as_dict()})
    return out


def goal_line(g: dict[str, Any]) -> str:
    """One goal as printed: the median and the spread of its rounds, the bound, and the verdict on
    the lower quartile (with the digits that show a miss: 0.99999 is not 1.000)."""
    head = f"  {g['size']:>5} {g['goal']:<26}"
    if g.get("value") is None:
        return f"{head} -: {g['why']}"
    if "spread" not in g:  # a result file from before the spread: its median alone
        return f"{head} {g['value']:.3f} (goal >= {g['bound']}): {'met' if g['met'] else 'MISSED'}"
    figures = Spread(**g["spread"]).describe(bound=g["bound"])
    return f"{head} {figures}, goal: lower quartile >= {g['bound']}: {'met' if g['met'] else g['why']}"


def fmt(x: float | None, spec: str) -> str:
    return "-" if x is None else format(x, spec)


def print_table(rows: list[dict[str, Any]], args: argparse.Namespace) -> None:
    scoring = [r for r in rows if r.get("kind") != "judge"]
    judging = [r for r in rows if r.get("kind") == "judge"]
    if scoring:
        print_scoring_table(scoring, args)
    if judging:
        print_judge_table(judging, args)
    print("goals:")
    for g in goals(rows):
        print(goal_line(g))


def run_settings(args: argparse.Namespace, inputs: str) -> str:
    """The tables' header tail: the settings every phase ran with (``inputs``: prompts or chats)."""
    return (
        (", enforce_eager" if args.enforce_eager else "")
        + f"; medians of {args.rounds} round(s) on fresh {inputs}"
        + f"; vllm serve with {SERVE_SETTINGS[args.vllm_serve_settings]}"
        + ("; interleaved: both servers up at once, half the memory fraction each" if args.interleave else "")
    )


def print_scoring_table(rows: list[dict[str, Any]], args: argparse.Namespace) -> None:
    print("\n==== scoring throughput (tokens/s), one GPU, same prompts ====")
    print(
        f"prompts {args.prompts}, lengths U[{args.min_len}, {args.max_len}], HTTP: {args.concurrency} in flight, "
        f"{args.items_per_request_list[0]} prompts/request; transformers: batches of {args.hf_batch}, padded"
        + run_settings(args, "prompts")
    )
    print(
        f"{'model':>6} {'params':>7} {'offline':>10} {'server':>10} {'vllm serve':>10} {'hf':>10} "
        f"{'srv/off':>8} {'srv/serve':>9} {'serve/off':>9} {'srv/hf':>7} {'|srv-off|':>9} {'|serve-off|':>11}"
    )
    for r in rows:
        print(
            f"{r['size']:>6} {r['params'] / 1e9:>6.2f}B {r['offline_tok_s']:>10,.0f} {r['server_tok_s']:>10,.0f} "
            f"{fmt(r.get('vllm_serve_tok_s'), ',.0f'):>10} {fmt(r.get('hf_tok_s'), ',.0f'):>10} "
            f"{fmt(r.get('server_vs_offline'), '.3f'):>8} {fmt(r.get('server_vs_vllm_serve'), '.3f'):>9} "
            f"{fmt(r.get('vllm_serve_vs_offline'), '.3f'):>9} {fmt(r.get('server_vs_hf'), '.2f'):>7} "
            f"{r['server_vs_offline_max_abs_diff']:>9.4f} {fmt(r.get('vllm_serve_vs_offline_max_abs_diff'), '.4f'):>11}"
        )
        print_spreads(r, SCORING_FIGURES)
        gaps = [
            f"{who} {fmt_gaps(r[key])}"
            for who, key in (
                ("server", "server_vs_offline_abs_diff"),
                ("vllm serve", "vllm_serve_vs_offline_abs_diff"),
                ("transformers", "hf_vs_offline_abs_diff"),
            )
            if key in r
        ]
        if gaps:  # result files written before the gaps have none
            print(f"{'':>6} |score - offline's|: " + "; ".join(gaps))
        if "pooled_rows_vs_every_row" in r:
            print(
                f"{'':>6} offline, pooled rows ÷ every row: {r['pooled_rows_vs_every_row']:.3f} (rounds "
                f"{fmt_rounds(r['pooled_rows_vs_every_row_rounds'])}; every row "
                f"{r['offline_every_row_tok_s']:,.0f} tok/s; max |diff| {r['pooled_rows_vs_every_row_max_abs_diff']:.4f})"
            )
        for k, v in r["other_request_sizes"].items():
            print(
                f"{'':>6} {'':>7} server with {k} prompt(s)/request: {v['tok_s']:,.0f} tok/s = {v['vs_offline']:.3f} x offline"
            )
        print(
            f"{'':>6} CPU busy (CPU s / wall s): server {r['server_cpu_busy']}"
            + (f"; vllm serve {r['vllm_serve_cpu_busy']}" if "vllm_serve_cpu_busy" in r else "")
        )
        print(f"{'':>6} server stages per request (its /metrics): {describe_stages(r['server_stages'])}")
        print_environments(r)


# (label, key): the per-round figures of a row whose spread is printed (``key_rounds``)
SCORING_FIGURES = (
    ("server / offline", "server_vs_offline"),
    ("server / vllm serve", "server_vs_vllm_serve"),
    ("vllm serve / offline", "vllm_serve_vs_offline"),
    ("server / transformers", "server_vs_hf"),
    ("offline tok/s", "offline_tok_s"),
    ("server tok/s", "server_tok_s"),
    ("vllm serve tok/s", "vllm_serve_tok_s"),
    ("transformers tok/s", "hf_tok_s"),
)
JUDGE_FIGURES = (
    ("server / vllm serve", "server_vs_vllm_serve"),
    ("server out tok/s", "server_out_tok_s"),
    ("vllm serve out tok/s", "vllm_serve_out_tok_s"),
)


def print_spreads(r: dict[str, Any], figures: Sequence[tuple[str, str]]) -> None:
    """Each per-round figure of a row as its median and spread, and each ratio refused for unlike
    environments with the differences."""
    for label, key in figures:
        rounds = r.get(f"{key}_rounds")
        if rounds:
            print(f"{'':>6} {label}: {spread(rounds).describe(',.0f' if key.endswith('tok_s') else '.3f')}")
        if f"{key}_refused" in r:
            print(f"{'':>6} {label}: REFUSED, environments differ: " + "; ".join(r[f"{key}_refused"]))


def print_environments(r: dict[str, Any]) -> None:
    """One line per recorded environment: event loop, HTTP parser, processes answering HTTP, and
    the processes that last ran on one physical core; then, per server, the pairs of processes
    (this client included) that shared a physical core during the headline round, and how much."""
    for who, key in (("server", "server_same_core"), ("vllm serve", "vllm_serve_same_core")):
        pairs = {pair: share for pair, share in (r.get(key) or {}).items() if share > 0}
        if key in r:
            print(f"{'':>6} on one physical core in the headline round ({who}): {pairs or 'none'}")
    for name, env in (r.get("environments") or {}).items():
        if not env or "error" in env:
            print(f"{'':>6} environment of {name}: not read ({(env or {}).get('error', 'not recorded')})")
            continue
        http = (
            f"loop {env['event_loop']}, parser {env['http_parser']}, {env['api_processes']} API process(es), "
            if env.get("api_processes") is not None
            else ""
        )
        last = "; ".join(env.get("same_core") or []) or "none"
        print(
            f"{'':>6} environment of {name}: {http}{env['engine_processes']} engine core(s), CPUs "
            f"{env.get('cpus')}; last on one physical core: {last}"
        )


def print_judge_table(rows: list[dict[str, Any]], args: argparse.Namespace) -> None:
    print("\n==== LLM judge throughput (output tokens/s), one GPU, same chats: /v1/chat/completions ====")
    print(
        f"{args.judge_prompts} chats per round, one user message of U[{args.min_len}, {args.max_len}] tokens "
        f"(+3 of the template), {args.judge_output_tokens} answer tokens each (max_tokens, greedy, "
        f"ignore_eos); HTTP: {args.concurrency} in flight, one chat per request" + run_settings(args, "chats")
    )
    print(
        f"{'model':>6} {'params':>7} {'server':>10} {'srv req/s':>9} {'vllm serve':>10} {'serve req/s':>11} "
        f"{'srv/serve':>9} {'wrong len':>9} {'same answer':>11} {'same prefix':>11}"
    )
    for r in rows:
        wrong = f"{r['server_wrong_length']}/{r.get('vllm_serve_wrong_length', '-')}"
        print(
            f"{r['size']:>6} {r['params'] / 1e9:>6.2f}B {r['server_out_tok_s']:>10,.0f} {r['server_req_s']:>9,.1f} "
            f"{fmt(r.get('vllm_serve_out_tok_s'), ',.0f'):>10} {fmt(r.get('vllm_serve_req_s'), ',.1f'):>11} "
            f"{fmt(r.get('server_vs_vllm_serve'), '.3f'):>9} {wrong:>9} "
            f"{fmt(r.get('greedy_identical'), '.3f'):>11} {fmt(r.get('greedy_common_prefix'), '.3f'):>11}"
        )
        print_spreads(r, JUDGE_FIGURES)
        if "vllm_serve_error" in r:
            print(
                f"{'':>6} vllm serve FAILED (its log's tail is in the JSON result): {r['vllm_serve_error'][:300]}"
            )
        if r["server_wrong_length"] or r.get("vllm_serve_wrong_length"):
            print(
                f"{'':>6} WARNING: answers not of {r['output_tokens']} tokens (server/vllm serve): {wrong}; "
                "the tokens/s compare unequal work"
            )
        print(
            f"{'':>6} CPU busy (CPU s / wall s): server {r['server_cpu_busy']}"
            + (f"; vllm serve {r['vllm_serve_cpu_busy']}" if "vllm_serve_cpu_busy" in r else "")
        )
        print_environments(r)
    print(
        "(wrong len: answers whose usage.completion_tokens differs from the tokens asked, server/vllm serve; "
        "same answer / same prefix: identical greedy texts, and the mean share of words before they differ)"
    )


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--sizes",
        default="0.4b,1.4b,7b",
        help=f"comma list of {sorted(SIZES)} for scoring; '' for none (only the judge)",
    )
    p.add_argument(
        "--judge-sizes",
        default="",
        help="comma list of sizes for the LLM judge (/v1/chat/completions: server vs vllm serve); "
        "default: none",
    )
    p.add_argument("--judge-prompts", type=int, default=512, help="chats per judge round")
    p.add_argument("--judge-output-tokens", type=int, default=128, help="answer tokens per chat (judge)")
    p.add_argument("--quick", action="store_true", help="0.4b only, 512 prompts, --enforce-eager")
    p.add_argument("--prompts", type=int, default=2048)
    p.add_argument("--min-len", type=int, default=64)
    p.add_argument(
        "--max-len",
        type=int,
        default=1024,
        help="longest prompt; also the engines' max_model_len (judge: plus the answer and 16)",
    )
    p.add_argument("--concurrency", type=int, default=256, help="HTTP requests in flight")
    p.add_argument(
        "--items-per-request",
        default="8",
        help="prompts per HTTP request; a comma list measures each with the reward server (the first is "
        "the headline, and the only one sent to vllm serve)",
    )
    p.add_argument(
        "--rounds",
        type=int,
        default=MIN_ROUNDS,
        help="the headline measurement on this many fresh prompt sets per engine (figures: medians "
        f"and spreads; a goal is judged on at least {MIN_ROUNDS}, on its rounds' lower quartile)",
    )
    p.add_argument("--hf-batch", type=int, default=64)
    p.add_argument("--gpu-memory-utilization", type=float, default=0.85)
    add_engine_arguments(p)
    p.add_argument("--skip-hf", action="store_true", help="no transformers phase")
    p.add_argument(
        "--hf-sizes", default="0.4b,1.4b", help="sizes that get the transformers phase (default: 0.4b,1.4b)"
    )
    p.add_argument("--skip-vllm-serve", action="store_true", help="no vllm serve phase")
    p.add_argument(
        "--offline-every-row",
        action="store_true",
        help="scoring: also run vLLM offline with REWARDPLANE_LAST_TOKEN_ONLY=0 (vLLM's own model, the "
        "final decoder layer on every row) and report the pooled rows' gain over it, round by round",
    )
    p.add_argument(
        "--interleave",
        action="store_true",
        help="scoring: the reward server and vllm serve up at once, half the memory fraction each, "
        "every prompt set scored by both back to back (the order alternating by round), so the GPU's "
        "drift between phases stays out of server / vllm serve",
    )
    p.add_argument(
        "--vllm-serve-settings",
        choices=tuple(SERVE_SETTINGS),
        default="server",
        help="vllm serve's batch limits and chunked prefill: the reward server's (server: compares the "
        "front ends over one engine) or vllm serve's own defaults (own: what a user running it gets)",
    )
    p.add_argument(
        "--reuse-models", action="store_true", help="use a model built earlier in --workdir (same size)"
    )
    p.add_argument("--phase-timeout", type=float, default=900.0, help="bound on each phase (s)")
    p.add_argument(
        "--stall-timeout",
        type=float,
        default=STALL_S,
        help="a server that answers nothing for this long while requests wait has stalled: its "
        "phase fails with how many requests it answered (s)",
    )
    p.add_argument("--workdir", type=Path, default=Path("/tmp/rp-scoring-bench"))
    p.add_argument("--out", type=Path, default=Path(os.environ["OUT"]) if os.environ.get("OUT") else None)
    # internal: one phase in this process
    p.add_argument(
        "--phase", choices=["build", "build-judge", "offline", EVERY_ROW_PHASE, "hf"], help=argparse.SUPPRESS
    )
    p.add_argument("--model-dir", type=Path, help=argparse.SUPPRESS)
    p.add_argument("--size", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.quick:
        args.sizes, args.prompts, args.enforce_eager = "0.4b", min(args.prompts, 512), True
    args.items_per_request_list = [int(x) for x in str(args.items_per_request).split(",") if x.strip()]
    args.size_list = [x.strip() for x in args.sizes.split(",") if x.strip()]
    args.judge_size_list = [x.strip() for x in args.judge_sizes.split(",") if x.strip()]
    unknown = [x for x in args.size_list + args.judge_size_list if x not in SIZES]
    if unknown:
        p.error(f"unknown sizes {unknown}; choose from {sorted(SIZES)}")
    if not args.phase and not args.size_list and not args.judge_size_list:
        p.error("nothing to measure: --sizes and --judge-sizes are both empty")
    check_engine_arguments(p, args)
    if min(args.judge_prompts, args.judge_output_tokens, args.rounds, args.concurrency) < 1:
        p.error("--judge-prompts, --judge-output-tokens, --rounds and --concurrency must be >= 1")
    return args


def write_result(rows: list[dict[str, Any]], meta: dict[str, Any], args: argparse.Namespace) -> None:
    if args.out is None:
        return
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "scoring_gpu.json").write_text(
        json.dumps(
            {
                "meta": meta,
                "rows": rows,
                "goals": goals(rows),
                "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
            },
            indent=2,
        )
    )


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    os.environ.setdefault("VLLM_USE_FLASHINFER_SAMPLER", "0")  # FlashInfer is not in the device bundle
    if args.phase:
        work = args.workdir
        if args.phase == "build":
            out = phase_build(args.model_dir, args.size, args.max_len)
        elif args.phase == "build-judge":
            out = phase_build_judge(args.model_dir, args.size, judge_model_len(args))
        else:
            prompts = json.loads((work / "prompts.json").read_text())
            settle_heap()
            if args.phase == EVERY_ROW_PHASE:
                # read by the reward server's worker extension in vLLM's workers (they inherit it)
                os.environ[LAST_TOKEN_ONLY.name] = "0"
            out = (
                phase_hf(args.model_dir, prompts, args)
                if args.phase == "hf"
                else phase_offline(args.model_dir, prompts, args)
            )
        (work / f"{args.phase}.json").write_text(json.dumps(out))
        return 0
    args.workdir.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    meta: dict[str, Any] = {
        "commit": os.environ.get("RP_COMMIT"),
        "date": time.strftime("%Y-%m-%d", time.gmtime()),
        # the machine: its CPUs and their load decide vLLM's CPU-bound steps (server_env.host)
        "host": server_env.host(),
        "batch_invariant": os.environ.get("VLLM_BATCH_INVARIANT", "0"),
        # the reward server's final decoder layer on the pooled rows only (vllm_last_token)
        "last_token_only": os.environ.get(LAST_TOKEN_ONLY.name, "1"),
    }
    rows: list[dict[str, Any]] = []
    runs = [(size, size, bench_size) for size in args.size_list]
    runs += [(f"judge {size}", size, bench_judge) for size in args.judge_size_list]
    for name, size, bench in runs:
        try:
            rows.append(bench(size, args, args.workdir, meta))
        except Exception as exc:  # keep the sizes measured so far
            print(f"[{name}] FAILED: {exc}", flush=True)
            meta.setdefault("failed", {})[name] = str(exc)[-2000:]
        meta["wall_s"] = time.perf_counter() - started  # so far: the run's length, for planning
        print_table(rows, args)  # after each size, in case a later one runs out of time
        write_result(rows, meta, args)
    return 1 if meta.get("failed") else 0


if __name__ == "__main__":
    raise SystemExit(main())
