"""An in-process rollout: one real vLLM engine (CPU) shared by the session, real broker and Redis.

``RolloutHarness`` wires the same stage objects the consumer processes run (generation stages per
pool, the env manager's two loops, the reward bridge) into one event loop, so tests can submit task
groups and watch every outcome on the topics.
"""

from __future__ import annotations

import time
from collections import defaultdict
from typing import Any

import pytest

from rollart.config import GenerationConfig
from rollart.messages import Abort, CompletedTrajectory, ScoredTrajectory, TaskSpec
from rollart.runtime import open_runtime
from rollart.stages.env import EnvManager, env_loops
from rollart.stages.generation import GenerationStage, generation_loop
from rollart.stages.reward import RewardBridge, reward_loops
from rollart.topics import expand_catalog
from rollart.topics.admin import apply_topics
from tests.conftest import RunningLoops, eventually, make_config


@pytest.fixture(scope="session")
async def engine(tiny_model):
    from rollart.engines.vllm_engine import VLLMEngine

    engine = VLLMEngine(tiny_model, GenerationConfig(max_concurrency=64, max_model_len=2048))
    await engine.start()
    yield engine
    engine.shutdown()


class RolloutHarness:
    def __init__(self, config, runtime, engine, chat):
        self.config = config
        self.rt = runtime
        self.engine = engine
        self.chat = chat
        self.loops = RunningLoops()
        self.generation: dict[str, Any] = {}
        self.completed: dict[str, CompletedTrajectory] = {}
        self.completed_at: dict[str, float] = {}
        self.aborted: dict[str, Abort] = {}
        self.scored: dict[str, ScoredTrajectory] = {}
        self.manager = EnvManager(runtime, chat, "env-test")

    async def start(self, pools: list[str]) -> None:
        for pool in pools:
            await self.start_pool(pool)
        tasks, actions = env_loops(self.rt, self.manager)
        await self.loops.start(actions)
        await self.loops.start(tasks, wait_assigned=False)
        scoring, verdicts = reward_loops(self.rt, RewardBridge(self.rt, self.chat))
        if verdicts is not None:
            await self.loops.start(verdicts)
        await self.loops.start(scoring, wait_assigned=False)
        await self.loops.start(self.rt.consumer_loop("observer", ["trajectories.completed", "rewards.results"],
                                                     self._observe, ordering="none", dedup=False),
                               wait_assigned=False)

    async def start_pool(self, pool: str) -> None:
        stage = GenerationStage(self.rt, self.engine, pool, f"gen-{pool}-test")
        membership = stage.membership()
        await membership.__aenter__()
        loop = await self.loops.start(generation_loop(self.rt, stage), wait_assigned=False)
        self.generation[pool] = (loop, membership)

    async def stop_pool(self, pool: str) -> None:
        loop, membership = self.generation.pop(pool)
        await self.loops.stop(loop)
        await membership.__aexit__(None, None, None)

    async def _observe(self, envelope, ctx) -> None:
        message = envelope.message
        if isinstance(message, CompletedTrajectory):
            self.completed.setdefault(message.traj_id, message)
            self.completed_at.setdefault(message.traj_id, time.monotonic())
        elif isinstance(message, Abort):
            self.aborted.setdefault(message.traj_id, message)
        elif isinstance(message, ScoredTrajectory):
            self.scored.setdefault(message.trajectory.traj_id, message)

    async def submit(self, group_id: str, tag: str, *, group_size: int = 2, redundancy: int = 0, seed: int = 0,
                     prompt: str = "", labels: dict | None = None) -> TaskSpec:
        spec = self.config.tags[tag]
        task = TaskSpec(group_id=group_id, env=spec.env, tag=tag, group_size=group_size, redundancy=redundancy,
                        seed=seed, prompt=prompt, labels=labels or {}, created_at=time.time())
        await self.rt.producer.send_and_wait("tasks", task, key=group_id)
        return task

    def ended(self, group_id: str) -> dict[str, list[str]]:
        out = defaultdict(list)
        for traj_id in self.completed:
            if traj_id.startswith(group_id + "-"):
                out["completed"].append(traj_id)
        for traj_id in self.aborted:
            if traj_id.startswith(group_id + "-"):
                out["aborted"].append(traj_id)
        return out

    async def wait_groups(self, groups: dict[str, int], timeout: float = 120.0) -> None:
        """Wait until every group has had ``n`` trajectories end (completed or aborted)."""
        await eventually(lambda: all(sum(map(len, self.ended(g).values())) >= n for g, n in groups.items()),
                         timeout=timeout, what=f"groups {sorted(groups)} to end")


@pytest.fixture
async def harness(endpoints, engine, chat, tiny_model, request):
    marker = request.node.get_closest_marker("rollout")
    options = dict(marker.kwargs) if marker else {}
    pools = options.pop("pools", ["p1"])
    started_pools = options.pop("start_pools", pools)
    config = make_config(endpoints, pools=pools, model={"path": str(tiny_model), "init_tiny": False},
                         generation={"heartbeat_ttl_s": 1.0}, routing={"live_check_interval_s": 0.2},
                         feeder={"alpha": None}, **options)
    await apply_topics(config, endpoints, expand_catalog(config))
    async with open_runtime(config, serve=False) as rt:
        harness = RolloutHarness(config, rt, engine, chat)
        await harness.start(started_pools)
        yield harness
        for pool in list(harness.generation):
            await harness.stop_pool(pool)
        await harness.loops.stop_all()
