"""The scoring benchmark names a server that stops answering (benchmarks/scoring_gpu.py): requests
in flight and no answer for ``stall_s`` fail the round with how many were answered, instead of
holding the phase (and the GPU machine) until the phase's bound. A slow server that keeps
answering is not a stall."""

from __future__ import annotations

import asyncio
import json
import sys
import threading
import time
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

sys.path.append(str(Path(__file__).resolve().parents[2]))  # benchmarks/, after everything else

from benchmarks.scoring_gpu import Stalled, drive, send_all  # noqa: E402


class _Server:
    """A real HTTP server on a free port: answers the first ``answers`` POSTs (each after
    ``delay_s``), then holds every further request open until the test ends."""

    def __init__(self, answers: int, delay_s: float) -> None:
        self.answers, self.delay_s = answers, delay_s
        self.count = 0
        self.lock = threading.Lock()
        self.release = threading.Event()
        owner = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                request = self.rfile.read(int(self.headers["Content-Length"]))
                with owner.lock:
                    owner.count += 1
                    mine = owner.count
                if mine > owner.answers:
                    owner.release.wait(30)  # the stall: the request is accepted, never answered
                    return
                time.sleep(owner.delay_s)
                inputs = json.loads(request)["input"]
                # /pooling's answer: one row per input, and the request's order number
                rows = [{"index": j, "data": [float(len(x))]} for j, x in enumerate(inputs)]
                body = json.dumps({"n": mine, "data": rows}).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: object) -> None:
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}/pooling"


@pytest.fixture
def serve() -> Iterator[Callable[..., _Server]]:
    started: list[_Server] = []

    def start(answers: int, delay_s: float = 0.0) -> _Server:
        s = _Server(answers, delay_s)
        threading.Thread(target=s.httpd.serve_forever, daemon=True).start()
        started.append(s)
        return s

    yield start
    for s in started:
        s.release.set()
        s.httpd.shutdown()
        s.httpd.server_close()


def test_a_server_that_stops_answering_is_named_with_what_it_answered(serve: Callable[..., _Server]) -> None:
    server = serve(answers=5)
    bodies = [{"input": [[1, 2, 3]]} for _ in range(20)]
    t0 = time.monotonic()
    with pytest.raises(Stalled) as err:
        asyncio.run(send_all(server.url, bodies, 8, dict, stall_s=0.5))
    assert time.monotonic() - t0 < 10, "the stall must end the round, not the phase's bound"
    assert "5 of 20 requests answered, none in the last 0.5 s" in str(err.value)
    assert server.url in str(err.value)


def test_a_slow_server_that_keeps_answering_is_not_a_stall(serve: Callable[..., _Server]) -> None:
    # every answer takes 0.2 s, 2 in flight: the round lasts ~1.2 s, well past stall_s, with
    # answers arriving all the while
    server = serve(answers=12, delay_s=0.2)
    done_at: list[float] = []
    seconds, answers = asyncio.run(
        send_all(server.url, [{"input": [[i]]} for i in range(12)], 2, dict, done_at, stall_s=0.5)
    )
    assert seconds > 0.5
    assert sorted(a["n"] for a in answers) == list(range(1, 13))
    assert all(t > 0 for t in done_at)


def test_a_stall_names_the_prompts_left_unanswered(serve: Callable[..., _Server]) -> None:
    # one request in flight at a time, so the server answers requests 0-2 and holds request 3,
    # whose longest prompt (1,024 tokens) is what the message must name
    server = serve(answers=3)
    lengths = [5, 6, 7, 8, 9, 10, 1024, 11, 12, 13]
    prompts = [[1] * n for n in lengths]
    target = {
        "name": "server",
        "url": server.url.removesuffix("/pooling"),
        "path": "/pooling",
        "body": {},
        "field": "data",
    }
    with pytest.raises(Stalled) as err:
        asyncio.run(drive(target, prompts, 2, 1, stall_s=0.5))  # type: ignore[arg-type]
    assert err.value.unanswered == [3, 4]
    assert "3 of 5 requests answered" in str(err.value)
    assert "the longest prompt of each unanswered request, in tokens: 1024, 13" in str(err.value)
