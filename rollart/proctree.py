"""Readings summed over a process and its descendants (a stage's tree holds vLLM's engine core and
worker): the soak's memory, the benchmarks' CPU."""

from __future__ import annotations

from typing import Callable

import psutil


def process_table() -> dict[int, list[int]]:
    """Every process's children, from one pass over /proc: a sampler reading many trees at once
    builds it once (psutil's ``children()`` makes that pass for every call)."""
    table: dict[int, list[int]] = {}
    for proc in psutil.process_iter(["ppid"]):
        table.setdefault(proc.info["ppid"], []).append(proc.pid)
    return table


def descendants(pid: int, table: dict[int, list[int]]) -> list[int]:
    """Every process below ``pid`` in ``table`` (:func:`process_table`)."""
    found, frontier = [], [pid]
    while frontier:
        frontier = [child for parent in frontier for child in table.get(parent, ())]
        found += frontier
    return found


def tree_sum(pid: int, read: Callable[[psutil.Process], float], *, children: bool = True,
             table: dict[int, list[int]] | None = None) -> float | None:
    """``read`` of a process plus, with ``children``, of every process below it (None if it is gone);
    ``table`` (:func:`process_table`) spares a pass over /proc."""
    try:
        root = psutil.Process(pid)
        below = [] if not children else [p.pid for p in root.children(recursive=True)] if table is None \
            else descendants(pid, table)
    except psutil.Error:
        return None
    total = 0.0
    for proc in [root, *below]:
        try:
            total += read(proc if isinstance(proc, psutil.Process) else psutil.Process(proc))
        except psutil.Error:  # gone between the listing and the read
            continue
    return total


def tree_rss_mib(pid: int) -> float | None:
    """Resident memory of a process and all its descendants, MiB (None if it is gone)."""
    total = tree_sum(pid, lambda p: p.memory_info().rss)
    return None if total is None else total / 2**20


def tree_cpu_s(pid: int, *, children: bool = True, table: dict[int, list[int]] | None = None) -> float | None:
    """CPU seconds (user + system) of a process and, with ``children``, every process below it."""
    def cpu(proc: psutil.Process) -> float:
        times = proc.cpu_times()
        return times.user + times.system

    return tree_sum(pid, cpu, children=children, table=table)


ENGINE_CORE = "VLLM::EngineCore"  # vLLM's engine core process (setproctitle)
ENGINE_WORKER = "VLLM::Worker"  # vLLM's CPU worker process (setproctitle): its OpenMP threads are bound


def titled_pids(pid: int, title: str, table: dict[int, list[int]] | None = None) -> list[int]:
    """The processes below ``pid`` whose command line (their setproctitle) holds ``title``."""
    try:
        below = [p.pid for p in psutil.Process(pid).children(recursive=True)] if table is None \
            else descendants(pid, table)
    except psutil.Error:
        return []
    found = []
    for child in below:
        try:
            if title in " ".join(psutil.Process(child).cmdline()):
                found.append(child)
        except psutil.Error:
            continue
    return found


def engine_core_pid(pid: int, table: dict[int, list[int]] | None = None) -> int | None:
    """The vLLM engine core below ``pid`` (a generation member's, or an in-process loop's), if any."""
    return next(iter(titled_pids(pid, ENGINE_CORE, table)), None)


def engine_root_pid(pid: int, table: dict[int, list[int]] | None = None) -> int | None:
    """The process whose tree is the vLLM engine below ``pid``: the fork server that forked its engine
    core and worker (``generation.engine_core_start: forkserver``), else the engine core, its worker
    spawned below it."""
    core = engine_core_pid(pid, table)
    if core is None:
        return None
    try:
        parent = psutil.Process(core).ppid()
    except psutil.Error:
        return None
    return core if parent == pid else parent
