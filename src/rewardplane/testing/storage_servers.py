"""Real storage servers for the model fetcher's tests (``python -m rewardplane.modelfetch``): an
S3-compatible store (moto's server mode, a process of moto's own virtualenv), and, in threads of
the calling process, a static HTTP file server (https:// sources) and a small hub (hf:// sources:
the API huggingface_hub's ``HfApi.model_info`` reads, and the ``resolve`` downloads).

Each binds the host it is given (``0.0.0.0`` for a node's pods to reach it) on a free port (or the
one given) and counts the requests it answers, so that a test can tell a cached fetch, which asks
nothing, from a download."""

from __future__ import annotations

import hashlib
import json
import re
import subprocess
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Iterable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlsplit

from rewardplane.testing.moto_server import COUNTS_PATH
from rewardplane.testing.processes import stop_process

CHUNK = 1 << 20


def _url_host(host: str) -> str:
    return "127.0.0.1" if host in ("", "0.0.0.0", "::") else host


class _Counts:
    """Requests answered, by method and path (thread-safe)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counts: Counter[tuple[str, str]] = Counter()

    def add(self, method: str, path: str) -> None:
        with self._lock:
            self._counts[(method, path)] += 1

    def total(self, method: str | None = None, path_prefix: str = "") -> int:
        with self._lock:
            return sum(
                n
                for (m, p), n in self._counts.items()
                if (method is None or m == method) and p.startswith(path_prefix)
            )

    def by_path(self, method: str = "GET") -> dict[str, int]:
        with self._lock:
            return {p: n for (m, p), n in self._counts.items() if m == method}

    def reset(self) -> None:
        with self._lock:
            self._counts.clear()


# ---------------------------------------------------------------------------------------------
# S3: moto's server mode, in moto's own virtualenv


MOTO_VENV = "moto-venv"
"""Under the project's cache: moto's virtualenv (scripts/setup.sh). moto needs botocore, which
needs python-dateutil<3; the project's kubernetes client needs >=3, so they cannot share a venv."""
MOTO_START_TIMEOUT_S = 60.0


class MotoUnavailableError(RuntimeError):
    """moto's virtualenv is missing: scripts/setup.sh makes it."""


def moto_python() -> Path:
    from rewardplane.protocol.settings import cache_root

    return cache_root() / MOTO_VENV / "bin" / "python"


class _RemoteCounts:
    """The request counts of the moto process (moto_server.py), read over HTTP."""

    def __init__(self, server: S3Server) -> None:
        self._server = server

    def _rows(self, method: str = "GET") -> list[tuple[str, str, int]]:
        import httpx

        resp = httpx.request(method, self._server.url + COUNTS_PATH, timeout=10)
        resp.raise_for_status()
        return [(m, p, int(n)) for m, p, n in resp.json()]

    def total(self, method: str | None = None, path_prefix: str = "") -> int:
        return sum(
            n for m, p, n in self._rows() if (method is None or m == method) and p.startswith(path_prefix)
        )

    def by_path(self, method: str = "GET") -> dict[str, int]:
        return {p: n for m, p, n in self._rows() if m == method}

    def reset(self) -> None:
        self._rows("DELETE")


class S3Server:
    """An S3-compatible endpoint: moto's server mode in its own process (its own virtualenv), which
    counts the requests it answers. Any access key is accepted (moto checks none)."""

    ACCESS_KEY = "testing"
    SECRET_KEY = "testing"
    REGION = "us-east-1"

    def __init__(self, host: str = "127.0.0.1", port: int = 0) -> None:
        self.host = host
        self._wanted_port = port
        self._port: int | None = None
        self._proc: subprocess.Popen[str] | None = None
        self._log: Any = None
        self.counts = _RemoteCounts(self)

    def start(self) -> S3Server:
        python = moto_python()
        if not python.exists():
            raise MotoUnavailableError(
                f"moto's virtualenv is missing ({python}): run scripts/setup.sh, which makes it"
            )
        # werkzeug logs every request to stderr; kept for the error of a failed start
        self._log = tempfile.TemporaryFile(mode="w+")  # noqa: SIM115 (closed by __exit__)
        script = Path(__file__).with_name("moto_server.py")
        self._proc = subprocess.Popen(
            [str(python), str(script), "--host", self.host, "--port", str(self._wanted_port)],
            stdout=subprocess.PIPE,
            stderr=self._log,
            text=True,
        )
        line: list[str] = []
        reader = threading.Thread(target=lambda: line.append(self._proc.stdout.readline()), daemon=True)  # type: ignore[union-attr]
        reader.start()
        reader.join(MOTO_START_TIMEOUT_S)
        if not line or not line[0].startswith("port "):
            self.stop()
            self._log.seek(0)
            raise RuntimeError(
                f"moto's server did not start within {MOTO_START_TIMEOUT_S:.0f} s: {self._log.read()[-2000:]}"
            )
        self._port = int(line[0].split()[1])
        return self

    def stop(self) -> None:
        if self._proc is not None:
            stop_process(self._proc)
            self._proc = None

    def __enter__(self) -> S3Server:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
        if self._log is not None:
            self._log.close()

    @property
    def port(self) -> int:
        if self._port is None:
            raise RuntimeError("the S3 server is not started")
        return self._port

    @property
    def url(self) -> str:
        return f"http://{_url_host(self.host)}:{self.port}"

    def env(self) -> dict[str, str]:
        """The variables a source Secret would give the fetcher for this store."""
        return {
            "AWS_ACCESS_KEY_ID": self.ACCESS_KEY,
            "AWS_SECRET_ACCESS_KEY": self.SECRET_KEY,
            "AWS_DEFAULT_REGION": self.REGION,
        }

    def upload_directory(self, directory: Path, bucket: str, prefix: str = "") -> list[str]:
        """Every file under ``directory`` to ``bucket/prefix/<relative path>`` (the bucket is
        created if missing); the keys written. Plain PUTs: moto checks no signature."""
        import httpx

        keys = []
        with httpx.Client(base_url=self.url, timeout=60) as http:
            http.put(f"/{bucket}")  # 200, or 409 when it exists
            for path in sorted(p for p in Path(directory).rglob("*") if p.is_file()):
                rel = path.relative_to(directory).as_posix()
                key = f"{prefix.strip('/')}/{rel}" if prefix.strip("/") else rel
                http.put(f"/{bucket}/{key}", content=path.read_bytes()).raise_for_status()
                keys.append(key)
        return keys


# ---------------------------------------------------------------------------------------------
# HTTP servers (standard library)


class _HttpServer:
    """A ThreadingHTTPServer in a daemon thread; subclasses supply ``_handle(handler, head)``."""

    def __init__(self, host: str = "127.0.0.1", port: int = 0) -> None:
        self.host = host
        self.counts = _Counts()
        outer = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def do_GET(self) -> None:
                outer.counts.add("GET", urlsplit(self.path).path)
                outer._handle(self, head=False)

            def do_HEAD(self) -> None:
                outer.counts.add("HEAD", urlsplit(self.path).path)
                outer._handle(self, head=True)

            def log_message(self, format: str, *args: Any) -> None:
                pass  # quiet: the tests count requests instead

        self._server = ThreadingHTTPServer((host, port), Handler)
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    def start(self) -> Any:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=10)

    def __enter__(self) -> Any:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    @property
    def port(self) -> int:
        return int(self._server.server_address[1])

    @property
    def url(self) -> str:
        return f"http://{_url_host(self.host)}:{self.port}"

    def _handle(self, h: BaseHTTPRequestHandler, head: bool) -> None:
        raise NotImplementedError

    @staticmethod
    def _reply(
        h: BaseHTTPRequestHandler,
        status: int,
        body: bytes = b"",
        headers: dict[str, str] | None = None,
        head: bool = False,
    ) -> None:
        h.send_response(status)
        for k, v in (headers or {}).items():
            h.send_header(k, v)
        h.send_header("Content-Length", str(len(body)))
        h.end_headers()
        if not head:
            h.wfile.write(body)

    rate_bytes_s: float | None = None
    """Send file bodies at most this fast (a slow store: long enough to watch a download's progress)."""

    def _send_file(self, h: BaseHTTPRequestHandler, path: Path, headers: dict[str, str], head: bool) -> None:
        h.send_response(200)
        for k, v in headers.items():
            h.send_header(k, v)
        h.send_header("Content-Length", str(path.stat().st_size))
        h.send_header("Content-Type", "application/octet-stream")
        h.end_headers()
        if head:
            return
        chunk_size = CHUNK if self.rate_bytes_s is None else max(1, int(self.rate_bytes_s / 10))
        with open(path, "rb") as f:
            while chunk := f.read(chunk_size):
                h.wfile.write(chunk)
                if self.rate_bytes_s is not None:
                    time.sleep(len(chunk) / self.rate_bytes_s)


def _inside(root: Path, rel: str) -> Path | None:
    """``root/rel`` if that is a file inside root, else None."""
    target = (root / rel.lstrip("/")).resolve()
    if not target.is_file() or not target.is_relative_to(root.resolve()):
        return None
    return target


class HttpFileServer(_HttpServer):
    """Serves the files under ``root`` at their relative paths (GET and HEAD). With
    ``authorization``, a request whose Authorization header is not exactly that gets 401; with
    ``rate_bytes_s``, file bodies are sent at most that fast."""

    def __init__(
        self,
        root: Path,
        host: str = "127.0.0.1",
        port: int = 0,
        authorization: str | None = None,
        rate_bytes_s: float | None = None,
    ) -> None:
        super().__init__(host, port)
        self.root = Path(root)
        self.authorization = authorization
        self.rate_bytes_s = rate_bytes_s

    def _handle(self, h: BaseHTTPRequestHandler, head: bool) -> None:
        if self.authorization is not None and h.headers.get("Authorization") != self.authorization:
            self._reply(h, 401, b"unauthorized\n", {"WWW-Authenticate": "Bearer"}, head)
            return
        target = _inside(self.root, unquote(urlsplit(h.path).path))
        if target is None:
            self._reply(h, 404, b"not found\n", head=head)
            return
        self._send_file(h, target, {}, head)


# ---------------------------------------------------------------------------------------------
# the hub


def git_blob_id(data: bytes) -> str:
    return hashlib.sha1(f"blob {len(data)}\0".encode() + data).hexdigest()


LFS_SUFFIXES = (".safetensors", ".bin", ".pt", ".gguf", ".h5", ".msgpack")


class _Repo:
    def __init__(self, directory: Path, revisions: Iterable[str], lfs_min_bytes: int) -> None:
        self.directory = directory
        self.siblings: list[dict[str, Any]] = []
        for path in sorted(p for p in directory.rglob("*") if p.is_file()):
            data = path.read_bytes()
            rel = path.relative_to(directory).as_posix()
            sibling: dict[str, Any] = {"rfilename": rel, "size": len(data)}
            if len(data) >= lfs_min_bytes or rel.endswith(LFS_SUFFIXES):
                sha = hashlib.sha256(data).hexdigest()
                pointer = f"version https://git-lfs.github.com/spec/v1\noid sha256:{sha}\nsize {len(data)}\n".encode()
                sibling["blobId"] = git_blob_id(pointer)
                sibling["lfs"] = {"sha256": sha, "size": len(data), "pointerSize": len(pointer)}
            else:
                sibling["blobId"] = git_blob_id(data)
            self.siblings.append(sibling)
        self.commit = hashlib.sha1(json.dumps(self.siblings, sort_keys=True).encode()).hexdigest()
        self.revisions = set(revisions) | {self.commit}


class FakeHub(_HttpServer):
    """The part of the hub's HTTP API the fetcher uses, for repos added from local folders:

    - ``GET /api/models/{repo}[/revision/{rev}]``: the model info (``?blobs=true`` or not, the same),
      siblings with size, blob id and, for large or weight files, LFS sha256;
    - ``GET /{repo}/resolve/{rev}/{file}``: the file;
    - 404 with ``X-Error-Code: RepoNotFound`` / ``RevisionNotFound`` for unknown repos and revisions;
    - with ``token``: 401 unless ``Authorization: Bearer <token>``.
    """

    _API = re.compile(r"^/api/models/(?P<repo>[^/]+(?:/[^/]+)?)(?:/revision/(?P<rev>[^/]+))?$")
    _RESOLVE = re.compile(r"^/(?P<repo>[^/]+/[^/]+)/resolve/(?P<rev>[^/]+)/(?P<file>.+)$")

    def __init__(self, host: str = "127.0.0.1", port: int = 0, token: str | None = None) -> None:
        super().__init__(host, port)
        self.token = token
        self.repos: dict[str, _Repo] = {}

    def add_repo(
        self, repo_id: str, directory: Path, revisions: Iterable[str] = ("main",), lfs_min_bytes: int = 10_000
    ) -> str:
        """Serve ``directory`` as ``repo_id`` at these revisions (and its commit); the commit sha."""
        repo = _Repo(Path(directory), revisions, lfs_min_bytes)
        self.repos[repo_id] = repo
        return repo.commit

    def _error(
        self, h: BaseHTTPRequestHandler, status: int, message: str, code: str | None, head: bool
    ) -> None:
        headers = {"Content-Type": "application/json", "X-Error-Message": message}
        if code:
            headers["X-Error-Code"] = code
        self._reply(h, status, json.dumps({"error": message}).encode(), headers, head)

    def _handle(self, h: BaseHTTPRequestHandler, head: bool) -> None:
        if self.token is not None and h.headers.get("Authorization") != f"Bearer {self.token}":
            message = (
                "Invalid credentials in Authorization header"
                if h.headers.get("Authorization")
                else "Unauthorized"
            )
            self._error(h, 401, message, None, head)
            return
        path = unquote(urlsplit(h.path).path)
        if m := self._API.match(path):
            repo_id, rev = m["repo"], m["rev"] or "main"
            repo = self.repos.get(repo_id)
            if repo is None:
                self._error(h, 404, "Repository not found", "RepoNotFound", head)
            elif rev not in repo.revisions:
                self._error(h, 404, f"Invalid rev id: {rev}", "RevisionNotFound", head)
            else:
                info = {
                    "_id": repo.commit[:24],
                    "id": repo_id,
                    "modelId": repo_id,
                    "sha": repo.commit,
                    "private": self.token is not None,
                    "gated": False,
                    "disabled": False,
                    "downloads": 0,
                    "likes": 0,
                    "tags": [],
                    "lastModified": "2024-01-01T00:00:00.000Z",
                    "createdAt": "2024-01-01T00:00:00.000Z",
                    "siblings": repo.siblings,
                }
                self._reply(h, 200, json.dumps(info).encode(), {"Content-Type": "application/json"}, head)
            return
        if m := self._RESOLVE.match(path):
            repo = self.repos.get(m["repo"])
            if repo is None:
                self._error(h, 404, "Repository not found", "RepoNotFound", head)
            elif m["rev"] not in repo.revisions:
                self._error(h, 404, f"Invalid rev id: {m['rev']}", "RevisionNotFound", head)
            elif (target := _inside(repo.directory, m["file"])) is None:
                self._error(h, 404, "Entry not found", "EntryNotFound", head)
            else:
                self._send_file(h, target, {"X-Repo-Commit": repo.commit, "ETag": f'"{repo.commit}"'}, head)
            return
        self._error(h, 404, "Not found", None, head)
