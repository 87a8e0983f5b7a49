"""GET /param_checksums: after a push, the server's live parameters are bit-for-bit the trainer's."""

from __future__ import annotations

import httpx

from rewardplane.protocol import Endpoints, ParamChecksumsResponse
from rewardplane.protocol import RewardModelTrainingMode as Mode
from rewardplane.transport.checksums import digests
from tests.fixtures.trainer import perturbed
from tests.integration.test_weight_sync import TOKEN, sync_for


def test_checksums_of_every_live_parameter_equal_the_trainers_after_a_full_push(
    server_factory, tiny_model_dir
):
    server = server_factory(tiny_model_dir, token=TOKEN)
    model = perturbed(tiny_model_dir, seed=21)
    with sync_for(server, bucket_bytes=1 << 16) as sync:
        sync.push(model.state_dict(), version=1, training_mode=Mode.FULL)
    r = httpx.get(
        server.url + Endpoints.PARAM_CHECKSUMS, headers={"Authorization": f"Bearer {TOKEN}"}, timeout=60
    )
    assert r.status_code == 200, r.text
    body = ParamChecksumsResponse.model_validate(r.json())
    assert body.version == 1 and len(body.workers) == 1
    want = digests(model.named_parameters())
    got = body.workers[0].checksums
    assert set(got) == set(want)
    assert [n for n in want if tuple(got[n]) != tuple(want[n])] == []
    assert httpx.get(server.url + Endpoints.PARAM_CHECKSUMS, timeout=30).status_code == 401
