"""The model fetcher (``python -m rewardplane.modelfetch``, the fetch-model init container), run as
a real process against real servers started here: moto's S3 server, a static HTTP server and a
small hub (``rewardplane.testing.storage_servers``). Nothing of the fetcher is mocked."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import tarfile
import threading
import time
import zipfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from rewardplane.protocol.model_sources import (
    EXIT_PERMANENT,
    EXIT_TRANSIENT,
    FETCH_MODULE,
    FetchProgress,
    cache_key,
    parse_source,
)
from rewardplane.testing.servers import free_port
from rewardplane.testing.storage_servers import FakeHub, HttpFileServer, S3Server

HUB_TOKEN = "hf_test_token"
# A fetch that must fail fast (no long retry) takes this long at most.
FAST_S = 15.0


@dataclass
class Fetch:
    returncode: int
    stdout: str
    stderr: str
    termination: str
    seconds: float

    @property
    def progress(self) -> list[FetchProgress]:
        return [p for line in self.stdout.splitlines() if (p := FetchProgress.from_line(line)) is not None]


def run_fetch(
    source: str,
    cache: Path,
    *,
    key: str | None = None,
    endpoint: str | None = None,
    env: dict[str, str] | None = None,
    extra: list[str] | None = None,
    timeout: float = 120,
) -> Fetch:
    key = key or cache_key(parse_source(source), endpoint)
    log = cache.parent / f"termination-{key}-{time.monotonic_ns()}.log"
    cmd = [sys.executable, "-m", FETCH_MODULE, "--source", source, "--cache-dir", str(cache), "--key", key]
    cmd += ["--termination-log", str(log), *(["--endpoint", endpoint] if endpoint else []), *(extra or [])]
    # the user's Secret arrives by envFrom: nothing else of ours leaks in (no ~/.aws, no HF cache)
    base = {k: v for k, v in os.environ.items() if not k.startswith(("AWS_", "HF_"))}
    base |= {
        "HOME": str(cache.parent),
        "AWS_CONFIG_FILE": "/dev/null",
        "AWS_SHARED_CREDENTIALS_FILE": "/dev/null",
    }
    base |= {"AWS_EC2_METADATA_DISABLED": "true"}
    start = time.monotonic()
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=base | (env or {}))
    seconds = time.monotonic() - start
    return Fetch(r.returncode, r.stdout, r.stderr, log.read_text() if log.exists() else "", seconds)


def tree(root: Path) -> dict[str, str]:
    """sha256 of every file under root, by relative path."""
    return {
        p.relative_to(root).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(root.rglob("*"))
        if p.is_file()
    }


def assert_ok(f: Fetch, phase: str) -> None:
    assert f.returncode == 0, f.stderr
    assert f.progress, f.stdout
    assert f.progress[-1].phase == phase, f.stdout


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny reward model plus a file in a sub-folder (keys keep their folders)."""
    from rewardplane.tinymodel import build_tiny_reward_model

    out = build_tiny_reward_model(tmp_path_factory.mktemp("model") / "tiny-rm")
    (out / "extra").mkdir()
    (out / "extra" / "notes.txt").write_text("sub-folders are kept\n")
    return out


@pytest.fixture(scope="module")
def s3(model_dir: Path) -> Iterator[S3Server]:
    with S3Server() as server:
        server.upload_directory(model_dir, "models", "tiny-rm")
        yield server


@pytest.fixture(scope="module")
def hub(model_dir: Path) -> Iterator[FakeHub]:
    with FakeHub(token=HUB_TOKEN) as server:
        server.add_repo("org/tiny-rm", model_dir, revisions=("main", "v1"))
        yield server


@pytest.fixture(scope="module")
def web(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[HttpFileServer]:
    root = tmp_path_factory.mktemp("www")
    shutil.copy(model_dir / "config.json", root / "config.json")
    with tarfile.open(root / "tiny-rm.tar.gz", "w:gz") as tar:
        tar.add(model_dir, arcname="tiny-rm")  # one top-level folder: unpacked without it
    with zipfile.ZipFile(root / "tiny-rm.zip", "w") as zf:
        for p in sorted(model_dir.rglob("*")):
            if p.is_file():
                zf.write(p, p.relative_to(model_dir).as_posix())
    with HttpFileServer(root, authorization="Bearer web-secret") as server:
        yield server


WEB_AUTH = {"AUTHORIZATION": "Bearer web-secret"}


# ---------------------------------------------------------------------------------------------
# each source delivers the exact bytes; a second fetch asks the server nothing


def test_s3_prefix_downloads_the_exact_files_then_serves_from_the_cache(
    s3: S3Server, model_dir: Path, tmp_path: Path
) -> None:
    cache = tmp_path / "cache"
    key = "tiny-rm-s3"
    first = run_fetch("s3://models/tiny-rm", cache, key=key, endpoint=s3.url, env=s3.env())
    assert_ok(first, "done")
    assert tree(cache / key / "model") == tree(model_dir)  # extra/notes.txt kept its folder
    last = first.progress[-1]
    assert (
        last.bytes_done
        == last.bytes_total
        == sum(p.stat().st_size for p in model_dir.rglob("*") if p.is_file())
    )
    manifest = json.loads((cache / key / "manifest.json").read_text())
    assert manifest["source"] == "s3://models/tiny-rm"
    assert {f["path"]: f["sha256"] for f in manifest["files"]} == tree(model_dir)
    # the server (another uid) reads it
    for p in (cache / key).rglob("*"):
        assert p.stat().st_mode & 0o777 == (0o755 if p.is_dir() else 0o644), p

    s3.counts.reset()
    second = run_fetch("s3://models/tiny-rm", cache, key=key, endpoint=s3.url, env=s3.env())
    assert_ok(second, "cached")
    assert s3.counts.total() == 0


def test_s3_prefix_naming_one_object_downloads_that_object(
    s3: S3Server, model_dir: Path, tmp_path: Path
) -> None:
    f = run_fetch("s3://models/tiny-rm/config.json", tmp_path / "c", key="one", endpoint=s3.url, env=s3.env())
    assert_ok(f, "done")
    assert tree(tmp_path / "c/one/model") == {"config.json": tree(model_dir)["config.json"]}


def test_hub_downloads_the_revision_checks_lfs_sha256_and_records_the_commit(
    hub: FakeHub, model_dir: Path, tmp_path: Path
) -> None:
    cache = tmp_path / "cache"
    env = {"HF_TOKEN": HUB_TOKEN}
    first = run_fetch("hf://org/tiny-rm@v1", cache, key="hub", endpoint=hub.url, env=env)
    assert_ok(first, "done")
    assert tree(cache / "hub/model") == tree(model_dir)
    manifest = json.loads((cache / "hub/manifest.json").read_text())
    assert manifest["revision"] == "v1"
    assert manifest["resolved_revision"] == hub.repos["org/tiny-rm"].commit
    # the weights are LFS files (sha256 checked), the small ones plain git blobs (blob id checked)
    assert any("lfs" in s for s in hub.repos["org/tiny-rm"].siblings)
    assert any("lfs" not in s for s in hub.repos["org/tiny-rm"].siblings)

    hub.counts.reset()
    assert_ok(run_fetch("hf://org/tiny-rm@v1", cache, key="hub", endpoint=hub.url, env=env), "cached")
    assert hub.counts.total() == 0


def test_https_single_file_and_archives(web: HttpFileServer, model_dir: Path, tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    single = run_fetch(f"{web.url}/config.json", cache, key="file", env=WEB_AUTH)
    assert_ok(single, "done")
    assert tree(cache / "file/model") == {"config.json": tree(model_dir)["config.json"]}
    for name in ("tiny-rm.tar.gz", "tiny-rm.zip"):
        f = run_fetch(f"{web.url}/{name}", cache, key=name.replace(".", "-"), env=WEB_AUTH)
        assert_ok(f, "done")
        assert tree(cache / name.replace(".", "-") / "model") == tree(model_dir), name
    web.counts.reset()
    assert_ok(run_fetch(f"{web.url}/tiny-rm.tar.gz", cache, key="tiny-rm-tar-gz", env=WEB_AUTH), "cached")
    assert web.counts.total() == 0


# ---------------------------------------------------------------------------------------------
# the node cache


def test_a_corrupted_cached_file_is_detected_and_downloaded_again(
    s3: S3Server, model_dir: Path, tmp_path: Path
) -> None:
    cache = tmp_path / "cache"
    assert_ok(run_fetch("s3://models/tiny-rm", cache, key="k", endpoint=s3.url, env=s3.env()), "done")
    victim = cache / "k/model/config.json"
    data = bytearray(victim.read_bytes())
    data[0] ^= 0xFF  # same size: only the sha256 check sees it
    os.chmod(victim, 0o644)
    victim.write_bytes(bytes(data))
    s3.counts.reset()
    again = run_fetch("s3://models/tiny-rm", cache, key="k", endpoint=s3.url, env=s3.env())
    assert_ok(again, "done")
    assert "config.json has sha256" in again.stderr
    assert tree(cache / "k/model") == tree(model_dir)
    assert s3.counts.total("GET", "/models/tiny-rm/") == len(tree(model_dir))
    # --verify size does not read the files: a same-size corruption passes it (the documented trade)
    victim.write_bytes(bytes(data))
    assert_ok(
        run_fetch(
            "s3://models/tiny-rm", cache, key="k", endpoint=s3.url, env=s3.env(), extra=["--verify", "size"]
        ),
        "cached",
    )
    victim.write_bytes(b"truncated")
    resized = run_fetch(
        "s3://models/tiny-rm", cache, key="k", endpoint=s3.url, env=s3.env(), extra=["--verify", "size"]
    )
    assert_ok(resized, "done")
    assert "config.json has 9 bytes" in resized.stderr


def test_two_concurrent_fetches_of_one_key_download_once(
    hub: FakeHub, model_dir: Path, tmp_path: Path
) -> None:
    cache = tmp_path / "cache"
    hub.counts.reset()
    results: list[Fetch] = []
    env = {"HF_TOKEN": HUB_TOKEN}

    def one() -> None:
        results.append(run_fetch("hf://org/tiny-rm", cache, key="shared", endpoint=hub.url, env=env))

    threads = [threading.Thread(target=one) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(r.progress[-1].phase for r in results) == ["cached", "done"], [r.stderr for r in results]
    assert all(r.returncode == 0 for r in results)
    assert hub.counts.total("GET", "/org/tiny-rm/resolve/") == len(tree(model_dir))
    assert tree(cache / "shared/model") == tree(model_dir)
    assert not [p for p in cache.iterdir() if p.name.startswith(".partial-")]


def test_eviction_removes_the_least_recently_used_entry_under_the_limit(
    s3: S3Server, model_dir: Path, tmp_path: Path
) -> None:
    cache = tmp_path / "cache"
    common = {"endpoint": s3.url, "env": s3.env()}
    assert_ok(run_fetch("s3://models/tiny-rm", cache, key="a", **common), "done")  # type: ignore[arg-type]
    assert_ok(run_fetch("s3://models/tiny-rm", cache, key="b", **common), "done")  # type: ignore[arg-type]
    past = time.time() - 3600
    os.utime(cache / "b/last-used", (past, past))  # b is now the least recently used
    entry = sum(p.stat().st_size for p in (cache / "a").rglob("*") if p.is_file())
    f = run_fetch(
        "s3://models/tiny-rm", cache, key="c", extra=["--max-cache-bytes", str(2 * entry + 1000)], **common
    )  # type: ignore[arg-type]
    assert_ok(f, "done")
    assert sorted(p.name for p in cache.iterdir() if p.is_dir()) == ["a", "c"], f.stderr
    assert "evicted b" in f.stderr


def test_stale_partial_directories_are_removed(s3: S3Server, tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    stale = cache / ".partial-k-999999"
    stale.mkdir(parents=True)
    (stale / "junk").write_text("left by a fetcher that died")
    assert_ok(run_fetch("s3://models/tiny-rm", cache, key="k", endpoint=s3.url, env=s3.env()), "done")
    assert not stale.exists()


# ---------------------------------------------------------------------------------------------
# failures: permanent ones exit 2 at once with the reason in the termination log


def _assert_permanent(f: Fetch, *words: str) -> None:
    assert f.returncode == EXIT_PERMANENT, (f.returncode, f.stderr)
    assert f.seconds < FAST_S, f"took {f.seconds:.1f} s: a permanent error is not retried"
    for w in words:
        assert w in f.termination, f.termination
    assert "\n" not in f.termination and 0 < len(f.termination.encode()) < 4096


def test_a_missing_bucket_is_permanent(s3: S3Server, tmp_path: Path) -> None:
    f = run_fetch("s3://no-such-bucket/x", tmp_path / "c", endpoint=s3.url, env=s3.env())
    _assert_permanent(f, "bucket no-such-bucket does not exist", s3.url)


def test_a_missing_prefix_is_permanent(s3: S3Server, tmp_path: Path) -> None:
    f = run_fetch("s3://models/no-such-prefix", tmp_path / "c", endpoint=s3.url, env=s3.env())
    _assert_permanent(f, "no objects under this prefix (bucket models exists", "check the prefix")
    assert not (tmp_path / "c").exists() or not [p for p in (tmp_path / "c").iterdir() if p.is_dir()]


def test_a_bad_uri_is_permanent(tmp_path: Path) -> None:
    _assert_permanent(run_fetch("s3://Bad_Bucket/x", tmp_path / "c", key="k"), "is not an S3 bucket name")
    _assert_permanent(run_fetch("pvc://models/x", tmp_path / "c", key="k"), "mounted, not downloaded")


def test_a_missing_hub_repo_or_revision_is_permanent(hub: FakeHub, tmp_path: Path) -> None:
    env = {"HF_TOKEN": HUB_TOKEN}
    _assert_permanent(
        run_fetch("hf://org/nope", tmp_path / "c", endpoint=hub.url, env=env), "hub repo org/nope not found"
    )
    _assert_permanent(
        run_fetch("hf://org/tiny-rm@v9", tmp_path / "c", endpoint=hub.url, env=env),
        "revision 'v9' not found",
        "spec.model.revision",
    )


def test_a_wrong_hub_token_is_permanent(hub: FakeHub, tmp_path: Path) -> None:
    wrong = run_fetch("hf://org/tiny-rm", tmp_path / "c", endpoint=hub.url, env={"HF_TOKEN": "hf_wrong"})
    _assert_permanent(wrong, "HTTP 401", "check HF_TOKEN in spec.model.sourceSecret")
    none = run_fetch("hf://org/tiny-rm", tmp_path / "c", endpoint=hub.url)
    _assert_permanent(none, "needs HF_TOKEN in spec.model.sourceSecret")


def test_https_401_and_404_are_permanent(web: HttpFileServer, tmp_path: Path) -> None:
    _assert_permanent(run_fetch(f"{web.url}/config.json", tmp_path / "c"), "HTTP 401", "AUTHORIZATION")
    _assert_permanent(
        run_fetch(f"{web.url}/config.json", tmp_path / "c", env={"AUTHORIZATION": "Bearer wrong"}),
        "HTTP 401",
        "check the AUTHORIZATION key",
    )
    _assert_permanent(
        run_fetch(f"{web.url}/missing.tar.gz", tmp_path / "c", env=WEB_AUTH), "HTTP 404", "check the URI"
    )


def test_an_archive_with_a_member_leaving_the_directory_is_refused(tmp_path: Path) -> None:
    root = tmp_path / "www"
    root.mkdir()
    evil = tmp_path / "evil.txt"
    evil.write_text("outside")
    with tarfile.open(root / "evil.tar", "w") as tar:
        tar.add(evil, arcname="../../evil.txt")
    with HttpFileServer(root) as server:
        f = run_fetch(f"{server.url}/evil.tar", tmp_path / "c")
    _assert_permanent(f, "would leave the model directory")
    assert not (tmp_path / "c").exists() or not [p for p in (tmp_path / "c").iterdir() if p.is_dir()]


@pytest.mark.parametrize("scheme", ["s3", "hf", "https"])
def test_connection_refused_is_transient_after_a_bounded_time(scheme: str, tmp_path: Path) -> None:
    url = f"http://127.0.0.1:{free_port()}"  # nobody listens
    source = {"s3": "s3://models/tiny-rm", "hf": "hf://org/tiny-rm", "https": f"{url}/m.tar.gz"}[scheme]
    env = {"AWS_ACCESS_KEY_ID": "x", "AWS_SECRET_ACCESS_KEY": "y"} if scheme == "s3" else {}
    f = run_fetch(source, tmp_path / "c", endpoint=None if scheme == "https" else url, env=env)
    assert f.returncode == EXIT_TRANSIENT, f.stderr
    assert f.seconds < 60, f"took {f.seconds:.1f} s"
    assert "attempt 1 of" in f.stderr  # it did retry
    assert f.termination
