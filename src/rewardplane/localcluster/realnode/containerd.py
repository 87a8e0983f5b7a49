"""The node's containerd through ``ctr``, in the namespace the kubelet uses: importing the images
(docker-archive tarballs, there is no registry) and killing what containers are left at ``down``.
"""

from __future__ import annotations

import json
import subprocess
import tarfile
import time
from pathlib import Path

from rewardplane.localcluster.realnode.layout import K8S_NAMESPACE, PAUSE_IMAGE, Layout
from rewardplane.localcluster.realnode.tools import RealNodeError, run


def archive_image_names(path: Path) -> list[str]:
    """The image names a docker-archive tarball (``docker save``) carries: its manifest's
    RepoTags. Raises RealNodeError for a file that is not such an archive."""
    try:
        with tarfile.open(path) as tar:
            member = tar.extractfile("manifest.json")
            if member is None:
                raise KeyError("manifest.json")
            manifest = json.load(member)
        return [str(tag) for entry in manifest for tag in entry.get("RepoTags") or []]
    except (OSError, KeyError, ValueError, AttributeError, tarfile.TarError) as exc:
        raise RealNodeError(
            f"{path} is not a docker-archive image tarball ({exc}); rebuild the images: bash scripts/build-images.sh"
        ) from exc


def file_stamp(path: Path) -> str:
    """What identifies one build of a tarball: its size and mtime."""
    st = path.stat()
    return f"{st.st_size}:{st.st_mtime_ns}"


class Containerd:
    def __init__(self, layout: Layout, images: Path) -> None:
        self.layout = layout
        self.images = images

    def ctr(
        self, args: list[str], *, check: bool = True, timeout: float = 60
    ) -> subprocess.CompletedProcess[str]:
        """``ctr`` against the node's containerd, in the namespace the kubelet uses."""
        return run(
            ["ctr", "-a", str(self.layout.containerd_sock), "-n", K8S_NAMESPACE, *args],
            check=check,
            timeout=timeout,
        )

    def image_names(self) -> set[str]:
        """The image names the node's containerd lists (none while it is not running)."""
        if not self.layout.containerd_sock.exists():
            return set()
        return set(self.ctr(["images", "ls", "-q"], check=False).stdout.split())

    def import_images(self, paths: list[Path] | None = None) -> list[str]:
        """Import docker-archive tarballs into the node's containerd (``k8s.io`` namespace).

        Default: every ``*.tar`` in the images dir (the pause image first). A tarball already
        imported (same size and mtime) is skipped only while containerd still lists every image it
        names: the record can outlive the content store (a cleaned disk, a reused cache), and a
        node without its pause image never starts a pod.
        """
        if paths is None:
            paths = sorted(self.images.glob("*.tar"), key=lambda p: (p.name != "pause.tar", p.name))
        if not any(p.name == "pause.tar" for p in paths) and PAUSE_IMAGE not in self.image_names():
            raise RealNodeError(
                f"no pause image in {self.images}; build the images first: bash scripts/build-images.sh"
            )
        stamps_file = self.layout.imported_json
        try:
            stamps = json.loads(stamps_file.read_text())
        except (OSError, ValueError):
            stamps = {}
        present = self.image_names()
        imported = []
        for path in paths:
            stamp = file_stamp(path)
            if stamps.get(str(path)) == stamp and set(archive_image_names(path)) <= present:
                continue
            self.ctr(["images", "import", str(path)], timeout=600)
            stamps[str(path)] = stamp
            imported.append(path.name)
            stamps_file.write_text(json.dumps(stamps, indent=2))
        return imported

    def running_tasks(self) -> list[str]:
        done = self.ctr(["tasks", "ls"], check=False)
        return [line.split()[0] for line in done.stdout.splitlines()[1:] if "RUNNING" in line.split()[2:]]

    def kill_containers(self) -> None:
        """Kill every container and sandbox left in the node's containerd, then remove them."""
        for task in self.ctr(["tasks", "ls", "-q"], check=False).stdout.split():
            self.ctr(["tasks", "kill", "-a", "-s", "SIGKILL", task], check=False)
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            states = self.ctr(["tasks", "ls"], check=False).stdout.splitlines()[1:]
            if all("STOPPED" in s for s in states):
                break
            time.sleep(0.3)
        for task in self.ctr(["tasks", "ls", "-q"], check=False).stdout.split():
            self.ctr(["tasks", "rm", "-f", task], check=False)
        for container in self.ctr(["containers", "ls", "-q"], check=False).stdout.split():
            self.ctr(["containers", "rm", container], check=False)
