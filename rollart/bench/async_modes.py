"""``rollart bench async``: end-to-end training throughput, synchronous vs asynchronous.

Four runs of the same job (``rollart run``: every stage a process), each a few training steps:

* sync: alpha = 0 — every turn of a batch comes from the policy just published; rollout waits for
  training and training for rollout;
* one-off: alpha = 1 with batch release — the next batch's rollout overlaps this batch's training,
  but a batch is released only when the previous batch's rollouts have all ended (one-step
  off-policy pipelines);
* alpha = 1, alpha = 2: rollart — groups stream in whenever the staleness bound allows.

Generation (with its engine) is pinned to one CPU and the trainer to another, as they sit on separate
clusters in production; with two equally loaded resources the best possible speedup is 2x. Throughput
is measured between the end of the warm-up steps and the last step, from the trainer's record.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import yaml

from rollart.config import RollartConfig, load_config

MODES = {
    "sync": {"alpha": 0},
    "one-off": {"alpha": 1, "release": "batch"},
    "alpha=1": {"alpha": 1},
    "alpha=2": {"alpha": 2},
}


def _pinning() -> dict[str, tuple[int, ...]]:
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        return {}
    half = len(cpus) // 2
    return {"generation": tuple(cpus[:half]), "trainer": tuple(cpus[half:])}


def _throughput(record: list[dict], warmup: int) -> dict[str, float]:
    steps = [r for r in record if "event" not in r]
    if len(steps) <= warmup + 1:
        raise RuntimeError(f"only {len(steps)} steps recorded")
    measured = steps[warmup + 1:]
    seconds = measured[-1]["time"] - steps[warmup]["time"]
    samples, tokens = sum(r["samples"] for r in measured), sum(r["tokens"] for r in measured)
    return {"trajectories_per_s": samples / seconds, "tokens_per_s": tokens / seconds,
            "step_s": seconds / len(measured), "staleness_max": max(r["staleness_max"] for r in measured),
            "wait_s_mean": sum(r["wait_s"] for r in measured) / len(measured),
            "train_s_mean": sum(r["train_s"] for r in measured) / len(measured)}


async def _run_mode(base: dict[str, Any], mode: str, work_dir: Path, steps: int, warmup: int,
                    pinning: dict[str, tuple[int, ...]]) -> dict[str, Any]:
    from rollart.job.run import RunOptions, run_job
    from rollart.training.checkpoint import CheckpointStore

    data = {**base, "job": f"bench-async-{mode.replace('=', '')}", "feeder": {**base.get("feeder", {}), **MODES[mode]}}
    path = work_dir / f"{mode}.yaml"
    path.write_text(yaml.safe_dump(data))
    out = work_dir / mode
    report = await run_job(path, load_config(path), RunOptions(steps=steps, out=out, timeout_s=1200,
                                                               cpu_affinity=pinning))
    row = {"mode": mode, **_throughput(CheckpointStore(out / "checkpoints").read_record(), warmup)}
    row["reward_last_steps"] = report["reward_last_steps"]
    return row


async def bench_async(config: RollartConfig, work_dir: Path, *, job_yaml: Path | None = None, steps: int = 10,
                      warmup: int = 2, modes: tuple[str, ...] = tuple(MODES)) -> dict[str, Any]:
    base = yaml.safe_load(job_yaml.read_text()) if job_yaml else {}
    base.setdefault("tags", {"frozenlake": {"env": "frozenlake", "reward": {"type": "env"}}})
    base.setdefault("feeder", {"group_size": 8, "groups_per_batch": 4})
    base.setdefault("env", {"max_groups": 8, "sampling": {"temperature": 1.0, "max_tokens": 4}})
    base.setdefault("trainer", {"micro_batch": 32})
    unknown = [m for m in modes if m not in MODES]
    if unknown:
        raise ValueError(f"unknown modes {unknown}; choose from {list(MODES)}")
    pinning = _pinning()
    rows = [await _run_mode(base, mode, work_dir, steps, warmup, pinning) for mode in modes]
    by_mode = {r["mode"]: r for r in rows}
    sync = by_mode.get("sync", rows[0])
    for row in rows:
        row["speedup_vs_sync"] = row["trajectories_per_s"] / sync["trajectories_per_s"]
    best = max(rows, key=lambda r: r["trajectories_per_s"])
    return {"benchmark": "async", "speedup": best["speedup_vs_sync"], "best_mode": best["mode"],
            "pinning": {k: list(v) for k, v in pinning.items()}, "bound": 2.0, "paper": "2.65-4.58x on GPUs",
            "setup": {"steps": steps, "warmup_steps": warmup, "config": str(job_yaml) if job_yaml else None},
            "rows": rows}
