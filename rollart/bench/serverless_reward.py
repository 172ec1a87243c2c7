"""``rollart bench serverless-reward``: rewards on a dedicated worker vs the HTTP function bridge,
under bursty completions.

Completed trajectories arrive in bursts (``burst`` at once, every ``gap_s``), as they do when many
groups finish together. The reward stage (the real bridge and consumer loop) scores each over HTTP
against a local reward service whose calls take ``service_s``:

* dedicated: one always-on worker with ``slots`` parallel slots (a reward model on its own GPU);
  calls beyond the slots queue;
* serverless: a function platform that runs each call in an instance of its own, starting a new
  instance (``cold_start_s``) when all warm ones are busy; instances stay warm between bursts.

Rollout time is each burst's makespan (first completion produced to last score on
``rewards.results``); utilisation is busy slot-seconds over provisioned slot-seconds (serverless is
billed per call, so its provisioned time is its busy time plus cold starts).
"""

from __future__ import annotations

import asyncio
import statistics
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from aiohttp import web

from rollart.config import RollartConfig, build_config
from rollart.local.http_server import serve_post
from rollart.messages import ScoredTrajectory
from rollart.messages.samples import sample_trajectory
from rollart.names import REWARDS_RESULTS, TRAJECTORIES_COMPLETED


@dataclass
class RewardService:
    """A local reward endpoint; ``slots`` None: serverless (an instance per concurrent call)."""

    service_s: float
    slots: int | None
    cold_start_s: float = 0.0
    busy_s: float = 0.0
    cold_starts: int = 0
    peak_instances: int = 0

    def __post_init__(self) -> None:
        self._slots = asyncio.Semaphore(self.slots) if self.slots else None
        self._warm = 0  # serverless: idle warm instances
        self._active = 0

    async def score(self, request: web.Request) -> web.Response:
        body = await request.json()
        if self._slots is not None:
            async with self._slots:
                await self._work()
        else:
            if self._warm > 0:
                self._warm -= 1
            else:
                self.cold_starts += 1
                await asyncio.sleep(self.cold_start_s)
            self._active += 1
            self.peak_instances = max(self.peak_instances, self._active + self._warm)
            try:
                await self._work()
            finally:
                self._active -= 1
                self._warm += 1
        return web.json_response({"reward": float(len(body["text"]) % 7) / 7})

    async def _work(self) -> None:
        started = time.perf_counter()
        await asyncio.sleep(self.service_s)
        self.busy_s += time.perf_counter() - started


async def _run_mode(base: RollartConfig, endpoints, chat, service: RewardService, *, bursts: int, burst: int,
                    gap_s: float) -> dict[str, Any]:
    from rollart.bench.harness import RunningLoops, eventually
    from rollart.runtime import open_runtime
    from rollart.stages.reward import RewardBridge, reward_loops
    from rollart.topics import expand_catalog
    from rollart.topics.admin import apply_topics

    runner, url = await serve_post(service.score)
    job = f"bench-reward-{'dedicated' if service.slots else 'serverless'}-{int(time.time() * 1000) % 10**8}"
    config = build_config({**base.model_dump(mode="json", exclude_none=True, exclude={"deploy"}), "job": job,
                           "kafka": {"bootstrap": endpoints.kafka_bootstrap}, "redis": {"url": endpoints.redis_url},
                           "bus": {"fetch_max_wait_ms": 5, "max_in_flight": 1024},
                           "tags": {"work": {"env": "frozenlake", "reward": {"type": "http", "url": url,
                                                                            "concurrency": 256, "timeout_s": 60}}}})
    await apply_topics(config, endpoints, expand_catalog(config))
    scored_at: dict[str, float] = {}

    async def observe(envelope, ctx) -> None:
        if isinstance(envelope.message, ScoredTrajectory):
            scored_at.setdefault(envelope.message.trajectory.traj_id, time.monotonic())

    loops = RunningLoops()
    makespans, latencies = [], []
    async with open_runtime(config, serve=False) as rt:
        bridge = RewardBridge(rt, chat)
        scoring, _ = reward_loops(rt, bridge)
        await loops.start(scoring)
        await loops.start(rt.consumer_loop("observer", [REWARDS_RESULTS], observe, ordering="none", dedup=False))
        started = time.monotonic()
        try:
            for b in range(bursts):
                burst_start = time.monotonic()
                ids = [f"b{b}t{i}" for i in range(burst)]
                sent = {}
                for traj_id in ids:
                    message = replace(sample_trajectory(traj_id=traj_id), tag="work", group_id=f"b{b}")
                    await rt.producer.send(TRAJECTORIES_COMPLETED, message, key=traj_id)
                    sent[traj_id] = time.monotonic()
                await eventually(lambda ids=ids: all(t in scored_at for t in ids), timeout=120, what=f"burst {b} scored")
                makespans.append(max(scored_at[t] for t in ids) - burst_start)
                latencies.extend(scored_at[t] - sent[t] for t in ids)
                await asyncio.sleep(max(0.0, burst_start + gap_s - time.monotonic()))
            wall = time.monotonic() - started
        finally:
            await loops.stop_all()
            await bridge.close()
            await runner.cleanup()
    provisioned = (service.slots * wall) if service.slots else (service.busy_s + service.cold_starts * service.cold_start_s)
    latencies.sort()
    return {"mode": "dedicated" if service.slots else "serverless",
            "capacity": f"{service.slots} slots" if service.slots else f"peak {service.peak_instances} instances",
            "burst_makespan_s": statistics.mean(makespans), "reward_latency_p50_s": latencies[len(latencies) // 2],
            "reward_latency_p99_s": latencies[int(len(latencies) * 0.99) - 1], "utilisation": service.busy_s / provisioned,
            "cold_starts": service.cold_starts, "scored": len(scored_at)}


async def bench_serverless_reward(config: RollartConfig, work_dir: Path, *, bursts: int = 6, burst: int = 64,
                                  gap_s: float = 2.0, service_s: float = 0.05, slots: int = 4,
                                  cold_start_s: float = 0.25) -> dict[str, Any]:
    from rollart.models.tiny import ensure_model
    from rollart.rollout.chat import ChatFormat
    from rollart.local.endpoints import job_endpoints

    chat = ChatFormat.from_pretrained(ensure_model(config.model))
    with job_endpoints(config, work_dir / "stack") as endpoints:
        dedicated = await _run_mode(config, endpoints, chat, RewardService(service_s, slots), bursts=bursts,
                                    burst=burst, gap_s=gap_s)
        serverless = await _run_mode(config, endpoints, chat, RewardService(service_s, None, cold_start_s),
                                     bursts=bursts, burst=burst, gap_s=gap_s)
    return {"benchmark": "serverless-reward", "speedup": dedicated["burst_makespan_s"] / serverless["burst_makespan_s"],
            "setup": {"bursts": bursts, "burst": burst, "gap_s": gap_s, "service_s": service_s, "slots": slots,
                      "cold_start_s": cold_start_s}, "rows": [dedicated, serverless]}
