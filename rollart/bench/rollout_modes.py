"""``rollart bench traj-vs-batch``: trajectory-level rollout vs batched env interaction.

The same trajectories (same ids, so the same env latency draws), the same engine and the same stage
code, two schedules:

* batch: every env of the batch steps in lock step — a turn's generation starts for all of them
  only when the slowest env of the previous turn has answered (how batch-style rollout loops work);
* trajectory: each trajectory runs on its own (rollart's env stage); the engine batches whatever
  requests are in flight.

Env step latency is Gaussian(mu, sigma) clipped at 0, for several sigma/mu. The figure is the
batch schedule's rollout time over the trajectory schedule's (paper: 1.23x at 0.1 to 2.27x at 1).

The default shape is the paper's regime scaled down: its env steps (mu = 10 s) are several times a
turn's generation on its GPU pool, so the figure is about the env's variance, not the engine. Here a
turn's generation among 64-128 in flight takes ~50 ms on the 2 CPU cores, so the default step is
mu = 200 ms, over 128 trajectories of 16 turns (the paper's pair, 1.23x / 2.27x, is the env-only
figure of a few hundred trajectories of ~16 turns). At 64 trajectories of 8 turns with 50 ms steps
(``--trajectories 64 --turns 8 --mu 0.05``, the default until 2026-12-07) the engine is as slow as the
env and even a free engine would give only 1.81x at sigma/mu 1: there the figure measures batched
generation's serial cost more than the env's variance.

Beside it, what a turn costs in CPU in each schedule (``/proc``, around each run): this process (the
env and generation stages and the engine's client), the vLLM engine (core and worker), the stack's
services where this benchmark started them (the broker), and the engine's steps per turn (vLLM's own
counter). ``cpu_busy`` is that CPU over the run's time on this process's cores: near 1, a schedule is
bound by the machine's compute and no longer by how its turns wait. ``env_only_speedup`` is the
figure an engine that cost nothing would give for the same latencies (128 trajectories of 16 turns at
sigma/mu 1: ~2.1x; 64 of 8: ~1.8x), and ``of_env_only`` the measured figure over it: near 1, the
trajectory-level schedule keeps what the env's variance offers; above 1 only as far as batched
generation, serial between the turns' env waits, costs more than trajectory-level generation hidden
among them; below 1, the engine or the machine, not the env, sets the trajectory-level schedule's end.
"""

from __future__ import annotations

import os
import random
import statistics
import time
from pathlib import Path
from typing import Any

from rollart.bench.envs import set_lockstep
from rollart.bench.session import BenchSession, bench_session
from rollart.config import Latency, RollartConfig
from rollart.proctree import engine_root_pid, process_table, tree_cpu_s

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


def env_only_speedup(latency: Latency, trajectories: int, turns: int, draws: int = 400, seed: int = 0) -> float:
    """The figure if generation cost nothing: the expected sum over turns of the slowest env step
    (batched) over the slowest trajectory's sum of steps (trajectory-level), for these latencies."""
    rng, batch_s, traj_s = random.Random(seed), 0.0, 0.0
    for _ in range(draws):
        steps = [[latency.draw(rng) for _ in range(turns)] for _ in range(trajectories)]
        batch_s += sum(max(column) for column in zip(*steps))
        traj_s += max(sum(row) for row in steps)
    return batch_s / traj_s


def _cpu_targets(session: BenchSession) -> dict[str, tuple[int, bool]]:
    """Where a turn's CPU goes, by name: (pid, with its children)."""
    me, table = os.getpid(), process_table()
    engine = engine_root_pid(me, table)
    return {"stages": (me, False), **({"engine": (engine, True)} if engine is not None else {}),
            **{name: (pid, True) for name, pid in session.services.items()}}


def _cpu_s(targets: dict[str, tuple[int, bool]]) -> dict[str, float]:
    table = process_table()
    return {name: tree_cpu_s(pid, children=children, table=table) or 0.0 for name, (pid, children) in targets.items()}


def _engine_steps() -> float | None:
    """vLLM's count of engine steps so far (its client's stat logger; None if it keeps none)."""
    from prometheus_client import REGISTRY

    counts = [sample.value for metric in REGISTRY.collect() if metric.name == "vllm:iteration_tokens_total"
              for sample in metric.samples if sample.name.endswith("_count")]
    return sum(counts) if counts else None


class CpuAccount:
    """CPU seconds per process and engine steps summed over a schedule's runs, and their time."""

    def __init__(self) -> None:
        self.cpu_s: dict[str, float] = {}
        self.steps: float | None = 0.0
        self.wall_s = 0.0
        self.turns = 0

    async def measure(self, targets: dict[str, tuple[int, bool]], run, turns: int) -> float:
        before, steps = _cpu_s(targets), _engine_steps()
        seconds = await run
        after, steps_after = _cpu_s(targets), _engine_steps()
        for name, cpu_s in after.items():
            self.cpu_s[name] = self.cpu_s.get(name, 0.0) + max(0.0, cpu_s - before.get(name, cpu_s))
        self.steps = None if self.steps is None or steps is None or steps_after is None \
            else self.steps + steps_after - steps
        self.wall_s, self.turns = self.wall_s + seconds, self.turns + turns
        return seconds

    def summary(self) -> dict[str, Any]:
        per_turn = {name: 1000 * cpu_s / self.turns for name, cpu_s in self.cpu_s.items()}
        return {"cpu_ms_per_turn": {**per_turn, "total": sum(per_turn.values())},
                "cpu_busy": sum(self.cpu_s.values()) / (self.wall_s * len(os.sched_getaffinity(0))),
                "engine_steps_per_turn": None if self.steps is None else self.steps / self.turns}


async def bench_traj_vs_batch(config: RollartConfig, work_dir: Path, *, mu_s: float, groups: int, group_size: int,
                              turns: int, repeats: int, ratios: tuple[float, ...] = (0.1, 0.5, 1.0)) -> dict[str, Any]:
    async with bench_session(config, work_dir) as session:
        return await _measure(session, mu_s, ratios, groups, group_size, turns, repeats)


async def _measure(session: BenchSession, mu_s, ratios, groups, group_size, turns, repeats) -> dict[str, Any]:
    for i in range(len(ratios)):
        set_lockstep(f"batch-r{i}", groups * group_size)
    times: dict[tuple[str, int], list[float]] = {(m, i): [] for m in MODES for i in range(len(ratios))}
    accounts = {key: CpuAccount() for key in times}
    configs = {m: session.config(f"bench-{m}", tags=_tags(m, ratios, mu_s, turns)) for m in MODES}
    async with session.harness(configs["batch"]) as batch, session.harness(configs["trajectory"]) as traj:
        harnesses = {"batch": batch, "trajectory": traj}
        for h in harnesses.values():
            await h.ready()
        await _rollout(traj, "r0", "warmup-", 2, group_size)  # engine shapes, first-call costs
        targets = _cpu_targets(session)  # the engine's processes are up now
        for rep in range(repeats):
            for i in range(len(ratios)):
                order = MODES if rep % 2 == 0 else MODES[::-1]  # alternate: drift hits both alike
                for mode in order:
                    # the same ids in both modes: FaultyEnv seeds by trajectory id, so the same latencies
                    run = _rollout(harnesses[mode], f"r{i}", f"rep{rep}r{i}-", groups, group_size)
                    times[(mode, i)].append(await accounts[(mode, i)].measure(targets, run,
                                                                              groups * group_size * turns))
    rows = []
    for i, ratio in enumerate(ratios):
        batch_s, traj_s = statistics.median(times[("batch", i)]), statistics.median(times[("trajectory", i)])
        cpu = {mode: accounts[(mode, i)].summary() for mode in MODES}
        latency = Latency(dist="gaussian", mean_s=mu_s, sigma_s=ratio * mu_s)
        speedup, env_only = batch_s / traj_s, env_only_speedup(latency, groups * group_size, turns)
        rows.append({"sigma_over_mu": ratio, "mu_s": mu_s, "batch_s": batch_s, "trajectory_s": traj_s,
                     "speedup": speedup, "env_only_speedup": env_only, "of_env_only": speedup / env_only,
                     "batch_runs_s": times[("batch", i)],
                     "trajectory_runs_s": times[("trajectory", i)],
                     **{f"{mode}_cpu_ms_per_turn": cpu[mode]["cpu_ms_per_turn"]["total"] for mode in MODES},
                     "trajectory_cpu_busy": cpu["trajectory"]["cpu_busy"], "cpu": cpu})
    return {"benchmark": "traj-vs-batch", "speedup": rows[-1]["speedup"],
            "speedup_by_sigma_over_mu": {str(r["sigma_over_mu"]): r["speedup"] for r in rows},
            "paper": {"0.1": 1.23, "1.0": 2.27},
            "setup": {"trajectories": groups * group_size, "turns": turns, "mu_s": mu_s, "repeats": repeats,
                      "max_tokens": 2}, "rows": rows}
