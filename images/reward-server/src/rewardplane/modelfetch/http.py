"""``https://`` (and ``http://``) sources: one file, or an archive that is unpacked. The
``AUTHORIZATION`` key of the source Secret is sent as the Authorization header, verbatim."""

from __future__ import annotations

import posixpath
from collections.abc import Iterator
from contextlib import contextmanager
from urllib.parse import unquote, urlsplit

import httpx

from rewardplane.modelfetch.archives import archive_kind
from rewardplane.modelfetch.errors import FetchError, PermanentFetchError, TransientFetchError
from rewardplane.modelfetch.files import CHUNK, Listing, RemoteFile, safe_relative

# Every network call has a timeout: 10 s to connect, 60 s between bytes.
TIMEOUT = httpx.Timeout(60.0, connect=10.0)
SECRET_HINT = "spec.model.sourceSecret"


def client() -> httpx.Client:
    # Redirects are followed (hub downloads go to a CDN); httpx drops the Authorization header
    # when a redirect leaves the origin, so a token is not handed to a third party.
    return httpx.Client(timeout=TIMEOUT, follow_redirects=True)


def status_error(status: int, what: str, auth_hint: str) -> FetchError:
    """The error for an HTTP answer other than 200: permanent for a client error, transient for a
    server error, a rate limit or a timeout."""
    if status in (401, 403):
        return PermanentFetchError(f"{what}: the server refused the credentials (HTTP {status}): {auth_hint}")
    if status == 404:
        return PermanentFetchError(f"{what}: not found on the server (HTTP 404): check the URI")
    if status in (408, 429) or status >= 500:
        return TransientFetchError(f"{what}: the server answered HTTP {status}; retrying later may help")
    return PermanentFetchError(f"{what}: the server answered HTTP {status}")


def transport_error(e: httpx.HTTPError, what: str) -> TransientFetchError:
    kind = "timed out" if isinstance(e, httpx.TimeoutException) else "failed"
    return TransientFetchError(f"{what}: the connection {kind} ({type(e).__name__}: {e})")


class HttpsSource:
    def __init__(self, url: str, authorization: str | None, http: httpx.Client) -> None:
        self.url = url
        self.authorization = authorization
        self.http = http

    def list_files(self) -> Listing:
        name = posixpath.basename(unquote(urlsplit(self.url).path))
        kind = archive_kind(name)
        # an archive is downloaded beside the model directory, then unpacked into it
        path = safe_relative(name, self.url)
        return Listing([RemoteFile(path=path, ref=self.url)], archive=kind is not None)

    @contextmanager
    def open(self, file: RemoteFile) -> Iterator[tuple[int | None, Iterator[bytes]]]:
        headers = {"Authorization": self.authorization} if self.authorization else {}
        if self.authorization:
            hint = f"check the AUTHORIZATION key (the whole header value) in {SECRET_HINT}"
        else:
            hint = (
                f"put an AUTHORIZATION key (the whole header value, e.g. 'Bearer <token>') in {SECRET_HINT}"
            )
        try:
            with self.http.stream("GET", file.ref, headers=headers) as r:
                if r.status_code != 200:
                    raise status_error(r.status_code, file.ref, hint)
                length = r.headers.get("content-length")
                plain = "content-encoding" not in r.headers
                yield (int(length) if length and plain else None), r.iter_bytes(CHUNK)
        except httpx.HTTPError as e:
            raise transport_error(e, file.ref) from e
