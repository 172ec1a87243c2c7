"""``rollart bench scheduling``: seconds per trained step under each scheduling of the rollout stages,
switched back and forth inside one run.

Whole runs on a shared machine drift by more than the effect measured here (±15% seconds per step
between runs of the same job), so the settings take turns inside one ``rollart run``: every
``block`` steps every thread of every stage but the trainer (vLLM's engine core and worker
included), with ``--switch stack`` of the run's own broker, Redis and Mooncake, or with ``--switch
trainer`` of the trainer, is switched to the next setting (policy, niceness and time slice: one
``sched_setattr``); what is not switched keeps the job's ``machine.scheduling``. A block's first step straddles
the switch and is left out. Each block's mean seconds per step is held to the baseline's (the first
setting: "runner", every stage scheduled as the runner is) at the same point of the run, interpolated
between the baseline blocks either side; a setting's figure is the median of those ratios, and the
headline is the runner's seconds per step over the last setting's. Lowering a niceness again needs
CAP_SYS_NICE (root).
"""

from __future__ import annotations

import asyncio
import os
import statistics
from pathlib import Path
from typing import Any, Literal

from rollart.config import MachineConfig, RollartConfig, StageScheduling
from rollart.local.processes import may_raise_priority
from rollart.local.supervision import STACK, own_stack_pids, schedule_threads

# every stage but the trainer, the local stack's services, or the trainer
Switched = Literal["rollout", "stack", "trainer"]

# The settings a run switches between, by name; "runner" first: the ratios are against it.
SETTINGS: dict[str, StageScheduling] = {
    "runner": StageScheduling(),
    "nice": StageScheduling(nice=10),
    "batch": StageScheduling(policy="batch"),
    "nice5+batch": StageScheduling(nice=5, policy="batch"),
    "nice15+batch": StageScheduling(nice=15, policy="batch"),  # configs/demo.yaml's rollout stages
    "nice+batch": StageScheduling(nice=10, policy="batch"),
    "idle": StageScheduling(nice=10, policy="idle"),
    "slice20": StageScheduling(slice_ms=20),  # EEVDF's time slice: 20 ms, against the kernel's default
}


def is_switched(stage: str, switched: Switched) -> bool:
    """Whether the switcher (not the job's plan) schedules ``stage`` (a ``machine.scheduling`` key)."""
    return stage == switched if switched != "rollout" else stage not in (STACK, "trainer")


def can_lower_niceness() -> bool:
    """Whether this process may set a niceness back down to its own (CAP_SYS_NICE, or RLIMIT_NICE allows it)."""
    return may_raise_priority(os.nice(0))


def block_figures(rows: list[dict], switches: list[tuple[int, str]]) -> list[tuple[str, float]]:
    """Each block's setting and seconds per step (its steps' time over their count), in run order.
    ``switches``: (the last step recorded when the setting was applied, its name), in order; a block's
    first step is left out. Not a median: under a staleness bound a trainer that finds a batch waiting
    trains the next one at once, so a block's steps alternate short and long, and a median of five
    picks one kind or the other (block medians of 0.17-0.48 s in one run)."""
    times = {r["step"]: r["time"] for r in rows if "event" not in r}
    last = max(times, default=0)
    blocks = []
    for (start, name), (end, _) in zip(switches, [*switches[1:], (last, "")]):
        steps = [times[s] - times[s - 1] for s in range(start + 2, end + 1) if s in times and s - 1 in times]
        if steps:
            blocks.append((name, statistics.fmean(steps)))
    return blocks


def against_baseline(blocks: list[tuple[str, float]], baseline: str) -> dict[str, list[float]]:
    """Each block's seconds per step over the baseline's at the same point of the run: interpolated
    between the baseline blocks either side (the nearest one at an end). A run's steps slow down as
    its trajectories lengthen, so a setting is held to its neighbours, not to the run's median."""
    base = [(i, seconds) for i, (name, seconds) in enumerate(blocks) if name == baseline]
    if not base:
        return {}
    ratios: dict[str, list[float]] = {}
    for i, (name, seconds) in enumerate(blocks):
        before = [b for b in base if b[0] < i][-1:]
        after = [b for b in base if b[0] > i][:1]
        if name == baseline or not before + after:
            continue
        if before and after:
            (i0, s0), (i1, s1) = before[0], after[0]
            expected = s0 + (s1 - s0) * (i - i0) / (i1 - i0)
        else:
            expected = (before + after)[0][1]
        ratios.setdefault(name, []).append(seconds / expected)
    return ratios


def _switched_pids(out: Path, switched: Switched) -> list[int]:
    """The processes a setting applies to: every stage but the trainer, the run's own stack, the trainer."""
    from rollart.chaos.inject import stage_pids
    from rollart.stages.registry import stage_of_process

    if switched == "stack":
        return own_stack_pids(out / "stack")  # the benchmark runs the job in this process
    return [pid for name, pid in stage_pids(out).items() if is_switched(stage_of_process(name), switched)]


async def _switch(out: Path, settings: list[str], block: int, steps: int, switches: list[tuple[int, str]],
                  switched: Switched) -> None:
    """Apply the settings in turn, each for ``block`` steps, until the run's last steps."""
    from rollart.training.checkpoint import CheckpointStore

    store, base_nice = CheckpointStore(out / "checkpoints"), os.nice(0)

    def recorded() -> int:
        return sum(1 for r in store.read_record() if "event" not in r)

    while recorded() < 2:  # the engine is loaded and steps are flowing
        await asyncio.sleep(0.5)
    turn = 0
    while (now := recorded()) < steps - 1:
        name = settings[turn % len(settings)]
        turn += 1
        switches.append((now, name))
        while recorded() < min(now + block, steps - 1):
            await asyncio.to_thread(schedule_threads, _switched_pids(out, switched), SETTINGS[name], base_nice)
            await asyncio.sleep(0.25)


async def bench_scheduling(config: RollartConfig, work_dir: Path, *, job_yaml: Path, steps: int = 110,
                           block: int = 6, settings: tuple[str, ...] = ("runner", "nice+batch"),
                           switched: Switched = "rollout") -> dict[str, Any]:
    from rollart.job.run import RunOptions, run_job
    from rollart.training.checkpoint import CheckpointStore

    if switched not in ("rollout", "stack", "trainer"):
        raise ValueError(f"--switch {switched}: rollout, stack or trainer")
    unknown = [s for s in settings if s not in SETTINGS]
    if unknown or len(settings) < 2:
        raise ValueError(f"settings {list(settings)}: name two or more of {', '.join(SETTINGS)}")
    if len({SETTINGS[s].nice for s in settings}) > 1 and not can_lower_niceness():
        raise PermissionError("switching between nicenesses needs CAP_SYS_NICE to lower one again: run this "
                              "benchmark as root (or with a RLIMIT_NICE that allows it)")
    out = work_dir / "run"
    # the switcher decides for what it switches; the rest keeps the job's plan
    plan = {k: v for k, v in config.machine.scheduling.items() if not is_switched(k, switched)}
    config = config.model_copy(update={"machine": MachineConfig(scheduling=plan)})
    switches: list[tuple[int, str]] = []
    switching = asyncio.create_task(_switch(out, list(settings), block, steps, switches, switched))
    try:
        await run_job(job_yaml, config, RunOptions(steps=steps, out=out, timeout_s=7200))
    finally:
        switching.cancel()
        await asyncio.gather(switching, return_exceptions=True)
    if switching.done() and not switching.cancelled() and switching.exception() is not None:
        raise switching.exception()  # type: ignore[misc]
    blocks = block_figures(CheckpointStore(out / "checkpoints").read_record(), switches)
    ratios = against_baseline(blocks, settings[0])
    missing = [s for s in settings[1:] if s not in ratios]
    if missing:
        raise ValueError(f"no whole block under {missing} beside a baseline one: run more steps (--steps) or "
                         "shorter blocks (--block)")
    rows = []
    for name in settings:
        own = [seconds for setting, seconds in blocks if setting == name]
        rows.append({"setting": name, **SETTINGS[name].model_dump(), "blocks": len(own),
                     "s_per_step": statistics.median(own) if own else None,
                     "vs_runner": statistics.median(ratios[name]) if name in ratios else 1.0,
                     "block_means": [round(b, 3) for b in own]})
    return {"benchmark": "scheduling", "rows": rows, "switches": switches,
            "speedup": 1 / rows[-1]["vs_runner"],
            "setup": {"config": str(job_yaml), "steps": steps, "block": block, "settings": list(settings),
                      "switched": switched}}
