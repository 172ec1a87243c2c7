"""`rollart bench scheduling`'s pieces: every thread of a process tree switched to a setting, and
each setting's blocks of steps read off the training record."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from rollart.bench.scheduling import SETTINGS, is_switched, against_baseline, block_figures, can_lower_niceness
from rollart.local.processes import thread_slice_ns
from rollart.local.supervision import schedule_threads

# A process with two extra threads and a child of its own, all asleep.
TREE = ("import subprocess, sys, threading, time\n"
        "child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'])\n"
        "for _ in range(2): threading.Thread(target=time.sleep, args=(60,), daemon=True).start()\n"
        "print(child.pid, flush=True); time.sleep(60)")


def threads_of(pid: int) -> list[int]:
    return [int(t) for t in os.listdir(f"/proc/{pid}/task")]


def test_every_thread_of_a_tree_is_switched_and_back():
    parent = subprocess.Popen([sys.executable, "-c", TREE], stdout=subprocess.PIPE, text=True)
    try:
        child = int(parent.stdout.readline())
        time.sleep(0.2)
        tids = threads_of(parent.pid) + threads_of(child)
        assert len(tids) >= 4
        base = os.nice(0)
        assert schedule_threads([parent.pid], SETTINGS["nice+batch"], base) == len(tids)
        assert {(os.sched_getscheduler(t), os.getpriority(os.PRIO_PROCESS, t)) for t in tids} == \
            {(os.SCHED_BATCH, base + 10)}, "every thread, the child's too"
        schedule_threads([parent.pid], SETTINGS["idle"], base)  # SCHED_IDLE keeps the niceness asked for too
        assert {(os.sched_getscheduler(t), os.getpriority(os.PRIO_PROCESS, t)) for t in tids} == \
            {(os.SCHED_IDLE, base + 10)}
        if can_lower_niceness():
            schedule_threads([parent.pid], SETTINGS["slice20"], base)
            assert {(os.sched_getscheduler(t), os.getpriority(os.PRIO_PROCESS, t), thread_slice_ns(t))
                    for t in tids} == {(os.SCHED_OTHER, base, 20_000_000)}, "a 20 ms slice, back at the base niceness"
            schedule_threads([parent.pid], SETTINGS["runner"], base)
            assert {(os.sched_getscheduler(t), os.getpriority(os.PRIO_PROCESS, t)) for t in tids} == \
                {(os.SCHED_OTHER, base)}
            assert all(thread_slice_ns(t) < 20_000_000 for t in tids), "the kernel's default slice again"
        else:  # an unprivileged user cannot take a niceness back: it is said, not ignored
            with pytest.raises(PermissionError):
                schedule_threads([parent.pid], SETTINGS["runner"], base)
    finally:
        parent.kill()
        parent.wait()
    assert schedule_threads([parent.pid], SETTINGS["runner"], 0) == 0, "a process gone is skipped"


def test_each_settings_blocks_leave_out_the_step_across_the_switch():
    durations = [2.0] * 5 + [1.0, 1.0, 1.0, 1.0] + [2.2, 2.0, 2.0] + [9.0, 1.2, 1.2]  # steps 2..16
    rows, t = [{"step": 1, "time": 0.0}], 0.0
    for step, d in enumerate(durations, start=2):
        t += d
        rows.append({"step": step, "time": t})
    rows.append({"event": "publish", "step": 3, "time": 1.0})
    blocks = block_figures(rows, [(1, "runner"), (5, "nice+batch"), (10, "runner"), (13, "nice+batch")])
    # runner: steps 3-5, then 12-13; nice+batch: steps 7-10, then 15-16 (the 9 s step 14 straddles)
    assert [name for name, _ in blocks] == ["runner", "nice+batch", "runner", "nice+batch"]
    assert [seconds for _, seconds in blocks] == pytest.approx([2.0, 1.0, 2.0, 1.2])


def test_a_block_of_alternating_short_and_long_steps_counts_its_mean():
    # a trainer that finds its next batch waiting trains it at once: steps alternate 0.1 s and 0.7 s
    rows = [{"step": s, "time": t} for s, t in enumerate([0.0, 1.0, 1.1, 1.8, 1.9, 2.6, 2.7, 3.4], start=1)]
    assert block_figures(rows, [(1, "runner")]) == [("runner", pytest.approx(0.4))]


def test_a_setting_is_held_to_the_baseline_blocks_either_side_as_the_run_slows():
    # the run slows by 0.2 s per block; the setting is 10% faster than the baseline would be there
    blocks = [("runner", 1.0), ("b", 0.9 * 1.2), ("runner", 1.4), ("b", 0.9 * 1.6), ("c", 1.8), ("runner", 2.0),
              ("b", 0.9 * 2.0)]
    ratios = against_baseline(blocks, "runner")
    assert ratios["b"] == pytest.approx([0.9, 0.9, 0.9]), "interpolated inside, the nearest baseline at the end"
    assert ratios["c"] == pytest.approx([1.0])
    assert against_baseline([("b", 1.0)], "runner") == {}


def test_switch_stack_takes_the_runs_own_services(tmp_path):
    from rollart.bench.scheduling import _switched_pids
    from rollart.local.stack import STACK_FILE
    from rollart.local.state import StackState

    assert _switched_pids(tmp_path, "stack") == [], "a run on configured endpoints has no services of its own"
    (tmp_path / "stack").mkdir()
    StackState(kafka_bootstrap="127.0.0.1:1", redis_url="redis://127.0.0.1:2/0", broker_pid=11, redis_pid=None,
               log_dir=str(tmp_path), started_at=0.0, mooncake_pids=[12, 13],
               owner_pid=os.getpid()).write(tmp_path / "stack" / STACK_FILE)
    assert sorted(_switched_pids(tmp_path, "stack")) == [11, 12, 13], "Redis not started by the run is not switched"


def test_what_each_switch_takes_from_the_jobs_plan():
    stages = ["trainer", "generation", "env", "reward", "feeder", "stack"]
    assert [s for s in stages if is_switched(s, "rollout")] == ["generation", "env", "reward", "feeder"]
    assert [s for s in stages if is_switched(s, "trainer")] == ["trainer"]
    assert [s for s in stages if is_switched(s, "stack")] == ["stack"]
