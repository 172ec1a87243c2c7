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
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

import yaml

from rollart.bench.session import bench_session
from rollart.config import RollartConfig
from rollart.local.children import die_with_parent, on_lasting_thread
from rollart.local.stack import free_port

PAGE = os.sysconf("SC_PAGE_SIZE")
TICKS = os.sysconf("SC_CLK_TCK")


def rss_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/statm") as fh:
        return int(fh.read().split()[1]) * PAGE


def cpu_seconds(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as fh:
        fields = fh.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICKS  # utime + stime


def running_trajectories(port: int) -> float:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2) as response:
            text = response.read().decode()
    except OSError:
        return 0.0
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("rollart_env_running_trajectories{"))


def start_env_process(cfg: RollartConfig, work_dir: Path, port: int) -> subprocess.Popen:
    path = work_dir / "scale-job.yaml"
    data = cfg.model_dump(mode="json", exclude_none=True, exclude={"deploy"})
    path.write_text(yaml.safe_dump(data))
    env = {**os.environ, "ROLLART_METRICS_PORT": str(port), "ROLLART_METRICS_HOST": "127.0.0.1"}
    parent = os.getpid()

    def popen() -> subprocess.Popen:  # a killed benchmark takes its env process with it
        with open(work_dir / "scale-env.log", "wb") as log:
            return subprocess.Popen([sys.executable, "-m", "rollart.cli", "consume", "env", "--config", str(path)],
                                    env=env, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                    preexec_fn=lambda: die_with_parent(parent=parent))
    return on_lasting_thread(popen)


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
        port = free_port()
        async with session.harness(cfg, env=False) as harness:
            proc = start_env_process(cfg, work_dir, port)
            try:
                return await _measure(harness, proc, port, groups, group_size, trajectories, turns, step_s)
            finally:
                proc.terminate()
                try:
                    proc.wait(60)
                except subprocess.TimeoutExpired:
                    proc.kill()


async def _measure(harness, proc, port, groups, group_size, trajectories, turns, step_s) -> dict[str, Any]:
    deadline = time.monotonic() + 300
    while not env_ready(port):
        if proc.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError("the env process did not start (see scale-env.log)")
        await asyncio.sleep(0.5)
    await asyncio.sleep(3)  # joined its groups; idle baseline
    base_rss, base_cpu = rss_bytes(proc.pid), cpu_seconds(proc.pid)
    started = time.monotonic()
    for g in range(groups):
        await harness.submit(f"s{g}", "work", group_size=group_size, seed=g)
    peak_rss, peak_running = base_rss, 0.0
    ids = {f"s{g}": group_size for g in range(groups)}
    while not all(len(harness.ended(g).get("completed", [])) + len(harness.ended(g).get("aborted", [])) >= n
                  for g, n in ids.items()):
        if proc.poll() is not None:
            raise RuntimeError("the env process died (see scale-env.log)")
        if time.monotonic() - started > 900:
            raise TimeoutError("the trajectories did not finish in 900 s")
        peak_rss = max(peak_rss, rss_bytes(proc.pid))
        peak_running = max(peak_running, running_trajectories(port))
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


def env_ready(port: int) -> bool:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/readyz", timeout=2) as response:
            return response.status == 200
    except OSError:
        return False
