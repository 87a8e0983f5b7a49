"""moto's S3-compatible server, counting the requests it answers: ``python moto_server.py --host H``.

Run by the interpreter of moto's own virtualenv (``scripts/setup.sh`` makes it: moto needs
botocore, whose python-dateutil<3 the kubernetes client 37 of the project's venv cannot live
with), so it imports nothing of rewardplane. Prints ``port <n>`` once it listens; ``GET
/_rewardplane/counts`` answers ``[[method, path, count], ...]`` and ``DELETE`` on it resets them.
"""

from __future__ import annotations

import argparse
import importlib
import json
import threading
from collections import Counter
from collections.abc import Callable, Iterable
from typing import Any

COUNTS_PATH = "/_rewardplane/counts"


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=0)
    args = p.parse_args()

    # moto lives only in its own virtualenv: imported by name, untyped
    moto_app: Any = importlib.import_module("moto.moto_server.werkzeug_app")
    serving: Any = importlib.import_module("werkzeug.serving")

    inner = moto_app.DomainDispatcherApplication(moto_app.create_backend_app)
    lock = threading.Lock()
    counts: Counter[tuple[str, str]] = Counter()

    def app(environ: dict[str, Any], start_response: Callable[..., Any]) -> Iterable[bytes]:
        method, path = environ.get("REQUEST_METHOD", ""), environ.get("PATH_INFO", "")
        if path == COUNTS_PATH:
            with lock:
                if method == "DELETE":
                    counts.clear()
                body = json.dumps([[m, p, n] for (m, p), n in counts.items()]).encode()
            start_response(
                "200 OK", [("Content-Type", "application/json"), ("Content-Length", str(len(body)))]
            )
            return [body]
        with lock:
            counts[(method, path)] += 1
        return inner(environ, start_response)

    server = serving.make_server(
        args.host, args.port, app, threaded=True, request_handler=moto_app.MotoRequestHandler
    )
    print(f"port {server.server_port}", flush=True)
    server.serve_forever()


if __name__ == "__main__":
    main()
