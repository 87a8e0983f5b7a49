"""The ``rewardplane`` command: one entry point, each subcommand owned by its package."""

from __future__ import annotations

import importlib
import sys

# subcommand → (module with main(argv) -> int, one-line help)
COMMANDS: dict[str, tuple[str, str]] = {
    "server": ("rewardplane.server.cli", "run a reward-model server (same as python -m rewardplane.server)"),
    "operator": ("rewardplane.operator.__main__", "run the Kubernetes operator"),
    "node": (
        "rewardplane.localcluster.nodeagent",
        "run the node agent (runs this node's pods as local processes)",
    ),
    "dev": ("rewardplane.localcluster.dev", "local development cluster: dev up | down | status"),
    "tiny-model": ("rewardplane.tinymodel", "build a tiny random-weight reward model (no downloads)"),
    "check-model": ("rewardplane.modelcheck", "check a model's config and tokenizer before deploying it"),
    "status": ("rewardplane.sdk.cli", "show a RewardModel's status"),
    "score": ("rewardplane.sdk.cli", "score texts with a RewardModel"),
    "push": ("rewardplane.sdk.cli", "push a saved checkpoint into a RewardModel's servers"),
}


def usage() -> str:
    lines = ["usage: rewardplane [--version] COMMAND [ARGS...]", "", "commands:"]
    lines += [f"  {name:<11} {help_}" for name, (_, help_) in COMMANDS.items()]
    lines += ["", "rewardplane COMMAND --help describes a command."]
    return "\n".join(lines)


def version() -> str:
    from importlib.metadata import PackageNotFoundError
    from importlib.metadata import version as installed

    try:
        return installed("rewardplane")
    except PackageNotFoundError:  # run from the source tree (PYTHONPATH), not installed
        return "unknown (not installed)"


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if not args or args[0] in ("-h", "--help"):
        print(usage())
        return 0
    if args[0] in ("-V", "--version"):
        print(f"rewardplane {version()}")
        return 0
    name, rest = args[0], args[1:]
    if name not in COMMANDS:
        print(f"rewardplane: unknown command {name!r}\n\n{usage()}", file=sys.stderr)
        return 2
    module_name = COMMANDS[name][0]
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        print(
            f"rewardplane {name}: not available ({exc}); install the matching extra, e.g. "
            "pip install 'rewardplane[server,operator,train]'",
            file=sys.stderr,
        )
        return 2
    if module_name == "rewardplane.sdk.cli":
        return int(module.main([name, *rest]) or 0)
    return int(module.main(rest) or 0)


if __name__ == "__main__":
    raise SystemExit(main())
