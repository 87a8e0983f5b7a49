"""Which client the operator uses for its own API calls: the thin ``rewardplane.api.kube.Kube``
(httpx, JSON dicts, the kubernetes package only for its credential loaders) against the official
``kubernetes`` package's generated client (the baseline), on a real kube-apiserver + etcd.

Measured in one run, same server, same objects: a GET of one Pod and a LIST of N labelled Pods;
p50 over ``--runs`` calls each (a quarter of them for the LIST), and the ratio generated/thin. Also the import time of each client module in a fresh interpreter.

    python benchmarks/kube_client.py [--pods 200] [--runs 200]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from rewardplane.api.kube import Kube, core_path
from rewardplane.localcluster.controlplane import LocalControlPlane

NS = "default"


def p50(fn: Callable[[], Any], runs: int) -> float:
    times = []
    for _ in range(runs):
        started = time.perf_counter()
        fn()
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def import_s(module: str) -> float:
    code = f"import time; t = time.perf_counter(); import {module}; print(time.perf_counter() - t)"
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120
    )
    return float(out.stdout.strip())


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--pods", type=int, default=200)
    ap.add_argument("--runs", type=int, default=200)
    args = ap.parse_args()
    with (
        tempfile.TemporaryDirectory(prefix="rp-bench-kube-") as tmp,
        LocalControlPlane(Path(tmp) / "cp") as cp,
    ):
        thin = Kube.from_environment(str(cp.kubeconfig))
        from kubernetes import client, config

        api_client = config.new_client_from_config(str(cp.kubeconfig))
        core = client.CoreV1Api(api_client)
        thin.create(core_path("nodes"), {"metadata": {"name": "bench-node"}})
        for i in range(args.pods):
            thin.create(
                core_path("pods", NS),
                {
                    "metadata": {"name": f"p-{i}", "labels": {"bench": "yes"}},
                    "spec": {"nodeName": "bench-node", "containers": [{"name": "c", "image": "x"}]},
                },
            )
        results: dict[str, dict[str, float]] = {
            "get_pod": {
                "thin": p50(lambda: thin.get(core_path("pods", NS, "p-0")), args.runs),
                "generated": p50(lambda: core.read_namespaced_pod("p-0", NS), args.runs),
            },
            "list_pods": {
                "thin": p50(
                    lambda: thin.list(core_path("pods", NS), label_selector="bench=yes"), args.runs // 4
                ),
                "generated": p50(
                    lambda: core.list_namespaced_pod(NS, label_selector="bench=yes"), args.runs // 4
                ),
            },
            "import": {
                "thin": import_s("rewardplane.api.kube"),
                "generated": import_s("kubernetes.client"),
            },
        }
        thin.close()
        api_client.close()
    for what, r in results.items():
        r["ratio_generated_over_thin"] = r["generated"] / r["thin"]
        print(
            f"{what:<10} thin {r['thin'] * 1000:8.2f} ms   generated {r['generated'] * 1000:8.2f} ms   "
            f"ratio {r['ratio_generated_over_thin']:.2f}x"
        )
    print(json.dumps({"pods": args.pods, "runs": args.runs, **results}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
