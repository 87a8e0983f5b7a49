"""``python -m rewardplane.modelfetch --source URI --cache-dir DIR --key KEY [...]``: the command line
the operator renders for the ``fetch-model`` init container.

Exit 0: the model is in ``DIR/KEY/model`` (the last progress line says "done" or "cached").
Exit 2 (permanent): a bad URI, refused credentials, a missing bucket, object, repo or revision.
Exit 1 (transient): the network or the server failed after a few retries.
On failure the reason goes to stderr and to the termination log, which Kubernetes shows in the
container's ``lastState.terminated.message`` (and the operator in the RewardModel's status)."""

from __future__ import annotations

import argparse
import os
import sys
import traceback
from pathlib import Path

from rewardplane.modelfetch.errors import FetchError, PermanentFetchError, TransientFetchError
from rewardplane.modelfetch.fetch import FetchRequest, fetch
from rewardplane.modelfetch.progress import Progress
from rewardplane.protocol.model_sources import FETCH_MODULE, InvalidSourceError, parse_source

DEFAULT_TERMINATION_LOG = Path("/dev/termination-log")
# Kubernetes keeps the first 4096 bytes of the termination message.
MAX_MESSAGE_BYTES = 4000


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=f"python -m {FETCH_MODULE}", description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--source",
        required=True,
        help="s3://bucket/prefix, https://host/file-or-archive, hf://org/name[@rev]",
    )
    p.add_argument("--revision", default=None, help="hf: a branch, tag or commit (spec.model.revision)")
    p.add_argument(
        "--endpoint", default=None, help="s3: an S3-compatible store's URL; hf: a hub mirror's URL"
    )
    p.add_argument("--cache-dir", required=True, type=Path, help="the node cache (a hostPath)")
    p.add_argument(
        "--key", required=True, help="the model's folder in the cache (protocol.model_sources.cache_key)"
    )
    p.add_argument(
        "--max-cache-bytes",
        type=int,
        default=0,
        help="evict least-recently-used models over this (0: no limit)",
    )
    p.add_argument(
        "--verify",
        choices=("sha256", "size"),
        default="sha256",
        help="how a cached model is checked before use: every file's sha256 (default) or sizes only",
    )
    p.add_argument(
        "--termination-log", type=Path, default=None, help="default: /dev/termination-log if writable"
    )
    p.add_argument(
        "--lock-timeout", type=float, default=3600.0, help="seconds to wait for another fetch of the key"
    )
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    os.umask(0o022)  # the server, another user, reads the cache
    progress = Progress()
    try:
        try:
            source = parse_source(args.source, args.revision)
        except InvalidSourceError as e:
            raise PermanentFetchError(str(e)) from e
        request = FetchRequest(
            source=source,
            cache_dir=args.cache_dir,
            key=args.key,
            endpoint=args.endpoint or None,
            max_cache_bytes=args.max_cache_bytes,
            verify=args.verify,
            lock_timeout_s=args.lock_timeout,
        )
        model = fetch(request, progress)
    except FetchError as e:
        return _fail(e, args.termination_log)
    except Exception as e:  # a bug or an unforeseen failure: say so, and let the kubelet retry
        traceback.print_exc()
        return _fail(
            TransientFetchError(f"the model fetcher failed unexpectedly: {type(e).__name__}: {e}"),
            args.termination_log,
        )
    print(f"model ready in {model}", file=sys.stderr)
    return 0


def _fail(error: FetchError, termination_log: Path | None) -> int:
    message = " ".join(str(error).split())  # one paragraph
    kind = "permanent" if isinstance(error, PermanentFetchError) else "transient, after retries"
    print(f"fetch failed ({kind}): {message}", file=sys.stderr, flush=True)
    path = termination_log
    if path is None and DEFAULT_TERMINATION_LOG.exists() and os.access(DEFAULT_TERMINATION_LOG, os.W_OK):
        path = DEFAULT_TERMINATION_LOG
    if path is not None:
        try:
            path.write_bytes(message.encode()[:MAX_MESSAGE_BYTES])
        except OSError as e:
            print(f"cannot write the termination log {path}: {e}", file=sys.stderr)
    return error.exit_code


if __name__ == "__main__":
    sys.exit(main())
