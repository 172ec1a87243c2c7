"""``rollart bench eval-cost``: what held-out evaluation costs the training loop.

Two runs of the same job (``rollart run``, every stage a process): without ``eval:``, and with an eval
stage evaluating every ``every``-th version on a pool of its own (held-out copies of the job's tags,
weight 0, ``tasks`` eval tasks each, sampled at temperature 1 like the training turns). Training throughput is measured from the trainer's record
between the end of the warm-up steps and the last step, as ``rollart bench async`` does; the eval run
also reports how long each version's evaluation took. On one machine the eval pool's engine shares the
cores with everything else, so the ratio is an upper bound of the cost on a cluster, where the eval
pool has accelerators of its own and only the env and reward stages are shared.
"""

from __future__ import annotations

from pathlib import Path
from statistics import mean
from typing import Any

import yaml

from rollart.bench.async_modes import _throughput
from rollart.config import RollartConfig, load_config


def with_eval(base: dict[str, Any], every: int, tasks: int) -> dict[str, Any]:
    """``base`` plus an eval pool and held-out copies (weight 0) of its tags."""
    data = yaml.safe_load(yaml.safe_dump(base))
    data["pools"] = [*data.get("pools", ["default"]), "eval"]
    held_out = {}
    for tag, spec in data.get("tags", {}).items():
        held_out[f"{tag}-heldout"] = {**spec, "weight": 0, "pool": None}
    data["tags"] = {**data["tags"], **held_out}
    # Sampled as training samples (greedy on the demo's fixed map would be one trajectory 16 times over).
    sampling = {**data.get("env", {}).get("sampling", {}), "temperature": 1.0}
    data["eval"] = {"tags": sorted(held_out), "pool": "eval", "every_versions": every, "tasks_per_tag": tasks,
                    "sampling": sampling}
    return data


async def _run(data: dict[str, Any], name: str, work_dir: Path, steps: int, warmup: int) -> dict[str, Any]:
    from rollart.job.run import RunOptions, run_job
    from rollart.training.checkpoint import CheckpointStore

    path = work_dir / f"{name}.yaml"
    path.write_text(yaml.safe_dump({**data, "job": f"bench-eval-{name}"}))
    out = work_dir / name
    report = await run_job(path, load_config(path), RunOptions(steps=steps, out=out, timeout_s=2400))
    row = {"mode": name, **_throughput(CheckpointStore(out / "checkpoints").read_record(), warmup)}
    evals = report["eval"]
    row["eval_versions"] = len(evals)
    row["eval_s_mean"] = mean(e["seconds"] for e in evals) if evals else None
    row["eval_success_last"] = mean(t["success_rate"] for t in evals[-1]["tags"].values()) if evals else None
    row["eval_success_by_version"] = {e["version"]: mean(t["success_rate"] for t in e["tags"].values()) for e in evals}
    row["reward_last_steps"] = report["reward_last_steps"]
    return row


async def bench_eval_cost(config: RollartConfig, work_dir: Path, *, job_yaml: Path, steps: int = 20,
                          warmup: int = 2, every: int = 5, tasks: int = 16) -> dict[str, Any]:
    base = yaml.safe_load(job_yaml.read_text())
    if base.get("eval"):
        raise ValueError(f"{job_yaml} already has an eval: section; give the job without it")
    rows = [await _run(base, "no-eval", work_dir, steps, warmup),
            await _run(with_eval(base, every, tasks), f"eval-every-{every}", work_dir, steps, warmup)]
    for row in rows:
        row["throughput_vs_no_eval"] = row["trajectories_per_s"] / rows[0]["trajectories_per_s"]
    return {"benchmark": "eval-cost", "speedup": rows[1]["throughput_vs_no_eval"],
            "setup": {"steps": steps, "warmup_steps": warmup, "every_versions": every, "tasks_per_tag": tasks,
                      "config": str(job_yaml)},
            "rows": rows}
