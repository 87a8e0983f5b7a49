"""Control-plane token resolution, shared by the reward server and the SDK.

Both sides call :func:`resolve_token` so that one environment (``REWARDPLANE_TOKEN`` or a token
file named by ``REWARDPLANE_TOKEN_FILE``) configures server and client alike.
"""

from __future__ import annotations

import hmac
import os
from collections.abc import Mapping
from pathlib import Path

from . import settings
from .endpoints import TOKEN_ENV, TOKEN_FILE_ENV

BEARER_PREFIX = "Bearer "


def _read_token_file(path: str | os.PathLike[str], source: str) -> str:
    p = Path(path)
    try:
        text = p.read_text(encoding="utf-8")
    except FileNotFoundError:
        # A missing file is a configuration mistake (a Secret not mounted, a typo); silently
        # falling back to no token would only surface later as a 401 far from the cause.
        raise FileNotFoundError(
            f"token file {str(p)!r} ({source}) does not exist: create it, fix the path, or unset "
            f"{TOKEN_FILE_ENV} and pass the token directly / through {TOKEN_ENV}"
        ) from None
    except OSError as exc:
        raise OSError(f"cannot read token file {str(p)!r} ({source}): {exc}") from exc
    token = text.strip()
    if not token:
        raise ValueError(f"token file {str(p)!r} ({source}) is empty: write the token into it")
    return token


def resolve_token(
    token: str | None = None,
    token_file: str | os.PathLike[str] | None = None,
    *,
    environ: Mapping[str, str] | None = None,
) -> str | None:
    """Return the control-plane token, or ``None`` when none is configured.

    Precedence: the explicit ``token``; else the token file (``token_file``, else the file named by
    ``$REWARDPLANE_TOKEN_FILE``); else ``$REWARDPLANE_TOKEN``. Surrounding whitespace is stripped
    (files written by ``echo`` end in a newline). ``environ`` defaults to ``os.environ``.

    Raises ``FileNotFoundError`` for a token file that does not exist and ``ValueError`` for an
    explicitly given token or token file that is empty.
    """
    if token is not None:
        stripped = token.strip()
        if not stripped:
            raise ValueError(
                "the token given is empty: pass a non-empty token or None to use the environment"
            )
        return stripped
    if token_file is not None:
        return _read_token_file(token_file, "token_file argument")
    env_file = settings.TOKEN_FILE.get(environ)
    if env_file:
        return _read_token_file(env_file, f"${TOKEN_FILE_ENV}")
    return settings.TOKEN.get(environ)


def auth_headers(token: str | None) -> dict[str, str]:
    """``Authorization: Bearer <token>`` when a token is set, else no header."""
    return {"Authorization": f"{BEARER_PREFIX}{token}"} if token else {}


def token_matches(authorization: str | None, expected: str | None) -> bool:
    """Check an ``Authorization`` header value against the expected token (server side).

    No expected token means the control plane is open. The comparison is constant-time so the
    token cannot be guessed byte by byte from response timings.
    """
    if expected is None:
        return True
    if not authorization or not authorization.startswith(BEARER_PREFIX):
        return False
    given = authorization[len(BEARER_PREFIX) :].strip()
    return hmac.compare_digest(given.encode("utf-8"), expected.encode("utf-8"))
