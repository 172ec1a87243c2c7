"""``rollart soak [CONFIG] --minutes M --out FILE.json``: a steady training stream held for a long
period, with each stage's memory sampled; it must stay flat.

The job runs as ``rollart run`` does (every stage a supervised process, on a stack of its own) for
``duration_s``. Every ``sample_s`` the resident memory of each stage's process tree is read (the
generation stage's vLLM engine core is a child process). After ``warmup_s`` (model load, engine
warm-up, first weight sync: memory that is allocated once), the trend of each stage is judged:

* ``growth_mib``: the median of the last fifth of the samples minus the median of the first fifth;
* ``slope_mib_per_h``: least-squares slope over every post-warm-up sample;
* ``flat``: growth within ``max(FLAT_PCT % of the baseline, FLAT_MIB)``.

Throughput is reported per window from the trainer's record, so a stream that slowed (and so stopped
allocating) is not mistaken for a flat one, and so is the per-turn bus overhead (the env members'
``rollart_env_generation_overhead_seconds``, scraped from their /metrics each sample): ``overhead_drift``
compares its mean over the last fifth of the whole windows after the warm-up with the first fifth's.
"""

from __future__ import annotations

import asyncio
import json
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from rollart.chaos import scrape
from rollart.chaos.inject import stage_pids
from rollart.chaos.run import DEFAULT_TAGS
from rollart.config import load_config
from rollart.proctree import tree_rss_mib
from rollart.training.checkpoint import CheckpointStore

FLAT_PCT = 5.0  # growth allowed, as a share of the post-warm-up baseline
FLAT_MIB = 16.0  # and at least this much (allocator noise on a small process)
OVERHEAD = "rollart_env_generation_overhead_seconds"


@dataclass
class StageSeries:
    name: str
    samples: list[tuple[float, float]] = field(default_factory=list)  # (seconds since start, MiB)
    starts: list[tuple[int, float]] = field(default_factory=list)  # (pid, first sampled at)

    def add(self, pid: int, at: float, mib: float) -> None:
        if not self.starts or self.starts[-1][0] != pid:
            self.starts.append((pid, at))
        self.samples.append((at, mib))

    @property
    def restarts(self) -> int:
        return max(0, len(self.starts) - 1)


def memory_trend(samples: list[tuple[float, float]], warmup_s: float) -> dict[str, Any]:
    """Judge a stage's memory after warm-up (see the module docstring)."""
    after = [(t, mib) for t, mib in samples if t >= warmup_s]
    if len(after) < 5:
        return {"samples": len(after), "flat": None, "why": "fewer than 5 samples after warm-up"}
    fifth = max(1, len(after) // 5)
    baseline = statistics.median(m for _, m in after[:fifth])
    end = statistics.median(m for _, m in after[-fifth:])
    slope = statistics.linear_regression([t for t, _ in after], [m for _, m in after]).slope * 3600
    growth = end - baseline
    allowed = max(baseline * FLAT_PCT / 100, FLAT_MIB)
    return {"samples": len(after), "baseline_mib": round(baseline, 1), "end_mib": round(end, 1),
            "peak_mib": round(max(m for _, m in after), 1), "growth_mib": round(growth, 1),
            "growth_pct": round(100 * growth / baseline, 2) if baseline else 0.0,
            "slope_mib_per_h": round(slope, 1), "allowed_mib": round(allowed, 1), "flat": growth <= allowed}


def throughput_windows(record: list[dict], started: float, window_s: float) -> list[dict[str, float]]:
    """Trajectories trained per minute in consecutive windows of the run (from the trainer's record)."""
    steps = [r for r in record if "event" not in r]
    if not steps:
        return []
    rows, end = [], max(r["time"] for r in steps)
    at = started
    while at < end:
        trained = sum(len(r.get("traj_ids", ())) for r in steps if at <= r["time"] < at + window_s)
        rows.append({"from_s": round(at - started), "trajectories_per_min": round(60 * trained / window_s, 1)})
        at += window_s
    return rows


class MemorySampler:
    """Samples every stage's process-tree RSS from the run's ``pids.json``, and the env members'
    per-turn overhead histogram from their /metrics, until cancelled."""

    def __init__(self, out: Path, sample_s: float):
        self.out, self.sample_s = out, sample_s
        self.series: dict[str, StageSeries] = {}
        self.overhead: dict[str, list[scrape.HistogramSample]] = {}  # env instance -> scrapes
        self.started = time.time()

    async def run(self) -> None:
        while True:
            now = time.time() - self.started
            for name, pid in stage_pids(self.out).items():
                mib = await asyncio.to_thread(tree_rss_mib, pid)
                if mib is not None:
                    self.series.setdefault(name, StageSeries(name)).add(pid, now, mib)
            await self._scrape_overhead(now)
            await asyncio.sleep(self.sample_s)

    async def _scrape_overhead(self, now: float) -> None:
        for instance, target in scrape.stage_targets(self.out / "prometheus" / "targets.json", "env").items():
            text = await asyncio.to_thread(scrape.scrape, target)
            sample = scrape.parse_histogram(text, OVERHEAD, now) if text else None
            if sample is not None:
                self.overhead.setdefault(instance, []).append(sample)


def soak_job(base: dict[str, Any]) -> dict[str, Any]:
    """The job config for a soak: the feeder never runs dry (no group limit) and the trainer keeps going."""
    data = json.loads(json.dumps(base))
    data.setdefault("tags", DEFAULT_TAGS)
    data.setdefault("feeder", {})["max_groups"] = None
    return data


async def run_soak(config_path: Path | None, *, duration_s: float, out: Path, sample_s: float = 5.0,
                   warmup_s: float = 60.0) -> dict[str, Any]:
    from rollart.job.run import RunOptions, run_job

    if warmup_s >= duration_s:
        raise ValueError(f"--warmup ({warmup_s:.0f}s) must be shorter than the soak ({duration_s:.0f}s)")
    out.mkdir(parents=True, exist_ok=True)
    base = yaml.safe_load(config_path.read_text()) if config_path else {}
    path = out / "soak-job.yaml"
    path.write_text(yaml.safe_dump(soak_job(base)))
    config = load_config(path)
    sampler = MemorySampler(out, sample_s)
    sampling = asyncio.create_task(sampler.run())
    try:
        report = await run_job(path, config, RunOptions(steps=10**6, out=out, duration_s=duration_s,
                                                        timeout_s=duration_s + 3600))
    finally:
        sampling.cancel()
        await asyncio.gather(sampling, return_exceptions=True)
    record = CheckpointStore(out / "checkpoints").read_record()
    return soak_result(sampler, record, report, duration_s=duration_s, warmup_s=warmup_s)


def soak_result(sampler: MemorySampler, record: list[dict], report: dict, *, duration_s: float,
                warmup_s: float) -> dict[str, Any]:
    stages = {}
    for name, series in sorted(sampler.series.items()):
        # A restarted stage's memory starts over: judge its newest process, from its own warm-up on.
        trend = memory_trend(series.samples, series.starts[-1][1] + warmup_s)
        stages[name] = {**trend, "restarts": series.restarts}
    judged = [s["flat"] for s in stages.values() if s["flat"] is not None]
    return {
        "duration_s": duration_s, "warmup_s": warmup_s, "steps": len(report["steps"]),
        "trajectories_trained": sum(len(r.get("traj_ids", ())) for r in record if "event" not in r),
        "stages": stages, "flat": bool(judged) and all(judged) and len(judged) == len(stages),
        "throughput": throughput_windows(record, sampler.started, max(60.0, duration_s / 10)),
        **overhead_figures(sampler.overhead, max(60.0, duration_s / 10), warmup_s=warmup_s),
        "restarts": report["restarts"],
    }


def overhead_figures(series: dict[str, list[scrape.HistogramSample]], window_s: float, *,
                     warmup_s: float = 0.0) -> dict[str, Any]:
    """The per-turn overhead per window, and its drift: the mean over the last fifth of the whole
    windows after the warm-up against the first fifth's. The engine's warm-up turns and a window the
    run's end cut short would otherwise weigh like whole minutes of the steady stream."""
    rows = scrape.windows(series, 0.0, window_s)
    end = max((sample.at for samples in series.values() for sample in samples), default=0.0)
    means = [r["mean_s"] for r in rows
             if r["mean_s"] is not None and r["from_s"] >= warmup_s and r["from_s"] + window_s <= end]
    drift = None
    if len(means) >= 2:
        fifth = max(1, len(means) // 5)
        first, last = statistics.mean(means[:fifth]), statistics.mean(means[-fifth:])
        drift = {"first_fifth_mean_s": round(first, 6), "last_fifth_mean_s": round(last, 6),
                 "ratio": round(last / first, 3) if first else None, "windows_judged": len(means)}
    return {"turn_overhead": rows, "overhead_drift": drift}
