"""``rollart bench stage-cpu``: where a run's CPU goes, per stage, per trained step and per turn.

The job runs as ``rollart run`` runs it (every stage a supervised process on the run's own local
stack). Every ``sample_s`` the CPU seconds (user + system) of each stage's process tree are read from
``/proc`` (the generation stage's tree holds vLLM's engine core and worker), and so are the stack's
services (the broker's JVM, Redis, Mooncake) and the run's supervisor (this process alone: the stages
are its children). Over the steady steps (after ``skip``, so engine load and warm-up are not counted)
each process's CPU is read off at the first and the last but one step's time (the stages stop after
the last) and divided by the steps, the trajectories and the turns trained between them.

With ``in_process`` the same job also runs as the in-process loop (:mod:`rollart.job.inprocess`: one
process, no bus, generate-then-train) and the same window of steps is measured on its process tree,
split at the end of each step's rollout into its rollout and train phases; the headline is the
pipeline's CPU per trained step over the in-process loop's: what disaggregation costs in CPU, the
figure a 2-core machine's throughput is bound by. In both, a vLLM engine (its core and worker) is
read apart from the process holding it, so the engine's CPU per step compares directly.
"""

from __future__ import annotations

import asyncio
import bisect
import json
import os
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import psutil

from rollart.config import RollartConfig
from rollart.proctree import engine_root_pid, process_table, tree_cpu_s

IN_PROCESS = "in-process loop"
SUPERVISOR = "run supervisor"
ENGINE = " · vLLM engine"  # a process's engine core and worker (and their fork server), apart from it


def engine_split(name: str, pid: int, table: dict[int, list[int]] | None = None) -> dict[str, tuple[int, bool]]:
    """A process that holds a vLLM engine as two targets: the process alone and its engine (core and
    worker, and the fork server they came from), so the engine's CPU compares between the pipeline's
    generation member and the in-process loop. Before the engine core is up, the process alone (its
    counter never includes the engine)."""
    engine = engine_root_pid(pid, table)
    return {name: (pid, False), **({name + ENGINE: (engine, True)} if engine is not None else {})}


def listening_pid(port: int) -> int | None:
    """The process listening on a local TCP port (the machine's own Redis: the stack did not start it)."""
    try:
        conns = psutil.net_connections(kind="tcp")
    except psutil.Error:
        return None
    return next((c.pid for c in conns if c.status == psutil.CONN_LISTEN and c.laddr and c.laddr.port == port
                 and c.pid), None)


def stack_pids(stack_file: Path) -> dict[str, int]:
    """The services of the run's stack, by name (the broker, Redis, Mooncake's master and metadata);
    Redis is found by its port when the stack uses the machine's own."""
    try:
        state = json.loads(stack_file.read_text())
    except (OSError, ValueError):
        return {}
    pids = {"broker": state.get("broker_pid")}
    redis, redis_url = state.get("redis_pid"), state.get("redis_url")
    if redis is None and redis_url:
        from urllib.parse import urlparse

        redis = listening_pid(urlparse(redis_url).port or 6379)
    pids["redis"] = redis
    for i, pid in enumerate(state.get("mooncake_pids") or ()):
        pids[f"mooncake-{i}"] = pid
    return {name: pid for name, pid in pids.items() if pid}


@dataclass
class CpuSeries:
    """One process's cumulative CPU seconds over time; a restart (a new pid) starts a new counter."""

    pid: int
    samples: list[tuple[float, float]] = field(default_factory=list)  # (time.time(), CPU s)
    restarted: bool = False

    def add(self, pid: int, at: float, cpu_s: float) -> None:
        if pid != self.pid:
            self.pid, self.samples, self.restarted = pid, [], True
        if self.samples and cpu_s < self.samples[-1][1]:
            return  # a child exited and took its counter with it (a stage stopping): not a reading
        self.samples.append((at, cpu_s))

    def at(self, when: float) -> float | None:
        """The counter at ``when``, interpolated between the samples around it (None: not covered)."""
        times = [t for t, _ in self.samples]
        i = bisect.bisect_left(times, when)
        if i == 0 or i == len(times):
            return self.samples[0][1] if i == 0 and times and times[0] == when else None
        (t0, c0), (t1, c1) = self.samples[i - 1], self.samples[i]
        return c0 + (c1 - c0) * (when - t0) / (t1 - t0)

    def between(self, start: float, end: float) -> float | None:
        first, last = self.at(start), self.at(end)
        return None if first is None or last is None else last - first


class CpuSampler:
    """Samples each named process tree's CPU seconds every ``sample_s`` until cancelled;
    ``targets(table)`` names the processes anew each time (stages restart, the stack starts late).
    A target that is this process is read without the sampler's own CPU (one pass over /proc per
    sample, ~2-5 ms here: reported apart as ``own_cpu_s``)."""

    def __init__(self, targets: Callable[[dict[int, list[int]]], dict[str, tuple[int, bool]]], sample_s: float):
        self.targets, self.sample_s = targets, sample_s
        self.series: dict[str, CpuSeries] = {}
        self.own_cpu_s = 0.0

    async def run(self) -> None:
        while True:
            await asyncio.to_thread(self.sample)
            await asyncio.sleep(self.sample_s)

    def sample(self) -> float:
        """Read every target once; returns the time of the last reading."""
        started, now, me = time.thread_time(), time.time(), os.getpid()
        table = process_table()
        for name, (pid, children) in self.targets(table).items():
            cpu_s, now = tree_cpu_s(pid, children=children, table=table), time.time()
            if cpu_s is not None:
                self.series.setdefault(name, CpuSeries(pid)).add(pid, now, cpu_s - self.own_cpu_s * (pid == me))
        self.own_cpu_s += time.thread_time() - started
        return now


def pipeline_targets(out: Path):
    from rollart.chaos.inject import stage_pids
    from rollart.stages.registry import STAGES, stage_of_process

    def targets(table: dict[int, list[int]]) -> dict[str, tuple[int, bool]]:
        named: dict[str, tuple[int, bool]] = {}
        for name, pid in stage_pids(out).items():
            stage = STAGES.get(stage_of_process(name))
            named.update(engine_split(name, pid, table) if stage is not None and stage.runs_stage("generation")
                         else {name: (pid, True)})
        named.update({name: (pid, False) for name, pid in stack_pids(out / "stack" / "stack.json").items()})
        named[SUPERVISOR] = (os.getpid(), False)  # the stages are its children: itself only
        return named

    return targets


def steady_window(rows: list[dict], skip: int) -> dict[str, Any]:
    """The steps after the first ``skip`` and before the last (the stages stop after it, so their
    counters may not be read past it): their span and what they trained."""
    rows = sorted((r for r in rows if "event" not in r), key=lambda r: r["step"])
    if len(rows) < skip + 3:
        raise ValueError(f"{len(rows)} steps recorded: at least {skip + 3} are needed to skip {skip}")
    window = rows[skip:-1]
    trained = window[1:]  # what was trained between the first and the last step's time
    return {"start": window[0]["time"], "end": window[-1]["time"], "steps": len(trained),
            "first_step": trained[0]["step"], "last_step": trained[-1]["step"],
            "trajectories": sum(r["samples"] for r in trained),
            "turns": sum(r["samples"] * r.get("turns_mean", 0.0) for r in trained),
            "train_s_mean": statistics.mean(r["train_s"] for r in trained)}


def cpu_rows(series: dict[str, CpuSeries], window: dict[str, Any], group) -> list[dict[str, Any]]:
    """CPU per process group (``group(name)``) over the window: cores, core-seconds per step, CPU
    milliseconds per trajectory and per turn, share of the whole."""
    span = window["end"] - window["start"]
    by_group: dict[str, dict[str, Any]] = {}
    for name, s in sorted(series.items()):
        used = s.between(window["start"], window["end"])
        row = by_group.setdefault(group(name), {"stage": group(name), "processes": 0, "cpu_s": 0.0, "partial": []})
        row["processes"] += 1
        if used is None or s.restarted:
            row["partial"].append(name)  # restarted, or not sampled over the whole window
            continue
        row["cpu_s"] += used
    total = sum(r["cpu_s"] for r in by_group.values())
    rows = []
    for row in sorted(by_group.values(), key=lambda r: -r["cpu_s"]):
        cpu_s = row.pop("cpu_s")
        rows.append({**row, "cores": cpu_s / span, "core_s_per_step": cpu_s / window["steps"],
                     "cpu_ms_per_trajectory": 1e3 * cpu_s / max(1, window["trajectories"]),
                     "cpu_ms_per_turn": 1e3 * cpu_s / max(1.0, window["turns"]),
                     "share": cpu_s / total if total else 0.0})
        if not row["partial"]:
            del rows[-1]["partial"]
    rows.append({"stage": "all", "processes": sum(r["processes"] for r in rows), "cores": total / span,
                 "core_s_per_step": total / window["steps"],
                 "cpu_ms_per_trajectory": 1e3 * total / max(1, window["trajectories"]),
                 "cpu_ms_per_turn": 1e3 * total / max(1.0, window["turns"]), "share": 1.0})
    return rows


async def _pipeline(job_yaml: Path, config: RollartConfig, out: Path, steps: int, sample_s: float):
    from rollart.job.run import RunOptions, run_job
    from rollart.stages.registry import stage_of_process
    from rollart.training.checkpoint import CheckpointStore

    sampler = CpuSampler(pipeline_targets(out), sample_s)
    sampling = asyncio.create_task(sampler.run())
    try:
        await run_job(job_yaml, config, RunOptions(steps=steps, out=out, timeout_s=7200))
    finally:
        sampling.cancel()
        await asyncio.gather(sampling, return_exceptions=True)

    def group(name: str) -> str:
        process, engine, _ = name.partition(ENGINE)
        service = process.split("-")[0]
        return name if name == SUPERVISOR else service if service in ("broker", "redis", "mooncake") \
            else stage_of_process(process) + engine

    return sampler.series, CheckpointStore(out / "checkpoints").read_record(), group


async def _in_process(config: RollartConfig, out: Path, steps: int):
    from rollart.job.inprocess import run_in_process

    # One reading as each step's rollout ends and as the step is recorded: the loop's phases are the
    # only clock it needs, and no reading falls after the engine's shutdown (its counters go with it).
    sampler = CpuSampler(lambda table: engine_split(IN_PROCESS, os.getpid(), table), 0.0)
    marks: list[tuple[str, int, float]] = []
    result = await run_in_process(config, out, steps,
                                  progress=lambda row: marks.append(("step", row["step"], sampler.sample())),
                                  on_rollout_end=lambda step: marks.append(("rollout", step, sampler.sample())))
    return sampler.series, result["rows"], lambda name: name, marks


def phase_cpu(series: dict[str, CpuSeries], marks: list[tuple[str, int, float]],
              window: dict[str, Any]) -> dict[str, float]:
    """The in-process loop's core-seconds per step in each phase over the window: ``rollout`` (from
    the step before's record to this step's batch: generation, env, reward) and ``train`` (from the
    batch to the record: the optimiser step, the weights into the engine)."""
    at = {(phase, step): t for phase, step, t in marks}
    totals = {"rollout": 0.0, "train": 0.0}
    for step in range(window["first_step"], window["last_step"] + 1):
        spans = {"rollout": (at.get(("step", step - 1)), at.get(("rollout", step))),
                 "train": (at.get(("rollout", step)), at.get(("step", step)))}
        for phase, (start, end) in spans.items():
            if start is None or end is None:
                raise ValueError(f"step {step}'s {phase} phase was not marked")
            totals[phase] += sum(s.between(start, end) or 0.0 for s in series.values())
    return {phase: total / window["steps"] for phase, total in totals.items()}


async def bench_stage_cpu(config: RollartConfig, work_dir: Path, *, job_yaml: Path, steps: int = 30, skip: int = 5,
                          sample_s: float = 0.5, in_process: bool = True) -> dict[str, Any]:
    runs = [("pipeline", lambda: _pipeline(job_yaml, config, work_dir / "pipeline", steps, sample_s))]
    if in_process:
        runs.append(("in-process", lambda: _in_process(config, work_dir / "in-process", steps)))
    rows, per_step = [], {}
    for mode, run in runs:
        series, record, group, *marks = await run()
        window = steady_window(record, skip)
        mode_rows = cpu_rows(series, window, group)
        rows += [{"mode": mode, **row} for row in mode_rows]
        per_step[mode] = {"core_s_per_step": mode_rows[-1]["core_s_per_step"],
                          "seconds_per_step": (window["end"] - window["start"]) / window["steps"],
                          "train_s_mean": window["train_s_mean"], "steps": window["steps"],
                          "turns_per_step": window["turns"] / window["steps"],
                          "engine_core_s_per_step": sum(r["core_s_per_step"] for r in mode_rows
                                                        if r["stage"].endswith(ENGINE))}
        if marks:
            per_step[mode]["phases_core_s_per_step"] = phase_cpu(series, marks[0], window)
    result: dict[str, Any] = {"benchmark": "stage-cpu", "rows": rows, "per_step": per_step,
                              "setup": {"config": str(job_yaml), "steps": steps, "skip": skip, "sample_s": sample_s}}
    if len(per_step) == 2:
        result["speedup"] = per_step["pipeline"]["core_s_per_step"] / per_step["in-process"]["core_s_per_step"]
        result["pipeline_cpu_over_in_process"] = result["speedup"]
    return result
