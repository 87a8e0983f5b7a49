"""``rewardplane status | score | push``: a RewardModel from the command line, without writing Python.

    rewardplane status NAME [-n NS]              rewardplane status --url URL [--url URL ...]
    rewardplane score NAME TEXT... [-n NS] [--raw | --normalize]
    rewardplane score --url URL TEXT... [--normalize]
    rewardplane push NAME --from CHECKPOINT --version N [--mode MODE] [-n NS] [--timeline PUSH.png]
    rewardplane push --url URL --from CHECKPOINT --version N [--mode MODE] [--token-file FILE]

With NAME, through the cluster: credentials from ``--kubeconfig``, else in-cluster, else
``$KUBECONFIG`` / ``~/.kube/config``; pushing reads the control-plane token from
``REWARDPLANE_TOKEN`` or the model's Secret. With ``--url`` (direct mode, no cluster): the servers
themselves; pushing reads the token from ``--token-file``, ``REWARDPLANE_TOKEN_FILE`` or
``REWARDPLANE_TOKEN``.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Mapping
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from rewardplane.protocol import DEFAULT_GROUP_PORT, RewardModelTrainingMode


def _common(p: argparse.ArgumentParser, name_nargs: str | None = "?") -> None:
    p.add_argument("name", nargs=name_nargs, help="the RewardModel (leave out with --url)")
    p.add_argument(
        "-n", "--namespace", default="default", help="the RewardModel's namespace (default: default)"
    )
    p.add_argument(
        "--kubeconfig", default=None, help="kubeconfig (default: in-cluster, $KUBECONFIG, ~/.kube/config)"
    )
    p.add_argument(
        "--url",
        dest="urls",
        action="append",
        metavar="URL",
        help="direct mode, no cluster: a reward server's address, e.g. http://10.0.0.5:8001 (repeat for each)",
    )


# Each subcommand: its one-line help, and the description its own --help shows.
_COMMANDS = {
    "status": (
        "show a RewardModel's status, endpoints and last push",
        "Show a RewardModel's phase, conditions, endpoints (with each replica's weights version) and "
        "its last push.",
    ),
    "score": (
        "score texts with a RewardModel's ready replicas",
        "Score one or more texts with a RewardModel's ready replicas; prints one line per text "
        "(score, tab, text) and the weights version that scored them.",
    ),
    "push": (
        "push a saved checkpoint into a RewardModel's servers",
        "Push the weights of a saved checkpoint into every replica of a RewardModel, in memory, as "
        "one new weights version; returns once every replica serves it.",
    ),
}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="rewardplane", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = p.add_subparsers(dest="command", required=True)
    commands = {}
    for name, (summary, description) in _COMMANDS.items():
        commands[name] = sub.add_parser(name, help=summary, description=description)
        _common(commands[name])  # the target: NAME, or --url
    status = commands["status"]
    status.add_argument("--json", action="store_true", help="print the raw status as JSON")
    score = commands["score"]
    score.add_argument("texts", nargs="*", metavar="TEXT")
    how = score.add_mutually_exclusive_group()
    how.add_argument(
        "--raw",
        action="store_true",
        help="raw head outputs (the default with --url and where the model's spec says so)",
    )
    how.add_argument("--normalize", action="store_true", help="sigmoid/softmax of the head outputs")
    push = commands["push"]
    push.add_argument(
        "--from",
        dest="checkpoint",
        required=True,
        type=Path,
        help="a saved Hugging Face checkpoint folder (save_pretrained)",
    )
    push.add_argument("--version", type=int, required=True, help="new weights version (must increase)")
    push.add_argument(
        "--mode",
        choices=[m.value for m in RewardModelTrainingMode],
        default=None,
        help="what to push (default: the model's spec.weightSync.defaultTrainingMode, else full)",
    )
    push.add_argument("--timeout", type=float, default=600.0, help="seconds for the whole push (default 600)")
    push.add_argument("--trainer-host", default=None, help="this machine's address as the replicas reach it")
    push.add_argument(
        "--bucket-bytes", type=int, default=None, help="bytes per transfer bucket (default 1 GiB)"
    )
    push.add_argument(
        "--token-file",
        default=None,
        help="with --url: the servers' control-plane token (else $REWARDPLANE_TOKEN...)",
    )
    push.add_argument(
        "--group-port",
        type=int,
        default=DEFAULT_GROUP_PORT,
        help=f"with --url: the port this machine hosts the push's rendezvous on (default {DEFAULT_GROUP_PORT})",
    )
    push.add_argument(
        "--timeline",
        type=Path,
        default=None,
        metavar="PNG",
        help="write the push's per-replica timeline (its phases on each replica) as a PNG; needs "
        "matplotlib (pip install 'rewardplane[plot]')",
    )
    return p


def _handle(args: argparse.Namespace) -> Any:
    from .cluster import RewardModelHandle

    return RewardModelHandle(args.name, args.namespace, kubeconfig=args.kubeconfig)


def check_target(args: argparse.Namespace) -> None:
    """Exactly one of NAME (the cluster) and ``--url`` (direct mode)."""
    if args.urls and args.name is not None and args.command != "score":
        raise UsageError(f"give the RewardModel's name or --url, not both (got {args.name!r} and --url)")
    if not args.urls and args.name is None:
        raise UsageError(
            f"name the RewardModel (rewardplane {args.command} NAME), or give a server's address without a "
            f"cluster (rewardplane {args.command} --url http://HOST:8001)"
        )


def cmd_status(args: argparse.Namespace) -> int:
    from rewardplane.api.heartbeat import unconfirmed
    from rewardplane.api.status import RewardModelStatus

    if args.urls:
        return direct_status(args.urls)
    with _handle(args) as handle:
        rm = handle.get()
        raw = rm.get("status") or {}
        ws = handle.weightsync()
        if args.json:
            print(json.dumps({"status": raw, "weightsync": (ws or {}).get("status")}, indent=2))
            return 0
        status = RewardModelStatus.model_validate(raw)
        doubt = unconfirmed(raw, datetime.now(UTC))
        print(
            f"RewardModel {args.namespace}/{args.name}: {status.phase}  ready "
            f"{status.ready_replicas}/{status.replicas}  weights version {status.weights_version}"
            + ("  (UNCONFIRMED)" if doubt else "")
        )
        if doubt:
            print(f"  WARNING: {doubt}")
        if status.message:
            print(f"  {status.message}")
        print(f"  {'REPLICA':<8} {'POD':<24} {'URL':<28} {'VERSION':<8} {'STATE':<10} READY")
        for e in status.endpoints:
            version = "-" if e.weights_version is None else str(e.weights_version)
            print(f"  {e.replica:<8} {e.pod:<24} {e.url:<28} {version:<8} {e.state or '-':<10} {e.ready}")
        for c in status.conditions:
            print(f"  {c.type}={c.status} ({c.reason}): {c.message}")
        wss = (ws or {}).get("status") or {}
        if wss:
            line = (
                f"  last push: version {wss.get('version')} {wss.get('trainingMode', '')} {wss.get('phase')}"
                f" in {wss.get('durationSeconds', '-')}s, world size {wss.get('worldSize', '-')}"
            )
            if wss.get("reason"):
                line += f" ({wss['reason']}: {wss.get('message', '')})"
            if wss.get("observedGeneration") != ((ws or {}).get("metadata") or {}).get("generation"):
                line += (
                    f"; version {((ws or {}).get('spec') or {}).get('version')} asked for, not taken up yet"
                )
            print(line)
    return 0


def score_normalize(spec: Mapping[str, Any], raw: bool, normalize: bool) -> bool:
    """Whether ``rewardplane score`` normalises: as the flags say, else as the RewardModel's
    ``spec.model.normalize`` says (the way its users score it)."""
    if raw or normalize:
        return normalize
    return bool(((spec.get("model") or {}).get("normalize")) or False)


def direct_status(urls: list[str]) -> int:
    """Each server's health, weights version and model (direct mode)."""
    import httpx

    from .retry import RewardClientError

    for url in urls:
        try:
            health = httpx.get(f"{url.rstrip('/')}/health", timeout=10).json()
        except (httpx.HTTPError, ValueError) as exc:
            raise RewardClientError(
                f"reward server {url} did not answer /health ({type(exc).__name__}: {exc}); check that it runs, "
                "listens on an address this machine reaches (--host 0.0.0.0) and that no firewall blocks the port"
            ) from exc
        print(
            f"{url}: {health.get('status')}  state {health.get('state')}  weights version {health.get('version')}"
            f"  admitted {health.get('admitted')}"
        )
    return 0


def cmd_score(args: argparse.Namespace) -> int:
    from rewardplane.protocol import ScoringRequest

    texts = [args.name, *args.texts] if args.urls and args.name is not None else list(args.texts)
    target = "--url URL" if args.urls else args.name
    if not texts:
        raise UsageError(f'give the text to score, e.g. rewardplane score {target} "a prompt and its answer"')
    empty = [i + 1 for i, t in enumerate(texts) if not t.strip()]
    if empty:
        raise UsageError(
            f"text {', '.join(map(str, empty))} is empty: give the text to score, e.g. "
            f'rewardplane score {target} "a prompt and its answer"'
        )
    if args.urls:
        from .client import RewardClient

        with RewardClient(args.urls) as client:
            response, _ = client.score(ScoringRequest(inputs=texts, normalize=args.normalize))
    else:
        with _handle(args) as handle:
            normalize = score_normalize(handle.get().get("spec") or {}, args.raw, args.normalize)
            response, _ = handle.client().score(ScoringRequest(inputs=texts, normalize=normalize))
    for text, score in zip(texts, response.scores, strict=True):
        print(f"{json.dumps(score)}\t{text}")
    print(f"(weights version {response.version})", file=sys.stderr)
    return 0


def check_checkpoint(path: Path) -> None:
    """Before anything is contacted: ``--from`` names a saved checkpoint folder."""
    if not path.is_dir():
        raise FileNotFoundError(f"checkpoint {path} is not a folder; pass what save_pretrained() wrote")
    if not (path / "config.json").exists() and not (path / "adapter_config.json").exists():
        raise FileNotFoundError(
            f"checkpoint {path} has no config.json (nor adapter_config.json): pass the folder "
            "save_pretrained() wrote"
        )


def load_checkpoint(path: Path, mode: RewardModelTrainingMode) -> dict[str, Any]:
    """The parameters to push from a saved checkpoint: a PEFT adapter folder is merged first."""
    import torch

    from rewardplane.protocol.naming import select_head

    check_checkpoint(path)
    if (path / "adapter_config.json").exists():
        from peft import AutoPeftModelForSequenceClassification

        model = AutoPeftModelForSequenceClassification.from_pretrained(
            path, dtype=torch.float32
        ).merge_and_unload()
    else:
        from transformers import AutoModelForSequenceClassification

        model = AutoModelForSequenceClassification.from_pretrained(path, dtype="auto")
    state = model.state_dict()
    return select_head(state) if mode is RewardModelTrainingMode.HEAD_ONLY else state


def push_mode(spec: Mapping[str, Any], given: str | None) -> RewardModelTrainingMode:
    """The flag, else the RewardModel's ``spec.weightSync.defaultTrainingMode``, else full."""
    default = (
        (spec.get("weightSync") or {}).get("defaultTrainingMode")
    ) or RewardModelTrainingMode.FULL.value
    return RewardModelTrainingMode(given or default)


def cmd_push(args: argparse.Namespace) -> int:
    check_checkpoint(args.checkpoint)
    if args.urls:
        return direct_push(args)
    if args.token_file is not None:
        raise UsageError(
            "--token-file goes with --url; through the cluster the token comes from the model's Secret"
        )
    kwargs: dict[str, Any] = {"timeout_s": args.timeout, "trainer_host": args.trainer_host}
    if args.bucket_bytes:
        kwargs["bucket_bytes"] = args.bucket_bytes
    with _handle(args) as handle:
        mode = push_mode(handle.get().get("spec") or {}, args.mode)
        params = load_checkpoint(args.checkpoint, mode)
        result = handle.push_weights(params, args.version, mode, **kwargs)
        print(
            f"pushed version {result.version} ({result.training_mode}, {result.bytes} bytes) to "
            f"{result.replicas} replica(s) in {result.duration_s:.2f}s (transfer {result.transfer_s:.2f}s)"
        )
        if args.timeline is not None:
            write_timeline(handle, result, args.timeline)
    return 0


def direct_push(args: argparse.Namespace) -> int:
    """``push --url``: this process hosts the group and pushes into the servers (direct mode)."""
    import time

    from .push.pusher import WeightPusher

    if args.timeline is not None:
        raise UsageError(
            "--timeline reads the operator's WeightSync: use it with a RewardModel's name, not --url"
        )
    mode = RewardModelTrainingMode(args.mode or RewardModelTrainingMode.FULL.value)
    params = load_checkpoint(args.checkpoint, mode)
    options: dict[str, Any] = {"timeout_s": args.timeout, "trainer_host": args.trainer_host}
    if args.bucket_bytes:
        options["bucket_bytes"] = args.bucket_bytes
    start = time.monotonic()
    with WeightPusher(args.urls, group_port=args.group_port, token_file=args.token_file, **options) as pusher:
        version = pusher.push(params, version=args.version, training_mode=mode)
    print(
        f"pushed version {version} ({mode.value}) to {len(args.urls)} server(s) in {time.monotonic() - start:.2f}s"
    )
    return 0


def write_timeline(handle: Any, result: Any, path: Path) -> None:
    """``result``'s per-replica timeline, read from each replica the push reached, as a PNG."""
    import httpx

    from .timeline import replica_timelines, write_png

    headers = {"Authorization": f"Bearer {handle.token()}"}

    def get(url: str) -> dict[str, Any]:
        r = httpx.get(url, headers=headers, timeout=10)
        r.raise_for_status()
        return dict(r.json())

    replicas = (result.weightsync.get("status") or {}).get("replicas") or []
    timelines = replica_timelines(replicas, result.version, get)
    write_png(path, timelines, f"{handle.name}: push of version {result.version} ({result.training_mode})")
    print(f"wrote the push's timeline ({len(timelines)} replica(s)) to {path}")


class UsageError(ValueError):
    """Bad command-line input, said in one line."""


COMMANDS = {"status": cmd_status, "score": cmd_score, "push": cmd_push}


def main(argv: list[str] | None = None) -> int:
    """``argv[0]`` is the subcommand (``status``, ``score`` or ``push``)."""
    parser = build_parser()
    args, extra = parser.parse_known_args(sys.argv[1:] if argv is None else argv)
    # `score NAME --raw TEXT...`: texts after the options (the name's optional with --url, so
    # argparse ends the positionals at the first option)
    if extra and args.command == "score" and not any(e.startswith("-") for e in extra):
        args.texts = [*args.texts, *extra]
    elif extra:
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    try:
        check_target(args)
        return COMMANDS[args.command](args)
    except Exception as exc:  # one clear line, not a traceback, for expected failures
        message = user_error(exc, args)
        if message is None:
            raise
        print(f"rewardplane {args.command}: {message}", file=sys.stderr)
        return 1


def user_error(exc: Exception, args: argparse.Namespace) -> str | None:
    """The one line for a failure the user can fix (None: a bug, shown with its traceback)."""
    from rewardplane.protocol.errors import RewardplaneError

    if isinstance(exc, (RewardplaneError, UsageError, FileNotFoundError, TimeoutError, ValueError)):
        return str(exc)
    kind = f"{type(exc).__module__}.{type(exc).__name__}"
    if kind == "kubernetes.config.config_exception.ConfigException":
        return (
            f"no cluster credentials ({exc}): set KUBECONFIG or pass --kubeconfig; without a cluster, "
            f"give the server's address: rewardplane {args.command} --url http://HOST:8001"
        )
    if kind.startswith("httpx.") and isinstance(exc, OSError | _httpx_error()):
        return (
            f"cannot reach the Kubernetes API server ({type(exc).__name__}: {exc}): check that the cluster "
            "runs and that KUBECONFIG (or --kubeconfig) points at it; without a cluster, use --url"
        )
    return None


def _httpx_error() -> type[Exception]:
    import httpx

    return httpx.HTTPError


if __name__ == "__main__":
    raise SystemExit(main())
