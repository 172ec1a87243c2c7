"""``rollart bench scale``: one env consumer process holding 1,000 concurrent trajectories.

The env stage runs as its own process (``rollart consume env``), exactly as deployed; generation (the
real engine) and rewards run in this process. Every trajectory is a ``CountdownEnv`` of ``turns``
turns with a fixed step latency, so all of them are open at once. Measured on the env process
from /proc: resident memory before and at peak, CPU seconds over the run; concurrency from the
process's own ``rollart_env_running_trajectories`` gauge (its /metrics).
"""

from __future__ import annotations

import asyncio
import os
import time
from pathlib import Path
from typing import Any

from rollart.bench.env_process import EnvProcess, env_process
from rollart.bench.session import bench_session
from rollart.config import RollartConfig

PAGE = os.sysconf("SC_PAGE_SIZE")
TICKS = os.sysconf("SC_CLK_TCK")


def rss_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/statm") as fh:
        return int(fh.read().split()[1]) * PAGE


def cpu_seconds(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as fh:
        fields = fh.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICKS  # utime + stime


def running_trajectories(process: EnvProcess) -> float:
    return sum(float(line.rsplit(" ", 1)[1]) for line in process.metrics().splitlines()
               if line.startswith("rollart_env_running_trajectories{"))


async def bench_scale(config: RollartConfig, work_dir: Path, *, trajectories: int = 1000, turns: int = 4,
                      step_s: float = 2.0) -> dict[str, Any]:
    groups, group_size = trajectories // 8, 8
    async with bench_session(config, work_dir) as session:
        tag = {"env": "rollart.bench.envs:CountdownEnv", "env_kwargs": {"turns": turns}, "max_turns": turns,
               "reward": {"type": "env"}, "faults": {"step_latency": {"dist": "fixed", "mean_s": step_s}}}
        cfg = session.config("bench-scale", tags={"work": tag},
                             env={"max_groups": groups, "sampling": {"max_tokens": 1}},
                             generation={"max_concurrency": 2 * trajectories},
                             bus={"max_in_flight": 4 * trajectories})
        async with session.harness(cfg, env=False) as harness, env_process(cfg, work_dir, name="scale-env") as env:
            return await _measure(harness, env, groups, group_size, trajectories, turns, step_s)


async def _measure(harness, env: EnvProcess, groups, group_size, trajectories, turns, step_s) -> dict[str, Any]:
    proc = env.proc
    await asyncio.sleep(3)  # joined its groups; idle baseline
    base_rss, base_cpu = rss_bytes(proc.pid), cpu_seconds(proc.pid)
    started = time.monotonic()
    for g in range(groups):
        await harness.submit(f"s{g}", "work", group_size=group_size, seed=g)
    peak_rss, peak_running = base_rss, 0.0
    ids = {f"s{g}": group_size for g in range(groups)}
    while not all(len(harness.ended(g).get("completed", [])) + len(harness.ended(g).get("aborted", [])) >= n
                  for g, n in ids.items()):
        env.check_alive()
        if time.monotonic() - started > 900:
            raise TimeoutError("the trajectories did not finish in 900 s")
        peak_rss = max(peak_rss, rss_bytes(proc.pid))
        peak_running = max(peak_running, running_trajectories(env))
        await asyncio.sleep(0.25)
    elapsed = time.monotonic() - started
    cpu = cpu_seconds(proc.pid) - base_cpu
    completed = sum(len(harness.ended(g).get("completed", [])) for g in ids)
    turns_done = completed * turns
    rows = [{"measure": "peak concurrent trajectories", "value": peak_running},
            {"measure": "completed", "value": completed},
            {"measure": "env process RSS idle (MiB)", "value": base_rss / 2**20},
            {"measure": "env process RSS peak (MiB)", "value": peak_rss / 2**20},
            {"measure": "memory per trajectory (KiB)", "value": (peak_rss - base_rss) / max(peak_running, 1) / 1024},
            {"measure": "env CPU per trajectory (ms)", "value": cpu / max(completed, 1) * 1000},
            {"measure": "env CPU per turn (ms)", "value": cpu / max(turns_done, 1) * 1000},
            {"measure": "env CPU share of one core", "value": cpu / elapsed},
            {"measure": "wall seconds", "value": elapsed}]
    return {"benchmark": "scale", "speedup": peak_running / trajectories,  # the share of the target held at once
            "concurrent_trajectories": peak_running, "memory_per_trajectory_bytes": (peak_rss - base_rss) / max(peak_running, 1),
            "cpu_per_trajectory_s": cpu / max(completed, 1), "setup": {"trajectories": trajectories, "turns": turns,
                                                                       "step_latency_s": step_s},
            "rows": rows}

