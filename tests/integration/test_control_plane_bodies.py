"""The token-protected routes against hostile and mistaken bodies, over real HTTP against a real
server process: the token is checked before a byte of the body is read, every control body is
capped in size and JSON structure before it is parsed (``/health`` stays fast under 10.9 MB
bodies of 200,000 objects, with the token or without), unknown fields are refused, a body that is
not UTF-8 is answered with the byte where it breaks, and a failed join is one log line."""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from rewardplane.testing.servers import ServerHandle, free_port, start_server

TOKEN = "secret"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
JSON = {"content-type": "application/json"}
HEALTH_P99_S = 0.05  # on top of the quiet p99


@pytest.fixture(scope="module")
def server(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerHandle]:
    h = start_server(tiny_model_dir, tmp_path_factory.mktemp("control-bodies"), token=TOKEN)
    yield h
    h.stop()


# The flooding clients: another process at the lowest CPU priority, as if on another machine, so
# that /health measures the server's event loop, not the test's own clients (CI has two cores).
FLOOD = """
import json, sys, time, httpx
url, path, token, seconds = sys.argv[1], sys.argv[2], sys.argv[3], float(sys.argv[4])
key = "metadata" if path == "/update_param_batch" else "extra"
objects = [{"name": "layer.w", "dtype": "float32", "shape": [1]}] * 200_000
body = json.dumps({key: objects}).encode()
assert 10_000_000 < len(body) < 12_000_000, len(body)
headers = {"content-type": "application/json", **({"Authorization": "Bearer " + token} if token else {})}
codes, deadline = set(), time.monotonic() + seconds
with httpx.Client(timeout=60) as c:
    while time.monotonic() < deadline:
        codes.add(c.post(url + path, content=body, headers=headers).status_code)
print(json.dumps(sorted(codes)))
"""


def _health_p99(server: ServerHandle, seconds: float) -> tuple[float, list[float]]:
    health: list[float] = []
    with httpx.Client(timeout=30) as c:
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            start = time.perf_counter()
            assert c.get(f"{server.url}/health").status_code == 200
            health.append(time.perf_counter() - start)
            time.sleep(0.01)
    health.sort()
    return health[int(0.99 * (len(health) - 1))], health


def _health_p99_while(server: ServerHandle, path: str, token: str) -> tuple[float, set[int]]:
    """Two flooding clients post a 10.9 MB body of 200,000 small objects to ``path`` over and over
    while ``/health`` is polled: its p99, and the status codes the posts got."""
    flood = [
        subprocess.Popen(
            ["nice", "-n", "19", sys.executable, "-c", FLOOD, server.url, path, token, "5"],
            stdout=subprocess.PIPE,
            text=True,
        )
        for _ in range(2)
    ]
    try:
        time.sleep(0.5)  # the clients build their bodies
        p99, health = _health_p99(server, 4)
        codes = {code for p in flood for code in json.loads(p.communicate(timeout=60)[0])}
    finally:
        for p in flood:
            p.kill()
    print(
        f"/health while 10.9 MB bodies go to {path} ({'token' if token else 'no token'}): n={len(health)} "
        f"p50={statistics.median(health) * 1000:.1f} ms p99={p99 * 1000:.1f} ms max={health[-1] * 1000:.1f} ms"
    )
    return p99, codes


@pytest.mark.parametrize("with_token", [False, True], ids=["no-token", "token"])
@pytest.mark.parametrize("path", ["/update_param_batch", "/sleep"])
def test_health_stays_fast_while_large_control_bodies_arrive(
    server: ServerHandle, path: str, with_token: bool
) -> None:
    # The machine's own /health p99 without the bodies, just before: what the rest of the suite
    # running beside this test (pytest -n) costs. A body parsed on the event loop holds it 190 ms
    # (no token) to 2 s (token) per post, far above the allowance on top of it.
    quiet, _ = _health_p99(server, 2)
    p99, codes = _health_p99_while(server, path, TOKEN if with_token else "")
    assert codes == ({413} if with_token else {401}), codes
    assert p99 <= quiet + HEALTH_P99_S, (
        f"/health p99 {p99 * 1000:.0f} ms while 10.9 MB bodies went to {path} "
        f"({quiet * 1000:.0f} ms without them)"
    )


def test_the_token_is_checked_before_the_body(server: ServerHandle) -> None:
    for headers in ({}, {"Authorization": "Bearer wrong"}):
        r = httpx.post(f"{server.url}/sleep", content=b"\0" * 4096, headers={**JSON, **headers})
        assert r.status_code == 401, r.text
        assert "bearer token" in r.json()["error"]


def test_a_control_body_over_its_route_cap_is_413_naming_the_cap(server: ServerHandle) -> None:
    body = json.dumps({"level": 1, "extra": [{"name": "layer.w"}] * 20_000}).encode()
    r = httpx.post(f"{server.url}/sleep", content=body, headers={**JSON, **AUTH})
    assert r.status_code == 413, r.text
    message = r.json()["error"]
    assert "/sleep" in message and "at most" in message, message


def test_an_announce_within_its_byte_cap_but_of_many_arrays_is_400(server: ServerHandle) -> None:
    """90 KB of empty arrays: within the announce's bytes for this model, but costly to parse, so
    the parsing helper counts its arrays off the event loop and refuses it before validation."""
    body = json.dumps({"metadata": [[]] * 30_000}, separators=(",", ":")).encode()
    # the first such body starts the helper process (a Python start: seconds on a loaded machine)
    r = httpx.post(f"{server.url}/update_param_batch", content=body, headers={**JSON, **AUTH}, timeout=60)
    assert r.status_code == 400, r.text
    message = r.json()["error"]
    assert "JSON arrays and objects" in message and "/update_param_batch" in message, message


# Each control route's body with one field misspelled (or unknown): a typo must not be ignored.
TYPOS = {
    "/init_communicator": {"host": "127.0.0.1", "port": 29500, "world_size": 2, "timeout": 5},
    "/close_communicator": {"groupid": "g1"},
    "/update_param_batch": {
        "metadata": [{"name": "score.weight", "dtype": "float32", "shape": [1, 8]}],
        "atomc": True,
    },
    "/restore_weights": {"version": 1, "timeout": 5},
    "/send_weights": {"port": 29500, "world_size": 2, "version": 1, "timeout": 5},
    "/sleep": {"level": 1, "timeout": 5},
    "/wake": {"timeout": 5},
    "/admission": {"admit": True, "versoin": 1},
}


@pytest.mark.parametrize("path", sorted(TYPOS))
def test_unknown_fields_are_422_on_every_control_route(server: ServerHandle, path: str) -> None:
    r = httpx.post(f"{server.url}{path}", json=TYPOS[path], headers=AUTH, timeout=30)
    assert r.status_code == 422, (path, r.status_code, r.text)
    assert "Extra inputs are not permitted" in r.json()["error"], r.text


@pytest.mark.parametrize("path,headers", [("/score", {}), ("/sleep", AUTH)])
def test_a_body_that_is_not_utf8_names_the_byte(
    server: ServerHandle, path: str, headers: dict[str, str]
) -> None:
    body = b'{"inputs": ["caf\xe9"]}'  # Latin-1, not UTF-8: byte 16 breaks it
    r = httpx.post(f"{server.url}{path}", content=body, headers={**JSON, **headers})
    assert r.status_code == 422, r.text
    message = r.json()["error"]
    assert "UTF-8" in message and "byte offset 16" in message, message


def test_a_body_that_is_not_json_names_where(server: ServerHandle) -> None:
    r = httpx.post(f"{server.url}/score", content=b'{"inputs": ["a"', headers=JSON)
    assert r.status_code == 422, r.text
    assert "not valid JSON" in r.json()["error"] and "column" in r.json()["error"], r.text


def test_a_failed_join_is_one_log_line_naming_the_cause(server: ServerHandle) -> None:
    port = free_port()  # nothing listens there: the rendezvous cannot connect
    r = httpx.post(
        f"{server.url}/init_communicator",
        json={"host": "127.0.0.1", "port": port, "world_size": 2, "timeout_s": 1.0, "group_id": "nobody"},
        headers=AUTH,
    )
    assert r.status_code == 200, r.text
    deadline = time.monotonic() + 60
    last_error = None
    while time.monotonic() < deadline and last_error is None:
        time.sleep(0.2)
        last_error = httpx.get(f"{server.url}/get_num_background_tasks", headers=AUTH).json()["last_error"]
    assert last_error is not None, "the join did not fail within 60 s"
    time.sleep(0.5)  # let the log line land
    lines = [x for x in server.log().splitlines() if f"127.0.0.1:{port}" in x or "frame #" in x]
    assert len(lines) == 1, "\n".join(lines)
    assert "joining the trainer's group" in lines[0] and "failed" in lines[0], lines[0]
    assert "\n" not in last_error and "frame #" not in last_error, last_error
