"""``rollart bench redundancy``: rollout time per training step with and without redundant rollouts,
under injected env failures and stragglers.

A step needs ``groups_per_step`` complete groups (``group_size`` completed trajectories each). Without
redundancy a group with a failed trajectory is incomplete and wasted (the feeder releases more), and
every group waits for its slowest trajectory. With redundancy ``r`` each group starts
``group_size + r`` rollouts and is complete at the ``group_size``-th completion; the rest are aborted
as ``redundant``. Same engine, same env stage, same seeded fault draws per trajectory id.
"""

from __future__ import annotations

import asyncio
import statistics
import time
from pathlib import Path
from typing import Any

from rollart.bench.session import BenchSession, bench_session
from rollart.config import RollartConfig


def _tag(turns: int, mu_s: float, failure_rate: float, straggler_rate: float, straggler_s: float) -> dict[str, Any]:
    return {"env": "rollart.bench.envs:CountdownEnv", "max_turns": turns, "reward": {"type": "env"},
            "env_kwargs": {"turns": turns},
            "faults": {"step_latency": {"dist": "exponential", "mean_s": mu_s},
                       "step_failure_rate": failure_rate, "straggler_rate": straggler_rate,
                       "straggler_latency": {"dist": "fixed", "mean_s": straggler_s}}}


async def _time_to_steps(harness, prefix: str, *, steps: int, groups_per_step: int, group_size: int,
                         redundancy: int, max_groups: int) -> dict[str, Any]:
    """Release groups (at most ``max_groups`` running) until ``steps * groups_per_step`` are complete."""
    needed = steps * groups_per_step
    started = time.monotonic()
    released, complete_at, done_groups = 0, [], set()
    while len(complete_at) < needed:
        running = released - len(done_groups)
        if running < max_groups and released < needed * 4:
            await harness.submit(f"{prefix}g{released}", "work", group_size=group_size, redundancy=redundancy,
                                 seed=released)
            released += 1
            continue
        for g in range(released):
            group_id = f"{prefix}g{g}"
            if group_id in done_groups:
                continue
            ended = harness.ended(group_id)
            completed = ended.get("completed", [])
            if len(completed) >= group_size:
                done_groups.add(group_id)
                complete_at.append(sorted(harness.completed_at[t] for t in completed)[group_size - 1])
            elif len(completed) + len(ended.get("aborted", [])) >= group_size + redundancy:
                done_groups.add(group_id)  # incomplete: wasted
        await asyncio.sleep(0.01)
        if time.monotonic() - started > 900:
            raise TimeoutError(f"{len(complete_at)} of {needed} complete groups after 900 s")
    complete_at.sort()
    step_times = [complete_at[(s + 1) * groups_per_step - 1] - started for s in range(steps)]
    return {"total_s": step_times[-1], "per_step_s": step_times[-1] / steps, "groups_released": released,
            "groups_incomplete": len(done_groups) - len(complete_at)}


async def bench_redundancy(config: RollartConfig, work_dir: Path, *, redundancy: int = 2, group_size: int = 8,
                           groups_per_step: int = 4, steps: int = 4, turns: int = 6, mu_s: float = 0.03,
                           failure_rate: float = 0.01, straggler_rate: float = 0.02, straggler_s: float = 1.5,
                           repeats: int = 2) -> dict[str, Any]:
    async with bench_session(config, work_dir) as session:
        return await _measure(session, redundancy, group_size, groups_per_step, steps, turns, mu_s,
                              failure_rate, straggler_rate, straggler_s, repeats)


async def _measure(session: BenchSession, redundancy, group_size, groups_per_step, steps, turns, mu_s,
                   failure_rate, straggler_rate, straggler_s, repeats) -> dict[str, Any]:
    tag = _tag(turns, mu_s, failure_rate, straggler_rate, straggler_s)
    cfg = session.config("bench-redundancy", tags={"work": tag}, env={"max_groups": groups_per_step * 2})
    results: dict[int, list[dict]] = {0: [], redundancy: []}
    async with session.harness(cfg) as harness:
        await harness.ready()
        for rep in range(repeats):
            for r in ((0, redundancy) if rep % 2 == 0 else (redundancy, 0)):
                results[r].append(await _time_to_steps(harness, f"rep{rep}-r{r}-", steps=steps,
                                                       groups_per_step=groups_per_step, group_size=group_size,
                                                       redundancy=r, max_groups=groups_per_step * 2))
    rows = []
    for r, runs in results.items():
        rows.append({"redundancy": r, "rollouts_per_group": group_size + r,
                     "per_step_s": statistics.median(x["per_step_s"] for x in runs),
                     "groups_released": sum(x["groups_released"] for x in runs) / len(runs),
                     "groups_incomplete": sum(x["groups_incomplete"] for x in runs) / len(runs),
                     "runs_per_step_s": [x["per_step_s"] for x in runs]})
    speedup = rows[0]["per_step_s"] / rows[1]["per_step_s"]
    return {"benchmark": "redundancy", "speedup": speedup, "paper": "up to 1.62x",
            "setup": {"group_size": group_size, "groups_per_step": groups_per_step, "steps": steps, "turns": turns,
                      "step_latency": f"exponential mean {mu_s}s", "step_failure_rate": failure_rate,
                      "straggler_rate": straggler_rate, "straggler_s": straggler_s, "repeats": repeats},
            "rows": rows}
