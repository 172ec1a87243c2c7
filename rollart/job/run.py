"""``rollart run CONFIG``: a whole training job on this machine, every stage its own process.

The local stack (broker, Redis, Mooncake store) is started for the run unless endpoints are
configured; the job gets a fresh name (its topics and state never mix with an earlier run's);
generation consumers, env consumers, the reward stage, the trainer, the eval stage (with ``eval:``)
and the feeder start as processes. The runner supervises them as Kubernetes would: a stage that dies is restarted (the
trainer with ``--resume``, from its last checkpoint). The run observer counts completed and aborted
trajectories; live progress comes from the trainer's record. The machinery (the stack, the stage
processes, their supervision, the observer) is :mod:`rollart.local`'s; this module is the job's plan. When the trainer has done the asked
number of steps (and the last due version is evaluated), the stages are stopped and ``report.json`` /
``report.png`` are written.
"""

from __future__ import annotations

import asyncio
import json
import logging
import shutil
import time
import uuid
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from redis.exceptions import RedisError

from rollart.config import ConfigError, RollartConfig
from rollart.evaluation.tasks import eval_sources, latest_due
from rollart.job.scale import Scaler
from rollart.job.report import build_report, eval_record, read_evals, write_report
from rollart.local.endpoints import job_endpoints, run_config
from rollart.local.observer import RunObserver, observing
from rollart.local.processes import StageProcesses, write_prometheus_config
from rollart.local.supervision import (schedule_stack, settle_startups, shared_machine_threads, stage_scheduling,
                                      start_stages, supervise, write_pids)
from rollart.models.tiny import ensure_model
from rollart.runtime import open_runtime
from rollart.stages.feeder import sources_from
from rollart.stages.registry import RUN_MONITOR
from rollart.stages.reward import check_rewards
from rollart.stages.trainer import trainer_alpha
from rollart.topics.admin import apply_topics
from rollart.training.checkpoint import CheckpointStore
from rollart.weights.follower import loads_key
from rollart.names import REWARDS_RESULTS, TRAJECTORIES_COMPLETED

log = logging.getLogger(__name__)


@dataclass
class RunOptions:
    steps: int
    out: Path
    resume: bool = False
    timeout_s: float = 3600.0
    # Stop this long after the first trained step, however many steps (a soak holds a steady stream:
    # start-up, slow on a loaded machine, does not eat into it); None: run the steps.
    duration_s: float | None = None
    env_members: int = 1
    gen_members: int = 1
    max_restarts: int = 5
    progress: Callable[[dict], None] | None = None
    cpu_affinity: dict[str, tuple[int, ...]] = field(default_factory=dict)  # stage -> CPUs (benchmarks)


def _job_name(config: RollartConfig, opts: RunOptions) -> str:
    state = opts.out / "run.json"
    if opts.resume:
        try:
            return json.loads(state.read_text())["job"]
        except (OSError, ValueError, KeyError):
            raise ConfigError(f"--resume: {state} does not name a run to continue") from None
    return f"{config.job}-{uuid.uuid4().hex[:6]}"


async def run_job(config_path: Path, config: RollartConfig, opts: RunOptions) -> dict:
    alpha = trainer_alpha(config)
    check_rewards(config)  # a reward or dataset that cannot load fails here, naming its tag, not in a stage
    sources_from(config)
    eval_sources(config)
    stage_scheduling(config)  # a stage it does not know fails here, not once the stack is up
    out = opts.out
    out.mkdir(parents=True, exist_ok=True)
    job = _job_name(config, opts)
    checkpoints = CheckpointStore(out / "checkpoints")
    if not opts.resume:
        shutil.rmtree(checkpoints.root, ignore_errors=True)
        eval_record(out).unlink(missing_ok=True)
    (out / "run.json").write_text(json.dumps({"job": job, "config": str(config_path), "steps": opts.steps,
                                              "alpha": alpha, "started_at": time.time()}))
    await asyncio.to_thread(ensure_model, config.model)  # once (with its warm start), before the stages race
    monitor, restarts = RunObserver(), Counter()
    try:
        loads = await _run_on_stack(config_path, config, job, opts, checkpoints, monitor, restarts)
    except BaseException:  # Ctrl-C, SIGTERM or a failure, the stack down by now: a report of what was trained
        _write_interrupted_report(job, alpha, checkpoints, monitor, restarts, out)
        raise
    report = build_report(job=job, alpha=alpha, record=checkpoints.read_record(), loads=loads,
                          monitor=monitor.summary(), started_at=monitor.started_at, finished_at=time.time(),
                          restarts=dict(restarts), evals=read_evals(out))
    write_report(report, out)
    return report


async def _run_on_stack(config_path: Path, config: RollartConfig, job: str, opts: RunOptions,
                        checkpoints: CheckpointStore, monitor: RunObserver, restarts: Counter) -> list[dict]:
    """The stack and every stage, followed until the steps are trained, then stopped; the weight loads."""
    with job_endpoints(config, opts.out / "stack", mooncake=None) as endpoints:
        cfg = run_config(config, endpoints, job)
        schedule_stack(cfg, opts.out / "stack")
        await apply_topics(cfg, endpoints)
        procs = StageProcesses(config_path, endpoints, job, opts.out / "logs", extra_env={
            "ROLLART_TRAINER_CHECKPOINT_DIR": str(checkpoints.root),
            "ROLLART_TRAINER_MAX_STEPS": str(opts.steps),
            "ROLLART_WEIGHTS_FS_ROOT": str(opts.out / "weights"),
            **({"ROLLART_EVAL_RECORD": str(eval_record(opts.out))} if config.eval is not None else {}),
            **shared_machine_threads(config),
        }, metrics_targets=write_prometheus_config(opts.out / "prometheus"), cpu_affinity=dict(opts.cpu_affinity),
           scheduling=stage_scheduling(cfg))
        monitor.started_at = time.time()
        try:
            start_stages(procs, cfg, {"generation": opts.gen_members, "env": opts.env_members}, training=True,
                         resume=opts.resume)
            await _follow(cfg, procs, monitor, checkpoints, restarts, opts)
        finally:
            procs.stop_all()
        return await _weight_loads(cfg)


def _write_interrupted_report(job: str, alpha: int, checkpoints: CheckpointStore, monitor: RunObserver,
                              restarts: Counter, out: Path) -> None:
    """The report of an interrupted run (no weight-load figures: the stack is going down); a failure
    to write it is logged, never raised over the interruption itself."""
    try:
        report = build_report(job=job, alpha=alpha, record=checkpoints.read_record(), loads=[],
                              monitor=monitor.summary(), started_at=monitor.started_at or time.time(),
                              finished_at=time.time(), restarts=dict(restarts), interrupted=True,
                              evals=read_evals(out))
        write_report(report, out)
    except Exception:  # noqa: BLE001
        log.exception("could not write the interrupted run's report to %s", out)


async def _follow(cfg: RollartConfig, procs: StageProcesses, monitor: RunObserver, checkpoints: CheckpointStore,
                  restarts: Counter, opts: RunOptions) -> None:
    async with observing(cfg, monitor, RUN_MONITOR, [TRAJECTORIES_COMPLETED, REWARDS_RESULTS], required=False,
                         bulk=True) as rt:
        deadline = time.monotonic() + opts.timeout_s
        shown, streaming_since = 0, None
        scaler = Scaler(cfg, procs)
        record = checkpoints.follow()
        while True:
            record.poll()
            rows = [r for r in record.rows if "event" not in r]
            for row in rows[shown:]:
                if opts.progress is not None:
                    opts.progress({**row, "target": opts.steps, **monitor.summary()})
            shown = len(rows)
            trainer = procs.stages["trainer"]
            if not trainer.alive() and trainer.proc.returncode == 0 and shown >= opts.steps:
                await _last_evaluation(cfg, opts, procs, restarts)
                return
            if shown and streaming_since is None:
                streaming_since = time.monotonic()
            if opts.duration_s is not None and streaming_since is not None \
                    and time.monotonic() - streaming_since > opts.duration_s:
                return
            await _scale(scaler, rt.redis, opts.out / "retired.json")
            supervise(procs, restarts, opts.max_restarts)
            settle_startups(procs)
            write_pids(procs, opts.out / "pids.json")
            if time.monotonic() > deadline:
                raise TimeoutError(f"{shown} of {opts.steps} steps in {opts.timeout_s:.0f}s")
            await asyncio.sleep(0.5)


async def _last_evaluation(cfg: RollartConfig, opts: RunOptions, procs: StageProcesses, restarts: Counter) -> None:
    """The steps are trained: wait (up to ``eval.timeout_s``) for the evaluation of the last due version."""
    if cfg.eval is None:
        return
    last = latest_due(cfg, opts.steps)  # the trainer publishes a version per step
    deadline = time.monotonic() + cfg.eval.timeout_s
    while last is not None and time.monotonic() < deadline:
        if any(row["version"] >= last for row in read_evals(opts.out)):
            return
        supervise(procs, restarts, opts.max_restarts)
        await asyncio.sleep(0.5)
    log.warning("the evaluation of version %s was not over %.0fs after the last step", last, cfg.eval.timeout_s)


async def _scale(scaler: Scaler, redis, retired_file: Path) -> None:
    """Apply `rollart scale` requests; members scaled away and their exit codes go to ``retired_file``
    (0: the member drained and left its groups)."""
    known = len(scaler.retired)
    try:
        await scaler.reconcile(redis)
    except RedisError as exc:  # Redis down or flushed mid-read: the next round retries
        log.warning("scale requests unreadable (%s); keeping the members as they are", exc)
    if len(scaler.retired) != known:
        retired_file.write_text(json.dumps(scaler.retired))


async def _weight_loads(cfg: RollartConfig) -> list[dict]:
    async with open_runtime(cfg, client_id="run-report", serve=False) as rt:
        raw = await rt.redis.lrange(loads_key(cfg.redis.key_prefix, cfg.job), 0, -1)
    return [json.loads(x) for x in raw]
