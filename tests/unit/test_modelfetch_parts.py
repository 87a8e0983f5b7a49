"""The model fetcher's pure parts: which archive members are refused, which cache entries are
evicted, and the progress lines' rate; and how the S3 client reads its settings and maps a store's
answers (a stub endpoint's: refusals, errors moto does not give) to the fetcher's failures."""

from __future__ import annotations

import io
import socket
import stat
import tarfile
import threading
import time
import zipfile
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import parse_qs, unquote, urlsplit

import pytest

from rewardplane.modelfetch.archives import (
    archive_kind,
    hoist_single_folder,
    tar_member_path,
    unpack,
    zip_member_path,
)
from rewardplane.modelfetch.cache import EntryInfo, choose_evictions
from rewardplane.modelfetch.errors import PermanentFetchError, TransientFetchError
from rewardplane.modelfetch.files import safe_relative
from rewardplane.modelfetch.progress import Progress
from rewardplane.modelfetch.s3 import S3Source, make_store
from rewardplane.protocol.model_sources import EXIT_PERMANENT, FetchProgress


def _tar_member(name: str, kind: bytes = tarfile.REGTYPE) -> tarfile.TarInfo:
    m = tarfile.TarInfo(name)
    m.type = kind
    return m


@pytest.mark.parametrize("name", ["config.json", "sub/model.safetensors", "./a/b", "a/../b"])
def test_plain_tar_members_keep_their_relative_path(name: str) -> None:
    assert tar_member_path(_tar_member(name), "t") == safe_relative(name, "t")
    assert tar_member_path(_tar_member(name, tarfile.DIRTYPE), "t") is None


@pytest.mark.parametrize("name", ["../x", "/etc/passwd", "a/../../x", "..", "", "."])
def test_tar_members_leaving_the_directory_are_refused(name: str) -> None:
    with pytest.raises(PermanentFetchError, match="would leave the model directory"):
        tar_member_path(_tar_member(name), "t")


@pytest.mark.parametrize(
    "kind", [tarfile.SYMTYPE, tarfile.LNKTYPE, tarfile.CHRTYPE, tarfile.BLKTYPE, tarfile.FIFOTYPE]
)
def test_tar_links_and_devices_are_refused(kind: bytes) -> None:
    with pytest.raises(PermanentFetchError) as e:
        tar_member_path(_tar_member("inside/x", kind), "t")
    assert e.value.exit_code == EXIT_PERMANENT


def test_zip_links_and_escaping_names_are_refused() -> None:
    link = zipfile.ZipInfo("link")
    link.external_attr = (stat.S_IFLNK | 0o777) << 16
    with pytest.raises(PermanentFetchError, match="link"):
        zip_member_path(link, "z")
    with pytest.raises(PermanentFetchError, match="leave"):
        zip_member_path(zipfile.ZipInfo("../evil"), "z")
    assert zip_member_path(zipfile.ZipInfo("a/b.txt"), "z") == "a/b.txt"
    assert zip_member_path(zipfile.ZipInfo("a/"), "z") is None


def test_a_tar_with_a_symlink_unpacks_nothing_outside(tmp_path: Path) -> None:
    archive = tmp_path / "m.tar"
    with tarfile.open(archive, "w") as tar:
        data = b"{}"
        info = tarfile.TarInfo("config.json")
        info.size = len(data)
        tar.addfile(info, io.BytesIO(data))
        link = tarfile.TarInfo("escape")
        link.type = tarfile.SYMTYPE
        link.linkname = "/etc"
        tar.addfile(link)
    with pytest.raises(PermanentFetchError, match="link"):
        unpack(archive, "tar", tmp_path / "out", "https://x/m.tar")
    assert not (tmp_path / "out" / "escape").exists()


def test_one_top_level_folder_is_hoisted(tmp_path: Path) -> None:
    (tmp_path / "m" / "rm-7b").mkdir(parents=True)
    (tmp_path / "m" / "rm-7b" / "config.json").write_text("{}")
    hoist_single_folder(tmp_path / "m")
    assert [p.name for p in (tmp_path / "m").iterdir()] == ["config.json"]
    hoist_single_folder(tmp_path / "m")  # a file at the top: left as it is
    assert [p.name for p in (tmp_path / "m").iterdir()] == ["config.json"]


def test_archive_kinds() -> None:
    assert [archive_kind(n) for n in ("a.tar", "a.TGZ", "a.tar.gz", "a.zip", "a.safetensors")] == [
        "tar",
        "tar",
        "tar",
        "zip",
        None,
    ]


def test_eviction_removes_least_recently_used_first_until_under_the_limit() -> None:
    entries = [
        EntryInfo("old", 40, 1.0),
        EntryInfo("mid", 40, 2.0),
        EntryInfo("new", 40, 3.0),
        EntryInfo("me", 40, 0.5),
    ]
    assert choose_evictions(entries, {"me"}, 200) == []
    assert choose_evictions(entries, {"me"}, 0) == []  # 0: no limit
    assert choose_evictions(entries, {"me"}, 120) == ["old"]
    assert choose_evictions(entries, {"me"}, 80) == ["old", "mid"]
    # the entry just fetched, and entries in use, stay even when the limit cannot be met
    assert choose_evictions(entries, {"me", "old"}, 10) == ["mid", "new"]


def test_progress_lines_are_rate_limited_but_phase_changes_always_print() -> None:
    out = io.StringIO()
    p = Progress(out, interval_s=3600)
    p.phase("downloading", bytes_total=100, files_total=2)
    for _ in range(50):
        p.add(1)
    p.add(50, files=2)
    p.phase("done", bytes_done=100, bytes_total=100, files_done=2, files_total=2)
    lines = [FetchProgress.from_line(line) for line in out.getvalue().splitlines()]
    assert [x.phase for x in lines if x] == ["downloading", "done"]
    assert (
        p.state.bytes_done == 100
        and p.state.describe() == "model downloaded: 100% (100 B of 100 B, 2 of 2 files)"
    )


# ---------------------------------------------------------------------------------------------
# s3:// sources (obstore): what the store answers, as the fetcher's two kinds of failure


class _StubS3:
    """An S3 endpoint that answers every request with one status and body, or lists ``keys``
    (key: size; HEAD finds only ``objects``): what moto cannot be made to answer."""

    def __init__(self) -> None:
        self.status = 200
        self.body = b""
        self.keys: dict[str, int] = {}
        self.objects: set[str] = set()
        stub = self

        class Handler(BaseHTTPRequestHandler):
            def _answer(self) -> None:
                status, body = stub.status, stub.body
                path = urlsplit(self.path)
                if status == 200 and "list-type=2" in path.query:
                    prefix = parse_qs(path.query).get("prefix", [""])[0]
                    rows = "".join(
                        f"<Contents><Key>{k}</Key><Size>{n}</Size>"
                        "<LastModified>2026-01-01T00:00:00.000Z</LastModified></Contents>"
                        for k, n in stub.keys.items()
                        if k.startswith(prefix)
                    )
                    body = f"<ListBucketResult><IsTruncated>false</IsTruncated>{rows}</ListBucketResult>".encode()
                elif status == 200:
                    key = unquote(path.path).split("/", 2)[2]
                    status = 200 if key in stub.objects else 404
                self.send_response(status)
                self.send_header(
                    "Content-Length", "0" if status == 200 and self.command == "HEAD" else str(len(body))
                )
                self.send_header("Last-Modified", "Thu, 01 Jan 2026 00:00:00 GMT")
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(body)

            do_GET = do_HEAD = _answer

            def log_message(self, *args: object) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        self.url = f"http://127.0.0.1:{self.server.server_port}"


@pytest.fixture(scope="module")
def stub_s3() -> Iterator[_StubS3]:
    stub = _StubS3()
    yield stub
    stub.server.shutdown()


KEYS = {"AWS_ACCESS_KEY_ID": "k", "AWS_SECRET_ACCESS_KEY": "s"}


def _s3_source(stub: _StubS3, env: dict[str, str] = KEYS, prefix: str = "rm") -> S3Source:
    return S3Source("models", prefix, stub.url, make_store("models", stub.url, env))


@pytest.mark.parametrize(
    ("status", "body", "kind", "words"),
    [
        (403, b"<Error><Code>AccessDenied</Code><Message>Access Denied</Message></Error>", PermanentFetchError,
         ["access denied", "HTTP 403 AccessDenied", "AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY", "spec.model.sourceSecret"]),
        (400, b"<Error><Code>InvalidAccessKeyId</Code></Error>", PermanentFetchError, ["access denied", "spec.model.sourceSecret"]),
        (404, b"<Error><Code>NoSuchBucket</Code></Error>", PermanentFetchError, ["bucket models does not exist at http://"]),
        (503, b"<Error><Code>SlowDown</Code></Error>", TransientFetchError, ["HTTP 503 SlowDown", "retrying later"]),
        (500, b"", TransientFetchError, ["HTTP 500"]),
        (301, b"", PermanentFetchError, ["not in region us-east-1", "AWS_REGION"]),
        (400, b"<Error><Code>InvalidArgument</Code><Message>bad</Message></Error>", PermanentFetchError,
         ["refused the request (HTTP 400 InvalidArgument: bad)"]),
    ],
)  # fmt: skip
def test_s3_answers_map_to_permanent_or_transient_failures(
    stub_s3: _StubS3, status: int, body: bytes, kind: type[Exception], words: list[str]
) -> None:
    stub_s3.status, stub_s3.body = status, body
    try:
        with pytest.raises(kind) as e:
            _s3_source(stub_s3, prefix="").list_files()  # the listing's request: an answer with a body
    finally:
        stub_s3.status, stub_s3.body = 200, b""
    for w in words:
        assert w in str(e.value), str(e.value)
    assert "\n" not in str(e.value) and "Debug source" not in str(e.value)


def test_s3_without_credentials_is_unsigned_and_a_refusal_says_to_add_them(stub_s3: _StubS3) -> None:
    source = _s3_source(stub_s3, env={})
    assert source.store.config.get("skip_signature") == "true"
    stub_s3.status, stub_s3.body = 403, b"<Error><Code>AccessDenied</Code></Error>"
    try:
        # the look-up of the prefix as one object (HEAD: an answer without a body)
        with pytest.raises(
            PermanentFetchError, match=r"HTTP 403\): the request went unsigned .* put AWS_ACCESS_KEY_ID"
        ):
            source.list_files()
    finally:
        stub_s3.status, stub_s3.body = 200, b""


def test_s3_client_settings_come_from_the_environment() -> None:
    store = make_store("models", "https://minio:9000", {**KEYS, "AWS_DEFAULT_REGION": "eu-west-1"})
    assert store.config["region"] == "eu-west-1" and store.config.get("skip_signature") != "true"
    assert store.config.get("virtual_hosted_style_request") != "true"  # paths on a compatible store
    env = {**KEYS, "AWS_REGION": "us-west-2", "AWS_DEFAULT_REGION": "eu-west-1"}
    assert make_store("models", None, env).config["region"] == "us-west-2"
    assert make_store("models", None, {}).config["region"] == "us-east-1"
    with pytest.raises(PermanentFetchError, match="AWS_SECRET_ACCESS_KEY is not"):
        make_store("models", None, {"AWS_ACCESS_KEY_ID": "k"})
    with pytest.raises(PermanentFetchError, match="spec.model.sourceEndpoint"):
        make_store("models", "minio:9000", KEYS)


def test_s3_refused_connection_is_transient_and_quick() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{s.getsockname()[1]}"  # bound, not listening: refused
        start = time.monotonic()
        with pytest.raises(TransientFetchError, match="cannot reach the store .*connection refused"):
            S3Source("models", "rm", url, make_store("models", url, KEYS)).list_files()
    assert time.monotonic() - start < 5


def test_s3_listing_keeps_sub_folders_and_skips_folder_markers(stub_s3: _StubS3) -> None:
    stub_s3.keys = {
        "rm/a.json": 3,
        "rm/sub/": 0,
        "rm/sub/b.bin": 5,
        "rm/empty": 0,
        "rm/marker/": 0,
        "rm-2/x": 1,
    }
    stub_s3.objects = {"rm/a.json", "rm/sub/b.bin", "rm/empty", "rm-2/x"}
    listing = _s3_source(stub_s3).list_files()
    assert [(f.path, f.size, f.ref) for f in listing.files] == [
        ("a.json", 3, "rm/a.json"),
        ("empty", 0, "rm/empty"),
        ("sub/b.bin", 5, "rm/sub/b.bin"),
    ]
    # a prefix that names one object: that object
    one = _s3_source(stub_s3, prefix="rm/a.json").list_files()
    assert [(f.path, f.ref) for f in one.files] == [("a.json", "rm/a.json")]
    with pytest.raises(PermanentFetchError, match="no objects under this prefix .*check the prefix"):
        _s3_source(stub_s3, prefix="nothing").list_files()
