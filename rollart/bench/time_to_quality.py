"""``rollart bench time-to-quality``: the disaggregated loop against an in-process one, to a success rate.

Two runs of the same job on the same cores, one after the other:

* pipeline: ``rollart run`` — every stage its own process over the bus, rollout overlapping training
  under the configured staleness bound (the demo: alpha = 1);
* in-process: :mod:`rollart.job.inprocess` — the same model, engine, tasks, rewards, algorithm and batch,
  generate-then-train in one process, no bus (alpha = 0 by construction).

For each, the time (from the launch of its processes, imports and engine start-up included: the
in-process loop runs as a process of its own) and the step at which the success rate over the last
``window`` steps first reaches ``target``, and the success rate over the last 20 steps. The headline
is pipeline time ÷ in-process time to the target (the "Loop throughput" goal: ≤ 1.0, i.e.
disaggregation costs no learning time), the median over ``repeats`` pairs of runs. Each pair runs on
seeds of its own (the feeder's tasks, the engine's sampling, the trainer's: the job's seeds plus the
repeat's index less one, so a single pair is the job as given): the in-process loop is deterministic for
given seeds (it reached 90% at step 73 in every run on the demo's), while the pipeline's steps to the
target moved by a third between runs on the same seeds; pairs on one seed would set a distribution
against a single draw. A run that never reaches the target has no time; its pair's ratio is then over
the whole runs and says so.
"""

from __future__ import annotations

import asyncio
import functools
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from rollart.config import RollartConfig

LAST_STEPS = 20  # "learning as today": success over the last 20 steps


def time_to_target(rows: list[dict], started_at: float, *, target: float, window: int) -> dict[str, Any]:
    """When the mean success of the last ``window`` steps first reaches ``target``, from ``started_at``."""
    rows = sorted((r for r in rows if "event" not in r), key=lambda r: r["step"])
    if not rows:
        raise ValueError("no training steps recorded")
    reached = None
    for i in range(window - 1, len(rows)):
        if statistics.mean(r["success_rate"] for r in rows[i - window + 1:i + 1]) >= target:
            reached = rows[i]
            break
    last = rows[-LAST_STEPS:]
    steps_s = (rows[-1]["time"] - rows[0]["time"]) / max(1, len(rows) - 1)
    return {"steps": len(rows), "first_step_s": rows[0]["time"] - started_at,
            "seconds_to_target": None if reached is None else reached["time"] - started_at,
            "steps_to_target": None if reached is None else reached["step"],
            "seconds_total": rows[-1]["time"] - started_at, "seconds_per_step": steps_s,
            "success_first_steps": statistics.mean(r["success_rate"] for r in rows[:LAST_STEPS]),
            "success_last_steps": statistics.mean(r["success_rate"] for r in last),
            "train_s_mean": statistics.mean(r["train_s"] for r in rows),
            "wait_s_mean": statistics.mean(r["wait_s"] for r in rows)}


async def _pipeline(job_yaml: Path, config: RollartConfig, out: Path, steps: int) -> tuple[list[dict], float]:
    from rollart.job.run import RunOptions, run_job
    from rollart.training.checkpoint import CheckpointStore

    report = await run_job(job_yaml, config, RunOptions(steps=steps, out=out, timeout_s=7200))
    return CheckpointStore(out / "checkpoints").read_record(), report["started_at"]


async def _in_process(config: RollartConfig, out: Path, steps: int) -> tuple[list[dict], float]:
    """The loop in a process of its own, timed from its launch: a pipeline's clock starts at its stages'
    launch, so both include their imports (this process has torch and transformers loaded already)."""
    from rollart.training.checkpoint import CheckpointStore

    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(config.model_dump_json())
    with (out / "in-process.log").open("wb") as log:  # the child's stdout and stderr
        started_at = time.time()
        proc = await asyncio.create_subprocess_exec(sys.executable, "-m", "rollart.job.inprocess",
                                                    str(out / "config.json"), str(out), str(steps),
                                                    stdout=log, stderr=subprocess.STDOUT)
        try:
            code = await proc.wait()
        finally:
            if proc.returncode is None:  # cancelled (Ctrl-C): the loop and its engine go too
                proc.terminate()
                await proc.wait()
    if code != 0:
        raise RuntimeError(f"the in-process loop exited {code}: {out / 'in-process.log'}")
    return CheckpointStore(out / "checkpoints").read_record(), started_at


SEEDED = ("feeder", "generation", "trainer")  # the sections whose seed a repeat moves


def repeat_job(job_yaml: Path, config: RollartConfig, repeat: int, work_dir: Path) -> tuple[Path, RollartConfig]:
    """Repeat ``repeat``'s job: the seeds of SEEDED moved by ``repeat - 1``, written where the pipeline's
    stages read it (they load the file, not this process's config); repeat 1 is the job as given."""
    if repeat == 1:
        return job_yaml, config
    import yaml

    data = yaml.safe_load(job_yaml.read_text()) or {}
    for section in SEEDED:
        data.setdefault(section, {})["seed"] = getattr(config, section).seed + repeat - 1
    work_dir.mkdir(parents=True, exist_ok=True)
    path = work_dir / f"job-{repeat}.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    seeds = {section: {"seed": data[section]["seed"]} for section in SEEDED}
    return path, config.with_updates(f"time-to-quality repeat {repeat}", **seeds)


async def bench_time_to_quality(config: RollartConfig, work_dir: Path, *, job_yaml: Path, steps: int = 150,
                                target: float = 0.9, window: int = 5,
                                order: tuple[str, ...] = ("in-process", "pipeline"),
                                repeats: int = 1) -> dict[str, Any]:
    @functools.cache  # both runs of a repeat share its job (and its file is written once)
    def job(repeat: int) -> tuple[Path, RollartConfig]:
        return repeat_job(job_yaml, config, repeat, work_dir)

    runs = {"pipeline": lambda repeat: _pipeline(*job(repeat), work_dir / f"pipeline-{repeat}", steps),
            "in-process": lambda repeat: _in_process(job(repeat)[1], work_dir / f"in-process-{repeat}", steps)}
    unknown = [m for m in order if m not in runs]
    if unknown or len(set(order)) != len(order) or not order:
        raise ValueError(f"order: each of {sorted(runs)} at most once (got {list(order)})")
    if repeats < 1:
        raise ValueError(f"repeats: at least 1 (got {repeats})")
    rows = []
    for repeat in range(1, repeats + 1):
        for mode in order if repeat % 2 else order[::-1]:  # each mode runs first as often as second
            record, started_at = await runs[mode](repeat)
            rows.append({"mode": mode, "repeat": repeat, "seed_offset": repeat - 1,
                         **time_to_target(record, started_at, target=target, window=window)})
    # a run that never reached the target, or fell back below it (a collapse): its record is the evidence
    missed = [f"{r['mode']} (repeat {r['repeat']})" for r in rows
              if r["seconds_to_target"] is None or r["success_last_steps"] < target]
    result: dict[str, Any] = {"benchmark": "time-to-quality", "target": target, "window_steps": window,
                              "setup": {"steps": steps, "config": str(job_yaml), "alpha": config.feeder.alpha,
                                        "batch": config.feeder.groups_per_batch * config.feeder.group_size,
                                        "repeats": repeats},
                              "rows": rows}
    if missed:  # the runs' records (grad norms, importance weights) tell a collapse from slow learning
        result["keep_work_dir"] = f"not at {target:.0%} at the end: {', '.join(missed)}"
    if len(order) == 2:
        result.update(pipeline_over_in_process(rows))
    return result


def pipeline_over_in_process(rows: list[dict]) -> dict[str, Any]:
    """Each repeat's pipeline time over its in-process time to the target (over the whole runs where
    either missed it); the headline is their median. Beside it, its parts, medians too: the steps ratio
    (repeats where both reached it), the seconds-per-step ratio and how much later the pipeline's first
    step came (every repeat, over whole runs): time to target ~ first step + steps x seconds per step."""
    ratios, steps, per_step, first_delay, whole = [], [], [], [], 0
    for repeat in sorted({r["repeat"] for r in rows}):
        pipe, local = (next(r for r in rows if r["repeat"] == repeat and r["mode"] == mode)
                       for mode in ("pipeline", "in-process"))
        both = pipe["seconds_to_target"] is not None and local["seconds_to_target"] is not None
        key = "seconds_to_target" if both else "seconds_total"
        ratios.append(pipe[key] / local[key])
        if both:
            steps.append(pipe["steps_to_target"] / local["steps_to_target"])
        if "seconds_per_step" in pipe and "seconds_per_step" in local:
            per_step.append(pipe["seconds_per_step"] / local["seconds_per_step"])
            first_delay.append(pipe["first_step_s"] - local["first_step_s"])
        whole += not both
    result: dict[str, Any] = {"speedup": statistics.median(ratios), "ratios": [round(r, 4) for r in ratios],
                              "measured_on": "time to target" if not whole else
                              f"whole runs in {whole} of {len(ratios)} repeats (a run did not reach the target)"}
    result["pipeline_over_in_process"] = result["speedup"]  # printed as the headline
    if steps:
        result["steps_ratio"] = statistics.median(steps)
    if per_step:
        result["seconds_per_step_ratio"] = statistics.median(per_step)
        result["first_step_later_s"] = statistics.median(first_delay)
    return result
