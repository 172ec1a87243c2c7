"""Readings summed over a process and its descendants (a stage's tree holds vLLM's engine core and
worker): the soak's memory, the benchmarks' CPU."""

from __future__ import annotations

from typing import Callable

import psutil


def tree_sum(pid: int, read: Callable[[psutil.Process], float], *, children: bool = True) -> float | None:
    """``read`` of a process plus, with ``children``, of every process below it (None if it is gone)."""
    try:
        root = psutil.Process(pid)
        procs = [root, *(root.children(recursive=True) if children else ())]
    except psutil.Error:
        return None
    total = 0.0
    for proc in procs:
        try:
            total += read(proc)
        except psutil.Error:  # gone between the listing and the read
            continue
    return total


def tree_rss_mib(pid: int) -> float | None:
    """Resident memory of a process and all its descendants, MiB (None if it is gone)."""
    total = tree_sum(pid, lambda p: p.memory_info().rss)
    return None if total is None else total / 2**20


def tree_cpu_s(pid: int, *, children: bool = True) -> float | None:
    """CPU seconds (user + system) of a process and, with ``children``, every process below it."""
    def cpu(proc: psutil.Process) -> float:
        times = proc.cpu_times()
        return times.user + times.system

    return tree_sum(pid, cpu, children=children)
