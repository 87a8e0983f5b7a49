"""The stores the real-node suite downloads models from: real servers on the host (an S3-compatible
store, an HTTP file server, a hub), bound to the node's address, which its Pods reach."""

from __future__ import annotations

import os
import shutil
import tarfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rewardplane.localcluster.realnode.layout import NODE_IP
from rewardplane.protocol.model_sources import FETCH_CONTAINER, FetchProgress
from rewardplane.testing.storage_servers import FakeHub, HttpFileServer, S3Server

BUCKET = "models"
HTTP_AUTHORIZATION = "Bearer e2e-files"
HUB_TOKEN = "hf_e2e"
HUB_REPO = "e2e/tiny-rm"
# A large file beside the model (transformers ignores it): the download then takes long enough,
# at the file server's rate, for the status to show its progress.
PADDING_BYTES = 12 << 20
FILE_RATE_BYTES_S = 2 << 20


@dataclass
class Stores:
    s3: S3Server
    files: HttpFileServer
    hub: FakeHub

    def close(self) -> None:
        for server in (self.s3, self.files, self.hub):
            server.stop()


def start_stores(model_dir: Path, scratch: Path) -> Stores:
    """The model at ``s3://models/tiny-rm``, at ``<files>/tiny-rm.tar.gz`` (with padding, served
    slowly) and as ``hf://e2e/tiny-rm`` on the hub, each needing its credentials but S3 (moto
    takes any key)."""
    shutil.rmtree(scratch, ignore_errors=True)
    (scratch / "files").mkdir(parents=True)
    s3 = S3Server(NODE_IP).start()
    s3.upload_directory(model_dir, BUCKET, "tiny-rm")
    padded = scratch / "padded"
    shutil.copytree(model_dir, padded)
    (padded / "padding.bin").write_bytes(os.urandom(PADDING_BYTES))  # incompressible
    with tarfile.open(scratch / "files" / "tiny-rm.tar.gz", "w:gz") as tar:
        for path in sorted(padded.iterdir()):
            tar.add(path, arcname=path.name)
    files = HttpFileServer(
        scratch / "files", NODE_IP, authorization=HTTP_AUTHORIZATION, rate_bytes_s=FILE_RATE_BYTES_S
    ).start()
    hub = FakeHub(NODE_IP, token=HUB_TOKEN).start()
    hub.add_repo(HUB_REPO, model_dir)
    return Stores(s3, files, hub)


def secret_body(name: str, data: dict[str, str]) -> dict[str, Any]:
    return {"metadata": {"name": name}, "stringData": data, "type": "Opaque"}


def fetch_progress(core: Any, namespace: str, pod: str) -> FetchProgress | None:
    """The last progress line of a Pod's model download (None before it printed one)."""
    try:
        log = core.read_namespaced_pod_log(pod, namespace, container=FETCH_CONTAINER)
    except Exception:  # not started yet: the API answers 400
        return None
    return FetchProgress.last_in(str(log))
