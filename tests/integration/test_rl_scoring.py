"""The training-side flow against a real reward server: the scorer (one request per batch, order
kept, errors raise and write nothing), the reward loop mixing rule functions with RM scores, and
the new scoring clients (blocking and async) agreeing with each other."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import pytest

from rewardplane.sdk import (
    AsyncRewardClient,
    RewardClient,
    RewardLoop,
    RewardModelScorer,
    RewardSample,
    RewardServerError,
    Rollout,
    Step,
    make_reward_rl,
    make_rm_grpo_assigner,
    rollout_text,
)
from rewardplane.testing.servers import ServerHandle, start_server
from tests.fixtures.flaky_proxy import FlakyProxy

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def server(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerHandle]:
    # A short max length, so that one over-long text makes its request fail with a 400.
    handle = start_server(tiny_model_dir, tmp_path_factory.mktemp("rl-server"), max_model_len=64)
    yield handle
    handle.stop()


@pytest.fixture
def proxy(server: ServerHandle) -> Iterator[FlakyProxy]:
    with FlakyProxy(server.url) as p:
        yield p


def make_rollouts(n: int, prompts: int = 3) -> list[Rollout]:
    return [
        Rollout(
            id=f"r{i}",
            steps=[
                Step(0, f"question {i % prompts}", f"answer {i} " + "fine " * (i % 5), reward=float(i % 2)),
                Step(1, "follow-up", f"more {i}", reward=0.0),
            ],
        )
        for i in range(n)
    ]


def test_scorer_sends_one_request_per_batch_in_order(server: ServerHandle, proxy: FlakyProxy) -> None:
    rollouts = make_rollouts(10)
    with RewardClient(server.url) as direct:
        expected = direct.score_batch([rollout_text(r) for r in rollouts])

    async def main() -> None:
        async with AsyncRewardClient(proxy.url) as client:
            await RewardModelScorer(client, batch_size=4).score(rollouts)

    asyncio.run(main())
    assert proxy.count("/score") == 3  # 10 rollouts in batches of 4: 4 + 4 + 2
    assert [r.meta["rm_score"] for r in rollouts] == pytest.approx(expected, rel=1e-5, abs=1e-6)
    assert len(set(expected)) == 10  # distinct texts score differently, so order is really checked


def test_step_level_scores_every_step(server: ServerHandle, proxy: FlakyProxy) -> None:
    rollouts = make_rollouts(3)
    texts = [f"{s.prev_obs}\n{s.action}" for r in rollouts for s in r.steps]
    with RewardClient(server.url) as direct:
        expected = direct.score_batch(texts, normalize=False)

    async def main() -> None:
        async with AsyncRewardClient(proxy.url) as client:
            scorer = RewardModelScorer(
                client, score_key="prm", score_level="step", batch_size=5, normalize=False
            )
            await scorer.score(rollouts)

    asyncio.run(main())
    assert proxy.count("/score") == 2  # 6 steps in batches of 5
    assert [s.info["prm"] for r in rollouts for s in r.steps] == pytest.approx(expected, rel=1e-5, abs=1e-6)
    assert all("prm" not in r.meta for r in rollouts)


def test_a_failed_batch_raises_and_writes_nothing(server: ServerHandle, proxy: FlakyProxy) -> None:
    rollouts = make_rollouts(9)
    rollouts[7].steps[1].action = "word " * 400  # beyond max_model_len: the third batch gets a 400

    async def main() -> None:
        async with AsyncRewardClient(proxy.url) as client:
            await RewardModelScorer(client, batch_size=3).score(rollouts)

    with pytest.raises(RewardServerError) as info:
        asyncio.run(main())
    assert info.value.status_code == 400
    assert proxy.count("/score") == 3  # the first two batches were scored, then the third failed
    assert all("rm_score" not in r.meta for r in rollouts)  # nothing partial


def test_scores_flow_into_grpo_weights_and_make_reward_rl(server: ServerHandle) -> None:
    rollouts = make_rollouts(6, prompts=2)  # two prompts, three rollouts each

    async def main() -> dict[tuple[str, int], float]:
        async with AsyncRewardClient(server.url) as client:
            plain = await make_reward_rl(client, batch_size=4).compute(rollouts)
            assert plain == {(r.id, s.index): r.meta["rm_score"] for r in rollouts for s in r.steps}
        return make_rm_grpo_assigner(3, rm_coeff=1.0).compute(rollouts)

    weights = asyncio.run(main())
    assert len(weights) == 12
    for prompt in ("question 0", "question 1"):
        group = [weights[(r.id, 0)] for r in rollouts if r.steps[0].prev_obs == prompt]
        assert sum(group) == pytest.approx(0.0, abs=1e-6)  # centred within each group


def test_reward_loop_mixes_rules_with_the_reward_model(server: ServerHandle, proxy: FlakyProxy) -> None:
    batch = [
        RewardSample(prompt=f"q{i}", response=f"the answer is {i}", ground_truth=str(i % 4))
        for i in range(40)
    ]
    with RewardClient(server.url) as direct:
        rm_expected = direct.score_batch([f"{s.prompt}\n{s.response}" for s in batch])

    async def main() -> list:  # type: ignore[type-arg]
        async with AsyncRewardClient(proxy.url) as client:
            loop = RewardLoop(client, max_concurrency=8)

            @loop.register
            def contains_truth(sample: RewardSample) -> dict[str, object]:
                ok = sample.response.endswith(str(sample.ground_truth))
                return {"score": float(ok), "checked": str(sample.ground_truth)}

            @loop.register(weight=0.5)
            async def judge(sample: RewardSample, client: AsyncRewardClient) -> float:
                # a function with its own prompt to the reward model, one request per sample
                (score,) = await client.score_batch([f"Rate: {sample.response}"])
                return float(score)  # type: ignore[arg-type]

            loop.add_reward_model(weight=2.0, batch_size=16)
            return await loop.run(batch)

    results = asyncio.run(main())
    # 40 judge requests, plus the RM component's batches of 16: 16 + 16 + 8
    assert proxy.count("/score") == 40 + 3
    for i, (r, rm) in enumerate(zip(results, rm_expected, strict=True)):
        ok = float(str(i % 4) == str(i)[-1])
        assert r.components["contains_truth"] == ok
        assert r.components["rm"] == pytest.approx(rm, rel=1e-5, abs=1e-6)
        # the total is Σ weight · component (the RM's batches of 16 may differ from one batch of 40
        # in the last float32 bits, which the line above allows)
        assert r.score == pytest.approx(ok + 0.5 * r.components["judge"] + 2.0 * r.components["rm"])
        assert r.extra == {"contains_truth": {"checked": str(i % 4)}}


def test_blocking_and_async_clients_agree(server: ServerHandle) -> None:
    texts = [f"text number {i}" for i in range(20)]
    with RewardClient([server.url, server.url], min_chunk=4) as sync_client:
        blocking = sync_client.score_batch(texts, normalize=False)
        assert sync_client.get_model_version() == 0

    async def main() -> list:  # type: ignore[type-arg]
        async with AsyncRewardClient(server.url) as client:
            return await client.score_batch(texts, normalize=False)

    assert asyncio.run(main()) == pytest.approx(blocking, rel=1e-5, abs=1e-6)


def test_a_blocking_client_is_refused_with_a_clear_error(server: ServerHandle) -> None:
    with RewardClient(server.url) as client:
        with pytest.raises(
            TypeError, match="needs an async scoring client.*RewardClient is the blocking one"
        ):
            RewardModelScorer(client)  # type: ignore[arg-type]
        with pytest.raises(TypeError, match="RewardLoop.add_reward_model needs an async scoring client"):
            RewardLoop(client).add_reward_model()  # type: ignore[arg-type]
