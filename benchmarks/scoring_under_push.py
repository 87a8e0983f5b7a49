"""Scoring throughput under weight pushes, end to end over HTTP (issue #28; two GPUs).

One vLLM reward server on GPU 0 (the 7B shape, ``--load-format dummy``: random weights, as
``benchmarks/weight_sync.py``), kept busy by a closed-loop load generator in a process of its own
(``benchmarks/push_load_generator.py``: token-id prompts of U[lo, hi] tokens, 8 per ``/pooling``
request, N requests in flight through the SDK's sharded HTTP pool; each answer's completion time
and weights ``version`` recorded); the trainer is this process, on GPU 1, with weights of the same
shape. One run, one timeline:

  1. baseline          no weight-sync group at all
  2. group_idle        the group joined and set up (the first pushes announced the layouts over HTTP
                       and formed the NCCL communicator; the servers' listeners wait on the store),
                       nothing in flight: what an idle communicator costs
  3. receive_pending   atomic full pushes started from the data plane, each held by the trainer for
                       ``--hold-s`` after the ready reduction, before its first byte: the server has
                       agreed and posted the receive of every bucket into its staging buffers on its
                       transfer stream (the first NCCL broadcast group pending on GPU 0, the rest
                       queued behind it; its worker thread polls for it) while vLLM keeps scoring.
                       The SDK has no call that holds a push: the trainer's ready reduction is wrapped
                       for that push. A streamed push cannot be held this way without pausing
                       scoring (it takes the weights lock before its workers agree).
  4. full              ``--pushes`` full pushes (streamed, from the data plane), ``--spacing-s`` apart
  5. head_only         ``--pushes`` head-only pushes
  6. full_atomic       ``--atomic-pushes`` atomic full pushes (the transfer while scoring, the swap)

Reported: the baseline (prompts/s, tokens/s); each phase's rate ÷ baseline; for each push the
trainer's call → return, the server's wait for the weights lock (a streamed push waits for every
request in flight: with N × 8 prompts queued, that is their time on the engine) and lock → commit,
the longest gap without a completion, the time the smoothed rate spent below ``--below-frac`` of the
baseline, and the throughput lost = baseline rate × window − prompts completed in the window
(window: the push ± pads, its ends moved into gaps between completion bursts so that whole engine
steps are counted), in prompts and in seconds of baseline; the same statistics on windows of the
baseline phase as the noise floor; request latency p50/p99 in flight during pushes and outside
them; and the server's version guarantees checked on every answer (one version per answer, body and
header agree; an answer sent after another was answered is never older; none older than a push that
returned before it was sent, none of a version before its push began). A violation, a failed
request or a failed push exits 1; phases skipped for lack of time (``--budget-s``) exit 3.

    bash scripts/gpu-run.sh bench scoring_under_push                  # 7b, 2 GPUs, ~6 min
    bash scripts/gpu-run.sh bench scoring_under_push --shape small --quick
    python benchmarks/scoring_under_push.py --cpu                     # smoke: tiny model, CPU, gloo
    python benchmarks/scoring_under_push.py --reanalyze RESULT.json   # the analysis again, new options

Writes ``--out`` (default ``$OUT/scoring_under_push.json`` when OUT is set) and the raw timeline
beside it (``…records.json``: every answer), which ``--reanalyze`` reads.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import faulthandler
import json
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, fields
from pathlib import Path
from typing import Any
from unittest import mock

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.push_load_analysis import (  # noqa: E402
    Options,
    Phase,
    PushRecord,
    Records,
    analyze,
    fmt,
    print_report,
)
from benchmarks.push_load_generator import LoadGen, write_json  # noqa: E402

TOKEN = "bench"
RESULT_NAME = "scoring_under_push.json"

# ---- the run ------------------------------------------------------------------------------------


def server_last_update(url: str, version: int, timeout_s: float = 2.0) -> dict[str, Any]:
    """The server's record of its last update (``/get_num_background_tasks``), once it is ``version``'s
    (it is written just after the commit that answered the trainer); {} if it does not come."""
    import httpx

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        with contextlib.suppress(httpx.HTTPError, ValueError):
            last = (
                httpx.get(
                    f"{url}/get_num_background_tasks", headers={"Authorization": f"Bearer {TOKEN}"}, timeout=5
                )
                .json()
                .get("last_update")
            )
            if last and last.get("version") == version:
                return dict(last)
        time.sleep(0.02)
    return {}


def held_reduction(
    reduce: Callable[[int], int], hold_s: float, spans: list[tuple[float, float]]
) -> Callable[[int], int]:
    """The trainer's status reduction, holding for ``hold_s`` after the first one every rank agreed
    on — a data-plane push's ready reduction — so the push waits between accept and send."""

    def wrapped(value: int) -> int:
        out = reduce(value)
        if not spans and out == 0:
            t0 = time.monotonic()
            time.sleep(hold_s)
            spans.append((t0, time.monotonic()))
        return out

    return wrapped


class PushFailed(RuntimeError):
    pass


class Timeline:
    """The trainer's side of the run: phases, pushes, the time left."""

    def __init__(
        self,
        url: str,
        loadgen: LoadGen,
        params: dict[str, Any],
        head: dict[str, Any],
        deadline: float,
        args: argparse.Namespace,
        initial_version: int,
    ) -> None:
        self.url, self.loadgen, self.params, self.head = url, loadgen, params, head
        self.deadline, self.args = deadline, args
        self.phases: list[Phase] = []
        self.pushes: list[PushRecord] = []
        self.skipped: list[str] = []
        self.versions: Iterator[int] = iter(range(initial_version + 1, 1 << 30))
        self.pusher: Any = None
        self.join_s: float | None = None

    def time_left(self) -> float:
        return self.deadline - time.monotonic()

    def sleep(self, seconds: float) -> None:
        """Sleep, checking each second that the load generator still runs."""
        end = time.monotonic() + seconds
        while (left := end - time.monotonic()) > 0:
            time.sleep(min(left, 1.0))
            self.loadgen.check()

    def phase(self, name: str, label: str, seconds: float, note: str = "") -> None:
        t0 = time.monotonic()
        self.sleep(seconds)
        self.phases.append(Phase(name, label, t0, time.monotonic(), note))
        print(f"[{name}] {seconds:.0f} s done", flush=True)

    def join(self) -> None:
        from rewardplane.testing.pushers import loopback_pusher

        a = self.args
        # bounds forming the group and every collective: a ready reduction waits for the server's lock
        # (every request in flight answered), a held push for the hold
        group_timeout = min(600.0, max(120.0, 3 * a.hold_s + 60))
        self.pusher = loopback_pusher(
            [self.url],
            TOKEN,
            device=a.trainer_device,
            bucket_bytes=a.bucket_mib << 20,
            connect_timeout_s=group_timeout,
            timeout_s=300,  # a push's HTTP calls; the server's wait for its lock
        )
        t0 = time.perf_counter()
        self.pusher.open()
        self.join_s = time.perf_counter() - t0
        print(f"[join] group formed in {self.join_s:.2f} s", flush=True)

    def push(
        self, kind: str, *, head_only: bool = False, atomic: bool = False, hold_s: float = 0.0
    ) -> PushRecord:
        from rewardplane.protocol import RewardModelTrainingMode as Mode

        publisher = self.pusher.open()
        rec = PushRecord(kind=kind, version=next(self.versions), t_call=0.0, atomic=atomic)
        spans: list[tuple[float, float]] = []
        sd, mode = (self.head, Mode.HEAD_ONLY) if head_only else (self.params, Mode.FULL)
        # the same group and layout; the header says atomic
        publisher.options = dataclasses.replace(publisher.options, atomic=atomic)
        self.pushes.append(rec)
        try:
            hold = (
                mock.patch.object(
                    publisher.comm, "max_flag", held_reduction(publisher.comm.max_flag, hold_s, spans)
                )
                if hold_s > 0
                else contextlib.nullcontext()
            )
            with hold:
                rec.t_call = time.monotonic()
                self.pusher.push(sd, version=rec.version, training_mode=mode)
                rec.t_return = time.monotonic()
            rec.ok = True
        except Exception as exc:
            rec.t_return = time.monotonic()
            rec.error = f"{type(exc).__name__}: {exc}"
            raise PushFailed(f"push {rec.version} ({kind}) failed: {rec.error}") from exc
        finally:
            publisher.options = dataclasses.replace(publisher.options, atomic=False)
            if spans:
                rec.hold_start, rec.hold_end = spans[0]
        rec.trainer = dict(publisher.last_stats)
        rec.server = server_last_update(self.url, rec.version)
        rec.via = rec.server.get("via")
        if hold_s > 0 and rec.via != "data_plane":
            print(
                f"!! held push {rec.version} went over {rec.via}: its hold is not a pending receive",
                flush=True,
            )
        return rec

    def series(self, name: str, label: str, k: int, push: Callable[[], PushRecord], reserve_s: float) -> None:
        """``k`` pushes ``--spacing-s`` apart (the phase begins and ends with a spacing); fewer where
        the time left is short."""
        spacing = self.args.spacing_s
        t0 = time.monotonic()
        self.sleep(spacing)
        took: list[float] = []
        for i in range(k):
            need = (max(took) if took else 10.0) + spacing + reserve_s
            if self.time_left() < need:
                self.skipped.append(f"{name}: {k - i} of {k} pushes (time left {self.time_left():.0f}s)")
                print(f"[{name}] out of time: {k - i} push(es) skipped", flush=True)
                break
            rec = push()
            took.append((rec.t_return or rec.t_call) - rec.t_call)
            self.sleep(spacing)
        self.phases.append(Phase(name, label, t0, time.monotonic(), f"{len(took)} pushes"))
        med = statistics.median(took) if took else float("nan")
        print(f"[{name}] {len(took)} push(es), median {1000 * med:.1f} ms call → return", flush=True)


def run_timeline(tl: Timeline, args: argparse.Namespace, reserve_s: float) -> None:
    """Phases 1-6 (docstring), each skipped where the time left would not see it through."""
    a = args
    tl.phase("baseline", "1 baseline (no group)", a.phase_s)
    tl.join()
    # set-up: layouts announced over HTTP (the copy plan learned), then one data-plane push of each
    # kind the phases use, so that one-time costs (first data-plane push, staging buffers) stay out
    for kind, head_only, atomic in (
        ("setup_full_http", False, False),
        ("setup_head_http", True, False),
        ("setup_full", False, False),
        ("setup_head", True, False),
        ("setup_full_atomic", False, True),
    ):
        if atomic and not (a.holds or a.atomic_pushes):
            continue
        tl.push(kind, head_only=head_only, atomic=atomic)
        tl.sleep(a.spacing_s)
    print(
        f"[setup] {', '.join(f'{p.kind} {1000 * ((p.t_return or 0) - p.t_call):.0f} ms via {p.via}' for p in tl.pushes)}"
    )

    def pushes(name: str, label: str, count: int, **push: Any) -> tuple[str, float, Callable[[], None]]:
        """A phase of ``count`` pushes of one kind (``push``: ``Timeline.push``'s options)."""

        def series() -> None:
            tl.series(name, label, count, lambda: tl.push(name, **push), reserve_s)

        return (name, 2 * a.spacing_s + 5, series)

    steps: list[tuple[str, float, Callable[[], None]]] = [
        ("group_idle", a.phase_s, lambda: tl.phase("group_idle", "2 group joined, idle", a.phase_s)),
        (
            "receive_pending",
            a.holds * (a.hold_s + 2 * a.spacing_s + 10),
            lambda: tl.series(
                "receive_pending",
                "3 receive pending (whole phase)",
                a.holds,
                lambda: tl.push("held", atomic=True, hold_s=a.hold_s),
                reserve_s,
            ),
        ),
        pushes("full", "4 full pushes (whole phase)", a.pushes),
        pushes("head_only", "5 head-only pushes (whole phase)", a.pushes, head_only=True),
        pushes("full_atomic", "6 atomic full pushes (whole phase)", a.atomic_pushes, atomic=True),
    ]
    for name, need, step in steps:
        if name == "receive_pending" and not a.holds or name == "full_atomic" and not a.atomic_pushes:
            continue
        if tl.time_left() < need + reserve_s:
            tl.skipped.append(f"{name}: the whole phase (time left {tl.time_left():.0f}s)")
            print(f"[{name}] skipped: {tl.time_left():.0f} s left", flush=True)
            continue
        step()
    tl.sleep(a.spacing_s)  # the last push's window ends inside the load


def git_commit() -> str | None:
    if os.environ.get("RP_COMMIT"):
        return os.environ["RP_COMMIT"]
    with contextlib.suppress(OSError, subprocess.SubprocessError):
        out = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True, timeout=10
        )
        if out.returncode == 0:
            return out.stdout.strip() or None
    return None


def run_meta(args: argparse.Namespace) -> dict[str, Any]:
    import torch

    meta: dict[str, Any] = {
        "commit": git_commit(),
        "date": time.strftime("%Y-%m-%d", time.gmtime()),
        "host": socket.gethostname(),
        "cpus": os.cpu_count(),
        "torch": torch.__version__,
        "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"),
        "switches": {k: v for k, v in os.environ.items() if k.startswith("REWARDPLANE_")},
    }
    if args.cpu:
        meta["card"] = "cpu"
    else:
        meta["card"] = torch.cuda.get_device_name(0)
        meta["trainer_card"] = torch.cuda.get_device_name(1)
        meta["gpus"] = torch.cuda.device_count()
        with contextlib.suppress(Exception):
            from importlib.metadata import version

            meta["vllm"] = version("vllm")
    return meta


def cpu_busy(pid: int) -> dict[str, float]:
    """CPU seconds of the server's processes (benchmarks/scoring_gpu.py's reader); {} where it fails."""
    try:
        from benchmarks.scoring_gpu import process_cpu_s

        return process_cpu_s(pid)
    except Exception:
        return {}


def start(args: argparse.Namespace, work: Path) -> tuple[Any, dict[str, Any], int, dict[str, Any]]:
    """The server (started, not yet healthy), the trainer's weights, the vocabulary, and facts of the model."""
    import torch

    from rewardplane.testing.servers import launch_server

    if args.cpu:
        from transformers import AutoModelForSequenceClassification

        from rewardplane.tinymodel import build_tiny_reward_model

        model_dir = build_tiny_reward_model(work / "model", num_labels=1, seed=0)
        server = launch_server(model_dir, work, token=TOKEN)
        try:
            model = AutoModelForSequenceClassification.from_pretrained(model_dir, dtype=torch.float32).eval()
        except BaseException:
            server.kill()
            raise
    else:
        from benchmarks.weight_sync import SIZES, build_trainer_model, make_checkpoint

        if args.shape not in SIZES:
            raise ValueError(f"--shape {args.shape}: choose from {sorted(SIZES)}")

        try:
            from benchmarks.scoring_gpu import wait_gpu_free

            wait_gpu_free()
        except Exception as exc:  # only a courtesy wait: never the reason a run fails
            print(f"(not waiting for free GPUs: {exc})")
        from rewardplane.testing.gpus import visible_gpus

        model_dir = make_checkpoint(args.shape, work)
        opts: dict[str, Any] = {
            "engine": "vllm",
            "dtype": "bfloat16",
            "load_format": "dummy",
            "gpu_memory_utilization": args.gpu_memory_utilization,
            "max_model_len": max(1024, args.max_len),
        }
        extra = (["--enforce-eager"] if args.enforce_eager else []) + args.server_args.split()
        server = launch_server(
            model_dir,
            work,
            token=TOKEN,
            extra_args=extra,
            env_extra={"CUDA_VISIBLE_DEVICES": visible_gpus(0), "VLLM_USE_FLASHINFER_SAMPLER": "0"},
            **opts,
        )
        try:  # the trainer's weights, built while the server starts
            torch.cuda.set_device(args.trainer_device)
            model = build_trainer_model(model_dir, args.trainer_device)
        except BaseException:
            server.kill()
            raise
    params = model.state_dict()
    vocab = int(json.loads((model_dir / "config.json").read_text())["vocab_size"])
    facts = {
        "params": sum(t.numel() for t in params.values()),
        "bytes_full": sum(t.numel() * t.element_size() for t in params.values()),
        "vocab": vocab,
    }
    return server, params, vocab, facts


def run(args: argparse.Namespace) -> int:
    import httpx
    import torch

    from rewardplane.protocol.naming import select_head
    from rewardplane.testing.servers import wait_healthy

    started = time.monotonic()
    deadline = started + args.budget_s
    # SystemExit on SIGTERM: the clean-up below ends the children (they run in sessions of their own)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    if not args.cpu and torch.cuda.device_count() < 2:
        print(f"needs 2 GPUs (server on GPU 0, trainer on GPU 1); {torch.cuda.device_count()} visible")
        return 2
    args.trainer_device = torch.device("cpu") if args.cpu else torch.device("cuda", 1)
    work = Path(tempfile.mkdtemp(prefix="scoring-under-push-"))
    children: list[Callable[[], None]] = []
    watchdog = start_watchdog(args.budget_s + 90, children)
    server = loadgen = None
    out_path = result_path(args)
    if out_path is not None:
        out_path.parent.mkdir(parents=True, exist_ok=True)
    results: dict[str, Any] = {"meta": run_meta(args), "args": jsonable(vars(args))}
    rc = 0
    try:
        server, params, vocab, facts = start(args, work)
        children.append(lambda: server.kill())
        results["model"] = facts | {"shape": "tiny" if args.cpu else args.shape}
        t0 = time.perf_counter()
        wait_healthy(server, args.server_timeout_s, poll_s=1.0)
        results["server_start_s"] = time.perf_counter() - t0
        results["server_args"] = server.args[1:]
        print(f"[server] healthy after {results['server_start_s']:.0f} s: {server.url}", flush=True)
        head = select_head(params)
        facts["bytes_head"] = sum(t.numel() * t.element_size() for t in head.values())
        initial = int(httpx.get(f"{server.url}/runtime_version", timeout=30).json()["version"])
        loadgen = LoadGen(work, server.url, args, vocab, max_duration_s=args.budget_s + 60)
        children.append(loadgen.kill)
        wait_flowing(loadgen, args.warmup_timeout_s)
        tl = Timeline(server.url, loadgen, params, head, deadline, args, initial)
        tl.sleep(args.warmup_s)
        cpu0, lg0, w0 = cpu_busy(server.process.pid), loadgen.cpu_s_now(), time.monotonic()
        try:
            run_timeline(tl, args, reserve_s=args.reserve_s)
        except PushFailed as exc:
            print(f"!! {exc}\n   (the timeline stops here; what was measured so far is analysed)", flush=True)
            rc = 1
        finally:
            results["cpu_busy_whole_run"] = busy_between(cpu0, cpu_busy(server.process.pid), w0)
            if lg0 is not None:
                results["cpu_busy_whole_run"]["load generator"] = round(
                    ((loadgen.cpu_s_now() or lg0) - lg0) / (time.monotonic() - w0), 3
                )
            if tl.pusher is not None:
                with contextlib.suppress(Exception):
                    tl.pusher.close()
        records = loadgen.stop(timeout_s=60)
        results.update(
            initial_version=initial,
            join_s=tl.join_s,
            skipped=tl.skipped,
            phases=[asdict(p) for p in tl.phases],
            push_records=[asdict(p) for p in tl.pushes],
            load_generator={"cpu_s": loadgen.cpu_s, "wall_s": loadgen.wall_s},
        )
        if out_path is not None:
            write_json(records_path(out_path), records.to_json())
            results["records_file"] = records_path(out_path).name
        analysis = analyze(records, tl.phases, tl.pushes, initial, options(args))
        results["analysis"] = analysis
        print_report(analysis, header(results), load_line(args, results))
        if tl.skipped:
            print(f"!! INCOMPLETE, skipped for time: {'; '.join(tl.skipped)} (exit 3)")
            rc = rc or 3
        if analysis["versions"]["violations"] or analysis["requests"]["failed"]:
            rc = 1
        if any(not p.ok for p in tl.pushes):
            rc = 1
    except Exception as exc:
        rc = 1
        results["error"] = f"{type(exc).__name__}: {exc}"
        print(f"!! FAILED: {type(exc).__name__}: {exc}", flush=True)
        if server is not None:
            print(f"--- server log (tail) ---\n{server.log()[-6000:]}", flush=True)
        if loadgen is not None:
            print(f"--- load generator log (tail) ---\n{loadgen.tail()}", flush=True)
    finally:
        if loadgen is not None:
            loadgen.kill()
        if server is not None:
            server.stop()
            lines = [ln for ln in server.log().splitlines() if "weights version" in ln]
            print("server log, the last pushes:\n  " + "\n  ".join(lines[-3:]), flush=True)
        watchdog.cancel()
        results["wall_s"] = time.monotonic() - started
        if out_path is not None:
            write_json(out_path, results, indent=2)
            for name, log in (
                ("server", server.log_path if server else None),
                ("loadgen", work / "loadgen.log"),
            ):
                if log is not None and log.exists():  # beside the result, for a look afterwards
                    shutil.copyfile(log, out_path.with_name(f"{out_path.stem}.{name}.log"))
            print(f"wrote {out_path}")
    print(f"total {time.monotonic() - started:.0f} s; exit {rc}")
    return rc


def wait_flowing(loadgen: LoadGen, timeout_s: float) -> None:
    """Until the load generator's first answers are in (bounded); fails at once on failed requests
    without any answer (e.g. a 400 for every request)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        loadgen.check()
        st = loadgen.status()
        if st.get("answered", 0) > 0:
            return
        if st.get("failed", 0) >= 3:
            raise RuntimeError(f"the load generator's requests fail: {st.get('first_error')}")
        time.sleep(0.2)
    raise RuntimeError(f"no answer within {timeout_s:.0f}s of load:\n{loadgen.tail()}")


def busy_between(before: dict[str, float], after: dict[str, float], t0: float) -> dict[str, float]:
    wall = max(time.monotonic() - t0, 1e-9)
    return {name: round((after[name] - before[name]) / wall, 3) for name in after if name in before}


def start_watchdog(seconds: float, children: list[Callable[[], None]]) -> threading.Timer:
    """A last resort: past ``seconds``, print every thread's stack, end the children, exit 124."""

    def fire() -> None:
        print(f"!! still running after {seconds:.0f}s: stacks, then everything is killed", flush=True)
        faulthandler.dump_traceback(all_threads=True)
        for kill in children:
            with contextlib.suppress(Exception):
                kill()
        os._exit(124)

    timer = threading.Timer(seconds, fire)
    timer.daemon = True
    timer.start()
    return timer


def jsonable(d: dict[str, Any]) -> dict[str, Any]:
    return {
        k: v if isinstance(v, (int, float, str, bool, type(None), list)) else str(v) for k, v in d.items()
    }


ANALYSIS_OPTIONS = tuple(f.name for f in fields(Options))  # each also a command-line option


def options(args: argparse.Namespace) -> Options:
    return Options(**{name: getattr(args, name) for name in ANALYSIS_OPTIONS})


def header(results: dict[str, Any]) -> str:
    m, meta = results["model"], results["meta"]
    engine = (
        "transformers engine on CPU, gloo" if results["args"].get("cpu") else f"vLLM {meta.get('vllm', '?')}"
    )
    size = f"{m['params'] / 1e9:.2f}B" if m["params"] >= 1e9 else f"{m['params'] / 1e6:.2f}M"
    return (
        f"scoring under weight pushes: {engine}, {m['shape']} ({size} params, {m['bytes_full'] / 1e9:.3f} GB "
        f"a full push, {m.get('bytes_head', 0) / 1e3:.1f} kB head-only), {meta['card']}, commit "
        f"{meta['commit']}, {meta['date']}"
    )


def load_line(args: argparse.Namespace, results: dict[str, Any]) -> str:
    return (
        f"load: /pooling, {args.concurrency} requests in flight x {args.per_request} token-id prompts of "
        f"U[{args.min_len}, {args.max_len}]; group joined in {fmt(results.get('join_s'), '.2f')} s; "
        f"CPU busy (CPU s / wall s): {results.get('cpu_busy_whole_run')}"
    )


def result_path(args: argparse.Namespace) -> Path | None:
    if args.out is not None:
        return Path(args.out)
    if os.environ.get("OUT"):
        return Path(os.environ["OUT"]) / RESULT_NAME
    return None


def records_path(out: Path) -> Path:
    return out.with_name(out.stem + ".records.json")


def reanalyze(args: argparse.Namespace) -> int:
    path = Path(args.reanalyze)
    results = json.loads(path.read_text())
    records = Records.from_json(json.loads((path.parent / results["records_file"]).read_text()))
    phases = [Phase(**p) for p in results["phases"]]
    pushes = [PushRecord(**p) for p in results["push_records"]]
    saved = argparse.Namespace(**results["args"])
    for key in args.given:  # the options given now; the run's own for the others
        setattr(saved, key, getattr(args, key))
    analysis = analyze(records, phases, pushes, results["initial_version"], options(saved))
    print_report(analysis, header(results), load_line(saved, results))
    if args.out:
        write_json(Path(args.out), results | {"analysis": analysis}, indent=2)
    return 1 if analysis["versions"]["violations"] or analysis["requests"]["failed"] else 0


# ---- command line ------------------------------------------------------------------------------

# per mode: GPU (the 7B run on two GPUs), --quick (a short GPU run), --cpu (the smoke run here)
DEFAULTS: dict[str, dict[str, Any]] = {
    "gpu": {
        "concurrency": 32,
        "min_len": 64,
        "max_len": 1024,
        "phase_s": 30.0,
        "warmup_s": 10.0,
        "hold_s": 8.0,
        "holds": 3,
        "pushes": 6,
        "atomic_pushes": 3,
        "spacing_s": 3.0,
        "pad_before_s": 0.5,
        "pad_after_s": 1.5,
        "align_s": 1.0,
        "hold_margin_s": 0.5,
        "below_frac": 0.5,
        "budget_s": 450.0,
        "reserve_s": 40.0,
        "server_timeout_s": 600.0,
    },
    "quick": {"phase_s": 12.0, "warmup_s": 5.0, "hold_s": 5.0, "holds": 2, "pushes": 3, "atomic_pushes": 2},
    "cpu": {
        "concurrency": 8,
        "min_len": 16,
        "max_len": 64,
        "phase_s": 5.0,
        "warmup_s": 3.0,
        "hold_s": 3.0,
        "holds": 2,
        "pushes": 3,
        "atomic_pushes": 2,
        "spacing_s": 1.5,
        "pad_before_s": 0.3,
        "pad_after_s": 0.6,
        "align_s": 0.3,
        "hold_margin_s": 0.3,
        "budget_s": 150.0,
        "reserve_s": 15.0,
        "server_timeout_s": 120.0,
    },
}


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--cpu", action="store_true", help="smoke run: tiny model, transformers engine on CPU, gloo"
    )
    p.add_argument("--quick", action="store_true", help="shorter phases and fewer pushes (GPU)")
    p.add_argument("--shape", default="7b", help="the model's shape (GPU): 7b or small, as weight_sync.py")
    p.add_argument(
        "--concurrency",
        type=int,
        help="requests in flight (GPU 32, CPU 8); a streamed push waits for all of them to be answered",
    )
    p.add_argument("--per-request", type=int, default=8, help="prompts per request")
    p.add_argument("--min-len", type=int, help="shortest prompt, tokens (GPU 64)")
    p.add_argument("--max-len", type=int, help="longest prompt, tokens (GPU 1024)")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--phase-s", type=float, help="seconds of phases 1 and 2 (GPU 30)")
    p.add_argument("--warmup-s", type=float, help="load before the baseline begins (GPU 10)")
    p.add_argument("--hold-s", type=float, help="phase 3: how long each push is held (GPU 8)")
    p.add_argument("--holds", type=int, help="phase 3: held pushes (GPU 3; 0: no phase 3)")
    p.add_argument("--pushes", type=int, help="phases 4 and 5: pushes each (GPU 6)")
    p.add_argument("--atomic-pushes", type=int, help="phase 6: atomic full pushes (GPU 3; 0: no phase 6)")
    p.add_argument("--spacing-s", type=float, help="from one push's return to the next push (GPU 3)")
    p.add_argument("--pad-before-s", type=float, help="a push's window starts this long before its call")
    p.add_argument("--pad-after-s", type=float, help="a push's window ends this long after its return")
    p.add_argument(
        "--align-s", type=float, help="window ends move up to this far to fall between answer bursts"
    )
    p.add_argument("--hold-margin-s", type=float, help="the first part of a hold left out of its rate")
    p.add_argument("--below-frac", type=float, help="report the time below this share of baseline (0.5)")
    p.add_argument(
        "--rate-width-s",
        type=float,
        default=None,
        help="smoothing of that rate (default: 2x the baseline's p99 gap between answers)",
    )
    p.add_argument(
        "--budget-s",
        type=float,
        help="phases are skipped past this (GPU 450 s); a watchdog kills the run 90 s later",
    )
    p.add_argument("--reserve-s", type=float, help="time kept for stopping and the analysis")
    p.add_argument("--server-timeout-s", type=float, help="bound on the server's start")
    p.add_argument(
        "--warmup-timeout-s", type=float, default=120.0, help="bound on the load generator's start"
    )
    p.add_argument("--request-timeout-s", type=float, default=300.0)
    p.add_argument(
        "--gpu-memory-utilization",
        type=float,
        default=0.6,
        help="vLLM's share of GPU 0 (the rest holds an atomic push's staging copy)",
    )
    p.add_argument(
        "--enforce-eager",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="vLLM without CUDA graphs / compilation (the 7B server starts in ~1 min)",
    )
    p.add_argument("--server-args", default="", help="extra server flags")
    p.add_argument("--bucket-mib", type=int, default=1024)
    p.add_argument("--out", default=None, help=f"result JSON (default $OUT/{RESULT_NAME} when OUT is set)")
    p.add_argument("--reanalyze", default=None, help="a result JSON of an earlier run: analyse it again")
    args = p.parse_args(argv)
    args.given = sorted(k for k in ANALYSIS_OPTIONS if getattr(args, k) is not None)
    mode = DEFAULTS["cpu"] if args.cpu else DEFAULTS["gpu"] | (DEFAULTS["quick"] if args.quick else {})
    for key, value in (DEFAULTS["gpu"] | mode).items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    if args.min_len < 1 or args.max_len < args.min_len:
        p.error(f"prompt lengths [{args.min_len}, {args.max_len}] make no sense")
    if args.pushes < 1:
        p.error("--pushes must be at least 1")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    if args.reanalyze:
        return reanalyze(args)
    os.environ.setdefault("VLLM_USE_FLASHINFER_SAMPLER", "0")
    return run(args)


if __name__ == "__main__":
    raise SystemExit(main())
