"""Reading the image names out of ``docker save`` tarballs: the real node re-imports a tarball
whose images containerd no longer lists, so it must know which names each tarball carries."""

from __future__ import annotations

import io
import json
import tarfile
from pathlib import Path

import pytest

from rewardplane.localcluster.realnode import RealNodeError, archive_image_names


def _archive(path: Path, members: dict[str, bytes]) -> Path:
    with tarfile.open(path, "w") as tar:
        for name, data in members.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return path


def test_names_come_from_the_manifests_repo_tags(tmp_path: Path) -> None:
    manifest = [
        {"Config": "c.json", "RepoTags": ["localhost/rewardplane/operator:1-local"], "Layers": []},
        {"Config": "d.json", "RepoTags": ["localhost/a:1", "localhost/a:latest"], "Layers": []},
        {"Config": "e.json", "RepoTags": None, "Layers": []},  # an untagged image names nothing
    ]
    path = _archive(
        tmp_path / "img.tar", {"layer/layer.tar": b"x", "manifest.json": json.dumps(manifest).encode()}
    )
    assert archive_image_names(path) == [
        "localhost/rewardplane/operator:1-local",
        "localhost/a:1",
        "localhost/a:latest",
    ]


@pytest.mark.parametrize(
    "members",
    [
        {"layer.tar": b"x"},  # no manifest
        {"manifest.json": b"{not json"},
        {"manifest.json": b'{"RepoTags": ["a"]}'},  # an object, not a list of images
    ],
)
def test_a_tarball_that_is_not_an_image_archive_is_named(tmp_path: Path, members: dict[str, bytes]) -> None:
    path = _archive(tmp_path / "bad.tar", members)
    with pytest.raises(
        RealNodeError, match=r"bad\.tar is not a docker-archive image tarball.*build-images\.sh"
    ):
        archive_image_names(path)


def test_a_file_that_is_not_a_tarball_is_named(tmp_path: Path) -> None:
    path = tmp_path / "operator.tar"
    path.write_bytes(b"truncated download")
    with pytest.raises(RealNodeError, match="operator.tar is not a docker-archive"):
        archive_image_names(path)
