"""``python -m rewardplane.operator``: run the operator standalone, with a /metrics endpoint."""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Callable
from typing import Any, TypeVar

from rewardplane.protocol import settings


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m rewardplane.operator", description=__doc__)
    try:  # the flags' defaults come from the environment (docs/settings.md)
        resync_interval, log_level = settings.RESYNC_INTERVAL.get(), settings.LOG_LEVEL.get()
        server_image = settings.SERVER_IMAGE.get()
        cache_dir, cache_size = settings.MODEL_CACHE_DIR.get(), settings.MODEL_CACHE_SIZE.get()
        cache_verify = settings.MODEL_CACHE_VERIFY.get()
    except settings.SettingError as exc:
        p.error(str(exc))
    p.add_argument(
        "--kubeconfig", help="kubeconfig to use (default: in-cluster, else $KUBECONFIG or ~/.kube/config)"
    )
    scope = p.add_mutually_exclusive_group()
    scope.add_argument("--namespace", "-n", help="watch only this namespace")
    scope.add_argument(
        "--all-namespaces", "-A", action="store_true", help="watch every namespace (the default)"
    )
    p.add_argument(
        "--metrics-port", type=int, default=9090, help="port of /metrics; 0 disables it (default 9090)"
    )
    p.add_argument("--liveness-port", type=int, default=0, help="port of kopf's /healthz; 0 disables it")
    p.add_argument(
        "--resync-interval",
        type=float,
        default=resync_interval,
        help="seconds between periodic reconciles of each RewardModel besides its events "
        f"(default {settings.RESYNC_INTERVAL.shown_default}, or ${settings.RESYNC_INTERVAL.name})",
    )
    p.add_argument(
        "--default-server-image",
        default=server_image,
        help="the reward-server image of a RewardModel without spec.engine.image (the chart passes "
        f"its serverImage value); default ${settings.SERVER_IMAGE.name}, else none: such a model is "
        "Degraded with reason NoImage",
    )
    p.add_argument(
        "--model-cache-dir",
        default=cache_dir,
        help="node directory where replicas keep models downloaded from s3://, https:// and hf://, "
        "shared by every replica and restart on the node (the chart passes modelCache.hostPath); empty: "
        f"each Pod downloads into its own emptyDir (default {settings.MODEL_CACHE_DIR.shown_default}, or "
        f"${settings.MODEL_CACHE_DIR.name})",
    )
    p.add_argument(
        "--model-cache-size",
        type=_bytes_flag,
        default=cache_size,
        help="keep the node cache under this many bytes (a quantity: 200Gi), evicting the least recently "
        f"used models after a download; 0: no limit (default {settings.MODEL_CACHE_SIZE.shown_default}, "
        f"or ${settings.MODEL_CACHE_SIZE.name})",
    )
    p.add_argument(
        "--model-cache-verify",
        type=_verify_flag,
        default=cache_verify,
        help="how a replica checks a model it finds in the node cache before its server starts: sha256 "
        "re-reads every file (catches a corrupted entry), size compares file sizes only (near-instant) "
        f"(default {settings.MODEL_CACHE_VERIFY.shown_default}, or ${settings.MODEL_CACHE_VERIFY.name})",
    )
    p.add_argument(
        "--leader-election-namespace",
        default=None,
        help="namespace of the leadership Lease (one operator acts at a time); default: the Pod's own "
        "(POD_NAMESPACE or its ServiceAccount's). Outside a cluster without this flag there is no election",
    )
    p.add_argument(
        "--lease-owner-deployment",
        default=None,
        help="the operator's own Deployment (in the Lease's namespace): the Lease is owned by it, so "
        "deleting the Deployment (helm uninstall) deletes the Lease too",
    )
    p.add_argument(
        "--no-leader-election",
        action="store_true",
        help="act without holding the Lease (only where no second operator can run)",
    )
    p.add_argument(
        "--log-level",
        default=log_level,
        help=f"DEBUG, INFO, WARNING, ERROR or CRITICAL (default INFO, or ${settings.LOG_LEVEL.name})",
    )
    p.add_argument(
        "--delete-children",
        action="store_true",
        help="delete a RewardModel's Pods, Service and Secret itself when it goes; only for a control "
        "plane without a garbage collector (the node-agent dev cluster): owner references do it "
        "everywhere else",
    )
    return p.parse_args(argv)


T = TypeVar("T")


def _setting_flag(parse: Callable[[str], T], problem: str) -> Callable[[str], T]:
    """An argparse type from a setting's parser: a bad value is "'<value>' is not <problem>"."""

    def flag(raw: str) -> T:
        try:
            return parse(raw)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{raw!r} is not {problem}") from None

    return flag


_bytes_flag = _setting_flag(settings.MODEL_CACHE_SIZE.parse, "a size: write bytes or a quantity like 200Gi")
_verify_flag = _setting_flag(
    settings.MODEL_CACHE_VERIFY.parse,
    f"a way to check the cache: give {' or '.join(settings.MODEL_CACHE_VERIFIES)}",
)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    # One line per API call or per resync tick of every model would drown what matters.
    logging.getLogger("httpx").setLevel(logging.WARNING)
    if logging.getLogger().level > logging.DEBUG:
        logging.getLogger("kopf.objects").setLevel(logging.WARNING)
    if args.resync_interval <= 0:
        print("--resync-interval must be > 0 seconds", file=sys.stderr)
        return 2
    # Read by the handlers module when it registers the timer, so set before importing it.
    settings.RESYNC_INTERVAL.export(args.resync_interval)
    settings.warn_retired(logging.getLogger("rewardplane.operator"))

    import kopf

    from rewardplane.api.kube import Kube

    from . import handlers, metrics  # noqa: F401  (importing registers the handlers)
    from .leadership import Leadership, own_namespace
    from .reconcile import Reconciler
    from .storage import ModelCache
    from .weightsync_driver import WeightSyncDriver

    try:
        kube = Kube.from_environment(args.kubeconfig)
    except Exception as exc:  # config loaders raise several types; all mean the same to the user
        print(
            f"cannot load Kubernetes credentials ({exc}); pass --kubeconfig or set KUBECONFIG",
            file=sys.stderr,
        )
        return 2
    if args.metrics_port:
        metrics.serve(args.metrics_port)
    reconciler = Reconciler(
        kube,
        namespace=args.namespace,
        delete_children=args.delete_children,
        default_image=args.default_server_image or None,
        model_cache=ModelCache(args.model_cache_dir, args.model_cache_size, args.model_cache_verify),
    )
    weightsyncs = WeightSyncDriver(
        kube,
        on_done=lambda key: reconciler.request(key, trigger="weightsync"),
        stale_pods=reconciler.stale_pods,
    )
    # One line that says the operator is up and what it watches: the first thing to look for in
    # `kubectl logs` when nothing seems to happen.
    logging.getLogger("rewardplane.operator").info(
        "rewardplane operator starting: watching %s; /metrics %s, /healthz %s; default reward-server "
        "image %s",
        f"namespace {args.namespace}" if args.namespace else "all namespaces",
        f"on port {args.metrics_port}" if args.metrics_port else "off",
        f"on port {args.liveness_port}" if args.liveness_port else "off",
        args.default_server_image
        or "none (a RewardModel without spec.engine.image is Degraded: NoImage; set --default-server-image)",
    )
    leadership = None
    lease_namespace = None if args.no_leader_election else own_namespace(args.leader_election_namespace)
    if lease_namespace is not None:
        leadership = Leadership(
            kube.configuration, lease_namespace, owner_deployment=args.lease_owner_deployment
        )
        leadership.acquire()  # blocks: a second operator waits here until the first stops
    else:
        logging.getLogger("rewardplane.operator").warning(
            "no leader election (%s): run only one operator against this cluster",
            "--no-leader-election" if args.no_leader_election else "no namespace known outside a cluster",
        )
    try:
        run_kopf(kopf, args, reconciler, weightsyncs)
    finally:
        if leadership is not None:
            leadership.release()
    return 0


def run_kopf(kopf: Any, args: argparse.Namespace, reconciler: Any, weightsyncs: Any) -> None:
    kopf.run(
        standalone=True,  # kopf's own peering is off: the Lease above decides who acts
        clusterwide=args.namespace is None,
        namespaces=[args.namespace] if args.namespace else (),
        memo=kopf.Memo(reconciler=reconciler, weightsyncs=weightsyncs),
        liveness_endpoint=f"http://0.0.0.0:{args.liveness_port}/healthz" if args.liveness_port else None,
    )


if __name__ == "__main__":
    sys.exit(main())
