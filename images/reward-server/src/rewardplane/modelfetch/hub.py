"""``hf://org/name@revision`` sources: the Hugging Face hub or a mirror of its API (``--endpoint``),
token from ``HF_TOKEN``. huggingface_hub lists the files (sizes, LFS sha256, the commit the
revision resolves to); the files themselves are streamed here from ``/{repo}/resolve/{commit}/...``
so that the progress counts bytes and every file is checked (LFS: sha256; others: git blob id)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from urllib.parse import quote

import httpx

from rewardplane.modelfetch.errors import FetchError, PermanentFetchError, TransientFetchError
from rewardplane.modelfetch.files import CHUNK, Listing, RemoteFile, safe_relative
from rewardplane.modelfetch.http import status_error, transport_error

DEFAULT_ENDPOINT = "https://huggingface.co"
LIST_TIMEOUT_S = 60.0


class HubSource:
    def __init__(
        self, repo: str, revision: str | None, endpoint: str, token: str | None, http: httpx.Client
    ) -> None:
        self.repo = repo
        self.revision = revision
        self.endpoint = endpoint.rstrip("/")
        self.token = token
        self.http = http
        self.commit: str | None = None
        self.uri = f"hf://{repo}" + (f"@{revision}" if revision else "")

    def _auth_hint(self) -> str:
        if self.token:
            return "check HF_TOKEN in spec.model.sourceSecret (it must grant read access to this repo)"
        return "a private or gated repo needs HF_TOKEN in spec.model.sourceSecret"

    def list_files(self) -> Listing:
        from huggingface_hub import HfApi
        from huggingface_hub.errors import (
            GatedRepoError,
            HfHubHTTPError,
            RepositoryNotFoundError,
            RevisionNotFoundError,
        )

        at = f" at {self.endpoint}"
        api = HfApi(endpoint=self.endpoint, token=self.token or False)
        try:
            info = api.model_info(
                self.repo,
                revision=self.revision,
                files_metadata=True,
                timeout=LIST_TIMEOUT_S,
                token=self.token or False,
            )
        except GatedRepoError as e:
            raise PermanentFetchError(
                f"{self.uri}: the repo is gated{at}: accept its terms on the hub, then {self._auth_hint()}"
            ) from e
        except RepositoryNotFoundError as e:
            raise PermanentFetchError(
                f"{self.uri}: hub repo {self.repo} not found{at} (or not visible with the token given): "
                f"check the name; {self._auth_hint()}"
            ) from e
        except RevisionNotFoundError as e:
            raise PermanentFetchError(
                f"{self.uri}: revision {self.revision!r} not found in {self.repo}{at}: check spec.model.revision "
                "(a branch, a tag or a commit)"
            ) from e
        except HfHubHTTPError as e:
            status = e.response.status_code if e.response is not None else 0
            if status:
                raise status_error(status, f"{self.uri}: listing the files{at}", self._auth_hint()) from e
            raise TransientFetchError(f"{self.uri}: listing the files{at} failed: {e}") from e
        except FetchError:
            raise
        except Exception as e:
            # huggingface_hub's HTTP client raises its own connection and timeout errors
            if isinstance(e, OSError) or type(e).__module__.split(".")[0] in (
                "httpx",
                "httpx2",
                "httpcore",
                "httpcore2",
            ):
                raise TransientFetchError(
                    f"{self.uri}: cannot reach the hub{at} ({type(e).__name__}: {e})"
                ) from e
            raise
        self.commit = info.sha or self.revision or "main"
        files = []
        for s in info.siblings or []:
            path = safe_relative(s.rfilename, self.uri)
            if s.lfs is not None:
                files.append(RemoteFile(path, s.lfs.size, sha256=s.lfs.sha256, ref=s.rfilename))
            else:
                files.append(RemoteFile(path, s.size, git_blob=s.blob_id, ref=s.rfilename))
        if not files:
            raise PermanentFetchError(f"{self.uri}: the repo has no files at this revision{at}")
        return Listing(files, revision=self.commit)

    @contextmanager
    def open(self, file: RemoteFile) -> Iterator[tuple[int | None, Iterator[bytes]]]:
        url = f"{self.endpoint}/{self.repo}/resolve/{quote(self.commit or 'main', safe='')}/{quote(file.ref)}"
        headers = {"Authorization": f"Bearer {self.token}"} if self.token else {}
        try:
            with self.http.stream("GET", url, headers=headers) as r:
                if r.status_code != 200:
                    raise status_error(r.status_code, f"{self.uri}: {file.ref}", self._auth_hint())
                yield file.size, r.iter_bytes(CHUNK)
        except httpx.HTTPError as e:
            raise transport_error(e, f"{self.uri}: {file.ref}") from e
