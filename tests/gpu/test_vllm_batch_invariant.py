"""Deterministic scoring on a real GPU: a reward server started with ``--deterministic`` (vLLM's
batch-invariant kernels, ``VLLM_BATCH_INVARIANT=1``, and prefix caching off) scores one text bit for
bit the same alone, at any position of batches of any size, and while other clients' requests share
the engine's steps.

Layout: a random-weight ``LlamaForSequenceClassification`` large enough that batches change the
GEMMs' tiling (hidden 1024, 8 layers, 16 heads, 8 KV heads, intermediate 4096; bf16, fp32 head),
served by ``python -m rewardplane.server --engine vllm --deterministic`` twice on GPU 0: as users get
it (on compute capability 9.0 and later the linear layers run cuBLASLt without split-K:
``server/engines/vllm_deterministic.py``), then with ``REWARDPLANE_DETERMINISTIC_GEMM=triton``
(vLLM's Triton matmul); each must log the matmul it runs. A server in the default mode gets the same
requests: on GPU 1 where there are two GPUs (started with the first), else on GPU 0 after the others
are ready; its scores must move somewhere (the test can tell the modes apart). Every run is written
to ``$OUT/batch_invariant_test.json`` (``RP_BI_DEFAULT_SERVER=0`` leaves the default server out).

Two probes: a short one (7 tokens, less than one 16-token KV block) and a long one (~260 tokens).
With prefix caching on, a repeated long prompt would reuse its cached blocks, computed by other
kernels than a whole prompt: its score moved by 5e-3 between the first scoring and later ones with
``VLLM_BATCH_INVARIANT=1`` alone, which is why ``--deterministic`` turns prefix caching off. Every
scoring of either probe, the first included, must be equal.

Each probe is scored alone, at the first, middle and last index of batches of 2, 7, 33 and 128
texts (other texts of 1-160 words, fresh ones for every batch), and in 3 rounds of 24 concurrent
background requests with 6 probe requests sent while those are in flight. Eight more texts (1-160
words) are each scored alone, twice, then the eight in one batch and among 56 others, so that a
difference that two probes might miss by chance shows. Scores are compared with ``==`` on the
floats the server returns (fp32 head outputs, serialized exactly).

A server started first, alone, runs ``--deterministic --enforce-eager`` (``-k eager`` runs only
it): eager, RMSNorm with a residual would be vLLM's fused CUDA kernel, whose thread block is 1024
wide below 256 tokens per launch and 256 above (vllm#48391); the server puts it on vLLM's Triton
norm kernel (``vllm_deterministic.residual_norm_rows_exact``).

The servers run the final decoder layer on the pooled rows only (``vllm_last_token``), as by
default: its few rows per step, and the score head's, run on vLLM's Triton matmul in this mode
(with cuBLASLt a prompt alone in its step scored 1 ulp away from its score in larger steps).

Env knobs: ``RP_VLLM_SERVER_ARGS`` (extra server flags), ``RP_VLLM_STARTUP_S`` (start timeout).
Time on one H200: the eager case 1 min 28 s; the two compiled deterministic servers 2 min 45 s
with ``RP_BI_DEFAULT_SERVER=0``; the default-mode server adds one more vLLM start.
"""

from __future__ import annotations

import asyncio
import os
import random
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest

from rewardplane.protocol.settings import DETERMINISTIC_GEMM
from rewardplane.server.engines.vllm_deterministic import CUBLAS_MIN_MAJOR
from rewardplane.testing.servers import ServerHandle
from tests.gpu.conftest import LlamaSize, build_llama_seqcls
from tests.gpu.vllm_support import device_count, record_result, start_vllm_server, stop, wait_ready

pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.timeout(1500)]

SIZE = LlamaSize(hidden=1024, layers=8, heads=16, kv_heads=8, intermediate=4096)
KV_BLOCK_TOKENS = 16  # vLLM's default KV-cache block size on CUDA: shorter prompts are never cached
SHORT_PROBE = "The answer is 42."
LONG_PROBE = (
    "The reward model reads the whole conversation, weighs how helpful, honest and harmless the "
    "final answer is, and returns one number that the policy tries to push up during training. "
    "A careful grader checks every step of the reasoning, notices when a claim has no support, "
    "prefers a short correct answer to a long wrong one, and gives the same number to the same "
    "text whether it arrives alone, first in a large batch, last in a small one, or in the middle "
    "of many other requests that the server happens to be scoring at the same moment."
)
PROBES = {"short": SHORT_PROBE, "long": LONG_PROBE}
MORE_TEXTS = 8  # scored alone and batched besides the probes
MORE_TEXTS_AMONG = 56  # other texts in the mixed batch
BATCH_SIZES = (2, 7, 33, 128)
POSITIONS = ("first", "middle", "last")
CONCURRENT_ROUNDS = 3
BACKGROUND_REQUESTS = 24
PROBE_REQUESTS = 6
# fmt: off
WORDS = [
    "the", "a", "reward", "model", "policy", "answer", "question", "helpful", "honest", "careful",
    "step", "sea", "night", "poem", "kernel", "batch", "score", "token", "layer", "train", "value",
    "gradient", "cluster", "server", "replica", "push", "weight", "cache", "prefix", "attention",
    "matrix", "tile", "sum", "order", "bit", "exact", "float", "number", "text", "short", "long",
    "varied",
]
# fmt: on
RESULT_FILE = "batch_invariant_test.json"
TRITON_GEMM_ENV = DETERMINISTIC_GEMM.name


def gpu_major() -> int:
    from vllm.platforms import current_platform  # NVML: no CUDA context in the test process

    cap = current_platform.get_device_capability()
    assert cap is not None, "no CUDA device capability"
    return cap.major


def other_texts(n: int, seed: int) -> list[str]:
    """``n`` texts of 1-160 words (1-~510 tokens with the test tokenizer), the same for a seed."""
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 160))) for _ in range(n)]


def index_of(position: str, n: int) -> int:
    return {"first": 0, "middle": n // 2, "last": n - 1}[position]


def one_value(score: Any) -> float:
    """The single label's raw score (a float; a one-element list is accepted too)."""
    if isinstance(score, list):
        assert len(score) == 1, f"expected one label, got {score}"
        score = score[0]
    return float(score)


def parse_scores(r: httpx.Response, n: int) -> tuple[list[float], list[int]]:
    assert r.status_code == 200, f"/score answered {r.status_code}: {r.text[:2000]}"
    data = sorted(r.json()["data"], key=lambda d: d["index"])
    assert len(data) == n, f"/score returned {len(data)} results for {n} inputs"
    return [one_value(d["score"]) for d in data], [int(d["num_tokens"]) for d in data]


def score(client: httpx.Client, url: str, texts: list[str]) -> tuple[list[float], list[int]]:
    return parse_scores(client.post(f"{url}/score", json={"input": texts, "normalize": False}), len(texts))


async def ascore(client: httpx.AsyncClient, url: str, texts: list[str]) -> tuple[list[float], list[int]]:
    r = await client.post(f"{url}/score", json={"input": texts, "normalize": False})
    return parse_scores(r, len(texts))


def with_probe(probe: str, n: int, index: int, seed: int) -> list[str]:
    """A batch of ``n`` texts: ``n - 1`` others with the probe at ``index``."""
    texts = other_texts(n - 1, seed)
    return texts[:index] + [probe] + texts[index:]


@dataclass
class ProbeRun:
    tokens: int
    cold: float  # the first scoring: nothing of the probe cached yet
    ref: float  # the second, alone: what every later case is compared with
    cases: dict[str, float] = field(default_factory=dict)

    def mismatches(self) -> dict[str, float]:
        return {k: v for k, v in self.cases.items() if v != self.ref}

    def max_diff(self) -> float:
        return max((abs(v - self.ref) for v in self.cases.values()), default=0.0)


async def concurrent_cases(url: str, probe: str, seed: int) -> dict[str, float]:
    """Rounds of background requests (1-16 other texts each) with probe requests sent while they are
    in flight, so the engine's steps mix requests of several clients."""
    out: dict[str, float] = {}
    limits = httpx.Limits(max_connections=BACKGROUND_REQUESTS + PROBE_REQUESTS)
    async with httpx.AsyncClient(timeout=httpx.Timeout(180.0), limits=limits) as client:
        for rnd in range(CONCURRENT_ROUNDS):
            rng = random.Random(seed * 1000 + rnd)
            background = [
                asyncio.create_task(
                    ascore(client, url, other_texts(rng.randint(1, 16), rng.randrange(1 << 30)))
                )
                for _ in range(BACKGROUND_REQUESTS)
            ]
            probes: list[tuple[str, int, asyncio.Task[tuple[list[float], list[int]]]]] = []
            for k in range(PROBE_REQUESTS):
                await asyncio.sleep(0.003 * k)  # spread over the background's steps
                n = rng.choice((1, 3, 9))
                index = rng.randrange(n)
                texts = with_probe(probe, n, index, rng.randrange(1 << 30))
                name = f"concurrent round {rnd}, request {k}: {n} text(s), index {index}"
                probes.append((name, index, asyncio.create_task(ascore(client, url, texts))))
            await asyncio.wait_for(asyncio.gather(*background, *(t for _, _, t in probes)), 300)
            for name, index, task in probes:
                out[name] = task.result()[0][index]
    return out


def run_cases(url: str, probe_id: int, probe: str) -> tuple[ProbeRun, int]:
    """Every case for one probe; also how many distinct scores a 128-text batch had (the model's
    scores differ between texts, so equality is no accident of a constant output)."""
    distinct = 0
    with httpx.Client(timeout=httpx.Timeout(180.0)) as client:
        (cold,), (tokens,) = score(client, url, [probe])
        (ref,), _ = score(client, url, [probe])
        run = ProbeRun(tokens=tokens, cold=cold, ref=ref)
        run.cases["alone, third time"] = score(client, url, [probe])[0][0]
        for b, n in enumerate(BATCH_SIZES):
            for p, position in enumerate(POSITIONS):
                index = index_of(position, n)
                texts = with_probe(probe, n, index, seed=10_000 * probe_id + 100 * b + p)
                scores, _ = score(client, url, texts)
                run.cases[f"batch of {n}, {position} (index {index})"] = scores[index]
                if n == max(BATCH_SIZES):
                    distinct = max(distinct, len(set(scores)))
    run.cases.update(asyncio.run(concurrent_cases(url, probe, seed=probe_id + 1)))
    return run, distinct


def run_more_texts(url: str) -> dict[str, ProbeRun]:
    """``MORE_TEXTS`` texts, each alone (twice), then all in one batch and spread among others."""
    texts = other_texts(MORE_TEXTS, seed=77)
    mixed = other_texts(MORE_TEXTS_AMONG, seed=78)
    # inserted in ascending order, each text ends up at its slot
    slots = random.Random(79).sample(range(len(mixed) + len(texts)), len(texts))
    for slot, text in sorted(zip(slots, texts, strict=True)):
        mixed.insert(slot, text)
    runs: dict[str, ProbeRun] = {}
    with httpx.Client(timeout=httpx.Timeout(180.0)) as client:
        for i, text in enumerate(texts):
            (cold,), (tokens,) = score(client, url, [text])
            (ref,), _ = score(client, url, [text])
            runs[f"text {i}"] = ProbeRun(tokens=tokens, cold=cold, ref=ref)
        together, _ = score(client, url, texts)
        among, _ = score(client, url, mixed)
    for i, at in enumerate(slots):
        runs[f"text {i}"].cases[f"the {MORE_TEXTS} together, index {i}"] = together[i]
        runs[f"text {i}"].cases[f"among {len(mixed)} texts, index {at}"] = among[at]
    return runs


def summary(runs: dict[str, ProbeRun]) -> dict[str, Any]:
    return {
        name: {
            "tokens": r.tokens,
            "cold": r.cold,
            "reference": r.ref,
            "cold_equals_reference": r.cold == r.ref,
            "cases": len(r.cases),
            "cases_differing": len(r.mismatches()),
            "max_abs_diff": r.max_diff(),
            "mismatches": {k: v for k, v in r.mismatches().items()},
        }
        for name, r in runs.items()
    }


def report(
    what: str, runs: dict[str, ProbeRun], server: ServerHandle, capsys: pytest.CaptureFixture[str]
) -> None:
    """Print past pytest's capture and merge into ``$OUT/batch_invariant_test.json`` (where set)."""
    s: dict[str, Any] = summary(runs)
    # vLLM logs "Disabling cascade attention when VLLM_BATCH_INVARIANT is enabled." when the mode is on
    s["log_mentions_batch_invariant"] = "VLLM_BATCH_INVARIANT" in server.log()
    s["server_log"] = str(server.log_path)
    with capsys.disabled():
        print(
            f"\n[batch-invariant test] {what} (server log {server.log_path}; mentions the mode: "
            f"{s['log_mentions_batch_invariant']}):"
        )
        for name, r in summary(runs).items():
            print(
                f"  {name} probe ({r['tokens']} tokens): {r['cases_differing']} of {r['cases']} cases differ "
                f"from the reference {r['reference']!r}, max |diff| {r['max_abs_diff']:.3g}; first (uncached) "
                f"scoring {r['cold']!r} ({'equal' if r['cold_equals_reference'] else 'DIFFERENT'})"
            )
    record_result(RESULT_FILE, what, s)


# ---- fixtures --------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def bi_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_llama_seqcls(tmp_path_factory.mktemp("vllm-bi"), SIZE, num_labels=1, seed=3)


@pytest.fixture(scope="module")
def servers(bi_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, ServerHandle]]:
    """``invariant``: ``--deterministic`` as users get it (cuBLASLt linear layers on Hopper and
    later); ``invariant-triton``: the same with vLLM's Triton matmul; ``default``: neither."""
    log_dir = tmp_path_factory.mktemp("vllm-bi-logs")
    with_default = os.environ.get("RP_BI_DEFAULT_SERVER", "1") != "0"
    two = device_count() >= 2
    triton = {TRITON_GEMM_ENV: "triton"}
    default = {"VLLM_BATCH_INVARIANT": "0"}
    handles: dict[str, ServerHandle] = {}
    try:
        handles["invariant"] = start_vllm_server(bi_model, log_dir, gpu=0, deterministic=True)
        if with_default and two:  # one start per GPU at a time: two starts at once on one GPU
            # disturb vLLM's memory profiling
            handles["default"] = start_vllm_server(bi_model, log_dir, gpu=1, env=default)
        wait_ready(handles["invariant"])
        handles["invariant-triton"] = start_vllm_server(
            bi_model, log_dir, gpu=0, deterministic=True, env=triton
        )
        wait_ready(handles["invariant-triton"])
        if with_default and not two:
            handles["default"] = start_vllm_server(bi_model, log_dir, gpu=0, env=default)
        if "default" in handles:
            wait_ready(handles["default"])
        yield handles
    finally:
        for h in handles.values():
            stop(h)


# ---- tests -----------------------------------------------------------------------------------


def test_scores_bit_identical_when_eager(
    bi_model: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``--deterministic --enforce-eager``: vLLM's custom ops (RMSNorm's CUDA kernels) instead of
    compiled code. Eager, RMSNorm with a residual would be vLLM's fused CUDA kernel, whose block width
    changes at 256 tokens per launch; the server puts it on the Triton norm kernel in this mode. Runs
    first, its server alone on GPU 0 and stopped before the other servers start."""
    handle = start_vllm_server(bi_model, tmp_path, gpu=0, deterministic=True, enforce_eager=True)
    try:
        wait_ready(handle)
        assert "--enforce-eager" in handle.args
        gemm = "triton" if gpu_major() < CUBLAS_MIN_MAJOR else "cublas"
        check_bit_identical(handle, gemm, f"--deterministic --enforce-eager, linear layers on {gemm}", capsys)
    finally:
        stop(handle)


@pytest.mark.parametrize("server", ["invariant", "invariant-triton"])
def test_scores_bit_identical_in_batch_invariant_mode(
    server: str, servers: dict[str, ServerHandle], capsys: pytest.CaptureFixture[str]
) -> None:
    gemm = "triton" if server == "invariant-triton" or gpu_major() < CUBLAS_MIN_MAJOR else "cublas"
    check_bit_identical(servers[server], gemm, f"--deterministic, linear layers on {gemm}", capsys)


def check_bit_identical(
    handle: ServerHandle, gemm: str, what: str, capsys: pytest.CaptureFixture[str]
) -> None:
    runs: dict[str, ProbeRun] = {}
    distinct = 0
    for probe_id, (name, probe) in enumerate(PROBES.items()):
        runs[name], d = run_cases(handle.url, probe_id, probe)
        distinct = max(distinct, d)
    runs.update(run_more_texts(handle.url))
    report(what, runs, handle, capsys)

    # the server ran the matmul this case is about (its vLLM worker logs the choice)
    assert f"linear layers on {gemm}" in handle.log(), f"no 'linear layers on {gemm}' in {handle.log_path}"
    # and the final decoder layer on the pooled rows, those rows on the Triton matmul
    assert "final decoder layer on the pooled rows only" in handle.log(), handle.log_path
    assert "the final layer's pooled rows on vLLM's Triton matmul" in handle.log(), handle.log_path
    # and RMSNorm with a residual on the Triton norm kernel where it runs eagerly
    assert "RMSNorm with a residual on vLLM's Triton norm kernel" in handle.log(), handle.log_path

    # the comparisons mean something: different texts get different scores
    assert runs["short"].ref != runs["long"].ref
    assert distinct >= max(BATCH_SIZES) // 2, (
        f"only {distinct} distinct scores in a batch of {max(BATCH_SIZES)}"
    )
    for name, run in runs.items():
        bad = run.mismatches()
        assert not bad, (
            f"{name} probe: {len(bad)} of {len(run.cases)} cases differ from its score alone {run.ref!r}: "
            + "; ".join(f"{k}: {v!r}" for k, v in list(bad.items())[:10])
        )
        assert run.cold == run.ref, f"{name} probe: first scoring {run.cold!r}, later ones {run.ref!r}"
    assert runs["short"].tokens < KV_BLOCK_TOKENS, "the short probe must fit one KV block"


def test_default_mode_differences_recorded(
    servers: dict[str, ServerHandle], capsys: pytest.CaptureFixture[str]
) -> None:
    """The same requests in the default mode: the probes' scores move with the batch (on 4× H200 the
    short probe's differed in 30 of 31 cases, by up to 0.012), so the first test can fail."""
    if "default" not in servers:
        pytest.skip("RP_BI_DEFAULT_SERVER=0: no default-mode server")
    url = servers["default"].url
    runs = {name: run_cases(url, probe_id, probe)[0] for probe_id, (name, probe) in enumerate(PROBES.items())}
    runs.update(run_more_texts(url))
    report("VLLM_BATCH_INVARIANT=0 (default mode)", runs, servers["default"], capsys)
    assert any(r.mismatches() or r.cold != r.ref for r in runs.values()), (
        "default mode gave bit-identical scores in every case: the test could not tell the modes apart"
    )
