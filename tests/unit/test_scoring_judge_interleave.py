"""The scoring benchmark's judge under ``--interleave`` (benchmarks/scoring_gpu.py): both judge
servers up at once, each round's chats sent to both, the order alternating by round, and each
server's environment recorded for the ratio's check. Two real HTTP processes stand in for the
reward server and ``vllm serve``; each logs the order in which its requests arrived."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest

sys.path.append(str(Path(__file__).resolve().parents[2]))  # benchmarks/, after everything else

import benchmarks.scoring_gpu as bench  # noqa: E402

FAKE_JUDGE = """
import json, sys, time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

port, log = int(sys.argv[1]), sys.argv[2]

class H(BaseHTTPRequestHandler):
    def log_message(self, *a):
        pass

    def do_GET(self):
        self.send_response(200 if self.path == "/health" else 404)
        self.end_headers()

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        text = body["messages"][0]["content"]
        with open(log, "a") as f:
            f.write(json.dumps([time.time(), text]) + "\\n")
        out = json.dumps({
            "choices": [{"message": {"content": "w4 " * body["max_tokens"]}}],
            "usage": {"completion_tokens": body["max_tokens"], "prompt_tokens": len(text.split())},
        }).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(out)))
        self.end_headers()
        self.wfile.write(out)

ThreadingHTTPServer(("127.0.0.1", port), H).serve_forever()
"""


def test_both_judges_take_turns_round_by_round(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    script = tmp_path / "fake_judge.py"
    script.write_text(FAKE_JUDGE)
    logs = {kind: tmp_path / f"{kind}.requests" for kind in bench.PAIR}

    def fake_cmd(kind: str, model_dir: Path, args: Any, limits: dict[str, int]) -> tuple[list[str], int]:
        assert args.gpu_memory_utilization == pytest.approx(0.425)  # half of 0.85 each
        port = bench.free_port()
        return [sys.executable, str(script), str(port), str(logs[kind])], port

    monkeypatch.setattr(bench, "judge_cmd", fake_cmd)
    args = bench.parse(["--sizes", "", "--judge-sizes", "0.4b", "--interleave", "--judge-output-tokens", "4"])
    args.concurrency = 4
    rounds = [[f"w{10 + r} w{100 + i}" for i in range(6)] for r in range(5)]  # a round's chats name it
    chats: bench.JudgeChats = {"warmup": ["w4 w5"], "rounds": rounds}

    server, serve = bench.measure_judge_pair(tmp_path / "model", chats, args, tmp_path, {})

    for run in (server, serve):
        assert [r["requests"] for r in run["rounds"]] == [6] * 5
        assert [r["output_tokens"] for r in run["rounds"]] == [24] * 5
        assert run["environment"]["api_processes"] == 1 and "versions" in run["environment"]
    first: dict[str, list[float]] = {}
    for kind, log in logs.items():
        seen = [json.loads(line) for line in log.read_text().splitlines()]
        assert [text for _, text in seen[:1]] == ["w4 w5"]  # the warm-up first
        first[kind] = [min(t for t, text in seen if text.startswith(f"w{10 + r} ")) for r in range(5)]
    goes_first = ["server" if first["server"][r] < first["vllm-serve"][r] else "vllm-serve" for r in range(5)]
    assert goes_first == ["server", "vllm-serve", "server", "vllm-serve", "server"]
    row = bench.judge_row("0.4b", {"params": 1, "batch_limits": {}}, server, serve, None, args)
    assert row["interleaved"] and row["server_vs_vllm_serve_spread"]["n"] == 5
    assert "server_vs_vllm_serve_refused" not in row  # two processes of one interpreter and environment
