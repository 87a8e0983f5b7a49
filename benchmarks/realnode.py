"""The real node against the node agent, in one run, on the same tiny model and the same machine.

For each kind of node (``rewardplane dev up --node agent`` and ``--node real``):

1. apply → Ready: create a RewardModel with one replica (CPU, transformers engine, the model from
   a node directory), time until it is Available with its replica ready; delete it, wait until its
   pod is gone; repeated ``--runs`` times, p50 reported.
2. push through the operator (``RewardModelHandle.push_weights``: call → WeightSync Completed,
   every replica on the new version), head_only and full, ``--push-runs`` each, p50.
3. operator RSS after all that: the host process (agent), or the operator container's processes
   (tini + python) on the real node.

Needs root, the binaries (scripts/install-k8s-tools.sh) and the images (scripts/build-images.sh).

    python benchmarks/realnode.py [--runs 5] [--push-runs 5] [--hidden 256] [--layers 4] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, cast

from rewardplane.localcluster import realnode
from rewardplane.localcluster.binaries import cache_dir
from rewardplane.localcluster.controlplane import api_client_for
from rewardplane.localcluster.dev import OPERATOR_NAMESPACE, helm_install_operator, local_image_tag
from rewardplane.tinymodel import build_tiny_reward_model

NAME = "bench-rm"
NS = "default"
GROUP, VERSION = "rewardplane.io", "v1alpha1"
TEXTS = ["a benchmark text", "another one, a little longer than the first"]


def wait(what: str, check: Callable[[], Any], timeout_s: float, poll_s: float = 0.05) -> Any:
    deadline = time.monotonic() + timeout_s
    while True:
        got = check()
        if got:
            return got
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout_s}s waiting for {what}")
        time.sleep(poll_s)


def rss_mib(pids: list[int]) -> float:
    total = 0
    for pid in pids:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                total += int(line.split()[1])
    return total / 1024


def descendants(pid: int) -> list[int]:
    out = [pid]
    for task in Path(f"/proc/{pid}/task").iterdir():
        children = (task / "children").read_text().split()
        for child in children:
            out += descendants(int(child))
    return out


@contextmanager
def agent_cluster(state: Path) -> Iterator[tuple[Path, Callable[[], list[int]]]]:
    dev = [sys.executable, "-m", "rewardplane.localcluster.dev"]
    up = subprocess.run(
        [*dev, "up", "--node", "agent", "--state-dir", str(state)],
        capture_output=True,
        text=True,
        timeout=180,
        check=True,
    )
    kubeconfig = Path(up.stdout.strip().split("=", 1)[1])
    try:
        yield kubeconfig, lambda: [int((state / "pids" / "operator.pid").read_text())]
    finally:
        subprocess.run(
            [*dev, "down", "--node", "agent", "--state-dir", str(state)], capture_output=True, timeout=120
        )


@contextmanager
def real_cluster(state: Path) -> Iterator[tuple[Path, Callable[[], list[int]]]]:
    node = realnode.RealNode(state)
    kubeconfig = node.up(timeout_s=300)

    def operator_pids() -> list[int]:
        api = api_client_for(kubeconfig)
        from kubernetes import client

        [pod] = client.CoreV1Api(api).list_namespaced_pod(OPERATOR_NAMESPACE).items
        statuses = pod.status.container_statuses if pod.status else None
        if not statuses or not statuses[0].container_id:
            raise RuntimeError("the operator pod's container has not started")
        cid = statuses[0].container_id.removeprefix("containerd://")
        api.close()
        out = subprocess.run(
            ["ctr", "-a", str(node.layout.containerd_sock), "-n", "k8s.io", "tasks", "ls"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout
        pid = next(int(line.split()[1]) for line in out.splitlines() if line.startswith(cid))
        return descendants(pid)

    try:
        helm_install_operator(kubeconfig)
        yield kubeconfig, operator_pids
    finally:
        node.down()


def rm_body(model_dir: Path) -> dict[str, Any]:
    return {
        "apiVersion": f"{GROUP}/{VERSION}",
        "kind": "RewardModel",
        "metadata": {"name": NAME, "namespace": NS},
        "spec": {
            "model": {"source": f"file://{model_dir}", "dtype": "float32"},
            "engine": {
                "kind": "hf",
                "image": f"localhost/rewardplane/reward-server:{local_image_tag()}",
                "imagePullPolicy": "Never",
            },
            "replicas": 1,
            "gpu": {"mode": "none"},
        },
    }


def bench(
    kind: str,
    kubeconfig: Path,
    operator_pids: Callable[[], list[int]],
    model_dir: Path,
    args: argparse.Namespace,
) -> dict[str, Any]:
    import torch
    from kubernetes import client
    from transformers import AutoModelForSequenceClassification

    from rewardplane.sdk import RewardModelTrainingMode, select_head
    from rewardplane.sdk.cluster import RewardModelHandle

    api = api_client_for(kubeconfig)
    custom, core = client.CustomObjectsApi(api), client.CoreV1Api(api)

    def available() -> bool:
        try:
            # the client types the decoded JSON as ``object``: one object is a dict
            rm = cast(
                dict[str, Any], custom.get_namespaced_custom_object(GROUP, VERSION, NS, "rewardmodels", NAME)
            )
        except client.ApiException:
            return False
        st = rm.get("status") or {}
        conds = {c["type"]: c["status"] for c in st.get("conditions") or []}
        return st.get("readyReplicas") == 1 and conds.get("Available") == "True"

    def models() -> list[dict[str, Any]]:
        listed = cast(
            dict[str, Any], custom.list_namespaced_custom_object(GROUP, VERSION, NS, "rewardmodels")
        )
        items: list[dict[str, Any]] = listed["items"]
        return items

    def no_pods() -> bool:
        return not core.list_namespaced_pod(NS, label_selector=f"rewardplane.io/model={NAME}").items

    ready_s = []
    for i in range(args.runs + 1):  # the first run warms caches (image, page cache): not counted
        start = time.monotonic()
        custom.create_namespaced_custom_object(GROUP, VERSION, NS, "rewardmodels", rm_body(model_dir))
        wait("Available", available, 300)
        if i:
            ready_s.append(time.monotonic() - start)
        if i < args.runs:
            custom.delete_namespaced_custom_object(GROUP, VERSION, NS, "rewardmodels", NAME)
            wait("the model gone", lambda: no_pods() and not available(), 120)
            wait(
                "the model object gone",
                lambda: not models(),
                120,
            )
    model = AutoModelForSequenceClassification.from_pretrained(model_dir, dtype=torch.float32)
    pushes: dict[str, list[float]] = {"head_only": [], "full": []}
    with RewardModelHandle(NAME, NS, kubeconfig=kubeconfig) as rm:
        version = rm.get_weights_version()
        for mode in (RewardModelTrainingMode.HEAD_ONLY, RewardModelTrainingMode.FULL):
            for _ in range(args.push_runs):
                params = (
                    select_head(model.state_dict())
                    if mode is RewardModelTrainingMode.HEAD_ONLY
                    else model.state_dict()
                )
                version += 1
                start = time.monotonic()
                rm.push_weights(params, version, mode, timeout_s=120)
                pushes[mode.value].append(time.monotonic() - start)
        rm.client().score_batch(TEXTS, normalize=False)
    rss = rss_mib(operator_pids())
    api.close()
    result = {
        "node": kind,
        "apply_to_ready_p50_s": round(statistics.median(ready_s), 2),
        "apply_to_ready_runs_s": [round(x, 2) for x in ready_s],
        "push_head_only_p50_ms": round(1000 * statistics.median(pushes["head_only"]), 1),
        "push_full_p50_ms": round(1000 * statistics.median(pushes["full"]), 1),
        "operator_rss_mib": round(rss, 1),
    }
    print(json.dumps(result), flush=True)
    return result


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--runs", type=int, default=5)
    p.add_argument("--push-runs", type=int, default=5)
    p.add_argument("--hidden", type=int, default=256, help="hidden size of the tiny model")
    p.add_argument("--layers", type=int, default=4, help="layers of the tiny model")
    p.add_argument("--json", type=Path, help="also write the results here")
    args = p.parse_args()
    results = []
    with tempfile.TemporaryDirectory(prefix="rp-bench-") as tmp:
        model_dir = Path(tmp) / "model"
        build_tiny_reward_model(model_dir, hidden_size=args.hidden, num_layers=args.layers, seed=0)
        Path(tmp).chmod(0o755)  # the server's user (65532) reads the model through a hostPath
        with agent_cluster(Path(tmp) / "agent") as (kubeconfig, pids):
            results.append(bench("agent", kubeconfig, pids, model_dir, args))
        with real_cluster(cache_dir() / "realnode-bench") as (kubeconfig, pids):
            results.append(bench("real", kubeconfig, pids, model_dir, args))
    out = {
        "machine": f"{platform.machine()}, {len(os.sched_getaffinity(0))} cores, {platform.platform()}",
        "model": {"hidden": args.hidden, "layers": args.layers},
        "runs": args.runs,
        "push_runs": args.push_runs,
        "results": results,
    }
    if args.json:
        args.json.write_text(json.dumps(out, indent=2) + "\n")
    a, r = results
    print(f"{'':28}{'node agent':>12}{'real node':>12}")
    for key, label in (
        ("apply_to_ready_p50_s", "apply -> Ready p50 (s)"),
        ("push_head_only_p50_ms", "push head_only p50 (ms)"),
        ("push_full_p50_ms", "push full p50 (ms)"),
        ("operator_rss_mib", "operator RSS (MiB)"),
    ):
        print(f"{label:28}{a[key]:>12}{r[key]:>12}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
