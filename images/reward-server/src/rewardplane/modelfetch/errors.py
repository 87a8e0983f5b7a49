"""The fetcher's two kinds of failure, which decide its exit code: the operator shows the reason of
a permanent one in the status and stops; the kubelet restarts the init container after a transient one."""

from __future__ import annotations

from rewardplane.protocol.model_sources import EXIT_PERMANENT, EXIT_TRANSIENT


class FetchError(Exception):
    """A failed fetch; the message says what was wrong and what to do about it."""

    exit_code: int = EXIT_TRANSIENT


class PermanentFetchError(FetchError):
    """Retrying cannot help: a bad source, a missing object, refused credentials."""

    exit_code = EXIT_PERMANENT


class TransientFetchError(FetchError):
    """The network or the server failed; a later attempt may succeed."""

    exit_code = EXIT_TRANSIENT
