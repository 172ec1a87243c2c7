"""``rollart run CONFIG``: a whole training job on this machine, every stage its own process.

The local stack (broker, Redis, Mooncake store) is started for the run unless endpoints are
configured; the job gets a fresh name (its topics and state never mix with an earlier run's);
generation consumers, env consumers, the reward stage, the trainer, the eval stage (with ``eval:``)
and the feeder start as processes. The runner supervises them as Kubernetes would: a stage that dies is restarted (the
trainer with ``--resume``, from its last checkpoint). A monitor counts completed and aborted
trajectories; live progress comes from the trainer's record. When the trainer has done the asked
number of steps (and the last due version is evaluated), the stages are stopped and ``report.json`` /
``report.png`` are written.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
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
from rollart.local.processes import StageProcesses
from rollart.messages import Abort, CompletedTrajectory, Envelope
from rollart.models.tiny import ensure_model
from rollart.rollout.runner import job_endpoints, run_config
from rollart.runtime import open_runtime
from rollart.stages.feeder import sources_from
from rollart.stages.registry import RUN_MONITOR, local_processes
from rollart.stages.reward import check_rewards
from rollart.stages.trainer import trainer_alpha
from rollart.topics.admin import apply_topics
from rollart.training.checkpoint import CheckpointStore
from rollart.weights.follower import loads_key
from rollart.names import TRAJECTORIES_COMPLETED

log = logging.getLogger(__name__)


@dataclass
class Monitor:
    """Counts what the env stage reports on ``trajectories.completed`` (first copy of each id)."""

    completed: set[str] = field(default_factory=set)
    aborted: Counter = field(default_factory=Counter)
    aborted_ids: set[str] = field(default_factory=set)
    tokens: int = 0
    started_at: float = 0.0  # when the stages were started (the run's clock)

    async def handle(self, envelope: Envelope, ctx) -> None:
        message = envelope.message
        if isinstance(message, CompletedTrajectory) and message.traj_id not in self.completed:
            self.completed.add(message.traj_id)
            self.tokens += sum(message.loss_mask)
        elif isinstance(message, Abort) and message.traj_id not in self.aborted_ids:
            self.aborted_ids.add(message.traj_id)
            self.aborted[message.reason] += 1

    def summary(self) -> dict:
        return {"completed": len(self.completed), "aborted": dict(self.aborted), "tokens": self.tokens}


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


def start_stages(procs: StageProcesses, cfg: RollartConfig, opts: RunOptions) -> None:
    members = {"generation": opts.gen_members, "env": opts.env_members}
    for name, argv in local_processes(cfg, training=True, members=members, resume=opts.resume):
        procs.start(name, *argv)


def supervise(procs: StageProcesses, restarts: Counter, opts: RunOptions) -> None:
    """Restart stages that died (the trainer from its checkpoint); give up after max_restarts."""
    for name in procs.failed():
        if restarts[name] >= opts.max_restarts:
            raise RuntimeError(f"stage {name} failed {restarts[name] + 1} times; last log lines:\n" + procs.tail(name))
        restarts[name] += 1
        process = procs.stages[name]
        argv = process.argv[process.argv.index("consume") + 1:]
        argv = [a for a in argv if a not in ("--config", str(procs.config_path))]
        if name == "trainer" and "--resume" not in argv:
            argv.append("--resume")
        procs.start(name, *argv)


def shared_machine_threads(config: RollartConfig) -> dict[str, str]:
    """The CPU plan of a run whose stages share one machine: the trainer gets half the cores for
    torch's intra-op threads unless ``trainer.torch_threads`` says otherwise (the engine's worker
    binds its own OpenMP threads and torch on every core competes with it: on 2 cores a 40-step demo
    trained its steps in 2.0-2.1 s with 1 thread against 2.7-2.8 s with 2; over 150 steps the two
    means were the same, within this machine's noise; see the README's CPU plan)."""
    if config.trainer.torch_threads is not None:
        return {}
    return {"ROLLART_TRAINER_TORCH_THREADS": str(max(1, (os.cpu_count() or 2) // 2))}


async def run_job(config_path: Path, config: RollartConfig, opts: RunOptions) -> dict:
    alpha = trainer_alpha(config)
    check_rewards(config)  # a reward or dataset that cannot load fails here, naming its tag, not in a stage
    sources_from(config)
    eval_sources(config)
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
    monitor, restarts = Monitor(), Counter()
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
                        checkpoints: CheckpointStore, monitor: "Monitor", restarts: Counter) -> list[dict]:
    """The stack and every stage, followed until the steps are trained, then stopped; the weight loads."""
    with job_endpoints(config, opts.out / "stack", mooncake=None) as endpoints:
        cfg = run_config(config, endpoints, job)
        await apply_topics(cfg, endpoints)
        procs = StageProcesses(config_path, endpoints, job, opts.out / "logs", extra_env={
            "ROLLART_TRAINER_CHECKPOINT_DIR": str(checkpoints.root),
            "ROLLART_TRAINER_MAX_STEPS": str(opts.steps),
            "ROLLART_WEIGHTS_FS_ROOT": str(opts.out / "weights"),
            **({"ROLLART_EVAL_RECORD": str(eval_record(opts.out))} if config.eval is not None else {}),
            **shared_machine_threads(config),
        }, metrics_targets=write_prometheus_config(opts.out / "prometheus"), cpu_affinity=dict(opts.cpu_affinity))
        monitor.started_at = time.time()
        try:
            start_stages(procs, cfg, opts)
            await _follow(cfg, procs, monitor, checkpoints, restarts, opts)
        finally:
            procs.stop_all()
        return await _weight_loads(cfg)


def _write_interrupted_report(job: str, alpha: int, checkpoints: CheckpointStore, monitor: "Monitor",
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


async def _follow(cfg: RollartConfig, procs: StageProcesses, monitor: Monitor, checkpoints: CheckpointStore,
                  restarts: Counter, opts: RunOptions) -> None:
    async with open_runtime(cfg, client_id=RUN_MONITOR, serve=False) as rt:
        loop = rt.consumer_loop(RUN_MONITOR, [TRAJECTORIES_COMPLETED], monitor.handle, ordering="none",
                                dedup=False)
        runner = asyncio.create_task(loop.run())
        deadline = time.monotonic() + opts.timeout_s
        shown, streaming_since = 0, None
        scaler = Scaler(cfg, procs)
        try:
            while True:
                rows = [r for r in checkpoints.read_record() if "event" not in r]
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
                supervise(procs, restarts, opts)
                _write_pids(procs, opts.out / "pids.json")
                if time.monotonic() > deadline:
                    raise TimeoutError(f"{shown} of {opts.steps} steps in {opts.timeout_s:.0f}s")
                await asyncio.sleep(0.5)
        finally:
            loop.stop()
            with contextlib.suppress(Exception):
                await runner


async def _last_evaluation(cfg: RollartConfig, opts: RunOptions, procs: StageProcesses, restarts: Counter) -> None:
    """The steps are trained: wait (up to ``eval.timeout_s``) for the evaluation of the last due version."""
    if cfg.eval is None:
        return
    last = latest_due(cfg, opts.steps)  # the trainer publishes a version per step
    deadline = time.monotonic() + cfg.eval.timeout_s
    while last is not None and time.monotonic() < deadline:
        if any(row["version"] >= last for row in read_evals(opts.out)):
            return
        supervise(procs, restarts, opts)
        await asyncio.sleep(0.5)
    log.warning("the evaluation of version %s was not over %.0fs after the last step", last, cfg.eval.timeout_s)


def write_prometheus_config(directory: Path, scrape_interval_s: float = 5.0) -> Path:
    """``prometheus.yml`` scraping every stage of the run (``prometheus --config.file DIR/prometheus.yml``);
    returns the targets file the stage runner keeps current."""
    directory.mkdir(parents=True, exist_ok=True)
    config = {"global": {"scrape_interval": f"{scrape_interval_s:g}s", "evaluation_interval": f"{scrape_interval_s:g}s"},
              "scrape_configs": [{"job_name": "rollart", "honor_labels": True,  # keep our `job` label
                                  "file_sd_configs": [{"files": ["targets.json"], "refresh_interval": "5s"}]}]}
    (directory / "prometheus.yml").write_text(json.dumps(config, indent=1))  # JSON is YAML
    return directory / "targets.json"


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


def _write_pids(procs: StageProcesses, path: Path) -> None:
    """Which process is which stage (for operators, and for tests that kill one)."""
    pids = {name: p.proc.pid for name, p in procs.stages.items() if p.alive()}
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(pids))
    tmp.replace(path)


async def _weight_loads(cfg: RollartConfig) -> list[dict]:
    async with open_runtime(cfg, client_id="run-report", serve=False) as rt:
        raw = await rt.redis.lrange(loads_key(cfg.redis.key_prefix, cfg.job), 0, -1)
    return [json.loads(x) for x in raw]
