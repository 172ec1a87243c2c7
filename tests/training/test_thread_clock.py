import asyncio
import os
import threading
import time

import pytest

from rollart.training.thread_clock import ThreadTimes, in_thread, timed


def _spin(seconds: float) -> int:
    end, n = time.perf_counter() + seconds, 0
    while time.perf_counter() < end:
        n += 1
    return n


def test_compute_counts_on_a_core_and_sleep_does_not():
    spun, busy = timed(lambda: _spin(0.2))
    assert spun > 0
    assert busy.cpu_s == pytest.approx(busy.wall_s, rel=0.25) and busy.cpu_s > 0.1
    _, asleep = timed(lambda: time.sleep(0.2))
    assert asleep.wall_s >= 0.2 and asleep.cpu_s < 0.02 and asleep.queue_s < 0.02


def test_a_thread_sharing_its_core_waits_in_the_run_queue():
    """Two busy threads on one core: each is runnable about half the time it is not running."""
    cpu = min(os.sched_getaffinity(0))
    results: dict[str, ThreadTimes] = {}

    def work(name: str) -> None:
        os.sched_setaffinity(0, {cpu})  # this thread only
        results[name] = timed(lambda: _spin(0.4))[1]

    threads = [threading.Thread(target=work, args=(n,)) for n in ("a", "b")]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    # the GIL lets one of them run at a time anyway; the other waits, asleep or queued, and the on-CPU
    # time stays below the wall time by what it waited
    for times in results.values():
        assert times.cpu_s + times.queue_s <= times.wall_s * 1.05
        assert times.cpu_s < times.wall_s * 0.9


def test_a_busy_process_on_the_same_core_shows_as_queue_time():
    cpu = min(os.sched_getaffinity(0))
    pid = os.fork()
    if pid == 0:  # the other process: spin on the same core, then leave
        os.sched_setaffinity(0, {cpu})
        _spin(1.0)
        os._exit(0)
    try:
        before = os.sched_getaffinity(0)
        os.sched_setaffinity(0, {cpu})
        try:
            time.sleep(0.1)  # the child is spinning by now
            _, shared = timed(lambda: _spin(0.4))
        finally:
            os.sched_setaffinity(0, before)
    finally:
        os.waitpid(pid, 0)
    assert shared.queue_s > 0.1, shared
    assert shared.cpu_s == pytest.approx(shared.wall_s - shared.queue_s, abs=0.05)


async def test_in_thread_times_the_work_in_its_worker_and_the_loop_goes_on():
    called_back = asyncio.Event()
    asyncio.get_running_loop().call_later(0.05, called_back.set)
    (caller, worker), times = await in_thread(lambda: (threading.main_thread().ident, threading.get_ident()))
    _, slept = await in_thread(lambda: time.sleep(0.2))
    assert caller != worker
    assert times.cpu_s is not None and times.queue_s is not None
    assert slept.wall_s >= 0.2 and called_back.is_set(), "the event loop ran while the worker slept"


def test_times_add_up_and_unknown_stays_unknown():
    total = ThreadTimes(1.0, 0.5, 0.25) + ThreadTimes(2.0, 1.0, 0.5)
    assert total == ThreadTimes(3.0, 1.5, 0.75)
    assert (total + ThreadTimes(1.0)) == ThreadTimes(4.0, None, None)
