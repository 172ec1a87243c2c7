"""`rollart bench stage-cpu`'s pieces: CPU read from /proc for a process tree (a vLLM engine apart
from the process holding it), the counters interpolated at step times, the per-stage rows over a
steady window, and the in-process loop's two phases."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from rollart.bench.stage_cpu import ENGINE, CpuSampler, CpuSeries, cpu_rows, engine_split, phase_cpu, steady_window
from rollart.proctree import tree_cpu_s

BUSY = "import time\nend = time.process_time() + {s}\nwhile time.process_time() < end: pass\ntime.sleep(60)"


def test_a_process_trees_cpu_counts_its_busy_child():
    parent = subprocess.Popen([sys.executable, "-c",
                               f"import subprocess, sys; subprocess.run([sys.executable, '-c', {BUSY.format(s=0.6)!r}])"])
    try:
        deadline = time.monotonic() + 30
        while (tree_cpu_s(parent.pid) or 0.0) < 0.6 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert tree_cpu_s(parent.pid) >= 0.6, "the child's busy loop is in its parent's tree"
        assert tree_cpu_s(parent.pid, children=False) < 0.5, "without children: the parent alone, which sleeps"
    finally:
        parent.kill()
        parent.wait()
    assert tree_cpu_s(parent.pid) is None


def test_counters_are_interpolated_at_step_times_and_a_restart_starts_over():
    s = CpuSeries(pid=1)
    for at, cpu in [(10.0, 1.0), (11.0, 2.0), (12.0, 2.5)]:
        s.add(1, at, cpu)
    assert s.between(10.5, 11.5) == pytest.approx(2.25 - 1.5)
    assert s.between(9.0, 11.0) is None, "before the first reading: not covered"
    s.add(1, 13.0, 0.2)  # a child exited with its counter: not a reading
    assert s.at(12.0) == 2.5 and len(s.samples) == 3
    s.add(2, 14.0, 0.1)
    assert s.restarted and s.samples == [(14.0, 0.1)]


def rows(n: int, samples: int = 8, turns: float = 3.0) -> list[dict]:
    return [{"step": i, "time": 100.0 + 2 * i, "samples": samples, "turns_mean": turns, "train_s": 1.0}
            for i in range(1, n + 1)] + [{"event": "resumed", "time": 0.0}]


def test_the_window_skips_warm_up_and_the_last_step():
    window = steady_window(rows(10), skip=3)
    assert (window["start"], window["end"]) == (108.0, 118.0), "steps 4 to 9"
    assert window["steps"] == 5 and window["trajectories"] == 40 and window["turns"] == 120
    with pytest.raises(ValueError, match="at least 6"):
        steady_window(rows(5), skip=3)


def test_rows_give_each_stage_its_cores_and_cpu_per_step_trajectory_and_turn():
    window = steady_window(rows(10), skip=3)  # 10 s, 5 steps, 40 trajectories, 120 turns
    series = {}
    for name, rate in [("gen-default-0", 0.5), ("env-0", 0.2), ("env-1", 0.1), ("trainer", 0.9)]:
        series[name] = CpuSeries(pid=7)
        for t in range(100, 125):
            series[name].add(7, float(t), rate * (t - 100))
    series["reward-0"] = CpuSeries(pid=8)
    series["reward-0"].add(9, 112.0, 1.0)  # restarted inside the window

    out = {r["stage"]: r for r in cpu_rows(series, window, lambda name: name.split("-")[0])}
    assert out["env"]["processes"] == 2 and out["env"]["cores"] == pytest.approx(0.3)
    assert out["env"]["core_s_per_step"] == pytest.approx(0.6)
    assert out["env"]["cpu_ms_per_trajectory"] == pytest.approx(75.0)
    assert out["env"]["cpu_ms_per_turn"] == pytest.approx(25.0)
    assert out["reward"]["partial"] == ["reward-0"] and out["reward"]["cores"] == 0
    assert out["all"]["cores"] == pytest.approx(1.7)
    assert out["trainer"]["share"] == pytest.approx(0.9 / 1.7)


def test_the_sampler_reads_named_trees_and_follows_a_restart():
    procs = [subprocess.Popen([sys.executable, "-c", BUSY.format(s=0.3)]) for _ in range(2)]
    try:
        current = {"a": procs[0].pid}
        sampler = CpuSampler(lambda table: {name: (pid, True) for name, pid in current.items()}, 0.0)
        sampler.sample()
        current["a"] = procs[1].pid
        sampler.sample()
        assert sampler.series["a"].restarted and sampler.series["a"].pid == procs[1].pid
        # as if the sampler had already spent 5 s (its real cost is milliseconds, below /proc's 10 ms ticks)
        itself = CpuSampler(lambda table: {"me": (os.getpid(), False)}, 0.0)
        itself.own_cpu_s = 5.0
        itself.sample()
        assert itself.series["me"].samples[-1][1] <= tree_cpu_s(os.getpid(), children=False) - 5.0, \
            "this process is read without the sampler's own CPU"
        assert itself.own_cpu_s >= 5.0, "and the sample's own CPU is added to it"
    finally:
        for p in procs:
            p.kill()
            p.wait()


def test_the_stacks_services_are_named_and_the_machines_redis_is_found_by_its_port(tmp_path):
    import json
    import os
    import socket

    from rollart.bench.stage_cpu import stack_pids

    with socket.socket() as server:  # stands where the machine's own Redis would listen
        server.bind(("127.0.0.1", 0))
        server.listen()
        port = server.getsockname()[1]
        (tmp_path / "stack.json").write_text(json.dumps({"broker_pid": 11, "redis_pid": None, "mooncake_pids": [12, 13],
                                                         "redis_url": f"redis://127.0.0.1:{port}/0"}))
        assert stack_pids(tmp_path / "stack.json") == {"broker": 11, "redis": os.getpid(), "mooncake-0": 12,
                                                       "mooncake-1": 13}
    assert stack_pids(tmp_path / "missing.json") == {}


def test_a_vllm_engine_below_a_process_is_read_apart_from_it():
    """The engine core is found by the title vLLM gives it (here an argument standing in for it);
    the process holding it is then read alone."""
    code = (f"import subprocess, sys; subprocess.run([sys.executable, '-c', {BUSY.format(s=0.6)!r}, "
            "'VLLM::EngineCore'])")
    parent = subprocess.Popen([sys.executable, "-c", code])
    try:
        deadline = time.monotonic() + 30
        while len(split := engine_split("gen-default-0", parent.pid)) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        (core, children), = [target for name, target in split.items() if name == "gen-default-0" + ENGINE]
        assert split["gen-default-0"] == (parent.pid, False) and core != parent.pid and children
        while (tree_cpu_s(core) or 0.0) < 0.6 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert tree_cpu_s(core) >= 0.6 and tree_cpu_s(parent.pid, children=False) < 0.5
    finally:
        parent.kill()
        parent.wait()
    assert engine_split("gone", parent.pid) == {"gone": (parent.pid, False)}


def test_the_in_process_loops_phases_split_each_steps_cpu_at_the_end_of_its_rollout():
    window = steady_window(rows(10), skip=3)  # steps 5 to 9 trained, from step 4's record at 108 s
    # each step: 0.5 s of rollout (loop 0.2 core-s, engine 0.3), then 1.5 s of training (loop 2.0)
    marks = [(phase, step, at) for step in range(1, 11)
             for phase, at in (("rollout", 100.0 + 2 * step - 1.5), ("step", 100.0 + 2 * step))]
    loop, engine, cpu_loop, cpu_engine = CpuSeries(pid=1), CpuSeries(pid=2), 0.0, 0.0
    for phase, _step, at in marks:
        if phase == "rollout":
            cpu_loop, cpu_engine = cpu_loop + 0.2, cpu_engine + 0.3
        else:
            cpu_loop += 2.0
        loop.add(1, at, cpu_loop)
        engine.add(2, at, cpu_engine)
    phases = phase_cpu({"loop": loop, "engine": engine}, marks, window)
    assert phases == {"rollout": pytest.approx(0.5), "train": pytest.approx(2.0)}
    with pytest.raises(ValueError, match="step 5's rollout phase was not marked"):
        phase_cpu({"loop": loop}, [m for m in marks if m[:2] != ("rollout", 5)], window)
