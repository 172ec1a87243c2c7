"""`rollart bench trainer-step` without --run: a run's steps replayed alone between its steps, the run
stopped meanwhile. The run here is a real child process writing a trainer's record (a whole job is what
the bench runs; what is checked is the pausing and the pairing, which do not depend on what trains)."""

import asyncio
import json
import subprocess
import sys
import time

import psutil
import pytest

from tests.bench.test_benchmarks import LENGTHS, SHARED_PREFIX

# A "run": every 0.15 s a step row (train_s 0.05), and a heartbeat every 5 ms, which a stopped process
# cannot write.
RUN = """
import json, sys, time
record, beats, steps, row = sys.argv[1], sys.argv[2], int(sys.argv[3]), json.loads(sys.argv[4])
with open(beats, "a") as b, open(record, "a") as r:
    for step in range(1, steps + 1):
        end = time.time() + 0.15
        while time.time() < end:
            b.write(f"{time.time()}\\n"); b.flush(); time.sleep(0.005)
        r.write(json.dumps({**row, "step": step, "time": time.time()}) + "\\n"); r.flush()
"""
ROW = {"train_s": 0.05, "train_cpu_s": 0.04, "train_queue_s": 0.005, "lengths": LENGTHS, "generated": [3, 5, 1, 4],
       "shared_prefix": SHARED_PREFIX, "rewards": [1.0, 0.0, 0.0, 1.0], "torch_threads": 1}


async def test_each_due_step_is_replayed_alone_with_the_run_stopped(tmp_path, tiny_model):
    from rollart.bench.trainer_step_interleaved import Interleaver, interleave, summary
    from rollart.config import build_config

    record, beats = tmp_path / "checkpoints" / "record.jsonl", tmp_path / "beats"
    record.parent.mkdir()
    proc = await asyncio.create_subprocess_exec(sys.executable, "-c", RUN, str(record), str(beats), "8",
                                                json.dumps(ROW))
    config = build_config({"model": {"path": str(tiny_model)}, "feeder": {"group_size": 2},
                           "trainer": {"micro_batch": 2}})
    interleaver = Interleaver(config, first=2, every=3, replays=2, processes=lambda: [proc.pid])
    await interleave(proc.wait(), record, interleaver)

    assert proc.returncode == 0
    rows = [json.loads(line) for line in record.read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(1, 9)), "the run went on after every pause"
    assert [r["step"] for r, _ in interleaver.pairs] == [2, 5, 8]
    assert all(len(times) == 2 and all(t.wall_s > 0 and t.cpu_s > 0 for t in times) for _, times in interleaver.pairs)
    stamps = [float(x) for x in beats.read_text().split()]
    for start, end in interleaver.pauses[:2]:  # (the run had written its last row before the third)
        assert end - start > 0.02
        assert not [t for t in stamps if start + 0.01 < t < end - 0.01], "the run wrote while paused"
        assert [t for t in stamps if t > end], "and went on after"
    assert interleaver.config.trainer.torch_threads == 1, "the run's own threads, from its record"

    result = summary(interleaver, rows)
    alone = result["rows"][1]["step_s_mean"]
    assert result["in_run_over_alone"] == pytest.approx(0.05 / alone)
    assert result["cpu_in_run_over_alone"] == pytest.approx(0.04 / result["rows"][1]["cpu_s_mean"])
    assert result["pair_ratio_min"] <= result["pair_ratio_median"] <= result["pair_ratio_max"]
    assert result["setup"]["replayed_steps"] == 3 and result["queue_s_in_run"] == pytest.approx(0.005)
    assert result["after_run_over_alone"] is None and len(result["rows"]) == 3
    # the same shapes once the run is over (`--run`'s way), beside them
    after = interleaver.replay_after()
    assert len(after) == 3 and all(t.wall_s > 0 for t in after)
    result = summary(interleaver, rows, after)
    assert result["rows"][3]["mode"] == "alone, after the run (the same shapes)"
    assert result["after_run_over_alone"] == pytest.approx(result["rows"][3]["step_s_mean"] / alone)


def test_the_every_step_row_leaves_out_the_steps_a_pause_overlapped(tiny_model):
    from rollart.bench.trainer_step_interleaved import Interleaver, summary
    from rollart.config import build_config
    from rollart.training.thread_clock import ThreadTimes

    config = build_config({"model": {"path": str(tiny_model)}})
    interleaver = Interleaver(config, first=2, every=2, replays=1)
    # steps end at 10, 11, 12, 13 s, each 0.5 s long; a pause 11.1-11.6 s overlaps step 3 (11.5-12)
    rows = [{**ROW, "step": s, "time": 9.0 + s, "train_s": 0.5} for s in range(1, 5)]
    interleaver.pairs = [(rows[1], [ThreadTimes(0.25, 0.2, 0.0)]), (rows[3], [ThreadTimes(0.5, 0.4, 0.0)])]
    interleaver.pauses = [(11.1, 11.6), (13.1, 13.4)]
    result = summary(interleaver, rows)
    assert result["rows"][2]["mode"].startswith("in the run (every step")
    assert result["rows"][2]["step_s_mean"] == pytest.approx(0.5)  # steps 2 and 4, not 1 (before) or 3
    assert result["pair_ratio_median"] == pytest.approx(1.5) and result["pair_ratio_max"] == pytest.approx(2.0)
    assert result["in_run_over_alone"] == pytest.approx(0.5 / 0.375)
    with pytest.raises(ValueError, match="no step was replayed"):
        summary(Interleaver(config, first=9, every=2, replays=1), rows)


def test_a_paused_block_continues_the_processes_whatever_it_raises():
    from rollart.bench.trainer_step_interleaved import paused

    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    try:
        with pytest.raises(RuntimeError), paused([child.pid, gone.pid]):  # one already gone: skipped
            time.sleep(0.05)
            assert psutil.Process(child.pid).status() == psutil.STATUS_STOPPED
            raise RuntimeError("a replay failed")
        time.sleep(0.05)
        assert psutil.Process(child.pid).status() != psutil.STATUS_STOPPED
    finally:
        child.kill()
        child.wait()


def test_a_killed_pausing_process_leaves_nothing_stopped(tmp_path):
    """The bench SIGKILLed mid-pause (no finally runs): its guard continues the run's processes."""
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    ready = tmp_path / "ready"
    pausing = subprocess.Popen([sys.executable, "-c", (
        "import sys, time, pathlib\n"
        "from rollart.bench.trainer_step_interleaved import paused\n"
        f"with paused([{sleeper.pid}]):\n"
        f"    pathlib.Path({str(ready)!r}).touch()\n"
        "    time.sleep(60)\n")])
    try:
        deadline = time.monotonic() + 60
        while not ready.exists():
            assert pausing.poll() is None and time.monotonic() < deadline, "the pausing process never paused"
            time.sleep(0.05)
        assert psutil.Process(sleeper.pid).status() == psutil.STATUS_STOPPED
        pausing.kill()
        pausing.wait()
        deadline = time.monotonic() + 10
        while psutil.Process(sleeper.pid).status() == psutil.STATUS_STOPPED:
            assert time.monotonic() < deadline, "still stopped after the pausing process died"
            time.sleep(0.05)
    finally:
        for process in (pausing, sleeper):
            process.kill()
            process.wait()
