"""Model sources as written in spec.model.source, and the fetcher's progress lines the status shows."""

from __future__ import annotations

import pytest

from rewardplane.protocol.model_sources import (
    FetchProgress,
    InvalidSourceError,
    SourceKind,
    parse_source,
)


def test_each_form_parses_to_what_is_fetched() -> None:
    s3 = parse_source("s3://models/llama/rm-7b/")
    assert (s3.kind, s3.location, s3.path, s3.downloaded) == (SourceKind.S3, "models", "llama/rm-7b", True)
    hub = parse_source("hf://org/rm@main")
    assert (hub.kind, hub.location, hub.revision) == (SourceKind.HUB, "org/rm", "main")
    assert parse_source("org/rm", "v3").revision == "v3"
    archive = parse_source("https://models.example.com/rm.tar.gz")
    assert archive.kind is SourceKind.HTTPS and archive.is_archive
    assert not parse_source("https://models.example.com/model.safetensors").is_archive
    pvc = parse_source("pvc://claim/a/b")
    assert (pvc.kind, pvc.location, pvc.path, pvc.downloaded) == (SourceKind.PVC, "claim", "a/b", False)


def test_gs_points_at_the_s3_api_instead() -> None:
    with pytest.raises(InvalidSourceError, match="storage.googleapis.com"):
        parse_source("gs://bucket/rm")


def test_progress_lines_round_trip_and_read_as_bytes_and_percent() -> None:
    p = FetchProgress("downloading", 120_000_000, 260_000_000, 3, 7)
    log = "\n".join(["starting", p.line(), "some other output"])
    assert FetchProgress.last_in(log) == p
    assert p.describe() == "downloading the model: 46% (120.0 MB of 260.0 MB, 3 of 7 files)"
    assert FetchProgress.from_line("rewardplane-fetch {not json") is None
    assert FetchProgress.last_in("no progress here") is None
    assert "another replica" in FetchProgress("waiting").describe()
