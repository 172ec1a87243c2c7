"""`rollart soak`: the memory-trend judgement on known series, the sampler on real processes, and a
short soak of a real job through the CLI."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import psutil
import pytest

from rollart.chaos.soak import StageSeries, memory_trend, throughput_windows, tree_rss_mib
from tests.conftest import REPO


def series(values, every_s=10.0):
    return [(i * every_s, v) for i, v in enumerate(values)]


def test_a_steady_series_is_flat_and_a_leak_is_not():
    steady = memory_trend(series([900] * 3 + [500, 503, 498, 501, 505, 499, 502, 500, 504, 501]), warmup_s=30)
    assert steady["flat"] and steady["baseline_mib"] == pytest.approx(500, abs=5) and steady["samples"] == 10
    leak = memory_trend(series([500 + 8 * i for i in range(20)]), warmup_s=0)  # 8 MiB per sample
    assert not leak["flat"] and leak["growth_mib"] > 100 and leak["slope_mib_per_h"] == pytest.approx(8 * 360, rel=0.01)
    assert memory_trend(series([1, 2, 3]), warmup_s=0)["flat"] is None  # too few samples to judge


def test_the_warm_up_spike_is_not_judged_and_small_processes_get_the_absolute_allowance():
    # a 40 MiB process growing 10 MiB is within FLAT_MIB; the same after a 2 GiB warm-up spike too
    assert memory_trend(series([40] * 5 + [50] * 5), warmup_s=0)["flat"]
    assert memory_trend(series([2048, 2048] + [40] * 5 + [50] * 5), warmup_s=20)["flat"]


def test_a_restarted_stage_is_judged_on_its_newest_process():
    stage = StageSeries("trainer")
    for i, (pid, mib) in enumerate([(1, 100), (1, 400), (2, 100), (2, 101), (2, 100)]):
        stage.add(pid, float(i), mib)
    assert stage.restarts == 1 and stage.starts[-1] == (2, 2.0)


def test_process_tree_memory_counts_children():
    # a parent that starts a child holding 64 MiB (as a generation stage starts its engine core)
    code = ("import subprocess, sys, time; subprocess.Popen([sys.executable, '-c', "
            "'import time; x = b\"x\" * (64 << 20); time.sleep(60)']); time.sleep(60)")
    parent = subprocess.Popen([sys.executable, "-c", code], start_new_session=True)
    try:
        def child_started():
            return psutil.Process(parent.pid).children() or None

        deadline = time.monotonic() + 10
        while not child_started() and time.monotonic() < deadline:
            time.sleep(0.1)
        time.sleep(0.5)
        alone = psutil.Process(parent.pid).memory_info().rss / 2**20
        assert tree_rss_mib(parent.pid) > alone + 60
        assert tree_rss_mib(2**22 + 7) is None  # no such process
    finally:
        os.killpg(parent.pid, signal.SIGKILL)
        parent.wait()


def test_throughput_windows_count_trained_trajectories():
    record = [{"time": 100 + t, "traj_ids": ["a"] * 4} for t in (10, 20, 70, 80, 90)] + [{"event": "x", "time": 1}]
    assert throughput_windows(record, started=100, window_s=60) == [
        {"from_s": 0, "trajectories_per_min": 8.0}, {"from_s": 60, "trajectories_per_min": 12.0}]


@pytest.mark.timeout(600)
def test_overhead_windows_come_from_bucket_increases_and_survive_a_restart():
    from rollart.chaos.scrape import HistogramSample, bucket_quantile, parse_histogram, windows
    from rollart.chaos.soak import OVERHEAD, overhead_figures

    text = (f'# TYPE {OVERHEAD} histogram\n'
            f'{OVERHEAD}_bucket{{job="j",pool="a",le="0.01"}} 3\n{OVERHEAD}_bucket{{job="j",pool="a",le="0.1"}} 4\n'
            f'{OVERHEAD}_bucket{{job="j",pool="a",le="+Inf"}} 4\n{OVERHEAD}_count{{job="j",pool="a"}} 4\n'
            f'{OVERHEAD}_sum{{job="j",pool="a"}} 0.1\n'
            f'{OVERHEAD}_bucket{{job="j",pool="b",le="0.01"}} 1\n{OVERHEAD}_bucket{{job="j",pool="b",le="0.1"}} 1\n'
            f'{OVERHEAD}_bucket{{job="j",pool="b",le="+Inf"}} 1\n{OVERHEAD}_count{{job="j",pool="b"}} 1\n'
            f'{OVERHEAD}_sum{{job="j",pool="b"}} 0.005\n')
    scraped = parse_histogram(text, OVERHEAD, at=10.0)
    assert (scraped.count, scraped.buckets[0.01], scraped.total) == (5, 4, pytest.approx(0.105)), "pools summed"
    assert parse_histogram("# TYPE other counter\nother_total 1\n", OVERHEAD, at=0) is None
    assert bucket_quantile([(0.01, 3), (0.1, 4), (float("inf"), 4)], 0.5) == pytest.approx(0.01 * 2 / 3)

    def at(t, count, fast, total):  # cumulative: `fast` of `count` turns under 10 ms
        return HistogramSample(t, count, total, {0.01: fast, 0.1: count, float("inf"): count})

    # minute 1: 10 fast turns; minute 2: 10 slow ones; then the env restarted (counters from 0): 4 fast
    series = {"env-0": [at(30, 5, 5, 0.025), at(60, 10, 10, 0.05), at(110, 20, 10, 0.6), at(150, 4, 4, 0.02)]}
    rows = windows(series, 0.0, 60.0)
    assert [r["observations"] for r in rows] == [10, 10, 4]
    assert rows[0]["mean_s"] == pytest.approx(0.005) and rows[1]["mean_s"] == pytest.approx(0.055)
    assert rows[0]["p50_s"] < 0.01 < rows[1]["p50_s"] and rows[2]["mean_s"] == pytest.approx(0.005)
    figures = overhead_figures(series, 60.0)
    assert figures["turn_overhead"] == rows  # every window is listed
    # only whole windows are judged: the third, cut short by the last scrape at 150 s, is not
    assert figures["overhead_drift"]["ratio"] == pytest.approx(11.0)
    assert figures["overhead_drift"]["windows_judged"] == 2
    assert overhead_figures(series, 60.0, warmup_s=60.0)["overhead_drift"] is None  # one whole window after it
    assert overhead_figures({}, 60.0) == {"turn_overhead": [], "overhead_drift": None}


def test_a_short_soak_samples_every_stage_and_judges_it(stack, tiny_model, tmp_path):
    """A real job held for 30 s of training: every stage sampled after its warm-up, throughput per window, the verdict
    in the exit code. (The figure itself comes from a long soak; see the README.)"""
    out = tmp_path / "soak" / "result.json"
    env = {**os.environ, "ROLLART_KAFKA_BOOTSTRAP": stack.kafka_bootstrap, "ROLLART_REDIS_URL": stack.redis_url,
           "ROLLART_MODEL_PATH": str(tiny_model), "ROLLART_MODEL_INIT_TINY": "false"}
    result = subprocess.run([sys.executable, "-m", "rollart.cli", "soak", "--minutes", "0.5", "--warmup", "15",
                             "--sample", "1", "--out", str(out)], cwd=REPO, env=env, capture_output=True, text=True,
                            timeout=500)
    assert out.exists(), result.stdout[-3000:] + result.stderr[-3000:]
    report = json.loads(out.read_text())
    assert set(report["stages"]) == {"feeder", "env-0", "reward-0", "trainer", "gen-default-0"}
    for name, row in report["stages"].items():
        assert row["samples"] >= 5 and row["restarts"] == 0, (name, row)
        assert row["baseline_mib"] > 40 and row["peak_mib"] >= row["end_mib"], (name, row)
    # the engine core is a child of the generation stage: its tree holds the model and the KV cache
    assert report["stages"]["gen-default-0"]["baseline_mib"] > report["stages"]["feeder"]["baseline_mib"]
    assert report["steps"] > 0 and report["trajectories_trained"] > 0 and report["throughput"]
    turns = [w for w in report["turn_overhead"] if w["observations"]]
    assert turns and all(w["mean_s"] > 0 and w["p50_s"] is not None for w in turns), report["turn_overhead"]
    assert result.returncode == (0 if report["flat"] else 1), result.stdout[-2000:]
    pids = json.loads((out.parent / "run" / "pids.json").read_text())
    assert not any(psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE
                   for p in pids.values()), "the soak stopped its stages"
