"""``rollart bench traj-vs-batch``: trajectory-level rollout vs batched env interaction.

The same trajectories (same ids, so the same env latency draws), the same engine and the same stage
code, two schedules:

* batch: every env of the batch steps in lock step — a turn's generation starts for all of them
  only when the slowest env of the previous turn has answered (how batch-style rollout loops work);
* trajectory: each trajectory runs on its own (rollart's env stage); the engine batches whatever
  requests are in flight.

Env step latency is Gaussian(mu, sigma) clipped at 0, for several sigma/mu. The figure is the
batch schedule's rollout time over the trajectory schedule's (paper: 1.23x at 0.1 to 2.27x at 1).
"""

from __future__ import annotations

import statistics
import time
from pathlib import Path
from typing import Any

from rollart.bench.envs import set_lockstep
from rollart.bench.session import BenchSession, bench_session
from rollart.config import RollartConfig

MODES = ("batch", "trajectory")


def _tags(mode: str, ratios: tuple[float, ...], mu_s: float, turns: int) -> dict[str, Any]:
    tags = {}
    for i, ratio in enumerate(ratios):
        tags[f"r{i}"] = {"env": "rollart.bench.envs:CountdownEnv", "max_turns": turns, "reward": {"type": "env"},
                         "env_kwargs": {"turns": turns, "lockstep": f"{mode}-r{i}" if mode == "batch" else None},
                         "faults": {"step_latency": {"dist": "gaussian", "mean_s": mu_s, "sigma_s": ratio * mu_s}}}
    return tags


async def _rollout(harness, tag: str, prefix: str, groups: int, group_size: int) -> float:
    """Seconds from releasing ``groups`` groups to the last trajectory completing."""
    ids = [f"{prefix}g{g}" for g in range(groups)]
    started = time.monotonic()
    for g, group_id in enumerate(ids):
        await harness.submit(group_id, tag, group_size=group_size, seed=g)
    await harness.wait_groups({group_id: group_size for group_id in ids}, timeout=900)
    aborted = [t for group_id in ids for t in harness.ended(group_id).get("aborted", [])]
    if aborted:
        raise RuntimeError(f"{len(aborted)} trajectories aborted: the benchmark needs every one to finish")
    return max(harness.completed_at[t] for group_id in ids for t in harness.ended(group_id)["completed"]) - started


async def bench_traj_vs_batch(config: RollartConfig, work_dir: Path, *, mu_s: float = 0.05,
                              ratios: tuple[float, ...] = (0.1, 0.5, 1.0), groups: int = 8, group_size: int = 8,
                              turns: int = 8, repeats: int = 3) -> dict[str, Any]:
    async with bench_session(config, work_dir) as session:
        return await _measure(session, mu_s, ratios, groups, group_size, turns, repeats)


async def _measure(session: BenchSession, mu_s, ratios, groups, group_size, turns, repeats) -> dict[str, Any]:
    for i in range(len(ratios)):
        set_lockstep(f"batch-r{i}", groups * group_size)
    times: dict[tuple[str, int], list[float]] = {(m, i): [] for m in MODES for i in range(len(ratios))}
    configs = {m: session.config(f"bench-{m}", tags=_tags(m, ratios, mu_s, turns)) for m in MODES}
    async with session.harness(configs["batch"]) as batch, session.harness(configs["trajectory"]) as traj:
        harnesses = {"batch": batch, "trajectory": traj}
        for h in harnesses.values():
            await h.ready()
        await _rollout(traj, "r0", "warmup-", 2, group_size)  # engine shapes, first-call costs
        for rep in range(repeats):
            for i in range(len(ratios)):
                order = MODES if rep % 2 == 0 else MODES[::-1]  # alternate: drift hits both alike
                for mode in order:
                    # the same ids in both modes: FaultyEnv seeds by trajectory id, so the same latencies
                    times[(mode, i)].append(await _rollout(harnesses[mode], f"r{i}", f"rep{rep}r{i}-",
                                                           groups, group_size))
    rows = []
    for i, ratio in enumerate(ratios):
        batch_s, traj_s = statistics.median(times[("batch", i)]), statistics.median(times[("trajectory", i)])
        rows.append({"sigma_over_mu": ratio, "mu_s": mu_s, "batch_s": batch_s, "trajectory_s": traj_s,
                     "speedup": batch_s / traj_s, "batch_runs_s": times[("batch", i)],
                     "trajectory_runs_s": times[("trajectory", i)]})
    return {"benchmark": "traj-vs-batch", "speedup": rows[-1]["speedup"],
            "speedup_by_sigma_over_mu": {str(r["sigma_over_mu"]): r["speedup"] for r in rows},
            "paper": {"0.1": 1.23, "1.0": 2.27},
            "setup": {"trajectories": groups * group_size, "turns": turns, "mu_s": mu_s, "repeats": repeats,
                      "max_tokens": 2}, "rows": rows}
