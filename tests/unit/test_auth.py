"""Control-plane token resolution (pure apart from a temporary token file)."""

from __future__ import annotations

from pathlib import Path

import pytest

from rewardplane.protocol import TOKEN_ENV, TOKEN_FILE_ENV
from rewardplane.protocol.auth import auth_headers, resolve_token, token_matches


def test_precedence(tmp_path: Path) -> None:
    f = tmp_path / "token"
    f.write_text("from-file\n")
    g = tmp_path / "env-token"
    g.write_text("  from-env-file  ")
    env = {TOKEN_ENV: " from-env ", TOKEN_FILE_ENV: str(g)}
    assert resolve_token("  explicit\n", f, environ=env) == "explicit"
    assert resolve_token(None, f, environ=env) == "from-file"
    assert resolve_token(environ=env) == "from-env-file"
    assert resolve_token(environ={TOKEN_ENV: " from-env "}) == "from-env"
    assert resolve_token(environ={}) is None
    assert resolve_token(environ={TOKEN_ENV: "   "}) is None


def test_missing_token_file_is_a_clear_error(tmp_path: Path) -> None:
    missing = tmp_path / "nope"
    with pytest.raises(FileNotFoundError, match="nope.*does not exist"):
        resolve_token(token_file=missing, environ={})
    with pytest.raises(FileNotFoundError, match=TOKEN_FILE_ENV):
        resolve_token(environ={TOKEN_FILE_ENV: str(missing)})


def test_empty_values_are_rejected(tmp_path: Path) -> None:
    empty = tmp_path / "empty"
    empty.write_text("\n")
    with pytest.raises(ValueError, match="empty"):
        resolve_token(token_file=empty, environ={})
    with pytest.raises(ValueError, match="empty"):
        resolve_token(" ", environ={})


def test_headers_and_matching() -> None:
    assert auth_headers(None) == {}
    assert auth_headers("s3cret") == {"Authorization": "Bearer s3cret"}
    assert token_matches("Bearer s3cret", "s3cret")
    assert not token_matches("Bearer wrong", "s3cret")
    assert not token_matches(None, "s3cret")
    assert not token_matches("s3cret", "s3cret")  # scheme required
    assert token_matches(None, None)  # no token configured → open control plane
