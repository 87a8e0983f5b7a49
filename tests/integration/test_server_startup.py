"""A server that cannot load its model says why at once, as the last line it prints."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest


def _start(model: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "rewardplane.server", "--model", model, "--engine", "hf", "--device", "cpu"],
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_missing_model_path_fails_fast_with_the_path(tmp_path: Path) -> None:
    missing = tmp_path / "no-such-model"
    result = _start(str(missing))
    assert result.returncode == 2
    last = result.stderr.strip().splitlines()[-1]
    assert f"model not found at {missing}" in last and "spec.model.source" in last
    assert "huggingface" not in result.stderr.lower() and "repo id" not in result.stderr.lower()


def test_folder_without_a_checkpoint_is_named(tmp_path: Path) -> None:
    result = _start(str(tmp_path))
    assert result.returncode == 2
    assert "has no config.json" in result.stderr.strip().splitlines()[-1]


def problem_as_uid(model: Path, uid: int) -> str | None:
    """``model_source_problem`` run in a child process that switched to ``uid`` (the interpreter
    itself lives under /root, which that uid cannot enter, so the server cannot be started as it)."""
    from rewardplane.server.cli import model_source_problem

    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: drop to the uid, look, report, exit without cleanup
        try:
            os.setgid(uid)
            os.setuid(uid)
            os.write(write, (model_source_problem(str(model)) or "").encode())
        finally:
            os._exit(0)
    os.close(write)
    with os.fdopen(read) as pipe:
        answer = pipe.read()
    os.waitpid(pid, 0)
    return answer or None


@pytest.mark.skipif(
    os.geteuid() != 0, reason="looks at the checkpoint as another user (needs root to switch)"
)
def test_unreadable_model_files_are_named_with_mode_owner_and_fix() -> None:
    """A checkpoint written 0600 by root (save_pretrained under umask 077), served by the non-root
    uid the operator runs replicas as: the server's last line names the file, its mode and owner,
    the server's uid and the fix (not "no such file or directory")."""
    from rewardplane.tinymodel import build_tiny_reward_model

    root = Path(tempfile.mkdtemp(prefix="rp-unreadable-", dir="/tmp"))
    try:
        root.chmod(0o755)
        model = build_tiny_reward_model(root / "rm", num_labels=1, seed=0)
        assert problem_as_uid(model, 65532) is None  # readable as built
        (model / "config.json").chmod(0o600)
        problem = problem_as_uid(model, 65532) or ""
        model.chmod(0o700)
        folder = problem_as_uid(model, 65532) or ""
    finally:
        shutil.rmtree(root, ignore_errors=True)
    assert problem.startswith("model files unreadable: "), problem
    for needle in (str(model / "config.json"), "-rw-------", "owner uid 0", "(uid 65532", "chmod -R a+rX"):
        assert needle in problem, (needle, problem)
    assert folder.startswith("model files unreadable: ") and f"{model} (mode drwx------" in folder, folder


def test_a_checkpoint_folder_without_weights_is_named_with_the_fix(
    tmp_path: Path, tiny_model_dir: Path
) -> None:
    for f in tiny_model_dir.iterdir():
        if not f.name.endswith((".safetensors", ".bin")):
            shutil.copy(f, tmp_path / f.name)
    result = _start(str(tmp_path))
    assert result.returncode == 2, result.stderr
    last = result.stderr.strip().splitlines()[-1]
    assert "has a config.json but no weights" in last and "save_pretrained" in last, last


def _unreachable_hub(tmp_path: Path) -> dict[str, str]:
    with socket.socket() as closed:
        closed.bind(("127.0.0.1", 0))
        port = closed.getsockname()[1]  # nothing listens once this closes: the hub is unreachable
    env = {**os.environ, "HF_ENDPOINT": f"http://127.0.0.1:{port}", "HF_HOME": str(tmp_path / "hf")}
    env.pop("HF_HUB_OFFLINE", None)
    return env


def test_a_hub_id_without_network_is_refused_naming_the_ways_out(tmp_path: Path) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "rewardplane.server", "--model", "org/name", "--device", "cpu"],
        capture_output=True,
        text=True,
        timeout=300,
        env=_unreachable_hub(tmp_path),
    )
    assert result.returncode == 2, result.stderr
    last = result.stderr.strip().splitlines()[-1]
    assert "HF_HUB_OFFLINE=1" in last and "--model" in last and "did not answer" in last, last


PROBE = """
import time
from rewardplane.server.cli import hub_problem
start = time.monotonic()
problem = hub_problem("org/name")
print(time.monotonic() - start, problem is not None)
"""


def test_the_hub_check_takes_seconds_where_the_hub_client_took_50(tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, "-c", PROBE],
        capture_output=True,
        text=True,
        timeout=300,
        env=_unreachable_hub(tmp_path),
    )
    took, found = done.stdout.split()
    assert found == "True" and float(took) < 10, done  # the import of the server not counted
