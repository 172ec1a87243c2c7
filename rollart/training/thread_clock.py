"""Where a training step's seconds went: on a core, or waiting for one.

A step's wall time on a machine it shares with the rollout is its compute, the time its thread
waited in the run queue for a core (other processes' turns), and the time it slept (a lock, the GIL).
The thread's CPU clock gives the first; Linux keeps the second per thread in
``/proc/thread-self/schedstat`` (its second field: nanoseconds runnable but waiting; its first, the
time on a CPU, is only brought up to date at the scheduler's tick for a running thread, so the CPU
clock, which is, serves for that). The trainer records both per step
(``train_cpu_s``, ``train_queue_s``) and ``rollart bench trainer-step`` sets them beside the same step
alone, so a step slower in the run says whether it lost its core or ran slower on it.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, TypeVar

T = TypeVar("T")

SCHEDSTAT = Path("/proc/thread-self/schedstat")


@dataclass(frozen=True)
class ThreadTimes:
    """Seconds of one piece of work in one thread: wall, on a CPU, and runnable but waiting for one
    (``queue_s`` is None where the kernel does not keep it; both are None in a sum with an unknown)."""

    wall_s: float
    cpu_s: float | None = None
    queue_s: float | None = None

    def __add__(self, other: ThreadTimes) -> ThreadTimes:
        return ThreadTimes(self.wall_s + other.wall_s, _plus(self.cpu_s, other.cpu_s), _plus(self.queue_s, other.queue_s))


def _plus(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None else a + b


def _queued_ns() -> int | None:
    try:
        _on_cpu, queued, _turns = SCHEDSTAT.read_text().split()
    except (OSError, ValueError):  # not Linux, or a kernel without schedstats
        return None
    return int(queued)


def timed(fn: Callable[[], T]) -> tuple[T, ThreadTimes]:
    """``fn()`` in this thread, and its times."""
    queued, cpu, started = _queued_ns(), time.thread_time(), time.perf_counter()
    result = fn()
    wall, cpu, queued_after = time.perf_counter() - started, time.thread_time() - cpu, _queued_ns()
    if queued is None or queued_after is None:
        return result, ThreadTimes(wall, cpu)
    return result, ThreadTimes(wall, cpu, (queued_after - queued) / 1e9)


async def in_thread(fn: Callable[[], T]) -> tuple[T, ThreadTimes]:
    """``fn()`` in a worker thread (the event loop goes on meanwhile), and its times in that thread."""
    return await asyncio.to_thread(timed, fn)
