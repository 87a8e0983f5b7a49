"""The settings registry (``rewardplane.protocol.settings``): ``docs/settings.md`` is the generated
page; no module reads a ``REWARDPLANE_*`` variable past the registry, or names one the registry
does not know; every registered setting is read somewhere; a bad value is one clear error, read
when asked (not at import)."""

from __future__ import annotations

import io
import logging
import re
import subprocess
import sys
import tokenize
from pathlib import Path

import pytest

from rewardplane.protocol import settings

ROOT = Path(__file__).resolve().parents[2]
SOURCE_TREES = ("core/src", "sdk/src", "operator/src", "images/reward-server/src", "src/rewardplane")
REGISTRY = ROOT / "core/src/rewardplane/protocol/settings.py"
NAME = re.compile(r"REWARDPLANE_[A-Z0-9_]+")
# a string literal that is exactly a variable's name: how an environment read (or write) spells it
NAME_LITERAL = re.compile(r"""^[rRbBuUfF]*(['"]{1,3})(REWARDPLANE_[A-Z0-9_]+)\1$""")
SHELL_READ = re.compile(r"\$\{?(REWARDPLANE_[A-Z0-9_]+)")


def _sources() -> list[Path]:
    files = [p for tree in SOURCE_TREES for p in sorted((ROOT / tree).rglob("*.py"))]
    return [p for p in files if p != REGISTRY]


def _attributes() -> dict[str, settings.Setting[object]]:
    """The registry's settings by their attribute name (``TOKEN``, ``STAGING_MAX_BYTES``, ...)."""
    return {k: v for k, v in vars(settings).items() if isinstance(v, settings.Setting)}


def test_the_settings_page_is_generated_from_the_registry() -> None:
    page = (ROOT / "docs/settings.md").read_text()
    assert page == settings.markdown(), "docs/settings.md is stale: python scripts/settings_doc.py"
    check = [sys.executable, str(ROOT / "scripts/settings_doc.py"), "--check"]
    assert subprocess.run(check, capture_output=True).returncode == 0


def test_every_setting_is_registered_once_under_its_attribute() -> None:
    attributes = _attributes()
    assert sorted(s.name for s in attributes.values()) == sorted(s.name for s in settings.SETTINGS)
    for attr, setting in attributes.items():
        assert setting.name == settings.PREFIX + attr, attr  # settings.X reads REWARDPLANE_X
        assert setting.meaning and "\n" not in setting.meaning and setting.read_by and setting.kind
    assert not set(settings.RETIRED) & {s.name for s in settings.SETTINGS}


def test_no_module_reads_a_variable_past_the_registry() -> None:
    readers = []
    for path in _sources():
        tokens = tokenize.generate_tokens(io.StringIO(path.read_text()).readline)
        for tok in tokens:
            if tok.type == tokenize.STRING and NAME_LITERAL.match(tok.string):
                readers.append(f"{path.relative_to(ROOT)}:{tok.start[0]}: {tok.string}")
    assert not readers, (
        "read REWARDPLANE_* variables through rewardplane.protocol.settings (settings.X.get(), "
        "settings.X.name), not by name:\n" + "\n".join(readers)
    )


def test_the_code_names_only_registered_variables() -> None:
    """Comments, docstrings and messages included: a retired switch is not mentioned as if it worked."""
    known = {s.name for s in settings.SETTINGS}
    unknown = [
        f"{path.relative_to(ROOT)}:{n}: {name}"
        for path in _sources()
        for n, line in enumerate(path.read_text().splitlines(), 1)
        for name in NAME.findall(line)
        if name not in known
    ]
    assert not unknown, "\n".join(unknown)


def test_the_scripts_read_only_registered_variables() -> None:
    known = {s.name for s in settings.SETTINGS}
    read = {
        (script.name, name)
        for script in sorted((ROOT / "scripts").glob("*.sh"))
        for name in SHELL_READ.findall(script.read_text())
    }
    assert not {r for r in read if r[1] not in known}


def test_every_registered_setting_is_read_somewhere() -> None:
    python = "\n".join(p.read_text() for p in _sources())
    python += "\n".join(p.read_text() for p in sorted((ROOT / "tests/e2e").glob("*.py")))
    scripts = "\n".join(p.read_text() for p in sorted((ROOT / "scripts").glob("*.sh")))
    unread = []
    for attr, setting in _attributes().items():
        in_python = re.search(rf"\bsettings\.{attr}\b", python)
        in_scripts = re.search(rf"\$\{{?{setting.name}\b", scripts)
        if not (in_python or in_scripts):
            unread.append(setting.name)
        if setting.read_by.startswith("scripts/"):
            assert in_scripts, f"{setting.name}: read_by names a script, which does not read it"
    assert not unread, f"registered but read nowhere (drop them, or read them): {unread}"


def test_a_setting_is_read_when_asked_and_a_bad_value_says_what_to_give(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("REWARDPLANE_RESYNC_INTERVAL", raising=False)
    assert settings.RESYNC_INTERVAL.get() == 30.0
    monkeypatch.setenv("REWARDPLANE_RESYNC_INTERVAL", " 2.5 ")
    assert settings.RESYNC_INTERVAL.get() == 2.5  # read now, not at import
    monkeypatch.setenv("REWARDPLANE_RESYNC_INTERVAL", "")
    assert settings.RESYNC_INTERVAL.get() == 30.0  # blank is unset
    for bad in ("soon", "0", "-1", "inf"):
        monkeypatch.setenv("REWARDPLANE_RESYNC_INTERVAL", bad)
        with pytest.raises(settings.SettingError) as info:
            settings.RESYNC_INTERVAL.get()
        message = str(info.value)
        assert message.startswith(f"REWARDPLANE_RESYNC_INTERVAL={bad!r} is not valid: give seconds > 0")
        assert "default 30" in message
    monkeypatch.setenv("REWARDPLANE_STAGING_MAX_BYTES", "1G")
    with pytest.raises(settings.SettingError, match="a whole number of bytes >= 0"):
        settings.STAGING_MAX_BYTES.get()
    assert settings.STAGING_MAX_BYTES.get({"REWARDPLANE_STAGING_MAX_BYTES": "1024"}) == 1024
    assert settings.EXISTING_CLUSTER.get({"REWARDPLANE_EXISTING_CLUSTER": "1"}) is True
    assert settings.LOG_LEVEL.get({"REWARDPLANE_LOG_LEVEL": "debug"}) == "DEBUG"
    with pytest.raises(settings.SettingError, match="give 1 or 0"):
        settings.E2E_KEEP.get({"REWARDPLANE_E2E_KEEP": "maybe"})


def test_export_writes_what_get_reads() -> None:
    env: dict[str, str] = {}
    settings.RESYNC_INTERVAL.export(7.5, env)
    settings.EXISTING_CLUSTER.export(True, env)
    settings.TOKEN.export("t", env)
    assert env == {
        "REWARDPLANE_RESYNC_INTERVAL": "7.5",
        "REWARDPLANE_EXISTING_CLUSTER": "1",
        "REWARDPLANE_TOKEN": "t",
    }
    assert settings.RESYNC_INTERVAL.get(env) == 7.5 and settings.EXISTING_CLUSTER.get(env) is True
    settings.TOKEN.export(None, env)
    assert settings.TOKEN.get(env) is None and "REWARDPLANE_TOKEN" not in env


def test_retired_names_are_reported_not_read(caplog: pytest.LogCaptureFixture) -> None:
    env = {"REWARDPLANE_PER_TENSOR_WIRE": "0", "REWARDPLANE_TOKEN": "t"}
    assert settings.retired_in_environment(env) == ["REWARDPLANE_PER_TENSOR_WIRE"]
    with caplog.at_level(logging.WARNING):
        settings.warn_retired(logging.getLogger("test"), env)
    assert [r.getMessage() for r in caplog.records] == [
        f"REWARDPLANE_PER_TENSOR_WIRE is set but retired: {settings.RETIRED['REWARDPLANE_PER_TENSOR_WIRE']}"
    ]


def test_server_flags_fall_back_to_the_environment_and_reach_it(monkeypatch: pytest.MonkeyPatch) -> None:
    from rewardplane.server.config import parse_args

    monkeypatch.setenv("REWARDPLANE_STAGING_MAX_BYTES", "2048")
    monkeypatch.setenv("REWARDPLANE_VLLM_RPC_TIMEOUT_S", "60")
    cfg = parse_args(["--model", "m"])
    assert cfg.staging_max_bytes is None  # the environment decides
    cfg.export_settings()
    assert settings.STAGING_MAX_BYTES.get() == 2048 and settings.VLLM_RPC_TIMEOUT_S.get() == 60
    cfg = parse_args(["--model", "m", "--staging-max-bytes", "1024", "--vllm-rpc-timeout-s", "5"])
    cfg.export_settings()  # the flags win, and reach the worker processes through the environment
    assert settings.STAGING_MAX_BYTES.get() == 1024 and settings.VLLM_RPC_TIMEOUT_S.get() == 5
    monkeypatch.setenv("REWARDPLANE_VLLM_SCORE_TIMEOUT_S", "soon")
    with pytest.raises(SystemExit):  # a bad value in the environment stops the start
        parse_args(["--model", "m"])


def test_operator_flags_default_to_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    from rewardplane.operator.__main__ import parse_args

    monkeypatch.setenv("REWARDPLANE_RESYNC_INTERVAL", "12")
    monkeypatch.setenv("REWARDPLANE_LOG_LEVEL", "debug")
    args = parse_args([])
    assert (args.resync_interval, args.log_level) == (12.0, "DEBUG")
    assert parse_args(["--resync-interval", "3"]).resync_interval == 3.0
    monkeypatch.setenv("REWARDPLANE_RESYNC_INTERVAL", "-1")
    with pytest.raises(SystemExit):
        parse_args([])
