"""``rollart bench elastic``: one training job whose rollout members grow and shrink while it runs.

One `rollart run` (the soak's job: the feeder never runs dry) goes through phases of env and
generation members, ``1x1,2x2,1x1`` by default (env x generation per pool), each ``phase_s`` long
from the first trained step, scaled by the same requests `rollart scale` sends. Per phase: the
trajectories trained per minute (the trainer's record) and per rollout member, after ``settle_s``
(a new engine loads, groups rebalance). The figure: the widest phase's throughput over the first's.
More members only pay while the machine has free cores: on 2 cores a second engine takes the same
cores as the first, so the ratio says how much headroom rollout had, not how far rollart scales.
"""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path
from typing import Any

import yaml

from rollart.config import RollartConfig, load_config
from rollart.endpoints import Endpoints
from rollart.job.scale import ScaleRequest, request_scale
from rollart.local.stack import STACK_FILE, StackState
from rollart.state import connect_redis
from rollart.training.checkpoint import CheckpointStore


def parse_phases(spec: str) -> list[tuple[int, int]]:
    """``"1x1,2x2,1x1"`` → [(env members, generation members per pool), ...]."""
    try:
        phases = [tuple(int(n) for n in part.split("x")) for part in spec.split(",")]
    except ValueError:
        phases = []
    if not phases or any(len(p) != 2 or min(p) < 1 for p in phases):
        raise ValueError(f"--phases {spec!r}: want ENVxGEN[,ENVxGEN...] with members >= 1, e.g. 1x1,2x2,1x1")
    return [(p[0], p[1]) for p in phases]


def phase_rows(record: list[dict], phases: list[tuple[int, int]], started: float, phase_s: float,
               settle_s: float, pools: int) -> list[dict[str, Any]]:
    """Trajectories trained per minute in each phase's window after its settling time."""
    steps = [r for r in record if "event" not in r]
    rows = []
    for i, (env, gen) in enumerate(phases):
        begin, end = started + i * phase_s + settle_s, started + (i + 1) * phase_s
        trained = sum(len(r.get("traj_ids", ())) for r in steps if begin <= r["time"] < end)
        per_min = 60 * trained / (end - begin)
        members = env + gen * pools
        rows.append({"phase": i + 1, "env": env, "generation": gen, "trained": trained,
                     "trajectories_per_min": round(per_min, 1),
                     "per_member_per_min": round(per_min / members, 1), "window_s": round(end - begin)})
    return rows


async def _scale_through(config: RollartConfig, out: Path, phases: list[tuple[int, int]], phase_s: float,
                         first_step: asyncio.Event) -> float:
    """Send each phase's requests at its start; returns when the first phase began (Unix time)."""
    await first_step.wait()
    started = time.time()
    job = json.loads((out / "run.json").read_text())["job"]
    state = StackState.read(out / "stack" / STACK_FILE)
    redis = connect_redis(Endpoints(state.kafka_bootstrap, state.redis_url, "the run's stack"))
    cfg = config.with_updates("bench elastic", job=job)
    try:
        for i, (env, gen) in enumerate(phases):
            await request_scale(redis, cfg, ScaleRequest("env", env))
            for pool in cfg.pools:
                await request_scale(redis, cfg, ScaleRequest("generation", gen, pool))
            await asyncio.sleep(max(0.0, started + (i + 1) * phase_s - time.time()))
    finally:
        await redis.aclose()
    return started


async def bench_elastic(config: RollartConfig, work: Path, *, job_path: Path | None = None,
                        phases: str = "1x1,2x2,1x1", phase_s: float = 150.0, settle_s: float = 45.0) -> dict[str, Any]:
    from rollart.chaos.soak import soak_job
    from rollart.job.run import RunOptions, run_job

    plan = parse_phases(phases)
    if not 0 <= settle_s < phase_s:
        raise ValueError(f"--settle ({settle_s:.0f}s) must be shorter than a phase ({phase_s:.0f}s)")
    base = yaml.safe_load(job_path.read_text()) if job_path else {}
    path = work / "elastic-job.yaml"
    path.write_text(yaml.safe_dump(soak_job(base)))
    job_config = load_config(path)
    out = work / "run"
    first_step = asyncio.Event()
    scaling = asyncio.create_task(_scale_through(job_config, out, plan, phase_s, first_step))
    try:
        await run_job(path, job_config, RunOptions(
            steps=10**6, out=out, duration_s=len(plan) * phase_s, timeout_s=len(plan) * phase_s + 1800,
            env_members=plan[0][0], gen_members=plan[0][1], progress=lambda row: first_step.set()))
        started = await scaling
    finally:
        scaling.cancel()
    rows = phase_rows(CheckpointStore(out / "checkpoints").read_record(), plan, started, phase_s, settle_s,
                      len(job_config.pools))
    widest = max(rows, key=lambda r: r["env"] + r["generation"])
    retired = json.loads((out / "retired.json").read_text()) if (out / "retired.json").exists() else {}
    return {"benchmark": "elastic", "rows": rows, "phase_s": phase_s, "settle_s": settle_s,
            "speedup": round(widest["trajectories_per_min"] / max(rows[0]["trajectories_per_min"], 1e-9), 3),
            "retired": retired}
