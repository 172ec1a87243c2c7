"""An in-process rollout for benchmarks and tests: the stage objects the consumer processes run
(generation stages per pool, the env manager's two loops, the reward bridge) wired into one event
loop around one engine, so a caller can submit task groups and watch every outcome on the topics.
Same code paths as the processes; the engine loads once for many runs.
"""

from __future__ import annotations

import asyncio
import time
from collections import defaultdict
from typing import Any

from rollart.messages import Abort, CompletedTrajectory, ScoredTrajectory, TaskSpec
from rollart.stages.env import EnvManager, env_loops
from rollart.stages.generation import GenerationStage, generation_loop
from rollart.stages.reward import RewardBridge, reward_loops
from rollart.names import REWARDS_RESULTS, TASKS, TRAJECTORIES_COMPLETED


async def eventually(predicate, timeout: float = 30.0, interval: float = 0.05, what: str = "condition"):
    """Wait until ``predicate()`` (sync or async) is truthy; fail with ``what`` after ``timeout``."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if asyncio.iscoroutine(value):
            value = await value
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        await asyncio.sleep(interval)


class RunningLoops:
    """Start consumer loops as tasks; stop them all at teardown."""

    def __init__(self) -> None:
        self.tasks: dict[Any, asyncio.Task] = {}

    async def start(self, loop, *, wait_assigned: bool = True):
        self.tasks[loop] = asyncio.create_task(loop.run())
        await asyncio.wait({self.tasks[loop], asyncio.create_task(loop.wait_started())},
                           return_when=asyncio.FIRST_COMPLETED)
        if wait_assigned:
            await eventually(lambda: loop.assignment or self.tasks[loop].done(), what="a partition assignment")
        return loop

    async def stop(self, loop) -> None:
        loop.stop()
        await self.tasks.pop(loop)

    async def stop_all(self) -> None:
        for loop in list(self.tasks):
            loop.stop()
        results = await asyncio.gather(*self.tasks.values(), return_exceptions=True)
        self.tasks.clear()
        return results


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
        self.manager = EnvManager(runtime, chat, "env-harness")

    async def start(self, pools: list[str], *, env: bool = True) -> None:
        """Generation per pool, the reward bridge and an observer; the env stage too unless ``env``
        is False (it then runs elsewhere, e.g. as its own process). Returns when every loop holds its
        partitions; the groups join at once (each join waits out the broker's initial rebalance delay,
        ~3 s: one after the other they took 15 s)."""
        loops = [self.rt.consumer_loop("observer", [TRAJECTORIES_COMPLETED, REWARDS_RESULTS], self._observe,
                                       ordering="none", dedup=False)]
        if env:
            loops += env_loops(self.rt, self.manager)
        loops += [loop for loop in reward_loops(self.rt, RewardBridge(self.rt, self.chat)) if loop is not None]
        await asyncio.gather(*(self.start_pool(pool) for pool in pools),
                             *(self.loops.start(loop, wait_assigned=False) for loop in loops))
        await self.ready()

    async def ready(self, timeout: float = 60.0) -> None:
        """Every loop holds partitions: work submitted now starts at once (not after a group join)."""
        await eventually(lambda: all(loop.assignment for loop in self.loops.tasks), timeout=timeout,
                         what="every loop's partition assignment")

    async def start_pool(self, pool: str) -> None:
        """A generation member of ``pool``: its bus loop, and its direct server under
        ``generation.transport: direct``; in the pool registry while it runs."""
        stage = GenerationStage(self.rt, self.engine, pool, f"gen-{pool}-test")
        direct = stage.direct_server() if self.config.generation.transport == "direct" else None
        serving = asyncio.create_task(direct.run()) if direct is not None else None
        if direct is not None and pool == self.config.env.colocate_pool and self.manager.direct is not None:
            self.manager.direct.serve_here(direct)  # as rollart.stages.envgen composes them
        membership = stage.membership()
        await membership.__aenter__()
        loop = await self.loops.start(generation_loop(self.rt, stage), wait_assigned=False)
        self.generation[pool] = (loop, membership, direct, serving)

    async def stop_pool(self, pool: str) -> None:
        loop, membership, direct, serving = self.generation.pop(pool)
        await self.loops.stop(loop)
        if direct is not None:
            direct.stop()
            await serving
        await membership.__aexit__(None, None, None)

    async def close(self) -> None:
        """Stop every pool and loop; close the env manager's direct client."""
        for pool in list(self.generation):
            await self.stop_pool(pool)
        await self.loops.stop_all()
        await self.manager.close()

    async def _observe(self, envelope, ctx) -> None:
        message = envelope.message
        if isinstance(message, CompletedTrajectory):
            self._completed(message)
        elif isinstance(message, Abort):
            self.aborted.setdefault(message.traj_id, message)
        elif isinstance(message, ScoredTrajectory):
            self._completed(message.trajectory)  # scored by its env member: on no other topic
            self.scored.setdefault(message.trajectory.traj_id, message)

    def _completed(self, trajectory: CompletedTrajectory) -> None:
        self.completed.setdefault(trajectory.traj_id, trajectory)
        self.completed_at.setdefault(trajectory.traj_id, time.monotonic())

    async def submit(self, group_id: str, tag: str, *, group_size: int = 2, redundancy: int = 0, seed: int = 0,
                     prompt: str = "", labels: dict | None = None) -> TaskSpec:
        spec = self.config.tags[tag]
        task = TaskSpec(group_id=group_id, env=spec.env, tag=tag, group_size=group_size, redundancy=redundancy,
                        seed=seed, prompt=prompt, labels=labels or {}, created_at=time.time())
        await self.rt.producer.send_and_wait(TASKS, task, key=group_id)
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
