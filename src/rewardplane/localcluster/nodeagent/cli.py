"""``rewardplane node``: run a node agent until SIGTERM or SIGINT."""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
from pathlib import Path
from typing import Any

from rewardplane.localcluster.nodeagent.agent import NodeAgent
from rewardplane.localcluster.nodeagent.config import POD_NETWORK_ENV, AgentConfig, detect_memory
from rewardplane.protocol import settings

log = logging.getLogger("rewardplane.nodeagent")


def parse_labels(items: list[str]) -> dict[str, str]:
    labels = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise SystemExit(f"--label {item!r}: expected KEY=VALUE")
        labels[key] = value
    return labels


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="rewardplane node",
        description=(
            "Run a node agent: register a Node and run Pods bound to it (spec.nodeName) as local "
            "processes on their own loopback addresses."
        ),
    )
    p.add_argument(
        "--kubeconfig",
        default=os.environ.get("KUBECONFIG"),
        help="kubeconfig of the cluster (default: $KUBECONFIG)",
    )
    p.add_argument("--node-name", default="local-node")
    p.add_argument("--gpus", type=int, default=0, help="nvidia.com/gpu capacity to advertise")
    p.add_argument("--cpu", default=str(os.cpu_count() or 1))
    p.add_argument("--memory", default=None, help="memory capacity, e.g. 16Gi (default: MemTotal)")
    p.add_argument("--max-pods", type=int, default=110)
    p.add_argument(
        "--label", action="append", default=[], metavar="KEY=VALUE", help="node label (repeatable)"
    )
    p.add_argument(
        "--state-dir",
        type=Path,
        default=None,
        help="pod logs and volumes (default: ~/.cache/rewardplane/node/<node-name>)",
    )
    p.add_argument("--heartbeat-s", type=float, default=10.0)
    p.add_argument("--max-grace-s", type=float, default=30.0)
    p.add_argument(
        "--pod-network",
        type=int,
        default=settings.POD_NETWORK.get(),
        metavar="N",
        help=(
            f"pods get the loopback addresses 127.N.0.2, 127.N.0.3, ... (default 0, or ${POD_NETWORK_ENV}); "
            "node agents on one host need different values"
        ),
    )
    p.add_argument("--log-level", default="INFO")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    if not args.kubeconfig:
        print("rewardplane node: no kubeconfig; pass --kubeconfig PATH or set KUBECONFIG", file=sys.stderr)
        return 2
    if args.gpus < 0:
        print("rewardplane node: --gpus must be >= 0", file=sys.stderr)
        return 2
    if not 0 <= args.pod_network <= 255:
        print(
            "rewardplane node: --pod-network must be 0-255 (the second octet of 127.N.x.y)", file=sys.stderr
        )
        return 2
    from kubernetes import config as kconfig

    try:
        api = kconfig.new_client_from_config(config_file=args.kubeconfig)
    except Exception as exc:
        print(f"rewardplane node: cannot load kubeconfig {args.kubeconfig}: {exc}", file=sys.stderr)
        return 2
    state_dir = args.state_dir or Path.home() / ".cache" / "rewardplane" / "node" / args.node_name
    cfg = AgentConfig(
        node_name=args.node_name,
        gpus=args.gpus,
        cpu=args.cpu,
        memory=args.memory or detect_memory(),
        max_pods=args.max_pods,
        labels=parse_labels(args.label),
        state_dir=state_dir.expanduser(),
        heartbeat_s=args.heartbeat_s,
        max_grace_s=args.max_grace_s,
        pod_network=args.pod_network,
    )
    agent = NodeAgent(api, cfg)

    def _on_signal(signum: int, _frame: Any) -> None:
        log.info("signal %d: stopping", signum)
        agent.stop()

    signal.signal(signal.SIGTERM, _on_signal)
    signal.signal(signal.SIGINT, _on_signal)
    agent.run()
    return 0
