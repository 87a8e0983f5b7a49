"""A user's mistake on the command line is one line that names the fix, never a traceback: no
cluster credentials, an API server that does not answer, a checkpoint that is not there (checked
before anything is contacted), neither a name nor --url, a mode typo."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

from rewardplane.cli import main as rewardplane
from rewardplane.protocol import RewardModelTrainingMode
from rewardplane.sdk.cli import main


def _one_line(capsys: pytest.CaptureFixture[str]) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "Traceback" not in err[0], err
    return err[0]


@pytest.fixture
def no_cluster(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    monkeypatch.setenv("KUBECONFIG", str(tmp_path / "no-such-kubeconfig"))
    monkeypatch.setenv("HOME", str(tmp_path))  # no ~/.kube/config either
    return tmp_path


def test_no_kubeconfig_is_one_line_naming_kubeconfig_and_url(no_cluster, capsys) -> None:
    assert main(["status", "rm"]) == 1
    line = _one_line(capsys)
    assert "no cluster credentials" in line and "KUBECONFIG" in line and "--url" in line


def test_an_api_server_that_does_not_answer_is_one_line(no_cluster, capsys) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed once this block ends: connections are refused
    config = no_cluster / "kubeconfig"
    config.write_text(
        "apiVersion: v1\nkind: Config\ncurrent-context: c\n"
        f"clusters: [{{name: k, cluster: {{server: 'http://127.0.0.1:{port}'}}}}]\n"
        "users: [{name: u, user: {token: t}}]\ncontexts: [{name: c, context: {cluster: k, user: u}}]\n"
    )
    assert main(["status", "rm", "--kubeconfig", str(config)]) == 1
    line = _one_line(capsys)
    assert "cannot reach the Kubernetes API server" in line and "--url" in line


def test_a_missing_checkpoint_is_named_before_the_cluster_is_asked(no_cluster, capsys) -> None:
    assert main(["push", "rm", "--from", "/nope", "--version", "1"]) == 1
    line = _one_line(capsys)
    assert "checkpoint /nope is not a folder" in line  # not the missing credentials


def test_a_folder_that_is_no_checkpoint_is_named(no_cluster, capsys) -> None:
    assert main(["push", "--url", "http://127.0.0.1:9", "--from", str(no_cluster), "--version", "1"]) == 1
    assert "has no config.json" in _one_line(capsys)


@pytest.mark.parametrize(
    "command", [["status"], ["score", "text"], ["push", "--from", "/x", "--version", "1"]]
)
def test_neither_name_nor_url_says_both_ways(command: list[str], capsys) -> None:
    if command[0] == "score":
        command = ["score"]
    assert main(command) == 1
    line = _one_line(capsys)
    assert "--url" in line and "NAME" in line or "give the text" in line


def test_name_and_url_together_are_refused(capsys) -> None:
    assert main(["status", "rm", "--url", "http://127.0.0.1:9"]) == 1
    assert "not both" in _one_line(capsys)


def test_a_server_that_does_not_answer_in_direct_mode_is_one_line(capsys) -> None:
    assert main(["status", "--url", "http://127.0.0.1:9"]) == 1
    line = _one_line(capsys)
    assert "did not answer /health" in line and "--host 0.0.0.0" in line


def test_a_mode_typo_lists_the_modes() -> None:
    with pytest.raises(ValueError, match="'headonly' is not one of head_only, lora, full, adapter"):
        RewardModelTrainingMode("headonly")


def test_version_and_subcommand_help(capsys) -> None:
    assert rewardplane(["--version"]) == 0
    assert capsys.readouterr().out.startswith("rewardplane 0.1")
    with pytest.raises(SystemExit):
        rewardplane(["tiny-model", "--help"])
    assert capsys.readouterr().out.startswith("usage: rewardplane tiny-model")
