"""Where a reward model comes from (``spec.model.source``), shared by the operator, which renders
a replica's volumes and its download step, and the fetcher that runs in that step
(``python -m rewardplane.modelfetch`` in the reward-server image), whose progress lines the
operator reads back into the RewardModel's status.

Sources, in the forms of KServe's ``storageUri``:

- ``pvc://<claim>[/<path>]``: a PersistentVolumeClaim, mounted read-only (nothing downloaded);
- ``file:///<path>`` or ``/<path>``: a directory on the node (hostPath), mounted read-only;
- ``s3://<bucket>[/<prefix>]``: every object under the prefix (or the one object it names), from
  AWS or any S3-compatible store (``spec.model.sourceEndpoint``), credentials from
  ``spec.model.sourceSecret`` (``AWS_ACCESS_KEY_ID``, ``AWS_SECRET_ACCESS_KEY``);
- ``https://<host>/<path>`` (``http://`` too): one file, or an archive (``.tar``, ``.tar.gz``,
  ``.tgz``, ``.zip``) that is unpacked;
- ``hf://<org>/<name>[@<revision>]`` or ``<org>/<name>``: the hub's files at a revision
  (``HF_TOKEN`` from the secret; ``sourceEndpoint`` points at a mirror).

Downloaded sources land in a node cache keyed by :func:`cache_key`, so replicas and restarts on a
node share one download. Pure: no I/O here.
"""

from __future__ import annotations

import hashlib
import json
import posixpath
import re
from dataclasses import asdict, dataclass
from enum import StrEnum
from urllib.parse import urlsplit

FETCH_CONTAINER = "fetch-model"
"""Name of the init container that downloads a replica's model."""
FETCH_MODULE = "rewardplane.modelfetch"
PROGRESS_PREFIX = "rewardplane-fetch "
"""Progress lines on the fetcher's stdout start with this, then one JSON object."""
EXIT_PERMANENT = 2
"""The fetcher's exit code when retrying cannot help: a bad source, a missing object, refused credentials."""
EXIT_TRANSIENT = 1
"""The fetcher's exit code after retries of a transient failure (the network, a server error)."""
ARCHIVE_SUFFIXES = (".tar", ".tar.gz", ".tgz", ".zip")

_BUCKET = re.compile(r"^[a-z0-9][a-z0-9.\-]{1,61}[a-z0-9]$")
_HUB_PART = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._\-]*$")
_SOURCES_HELP = (
    "use pvc://<claim>/<path>, file:///<path on the node>, s3://<bucket>/<prefix>, "
    "https://<host>/<file or archive>, or hf://<org>/<name>[@<revision>]"
)


class InvalidSourceError(ValueError):
    """spec.model.source cannot be delivered; the message says what to write instead."""


class SourceKind(StrEnum):
    PVC = "pvc"
    FILE = "file"
    S3 = "s3"
    HTTPS = "https"
    HUB = "hf"


@dataclass(frozen=True)
class ModelSource:
    kind: SourceKind
    uri: str
    """The source as written."""
    location: str
    """pvc: the claim; file: the path; s3: the bucket; https: the URL; hf: ``<org>/<name>``."""
    path: str = ""
    """pvc: the path inside the claim; s3: the key prefix (no leading slash)."""
    revision: str | None = None
    """hf: branch, tag or commit (None: the hub's default branch)."""

    @property
    def downloaded(self) -> bool:
        """Whether a replica downloads the model (s3, https, hf) rather than mounting it."""
        return self.kind in (SourceKind.S3, SourceKind.HTTPS, SourceKind.HUB)

    @property
    def is_archive(self) -> bool:
        return self.kind is SourceKind.HTTPS and urlsplit(self.location).path.lower().endswith(
            ARCHIVE_SUFFIXES
        )


def parse_source(source: str, revision: str | None = None) -> ModelSource:
    """``spec.model.source`` (+ ``spec.model.revision``) → a ModelSource; InvalidSourceError says
    what is wrong and what to write instead."""
    source = source.strip()
    if not source:
        raise InvalidSourceError(f"spec.model.source is empty: {_SOURCES_HELP}")
    scheme = source.split("://", 1)[0].lower() if "://" in source else ""
    if scheme == "pvc":
        rest = source[len("pvc://") :].strip("/")
        claim, _, sub = rest.partition("/")
        if not claim:
            raise InvalidSourceError(
                f"spec.model.source {source!r}: name the claim, e.g. pvc://models/tiny-rm"
            )
        sub = posixpath.normpath(sub) if sub else ""
        if sub.startswith(".."):
            raise InvalidSourceError(
                f"spec.model.source {source!r}: the path inside the claim may not leave it"
            )
        return ModelSource(SourceKind.PVC, source, claim, sub)
    if scheme == "file" or source.startswith("/"):
        path = source[len("file://") :] if scheme == "file" else source
        if not path.startswith("/"):
            raise InvalidSourceError(
                f"spec.model.source {source!r}: file:// needs an absolute path (file:///models/x)"
            )
        return ModelSource(SourceKind.FILE, source, posixpath.normpath(path))
    if scheme == "s3":
        rest = source[len("s3://") :]
        bucket, _, prefix = rest.partition("/")
        if not _BUCKET.match(bucket):
            raise InvalidSourceError(
                f"spec.model.source {source!r}: {bucket!r} is not an S3 bucket name (3-63 lowercase "
                "letters, digits, dots and hyphens); write s3://<bucket>/<prefix>"
            )
        if ".." in prefix.split("/"):
            raise InvalidSourceError(f"spec.model.source {source!r}: the prefix may not contain '..'")
        return ModelSource(SourceKind.S3, source, bucket, prefix.strip("/"))
    if scheme in ("https", "http"):
        parts = urlsplit(source)
        if not parts.hostname or parts.path.strip("/") == "":
            raise InvalidSourceError(
                f"spec.model.source {source!r}: name a file or an archive on the server, "
                "e.g. https://models.example.com/rm-7b.tar.gz"
            )
        if parts.username or parts.password:
            raise InvalidSourceError(
                f"spec.model.source {source!r}: credentials do not belong in the URI (it is shown in "
                "the status); put an AUTHORIZATION key in spec.model.sourceSecret instead"
            )
        return ModelSource(SourceKind.HTTPS, source, source)
    if scheme == "gs":
        raise InvalidSourceError(
            f"spec.model.source {source!r}: gs:// is not supported; Cloud Storage serves the S3 API: "
            "write s3://<bucket>/<prefix> with spec.model.sourceEndpoint https://storage.googleapis.com "
            "and HMAC keys in spec.model.sourceSecret"
        )
    if scheme not in ("", "hf"):
        raise InvalidSourceError(f"spec.model.source {source!r}: unknown scheme {scheme}://; {_SOURCES_HELP}")
    hub_id = source[len("hf://") :] if scheme == "hf" else source
    hub_id, at, pinned = hub_id.partition("@")
    parts_ = hub_id.split("/")
    if len(parts_) not in (1, 2) or not all(_HUB_PART.match(p) for p in parts_) or (at and not pinned):
        raise InvalidSourceError(f"spec.model.source {source!r} is not a model source: {_SOURCES_HELP}")
    if pinned and revision and pinned != revision:
        raise InvalidSourceError(
            f"spec.model.source {source!r} pins revision {pinned!r} but spec.model.revision is "
            f"{revision!r}: give the revision once"
        )
    return ModelSource(SourceKind.HUB, source, hub_id, revision=pinned or revision or None)


def cache_key(source: ModelSource, endpoint: str | None = None) -> str:
    """The node cache's directory name for a downloaded source: readable (the source's last part)
    and unique (a hash of the source, its revision and the endpoint it comes from)."""
    identity = json.dumps([source.kind.value, source.location, source.path, source.revision, endpoint or ""])
    digest = hashlib.sha256(identity.encode()).hexdigest()[:16]
    tail = (source.path or urlsplit(source.location).path or source.location).rstrip("/")
    slug = re.sub(r"[^A-Za-z0-9._-]+", "-", posixpath.basename(tail) or source.location)[:40].strip("-.")
    return f"{slug or 'model'}-{digest}"


@dataclass(frozen=True)
class FetchProgress:
    """One progress line of the fetcher: what it is doing and how far it got."""

    phase: str
    """listing, waiting (for another replica's download of the same model), downloading, verifying,
    done (downloaded), cached (found in the node cache)."""
    bytes_done: int = 0
    bytes_total: int | None = None
    files_done: int = 0
    files_total: int | None = None

    def line(self) -> str:
        return PROGRESS_PREFIX + json.dumps(asdict(self), separators=(",", ":"))

    @classmethod
    def from_line(cls, line: str) -> FetchProgress | None:
        """The progress in one line of the fetcher's output; None for any other line."""
        if not line.startswith(PROGRESS_PREFIX):
            return None
        try:
            data = json.loads(line[len(PROGRESS_PREFIX) :])
            return cls(
                **{k: data[k] for k in ("phase", "bytes_done", "bytes_total", "files_done", "files_total")}
            )
        except (ValueError, TypeError, KeyError):
            return None

    @classmethod
    def last_in(cls, text: str) -> FetchProgress | None:
        """The latest progress in a stretch of the fetcher's output."""
        for line in reversed(text.splitlines()):
            progress = cls.from_line(line.strip())
            if progress is not None:
                return progress
        return None

    def describe(self) -> str:
        """For people: ``downloading the model: 46% (120.0 MB of 260.0 MB, 3 of 7 files)``."""
        if self.phase == "waiting":
            return "waiting for another replica's download of the model on this node"
        if self.phase == "listing":
            return "listing the model's files"
        if self.phase == "cached":
            return "model found in the node cache"
        done = _size(self.bytes_done)
        if self.bytes_total:
            pct = min(100, int(100 * self.bytes_done / self.bytes_total))
            amount = f"{pct}% ({done} of {_size(self.bytes_total)}"
        else:
            amount = f"({done}"
        if self.files_total:
            amount += f", {self.files_done} of {self.files_total} files"
        verb = {"verifying": "verifying the cached model", "done": "model downloaded"}.get(
            self.phase, "downloading the model"
        )
        return f"{verb}: {amount})"


def _size(n: int) -> str:
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n} B"
