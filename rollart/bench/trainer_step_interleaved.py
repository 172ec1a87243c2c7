"""``rollart bench trainer-step`` without ``--run``: the job run, and every K-th of its training steps
replayed alone between the run's steps, the run paused for it.

A replay after the run (``--run OUT``) sets the step in the run beside the step alone minutes later;
on a shared host whose speed moves from minute to minute (this project's machines: the same step 1.2-1.6x
slower in some stretches of an hour than in others) that compares two minutes of the host as much as
the run's cost to the trainer. Here, once the trainer records step N, every process of the run (the
local stack and the stages: all children of this process) is stopped (SIGSTOP), step N's batch shape
is replayed in this process (one untimed step to bring its memory back into the caches, then
``replays`` timed), and the run goes on (SIGCONT): each pair is the same shape, under a second apart,
on the same host minute. The replayed steps are never paused themselves (each finished before its
pause); the run's other steps that overlapped a pause are left out of the "every step" row. A failure
or Ctrl-C during a pause continues the run before it stops it, and so does a SIGKILL of this process:
a guard process holds the read end of a pipe from this one for the pause and continues them at its
end of file (their parent-death SIGTERM would otherwise wait for a SIGCONT that never comes).
"""

from __future__ import annotations

import asyncio
import os
import random
import signal
import statistics
import subprocess
import sys
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Awaitable, Callable, Iterator

from rollart.bench.trainer_step import mean_of, recorded_times, replay_config, replayed_step, timed_steps, \
    timing_row
from rollart.config import RollartConfig
from rollart.training.checkpoint import RecordFollower
from rollart.training.thread_clock import ThreadTimes, timed

POLL_S = 0.01  # how soon after the trainer's record a pause comes (the next step often starts at once)


# The guard: at end of file on its stdin (the pause is over, or the pausing process died), continue them.
_GUARD = """
import os, signal, sys
sys.stdin.buffer.read()
for pid in map(int, sys.argv[1:]):
    try:
        os.kill(pid, signal.SIGCONT)
    except ProcessLookupError:
        pass
"""


@contextmanager
def _guarded(pids: list[int]) -> Iterator[None]:
    """For the block, a process that continues ``pids`` if this one dies before it does (SIGKILL
    included: the kernel closes the pipe's write end either way)."""
    guard = subprocess.Popen([sys.executable, "-I", "-S", "-c", _GUARD, *map(str, pids)], stdin=subprocess.PIPE)
    try:
        yield
    finally:
        assert guard.stdin is not None
        guard.stdin.close()
        guard.wait(timeout=10)


@contextmanager
def paused(pids: list[int]) -> Iterator[None]:
    """These processes stopped (SIGSTOP) for the block and continued after it, whatever it raises or
    if this process is killed; one that has gone meanwhile is skipped."""
    with _guarded(pids), _stopped(pids):
        yield


@contextmanager
def _stopped(pids: list[int]) -> Iterator[None]:
    stopped = []
    try:
        for pid in pids:
            try:
                os.kill(pid, signal.SIGSTOP)
                stopped.append(pid)
            except ProcessLookupError:
                pass
        yield
    finally:
        for pid in stopped:
            try:
                os.kill(pid, signal.SIGCONT)
            except ProcessLookupError:
                pass


def run_processes() -> list[int]:
    """Every process this one started, and theirs (the run's stack and stages)."""
    import psutil

    return [child.pid for child in psutil.Process().children(recursive=True)]


def step_span(row: dict) -> tuple[float, float]:
    """When a recorded step trained (its row is written as its step ends)."""
    return row["time"] - row["train_s"], row["time"]


def _overlaps(span: tuple[float, float], pauses: list[tuple[float, float]]) -> bool:
    return any(span[0] < end and start < span[1] for start, end in pauses)


@dataclass
class Interleaver:
    """Replays every ``every``-th recorded step from ``first`` alone, the run paused around it."""

    config: RollartConfig
    first: int
    every: int
    replays: int
    processes: Callable[[], list[int]] = run_processes
    # each replayed step's row beside its times alone; each pause's (start, end), epoch seconds
    pairs: list[tuple[dict, list[ThreadTimes]]] = field(default_factory=list, init=False)
    pauses: list[tuple[float, float]] = field(default_factory=list, init=False)
    _backend: Any = field(default=None, init=False)
    _rng: random.Random = field(default_factory=lambda: random.Random(0), init=False)

    def due(self, row: dict) -> bool:
        return row["step"] >= self.first and (row["step"] - self.first) % self.every == 0

    def on_step(self, row: dict) -> None:
        """``row`` just recorded: if due, the run stopped, its shape replayed alone here, the run on."""
        if not self.due(row):
            return
        if self._backend is None:  # built from the run's first due row: its threads and precision
            from rollart.stages.trainer import build_backend

            self.config = replay_config(self.config, row)
            self._backend = build_backend(self.config)
        steps = [replayed_step(self._backend, self.config, row, self._rng) for _ in range(1 + self.replays)]
        pids = self.processes()
        start = time.time()
        with paused(pids):
            steps[0]()  # untimed: the run's processes had the caches
            times = [timed(step)[1] for step in steps[1:]]
        self.pauses.append((start, time.time()))
        self.pairs.append((row, times))

    def replay_after(self) -> list[ThreadTimes]:
        """The replayed shapes again, back to back, the run over: as ``--run`` times them."""
        return timed_steps(self._backend, self.config, [row for row, _ in self.pairs]) if self.pairs else []


async def interleave(run: Awaitable[Any], record: Path, interleaver: Interleaver) -> None:
    """Follow ``record`` while ``run`` goes, handing each new step row to ``interleaver`` at once: its
    replay blocks this event loop too (the run's supervisor waits with its stages)."""
    follower = RecordFollower(record)
    task = asyncio.ensure_future(run)
    try:
        while True:
            done = task.done()  # the record's last rows are read after the run ends
            for row in follower.poll():
                if "event" not in row and row.get("lengths"):
                    interleaver.on_step(row)
            if done:
                await task  # its failure, if any
                return
            await asyncio.sleep(POLL_S)
    finally:
        task.cancel()


def summary(interleaver: Interleaver, rows: list[dict], after: list[ThreadTimes] | None = None) -> dict[str, Any]:
    """The replayed steps in the run beside the same shapes alone, pair by pair, and the run's every
    step from the first replayed one that no pause overlapped; ``after``: the same shapes replayed
    once the run was over (``--run``'s way), whose ratio is ``after_run_over_alone``."""
    if not interleaver.pairs:
        raise ValueError(f"no step was replayed: the run recorded {len(rows)} steps with their shapes, "
                         f"the first replay was due at step {interleaver.first}")
    in_run = [recorded_times(r) for r, _ in interleaver.pairs]
    alone = [t for _, times in interleaver.pairs for t in times]
    each = [r["train_s"] / statistics.mean(t.wall_s for t in times) for r, times in interleaver.pairs]
    unpaused = [recorded_times(r) for r in rows
                if r["step"] >= interleaver.first and not _overlaps(step_span(r), interleaver.pauses)]
    ratio = mean_of(in_run, "wall_s") / mean_of(alone, "wall_s")
    cpu_in_run = mean_of(in_run, "cpu_s")
    return {"benchmark": "trainer-step", "interleaved": True, "speedup": ratio, "in_run_over_alone": ratio,
            "cpu_in_run_over_alone": None if cpu_in_run is None else cpu_in_run / mean_of(alone, "cpu_s"),
            "queue_s_in_run": mean_of(in_run, "queue_s"),
            # each pair's ratio: how far the host's minutes move it
            "pair_ratio_median": statistics.median(each), "pair_ratio_min": min(each), "pair_ratio_max": max(each),
            "pause_s_mean": statistics.mean(end - start for start, end in interleaver.pauses),
            # > 1: the host ran the step slower after the run than between its steps
            "after_run_over_alone": mean_of(after, "wall_s") / mean_of(alone, "wall_s") if after else None,
            "pairs": [{"step": r["step"], "in_run_s": r["train_s"], "in_run_cpu_s": r.get("train_cpu_s"),
                       "in_run_queue_s": r.get("train_queue_s"), "alone_s": [t.wall_s for t in times]}
                      for r, times in interleaver.pairs],
            "setup": {"steps": len(rows), "replayed_steps": len(interleaver.pairs), "first": interleaver.first,
                      "every": interleaver.every, "replays": interleaver.replays,
                      "torch_threads": interleaver.config.trainer.torch_threads,
                      "mixed_precision": interleaver.config.trainer.mixed_precision},
            "rows": [timing_row("in the run (the replayed steps)", in_run), timing_row("alone, between them", alone)]
                    + ([timing_row("in the run (every step from the first replayed, none paused)", unpaused)]
                       if unpaused else [])
                    + ([timing_row("alone, after the run (the same shapes)", after)] if after else [])}


async def bench_trainer_step_interleaved(config: RollartConfig, work_dir: Path, *, job_yaml: Path,
                                         steps: int = 80, first: int = 20, every: int = 4,
                                         replays: int = 2) -> dict[str, Any]:
    from rollart.job.run import RunOptions, run_job
    from rollart.training.checkpoint import CheckpointStore

    if not 1 <= first <= steps:
        raise ValueError(f"first: a step of the run's 1..{steps} (got {first})")
    import torch

    out = work_dir / "run"
    interleaver = Interleaver(config, first=first, every=every, replays=replays)
    threads_before = torch.get_num_threads()
    try:
        await interleave(run_job(job_yaml, config, RunOptions(steps=steps, out=out, timeout_s=7200)),
                         out / "checkpoints" / "record.jsonl", interleaver)
        rows = [r for r in CheckpointStore(out / "checkpoints").read_record() if "event" not in r and r.get("lengths")]
        after = interleaver.replay_after()
    finally:
        torch.set_num_threads(threads_before)  # the backend set the run's count for this process
    return {**summary(interleaver, rows, after), "config": str(job_yaml)}
