"""``s3://bucket/prefix`` sources, from AWS or any S3-compatible store (``--endpoint``), through
obstore (the Rust object_store crate). Credentials come from the environment (the source Secret:
``AWS_ACCESS_KEY_ID``, ``AWS_SECRET_ACCESS_KEY``, ``AWS_SESSION_TOKEN``; ``AWS_REGION``/
``AWS_DEFAULT_REGION``, else us-east-1); with none, requests go unsigned (a public bucket)."""

from __future__ import annotations

import os
import posixpath
import re
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from datetime import timedelta
from typing import TYPE_CHECKING
from urllib.parse import urlsplit

import obstore.exceptions as oe
from obstore.store import S3Store

from rewardplane.modelfetch.errors import FetchError, PermanentFetchError, TransientFetchError
from rewardplane.modelfetch.files import CHUNK, Listing, RemoteFile, safe_relative

if TYPE_CHECKING:
    from obstore.store import ClientConfig, RetryConfig, S3Config

SECRET_HINT = "spec.model.sourceSecret"
_CRED_HINT = f"check AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY (and AWS_SESSION_TOKEN) in {SECRET_HINT}"
_NO_CRED_HINT = f"the request went unsigned (no credentials): put AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY in {SECRET_HINT}"
DEFAULT_REGION = "us-east-1"

# Every request has a timeout: 10 s to connect, 60 s between bytes. The bound on a whole request
# (which object_store sets to 30 s unless told) covers the largest weight file at a slow link;
# a stalled transfer is caught by the read timeout.
CLIENT_OPTIONS: ClientConfig = {
    "connect_timeout": timedelta(seconds=10),
    "read_timeout": timedelta(seconds=60),
    "timeout": timedelta(hours=6),
}
# object_store's own retries stay few: retry.py retries the whole call as well, and a fetcher that
# cannot connect is to exit within seconds.
RETRY: RetryConfig = {
    "max_retries": 1,
    "backoff": {"init_backoff": timedelta(milliseconds=200), "max_backoff": timedelta(seconds=1)},
    "retry_timeout": timedelta(seconds=30),
}

# S3 error codes (the <Code> of an error response) that mean refused credentials
_DENIED = {
    "AccessDenied",
    "InvalidAccessKeyId",
    "SignatureDoesNotMatch",
    "ExpiredToken",
    "InvalidToken",
    "TokenRefreshRequired",
    "AllAccessDisabled",
}
_TRANSIENT = {"SlowDown", "InternalError", "ServiceUnavailable", "RequestTimeout", "Throttling"}
_STATUS = re.compile(r"non-2xx status code: (\d{3})")
_CODE = re.compile(r"<Code>([^<]*)</Code>")
_MESSAGE = re.compile(r"<Message>([^<]*)</Message>")
_REQUEST = re.compile(r"Error performing (\w+) (\S+) in .*? - (.*)")


def _get(env: Mapping[str, str], name: str) -> str | None:
    return env.get(name) or None


def make_store(bucket: str, endpoint: str | None, env: Mapping[str, str] = os.environ) -> S3Store:
    """The bucket's store. obstore also reads the other ``AWS_*`` variables of the process's
    environment itself (e.g. ``AWS_WEB_IDENTITY_TOKEN_FILE`` and ``AWS_ROLE_ARN`` of a
    service-account role); the ones named here are taken from ``env`` and win."""
    region = _get(env, "AWS_REGION") or _get(env, "AWS_DEFAULT_REGION") or DEFAULT_REGION
    key_id, secret = _get(env, "AWS_ACCESS_KEY_ID"), _get(env, "AWS_SECRET_ACCESS_KEY")
    if bool(key_id) != bool(secret):
        have, missing = (
            ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY")
            if key_id
            else ("AWS_SECRET_ACCESS_KEY", "AWS_ACCESS_KEY_ID")
        )
        raise PermanentFetchError(
            f"s3://{bucket}: incomplete credentials ({have} is set, {missing} is not): {_CRED_HINT}"
        )
    # credentials that obstore finds itself: a web identity (IRSA) or a container credentials URI
    # (EKS Pod Identity, ECS); nothing at all: unsigned requests, for a public bucket
    role = any(
        _get(env, k)
        for k in (
            "AWS_WEB_IDENTITY_TOKEN_FILE",
            "AWS_CONTAINER_CREDENTIALS_FULL_URI",
            "AWS_CONTAINER_CREDENTIALS_RELATIVE_URI",
        )
    )
    config: S3Config = {
        "region": region,
        # S3-compatible stores (MinIO, Ceph, moto) serve buckets as paths; AWS, as host names
        # (a name with dots does not match AWS's certificate as a host name: a path then)
        "virtual_hosted_style_request": not endpoint and "." not in bucket,
        "skip_signature": not (key_id and secret) and not role,
    }
    if key_id and secret:
        config |= {"access_key_id": key_id, "secret_access_key": secret}
        if token := _get(env, "AWS_SESSION_TOKEN"):
            config["session_token"] = token
    options = CLIENT_OPTIONS.copy()
    if endpoint:
        url = urlsplit(endpoint)
        if url.scheme not in ("http", "https") or not url.hostname:
            raise PermanentFetchError(
                f"--endpoint {endpoint!r}: not an http:// or https:// URL; check spec.model.sourceEndpoint"
            )
        options["allow_http"] = url.scheme == "http"
        config["endpoint"] = endpoint.rstrip("/")
    try:
        return S3Store(bucket, config=config, client_options=options, retry_config=RETRY)
    except (oe.BaseError, ValueError) as e:
        raise PermanentFetchError(f"s3://{bucket}: cannot configure the S3 client: {_summary(e)}") from e


class S3Source:
    def __init__(self, bucket: str, prefix: str, endpoint: str | None, store: S3Store) -> None:
        self.bucket = bucket
        self.prefix = prefix
        self.endpoint = endpoint
        self.store = store
        self.uri = f"s3://{bucket}/{prefix}" if prefix else f"s3://{bucket}"

    def list_files(self) -> Listing:
        try:
            if self.prefix:
                # the prefix names one object: that object is the model (one file)
                single = self._head(self.prefix)
                if single is not None:
                    name = posixpath.basename(self.prefix)
                    return Listing([RemoteFile(safe_relative(name, self.uri), single, ref=self.prefix)])
            # object_store lists the objects below the prefix as a folder ("<prefix>/..."), and
            # gives a "folder" marker ("<prefix>/sub/", which holds nothing) without its slash
            objects = {
                str(o["path"]): int(o["size"])
                for chunk in self.store.list(self.prefix or None, chunk_size=1000)
                for o in chunk
            }
        except FetchError:
            raise
        except Exception as e:
            raise self._error(e, "listing the objects") from e
        folders = {posixpath.dirname(key) for key in objects}
        for key in [k for k, size in objects.items() if size == 0]:
            if any(f == key or f.startswith(key + "/") for f in folders) or self._head(key) is None:
                del objects[key]  # a folder marker, not an empty object
        under = self.prefix + "/" if self.prefix else ""
        files = [
            RemoteFile(safe_relative(key[len(under) :], self.uri), size, ref=key)
            for key, size in sorted(objects.items())
            if key.startswith(under)
        ]
        if not files:
            raise PermanentFetchError(
                f"{self.uri}: no objects under this prefix (bucket {self.bucket} exists{self._at()}); check the prefix"
            )
        return Listing(files)

    def _head(self, key: str) -> int | None:
        """The size of the object ``key``; None if there is none."""
        try:
            return int(self.store.head(key)["size"])
        except FileNotFoundError:
            return None
        except Exception as e:
            raise self._error(e, f"looking up the object {key}") from e

    @contextmanager
    def open(self, file: RemoteFile) -> Iterator[tuple[int | None, Iterator[bytes]]]:
        try:
            result = self.store.get(file.ref)
            size = int(result.meta["size"])
        except Exception as e:
            raise self._error(e, f"reading {file.ref}") from e
        yield size, self._chunks(file, iter(result.stream(min_chunk_size=CHUNK)))

    def _chunks(self, file: RemoteFile, stream: Iterator[bytes]) -> Iterator[bytes]:
        """The stream's chunks; its failures (mid-body) as the fetcher's errors."""
        while True:
            try:
                chunk = next(stream)
            except StopIteration:
                return
            except Exception as e:
                raise self._error(e, f"reading {file.ref}") from e
            yield chunk

    def _at(self) -> str:
        return f" at {self.endpoint}" if self.endpoint else ""

    def _error(self, e: Exception, doing: str) -> Exception:
        """obstore's exceptions as the fetcher's two kinds; anything else passes through."""
        what = f"{self.uri}: {doing}"
        signed = str(self.store.config.get("skip_signature", "false")).lower() != "true"
        hint = _CRED_HINT if signed else _NO_CRED_HINT
        if isinstance(e, FetchError):
            return e
        if isinstance(e, oe.PermissionDeniedError | oe.UnauthenticatedError | PermissionError):
            return PermanentFetchError(f"{what}: access denied by the endpoint ({_status_text(e)}): {hint}")
        if isinstance(e, FileNotFoundError | oe.NotFoundError):
            return PermanentFetchError(
                f"{what}: the object does not exist (it was listed: was it deleted meanwhile?)"
            )
        if isinstance(e, oe.InvalidPathError | ValueError):
            return PermanentFetchError(f"{what}: an object key obstore cannot use ({_summary(e)})")
        if not isinstance(e, oe.BaseError):
            return e
        text = str(e)
        status, code = _status(text), _code(text)
        if code == "NoSuchBucket":
            return PermanentFetchError(
                f"{what}: bucket {self.bucket} does not exist{self._at()}; check the bucket name"
            )
        if code in _DENIED or status in (401, 403):
            return PermanentFetchError(f"{what}: access denied by the endpoint ({_status_text(e)}): {hint}")
        if "redirect" in text.lower() and status is None:
            region = self.store.config.get("region", DEFAULT_REGION)
            return PermanentFetchError(
                f"{what}: the store redirected the request{self._at()}: the bucket is not in region "
                f"{region}; set AWS_REGION in {SECRET_HINT} (or check spec.model.sourceEndpoint)"
            )
        if code in _TRANSIENT or status in (408, 429) or (status is not None and status >= 500):
            return TransientFetchError(
                f"{what}: the store answered {_status_text(e)}; retrying later may help"
            )
        if status == 404:
            return PermanentFetchError(
                f"{what}: the store answered {_status_text(e)}{self._at()}; check the bucket name "
                f"and spec.model.sourceEndpoint"
            )
        if status is not None:
            return PermanentFetchError(f"{what}: the store refused the request ({_status_text(e)})")
        if isinstance(e, oe.GenericError | oe.JoinError):
            # no HTTP answer: the connection failed or timed out
            return TransientFetchError(f"{what}: cannot reach the store{self._at()} ({_summary(e)})")
        return PermanentFetchError(f"{what}: {type(e).__name__}: {_summary(e)}")


def _status(text: str) -> int | None:
    m = _STATUS.search(text)
    return int(m.group(1)) if m else None


def _code(text: str) -> str | None:
    m = _CODE.search(text)
    return m.group(1) if m else None


def _status_text(e: Exception) -> str:
    """What the store answered, as far as the error tells: e.g. HTTP 403 AccessDenied: Access Denied."""
    text = str(e)
    status, code, message = _status(text), _code(text), _MESSAGE.search(text)
    parts = [f"HTTP {status}" if status else "", code or ""]
    head = " ".join(p for p in parts if p) or type(e).__name__
    return f"{head}: {message.group(1)}" if message and message.group(1) else head


def _summary(e: BaseException) -> str:
    """obstore's message on one line, without its debug dump and its timings: the request and what
    failed (a refused connection, a timeout: only the dump tells those apart)."""
    text, _, debug = str(e).partition("Debug source:")
    text = " ".join(text.split())
    if "ConnectionRefused" in debug:
        detail = "connection refused"
    elif "kind: Timeout" in debug or "TimedOut" in debug:
        detail = "timed out"
    elif "kind: Connect" in debug:
        detail = "cannot connect"
    else:
        detail = ""
    m = _REQUEST.search(text)
    if m:
        method, uri, rest = m.groups()
        text = f"{method} {uri}: {detail} ({rest})" if detail else f"{method} {uri}: {rest}"
    elif detail:
        text = f"{detail} ({text})"
    return text if len(text) <= 600 else text[:600] + "..."
