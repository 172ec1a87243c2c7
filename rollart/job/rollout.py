"""``rollart rollout``: start the stack and every stage as processes, collect N scored trajectories.

The run gets its own job name (``<job>-<run id>``), so its topics and state never mix with an
earlier run's. The run observer (:mod:`rollart.local.observer`) consumes ``rewards.results`` (scored
trajectories, de-duplicated by id) and ``trajectories.completed`` (aborts with reasons) until N
trajectories are scored, then the stages are stopped with SIGTERM and ``summary.json`` is written.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import time
import uuid
from pathlib import Path

from rollart.config import RollartConfig
from rollart.local.endpoints import job_endpoints, run_config, stage_logins
from rollart.local.observer import RunObserver, observing
from rollart.local.processes import StageProcesses
from rollart.local.supervision import schedule_stack, stage_scheduling, start_stages
from rollart.models.tiny import ensure_model
from rollart.stages.registry import ROLLOUT_COLLECTOR
from rollart.topics.admin import apply_topics
from rollart.names import REWARDS_RESULTS, TRAJECTORIES_COMPLETED
from rollart.timeouts import wait_for


async def collect(config: RollartConfig, target: int, procs: StageProcesses, timeout_s: float) -> RunObserver:
    collector = RunObserver(target, config.tag_shares(target))
    async with observing(config, collector, ROLLOUT_COLLECTOR, [REWARDS_RESULTS, TRAJECTORIES_COMPLETED],
                         required=True):
        deadline = time.monotonic() + timeout_s
        while not collector.done.is_set():
            failed = procs.failed()
            if failed:
                raise RuntimeError(f"stage(s) {failed} failed; last log lines:\n" + procs.tail(failed[0]))
            if time.monotonic() > deadline:
                raise TimeoutError(f"collected {len(collector.scored)} of {target} trajectories in {timeout_s}s "
                                   f"(per tag {dict(collector.per_tag)}, shares {collector.shares})")
            with contextlib.suppress(asyncio.TimeoutError):
                await wait_for(collector.done.wait(), 0.5)
    return collector


async def rollout(config_path: Path, config: RollartConfig, *, trajectories: int, out: Path,
                  timeout_s: float = 900.0, env_members: int = 1, gen_members: int = 1, secure: bool = False) -> dict:
    """``secure``: on the run's own SASL_SSL Kafka, each stage logged in as its own ACL'd user."""
    from rollart.stages.feeder import sources_from
    from rollart.stages.reward import check_rewards

    check_rewards(config)  # a reward or dataset that cannot load fails here, naming its tag
    sources_from(config)
    stage_scheduling(config)
    out.mkdir(parents=True, exist_ok=True)
    ensure_model(config.model)  # once, before the stages race to create it
    # tags are drawn at random by weight: room for the rarest tag to reach its share (the collector stops
    # the rollout once every tag has it, so the slack is rarely released)
    groups = 3 * math.ceil(trajectories / config.feeder.group_size) + 2 * env_members * config.env.max_groups
    with job_endpoints(config, out / "stack", secure=secure) as endpoints:
        job = f"{config.job}-{uuid.uuid4().hex[:6]}"
        cfg = run_config(config, endpoints, job)
        schedule_stack(cfg, out / "stack")
        await apply_topics(cfg, endpoints)
        procs = StageProcesses(config_path, endpoints, job, out / "logs",
                               extra_env={"ROLLART_FEEDER_ALPHA": "null", "ROLLART_FEEDER_MAX_GROUPS": str(groups)},
                               stage_env=await stage_logins(cfg, endpoints), scheduling=stage_scheduling(cfg))
        started = time.monotonic()
        try:
            start_stages(procs, cfg, {"generation": gen_members, "env": env_members}, training=False)
            collector = await collect(cfg, trajectories, procs, timeout_s)
        finally:
            exit_codes = procs.stop_all()
        summary = {"job": job, **collector.scored_summary(time.monotonic() - started), "exit_codes": exit_codes,
                   "stage_users": sorted(env["ROLLART_KAFKA_SASL_USERNAME"] for env in procs.stage_env.values())}
    (out / "summary.json").write_text(json.dumps(summary, indent=2))
    return summary
