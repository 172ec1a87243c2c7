"""The reward bridge against a real local HTTP reward function (aiohttp server on loopback)."""

from __future__ import annotations

from collections import Counter
from dataclasses import replace

import pytest
from aiohttp import web

from rollart.bus.dlq import H_DLQ_ERROR
from rollart.bus.reader import read_to_end
from rollart.config import HttpReward
from rollart.messages import Abort, GroupEnded, ScoredTrajectory
from rollart.messages.samples import sample_trajectory
from rollart.rewards.http import HttpRewardClient, check_url
from rollart.runtime import open_runtime
from rollart.stages.reward import RewardBridge, reward_loops
from rollart.topics import expand_catalog
from rollart.topics.admin import apply_topics
from tests.conftest import RunningLoops, eventually, make_config

TOKEN = "s3cret"


class RewardServer:
    """Scores by text length; fails on purpose for some trajectories; requires the bearer token."""

    def __init__(self) -> None:
        self.calls: Counter = Counter()
        self.successes: Counter = Counter()
        self.flaky_left: dict[str, int] = {}

    async def score(self, request: web.Request) -> web.Response:
        if request.headers.get("Authorization") != f"Bearer {TOKEN}":
            return web.json_response({"error": "unauthorized"}, status=401)
        body = await request.json()
        traj_id = body["traj_id"]
        self.calls[traj_id] += 1
        if body["tag"] == "poison":
            return web.Response(status=503, text="down")
        if self.flaky_left.get(traj_id, 0) > 0:
            self.flaky_left[traj_id] -= 1
            return web.Response(status=500, text="transient")
        self.successes[traj_id] += 1
        return web.json_response({"reward": 0.5, "components": {"length": len(body["text"]) / 1000}})


@pytest.fixture
async def reward_server():
    server = RewardServer()
    app = web.Application()
    app.router.add_post("/score", server.score)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]
    server.url = f"http://127.0.0.1:{port}/score"
    yield server
    await runner.cleanup()


def _spec(url: str) -> dict:
    return {"type": "http", "url": url, "token_env": "TEST_REWARD_TOKEN", "attempts": 3, "backoff_s": 0.01,
            "timeout_s": 5, "concurrency": 4}


async def test_http_rewards_once_per_trajectory_retry_then_dead_letter(endpoints, chat, tiny_model, reward_server,
                                                                      monkeypatch):
    monkeypatch.setenv("TEST_REWARD_TOKEN", TOKEN)
    config = make_config(endpoints, model={"path": str(tiny_model), "init_tiny": False},
                         tags={"web": {"env": "frozenlake", "reward": _spec(reward_server.url)},
                               "poison": {"env": "frozenlake", "reward": _spec(reward_server.url)}})
    await apply_topics(config, endpoints, expand_catalog(config))
    trajectories = [replace(sample_trajectory(f"w{i}-t0"), tag="web") for i in range(6)]
    poison = replace(sample_trajectory("p0-t0"), tag="poison")
    reward_server.flaky_left = {"w1-t0": 1, "w2-t0": 2}  # transient failures, fewer than the attempts

    loops = RunningLoops()
    async with open_runtime(config, serve=False) as rt:
        bridge = RewardBridge(rt, chat)
        scored: dict[str, ScoredTrajectory] = {}
        told: list = []  # what else the trainer is told: a group's end, a member whose reward failed

        async def collect(envelope, ctx) -> None:
            if isinstance(envelope.message, ScoredTrajectory):
                scored.setdefault(envelope.message.trajectory.traj_id, envelope.message)
            else:
                told.append(envelope.message)

        try:
            await loops.start(reward_loops(rt, bridge)[0])
            await loops.start(rt.consumer_loop("collector", ["rewards.results"], collect, dedup=False),
                              wait_assigned=False)
            for t in [trajectories[0], poison, *trajectories[1:], trajectories[3]]:  # w3 twice: a duplicate
                await rt.producer.send_and_wait("trajectories.completed", t, key=t.traj_id)
            ended = GroupEnded(group_id="p0", tag="poison", completed=("p0-t0",))
            await rt.producer.send_and_wait("trajectories.completed", ended, key="p0")
            await eventually(lambda: len(scored) == 6, what="6 scored trajectories")
            dead = await eventually(lambda: _dlq(rt), what="the poison trajectory in the DLQ")
            await eventually(lambda: len(told) == 2, what="the group's end and the failed member passed on")
        finally:
            await loops.stop_all()
            await bridge.close()

    assert {t.traj_id: reward_server.successes[t.traj_id] for t in trajectories} == {t.traj_id: 1 for t in trajectories}
    assert reward_server.calls["w1-t0"] == 2 and reward_server.calls["w2-t0"] == 3, "transient failures retried"
    assert reward_server.calls["p0-t0"] == 3, "a failing endpoint is tried `attempts` times"
    assert {s.reward for s in scored.values()} == {0.5 + 1.0}, "http reward plus the env reward"
    assert all("length" in s.reward_components and s.scorer == "http" for s in scored.values())
    error = dict(dead[0].headers)[H_DLQ_ERROR].decode()
    assert "p0" not in scored and "HTTP 503" in error and "failed 3 times" in error
    failed = next(m for m in told if isinstance(m, Abort))
    assert (failed.traj_id, failed.group_id, failed.reason) == ("p0-t0", "p0", "reward_failed")
    assert ended in told, "GroupEnded reaches the trainer unchanged"


async def _dlq(rt):
    records = [r async for r in read_to_end(rt.config, rt.endpoints, f"{rt.config.job}.trajectories.completed.dlq")]
    return records or None


async def test_missing_token_and_4xx_fail_without_retrying(reward_server, monkeypatch):
    monkeypatch.delenv("TEST_REWARD_TOKEN", raising=False)
    client = HttpRewardClient(HttpReward(**_spec(reward_server.url)))
    with pytest.raises(Exception, match="TEST_REWARD_TOKEN"):
        await client.score({"traj_id": "x", "tag": "web", "text": ""})
    monkeypatch.setenv("TEST_REWARD_TOKEN", "wrong")
    with pytest.raises(Exception, match="HTTP 401"):
        await client.score({"traj_id": "x", "tag": "web", "text": ""})
    assert reward_server.calls["x"] == 0 and client.calls == 1, "a 401 is not retried"
    await client.close()


def test_plain_http_to_a_remote_host_is_refused():
    with pytest.raises(ValueError, match="refusing plain HTTP"):
        check_url(HttpReward(url="http://reward.example.com/score"))
    assert check_url(HttpReward(url="http://reward.example.com/s", allow_insecure_remote=True))
    assert check_url(HttpReward(url="https://reward.example.com/score"))
    assert check_url(HttpReward(url="http://localhost:8000/score"))
