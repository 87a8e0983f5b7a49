"""The SDK's request bodies (``http_pool.json_body``): the same JSON document httpx's ``json=`` would
send, with its content type, and nothing for a request without a body."""

from __future__ import annotations

import json

import httpx

from rewardplane.sdk.http_pool import json_body


def test_the_body_is_the_same_json_with_its_content_type() -> None:
    body = {"input": [[5, 17, 31999], [4]], "model": "rm", "normalize": False, "text": "ünïcode"}
    request = httpx.Request("POST", "http://rm/score", **json_body(body))
    assert request.headers["content-type"] == "application/json"
    assert json.loads(request.content) == body
    assert json.loads(httpx.Request("POST", "http://rm/score", json=body).content) == body


def test_no_body_no_arguments() -> None:
    assert json_body(None) == {}
