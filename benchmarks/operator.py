"""Operator benchmark on the local control plane (real kube-apiserver + etcd, no node agent).

1. apply → all pods created: one RewardModel with N replicas, time from the create call until
   every Pod exists; repeated (default 20 times), p50/p90 reported.
2. many models: M RewardModels (default 100) created at once; time until each has its Pod and a
   status, and the operator's RSS afterwards.

Pods are bound to a registered Node that no agent runs, so they stay Pending: this measures the
operator, not model loading.

3. push (``--push``): a node agent runs real servers (a tiny model, ``--push-replicas`` replicas, CPU,
   gloo). A weight push through the operator (``RewardModelHandle.push_weights``: call → WeightSync
   Completed) against the same push in direct mode (``WeightPusher``: the trainer drives the
   replicas' control plane itself, a fresh group per push like the operator's), head-only and full;
   p50 of each and the ratio operator/direct.

4. scale (``--scale N``): N RewardModels (1 replica each, default 1000) reconciled, then the steady
   state over ``--window`` seconds with the operator's default resync period: the operator's CPU
   (cores, from /proc utime+stime), its RSS, the API requests it made (the API server's own
   counters), and apply → pods created p50 at that scale; each against the same figure measured
   first on the empty cluster (the ratio). The window starts once the resync backlog left by the
   creation burst is gone: when as many timer resyncs as there are models have run since every
   model was reconciled (each model's timer has come round about once), so it measures the
   steady state, not the catch-up.

Usage:

    python benchmarks/operator.py [--runs 20] [--replicas 3] [--models 100] [--json out.json]
    python benchmarks/operator.py --scale 1000 [--window 90] [--runs 20]
    python benchmarks/operator.py --push [--push-runs 10] [--push-replicas 2] [--hidden 256] [--layers 4]
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import yaml

from rewardplane.api.kube import Kube, core_path, custom_path
from rewardplane.api.names import pod_name
from rewardplane.localcluster.controlplane import LocalControlPlane, free_port
from rewardplane.localcluster.dev import operator_command
from rewardplane.testing.processes import stop_process

ROOT = Path(__file__).resolve().parents[1]
CRD_PATH = "/apis/apiextensions.k8s.io/v1/customresourcedefinitions"
NODE = "bench-node"
NAMESPACE = "bench"
# The operator's default reward-server image: no Pod here pulls an image (fake kubelet or node agent).
BENCH_SERVER_IMAGE = "localhost/rewardplane/reward-server:bench"


def bench_operator(kubeconfig: Path, metrics_port: int, *extra: str) -> list[str]:
    """The operator's command line in these benchmarks (``extra``: further options)."""
    return operator_command(
        kubeconfig,
        "--default-server-image",
        BENCH_SERVER_IMAGE,
        "--metrics-port",
        str(metrics_port),
        *extra,
        "--log-level",
        "WARNING",
    )


def wait(what: str, check: Callable[[], bool], timeout_s: float, poll_s: float = 0.02) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout_s}s waiting for {what}")
        time.sleep(poll_s)


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def model(name: str, replicas: int) -> dict[str, Any]:
    return {
        "apiVersion": "rewardplane.io/v1alpha1",
        "kind": "RewardModel",
        "metadata": {"name": name, "namespace": NAMESPACE},
        "spec": {
            "model": {"source": "/models/bench"},
            "engine": {"kind": "hf"},
            "replicas": replicas,
            "gpu": {"mode": "none", "node": NODE},
        },
    }


def setup(kube: Kube) -> None:
    for path in sorted((ROOT / "crds").glob("*.yaml")):
        kube.create(CRD_PATH, yaml.safe_load(path.read_text()))
    wait("CRDs established", lambda: _crd_ready(kube), 30)
    kube.create(core_path("namespaces"), {"metadata": {"name": NAMESPACE}})
    kube.create(core_path("nodes"), {"metadata": {"name": NODE}, "status": {"capacity": {"cpu": "64"}}})


def _crd_ready(kube: Kube) -> bool:
    crd = kube.get(f"{CRD_PATH}/rewardmodels.rewardplane.io") or {}
    return any(
        c["type"] == "Established" and c["status"] == "True"
        for c in (crd.get("status") or {}).get("conditions") or []
    )


def pods_exist(kube: Kube, name: str, replicas: int) -> bool:
    """Every replica's Pod exists, by a GET of each stable name: cheap whatever the namespace
    holds (a label-selected LIST decodes every Pod of the namespace, ~0.1-1 s at 1000 models, and
    polling it every 20 ms loaded the API server the applies were timed on)."""
    return all(kube.get(core_path("pods", NAMESPACE, pod_name(name, i))) is not None for i in range(replicas))


def pod_names(kube: Kube, name: str) -> set[str]:
    return {
        p["metadata"]["name"]
        for p in kube.list(core_path("pods", NAMESPACE), label_selector=f"rewardplane.io/model={name}")
    }


def delete_model(kube: Kube, name: str) -> None:
    kube.delete(custom_path(NAMESPACE, name))
    wait(f"{name} deleted", lambda: kube.get(custom_path(NAMESPACE, name)) is None, 60)
    for pod in pod_names(kube, name):  # no kubelet: force the bound pods out
        kube._call("DELETE", core_path("pods", NAMESPACE, pod), params={"gracePeriodSeconds": "0"})


def pods_listed(kube: Kube, name: str, replicas: int) -> bool:
    """Every replica's Pod exists, by a label-selected LIST (runs 1 and 2 of the README used this)."""
    return len(pod_names(kube, name)) == replicas


APPLY_CHECKS = {"get": pods_exist, "list": pods_listed}


def bench_apply(
    kube: Kube,
    runs: int,
    replicas: int,
    timeout_s: float = 60.0,
    check: Callable[[Kube, str, int], bool] = pods_exist,
) -> dict[str, Any]:
    """Create one model, time until its Pods exist, delete it; ``runs`` times.

    A run that passes ``timeout_s`` is counted (``timeouts``) at ``timeout_s`` rather than ending
    the benchmark, so p50/p90 stay honest lower bounds when some applies are that slow.
    """
    times = []
    timeouts = 0
    for i in range(runs):
        name = f"apply-{i}"
        started = time.perf_counter()
        kube.create(custom_path(NAMESPACE), model(name, replicas))
        try:
            wait(f"{replicas} pods of {name}", functools.partial(check, kube, name, replicas), timeout_s)
            times.append(time.perf_counter() - started)
        except TimeoutError:
            timeouts += 1
            times.append(timeout_s)
        delete_model(kube, name)
    times.sort()
    return {
        "runs": runs,
        "replicas": replicas,
        "timeouts": timeouts,
        "p50_s": statistics.median(times),
        "p90_s": times[int(0.9 * (len(times) - 1))],
        "max_s": times[-1],
    }


def _samples(text: str, metric: str) -> list[tuple[dict[str, str], float]]:
    """(labels, value) of each sample of ``metric`` in a Prometheus text exposition."""
    out = []
    for line in text.splitlines():
        if not line.startswith(metric + "{"):
            continue
        labels_s, _, value = line[len(metric) + 1 :].rpartition("} ")
        labels = dict(kv.split("=", 1) for kv in labels_s.split('",') if "=" in kv)
        out.append(({k: v.strip('"') for k, v in labels.items()}, float(value)))
    return out


def timer_reconciles(metrics_port: int) -> float:
    text = httpx.get(f"http://127.0.0.1:{metrics_port}/metrics", timeout=5).text
    return sum(
        v
        for labels, v in _samples(text, "rewardplane:operator_reconciles_total")
        if labels["trigger"] == "timer"
    )


def api_requests(kube: Kube) -> dict[str, float]:
    """Requests the API server has answered so far, by "VERB resource[/subresource]" (WATCHes and
    the benchmark's own calls included; compare two snapshots)."""
    text = kube._http.get("/metrics", headers=kube._headers()).text
    out: dict[str, float] = {}
    for labels, value in _samples(text, "apiserver_request_total"):
        resource = labels.get("resource", "") + (
            f"/{labels['subresource']}" if labels.get("subresource") else ""
        )
        if resource:
            key = f"{labels.get('verb', '?')} {resource}"
            out[key] = out.get(key, 0.0) + value
    return out


def requests_between(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    return {k: after[k] - before.get(k, 0.0) for k in sorted(after) if after[k] - before.get(k, 0.0) > 0}


def wait_resync_backlog(metrics_port: int, count: int, timeout_s: float) -> dict[str, Any]:
    """Until ``count`` timer resyncs ran since now (each model's timer came round about once after
    the creation burst); what was waited for and how long."""
    started, start_count = time.monotonic(), timer_reconciles(metrics_port)
    done = 0.0
    while time.monotonic() - started < timeout_s:
        done = timer_reconciles(metrics_port) - start_count
        if done >= count:
            break
        time.sleep(1)
    return {
        "waited_for": f"{count} timer resyncs after every model was reconciled",
        "timer_resyncs": done,
        "waited_s": time.monotonic() - started,
        "reached": done >= count,
    }


def reconcile_stats(metrics_port: int) -> dict[str, float]:
    """Reconciles done so far and their mean duration, from the operator's /metrics."""
    text = httpx.get(f"http://127.0.0.1:{metrics_port}/metrics", timeout=5).text
    values: dict[str, float] = {}
    for line in text.splitlines():
        for key in (
            "rewardplane:operator_reconcile_duration_seconds_sum",
            "rewardplane:operator_reconcile_duration_seconds_count",
        ):
            if line.startswith(key + " "):
                values[key.rsplit("_", 1)[1]] = float(line.split()[1])
    count = values.get("count", 0.0)
    return {
        "reconciles": count,
        "mean_reconcile_s": values.get("sum", 0.0) / count if count else float("nan"),
    }


def bench_many(kube: Kube, count: int, operator_pid: int, timeout_s: float = 900) -> dict[str, Any]:
    started = time.perf_counter()
    # A few creates in flight at once: one at a time, the 1000 round trips alone take minutes.
    with ThreadPoolExecutor(max_workers=8) as pool:
        list(pool.map(lambda i: kube.create(custom_path(NAMESPACE), model(f"many-{i}", 1)), range(count)))
    created = time.perf_counter() - started

    def all_reconciled() -> bool:
        try:
            items = kube.list(custom_path(NAMESPACE))
            pods = kube.list(core_path("pods", NAMESPACE), label_selector="rewardplane.io/model")
        except httpx.TimeoutException:  # a loaded API server: ask again at the next poll
            return False
        done = [
            m
            for m in items
            if m["metadata"]["name"].startswith("many-") and (m.get("status") or {}).get("phase")
        ]
        return len(done) == count and len(pods) >= count

    # Listing every model and Pod is itself heavy at 1000: poll rarely, not to load the server.
    wait(f"{count} models reconciled", all_reconciled, timeout_s, poll_s=0.2 if count <= 100 else 5.0)
    elapsed = time.perf_counter() - started
    return {
        "models": count,
        "create_calls_s": created,
        "all_reconciled_s": elapsed,
        "operator_rss_mib": rss_mib(operator_pid),
    }


def cpu_seconds(pid: int) -> float:
    """CPU time (user + system) a process has used so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def steady_cpu(pid: int, window_s: float) -> float:
    """Cores the process used on average over ``window_s`` seconds."""
    before, started = cpu_seconds(pid), time.monotonic()
    time.sleep(window_s)
    return (cpu_seconds(pid) - before) / (time.monotonic() - started)


def bench_scale(
    kube: Kube, count: int, operator_pid: int, metrics_port: int, args: argparse.Namespace
) -> dict[str, Any]:
    """Baseline on the empty cluster, then ``count`` models: steady CPU, RSS, apply p50."""
    empty: dict[str, Any] = {
        "cpu_cores": steady_cpu(operator_pid, min(args.window, 30)),
        "rss_mib": rss_mib(operator_pid),
        "apply": bench_apply(kube, args.runs, 1, check=APPLY_CHECKS[args.apply_check]),
    }
    many = bench_many(kube, count, operator_pid)
    # The resync period is 30 s; the timers that came due during the burst are worked off first.
    backlog = wait_resync_backlog(metrics_port, count, timeout_s=max(300.0, count * 0.5))
    requests_before = api_requests(kube)
    cpu = steady_cpu(operator_pid, args.window)
    window_requests = requests_between(requests_before, api_requests(kube))
    requests_before = api_requests(kube)
    apply = bench_apply(kube, args.runs, 1, timeout_s=30, check=APPLY_CHECKS[args.apply_check])
    loaded: dict[str, Any] = {
        "cpu_cores": cpu,
        "rss_mib": rss_mib(operator_pid),
        "api_requests_in_window": window_requests,
        "apply": apply,
        # Per apply: the operator's and the benchmark's own (GET pods polls, the model's delete).
        "api_requests_per_apply": {
            k: v / args.runs for k, v in requests_between(requests_before, api_requests(kube)).items()
        },
    }
    return {
        "models": count,
        "window_s": args.window,
        "apply_check": args.apply_check,
        "create_all": many,
        "resync_backlog": backlog,
        "empty": empty,
        "loaded": loaded,
        "apply_p50_ratio": loaded["apply"]["p50_s"] / empty["apply"]["p50_s"],
    }


def _p50(xs: list[float]) -> float:
    return statistics.median(xs)


def bench_push(kube: Kube, kubeconfig: Path, tmp: Path, args: argparse.Namespace) -> dict[str, Any]:
    """Operator push (call → Completed) vs direct-mode push of the same parameters."""
    import torch

    from rewardplane.protocol.naming import select_head
    from rewardplane.sdk.cluster import RewardModelHandle
    from rewardplane.sdk.push.pusher import WeightPusher
    from rewardplane.tinymodel import build_tiny_reward_model

    model_dir = build_tiny_reward_model(tmp / "model", hidden_size=args.hidden, num_layers=args.layers)
    from transformers import AutoModelForSequenceClassification

    model = AutoModelForSequenceClassification.from_pretrained(model_dir, dtype=torch.float32)
    full = {k: v.detach().clone() for k, v in model.state_dict().items()}
    head = select_head(full)
    name = "push-bench"
    kube.create(
        custom_path(NAMESPACE),
        {
            "apiVersion": "rewardplane.io/v1alpha1",
            "kind": "RewardModel",
            "metadata": {"name": name, "namespace": NAMESPACE},
            "spec": {
                "model": {"source": str(model_dir), "dtype": "float32"},
                "engine": {"kind": "hf"},
                "replicas": args.push_replicas,
                "gpu": {"mode": "none", "node": AGENT_NODE},
            },
        },
    )
    handle = RewardModelHandle(name, NAMESPACE, kubeconfig=str(kubeconfig))
    handle.wait_ready(300)

    def serves_at_least(version: int) -> bool:
        return handle.get_weights_version() >= version

    urls, token = handle.get_urls(), handle.token()
    version = 0
    out: dict[str, Any] = {
        "replicas": args.push_replicas,
        "runs": args.push_runs,
        "full_bytes": sum(v.numel() * v.element_size() for v in full.values()),
        "head_bytes": sum(v.numel() * v.element_size() for v in head.values()),
    }
    for mode, params in (("head_only", head), ("full", full)):
        via_operator, direct = [], []
        for _ in range(args.push_runs):
            version += 1
            started = time.perf_counter()
            handle.push_weights(params, version, mode, trainer_host="127.0.0.1", timeout_s=120)
            via_operator.append(time.perf_counter() - started)
            version += 1
            started = time.perf_counter()
            sync = WeightPusher(
                urls, group_port=free_port(), token=token, trainer_host="127.0.0.1", connect_timeout_s=60
            )
            try:
                sync.push(params, version=version, training_mode=mode)
            finally:
                sync.close()
            direct.append(time.perf_counter() - started)
            # The operator's next push must be newer than what direct mode pushed.
            wait("the model status to follow", functools.partial(serves_at_least, version), 30)
        out[mode] = {
            "operator_p50_s": _p50(via_operator),
            "direct_p50_s": _p50(direct),
            "ratio": _p50(via_operator) / _p50(direct),
            "operator_s": via_operator,
            "direct_s": direct,
        }
    handle.close()
    return out


AGENT_NODE = "bench-agent-node"


def run_push(args: argparse.Namespace) -> dict[str, Any]:
    with (
        tempfile.TemporaryDirectory(prefix="rp-bench-push-") as tmp_s,
        LocalControlPlane(Path(tmp_s) / "cp") as cp,
    ):
        tmp = Path(tmp_s)
        kube = Kube.from_environment(str(cp.kubeconfig))
        setup(kube)
        procs: list[subprocess.Popen[bytes]] = []
        logs = [open(tmp / n, "wb") for n in ("agent.log", "operator.log")]  # noqa: SIM115 (closed below)
        try:
            procs.append(
                subprocess.Popen(
                    [
                        sys.executable,
                        "-m",
                        "rewardplane.localcluster.nodeagent",
                        "--kubeconfig",
                        str(cp.kubeconfig),
                        "--node-name",
                        AGENT_NODE,
                        "--state-dir",
                        str(tmp / "node"),
                        "--heartbeat-s",
                        "5",
                    ],
                    stdout=logs[0],
                    stderr=subprocess.STDOUT,
                    start_new_session=True,
                )
            )
            procs.append(
                subprocess.Popen(
                    bench_operator(cp.kubeconfig, 0, "--resync-interval", "1"),
                    stdout=logs[1],
                    stderr=subprocess.STDOUT,
                    start_new_session=True,
                )
            )
            time.sleep(2)
            return bench_push(kube, cp.kubeconfig, tmp, args)
        finally:
            for proc in reversed(procs):
                stop_process(proc, grace_s=30)
            for f in logs:
                f.close()
            kube.close()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--runs", type=int, default=20)
    p.add_argument("--replicas", type=int, default=3)
    p.add_argument("--models", type=int, default=100)
    p.add_argument("--json", type=Path, help="also write the results here")
    p.add_argument("--push", action="store_true", help="benchmark weight pushes (operator vs direct) instead")
    p.add_argument("--push-runs", type=int, default=10)
    p.add_argument("--push-replicas", type=int, default=2)
    p.add_argument("--hidden", type=int, default=256, help="hidden size of the pushed tiny model")
    p.add_argument("--layers", type=int, default=4, help="layers of the pushed tiny model")
    p.add_argument("--scale", type=int, default=0, help="steady state with this many RewardModels instead")
    p.add_argument("--window", type=float, default=90.0, help="seconds of steady state measured (--scale)")
    p.add_argument(
        "--apply-check",
        choices=sorted(APPLY_CHECKS),
        default="get",
        help="how an apply's Pods are seen to exist: a GET per name (default) or a label-selected LIST",
    )
    p.add_argument("--tmp", help="directory for etcd's data and the logs (default: /dev/shm where it exists)")
    args = p.parse_args()
    if args.push:
        results = run_push(args)
        for mode in ("head_only", "full"):
            r = results[mode]
            print(
                f"{mode:<9} operator {r['operator_p50_s'] * 1000:8.1f} ms   direct {r['direct_p50_s'] * 1000:8.1f} ms"
                f"   ratio {r['ratio']:.2f}x  (p50 of {results['runs']}, {results['replicas']} replicas)"
            )
        print(json.dumps(results, indent=2))
        if args.json:
            args.json.write_text(json.dumps(results, indent=2))
        return 0

    # etcd's data in memory where there is a tmpfs: the benchmark measures the operator, not the disk.
    tmp_root = args.tmp or ("/dev/shm" if Path("/dev/shm").is_dir() else None)
    with (
        tempfile.TemporaryDirectory(prefix="rp-bench-", dir=tmp_root) as tmp,
        LocalControlPlane(Path(tmp) / "cp") as cp,
    ):
        kube = Kube.from_environment(str(cp.kubeconfig))
        setup(kube)
        log = open(Path(tmp) / "operator.log", "wb")  # noqa: SIM115 (closed below, after the process)
        metrics_port = free_port()
        operator = subprocess.Popen(
            bench_operator(cp.kubeconfig, metrics_port),
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        try:
            time.sleep(2)  # kopf starts its watches
            if args.scale:
                results = {"scale": bench_scale(kube, args.scale, operator.pid, metrics_port, args)}
                sc = results["scale"]
                print(
                    f"{sc['models']} models: operator CPU {sc['loaded']['cpu_cores']:.3f} cores "
                    f"(empty {sc['empty']['cpu_cores']:.3f}), RSS {sc['loaded']['rss_mib']:.0f} MiB "
                    f"(empty {sc['empty']['rss_mib']:.0f}), apply→pods p50 {sc['loaded']['apply']['p50_s']:.3f} s "
                    f"p90 {sc['loaded']['apply']['p90_s']:.3f} s ({sc['loaded']['apply']['timeouts']} timeouts) "
                    f"(empty {sc['empty']['apply']['p50_s']:.3f} s, ratio {sc['apply_p50_ratio']:.2f}x); "
                    f"all reconciled after {sc['create_all']['all_reconciled_s']:.0f} s; the window started "
                    f"after waiting {sc['resync_backlog']['waited_s']:.0f} s for "
                    f"{sc['resync_backlog']['waited_for']} (reached: {sc['resync_backlog']['reached']})"
                )
            else:
                results = {
                    "apply": bench_apply(kube, args.runs, args.replicas),
                    "many": bench_many(kube, args.models, operator.pid),
                }
            results["operator"] = reconcile_stats(metrics_port)
        finally:
            stop_process(operator, grace_s=20)
            log.close()
            kube.close()
    print(json.dumps(results, indent=2))
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
