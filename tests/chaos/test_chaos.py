"""`rollart chaos`: a short campaign with every fault type, and the audit must hold.

Scheduled (not random) so each fault type happens in CI: SIGKILL of generation (engine and all),
Redis flush, SIGKILL of the broker (the campaign's own Apache Kafka, restarted on its log), SIGKILL of
the trainer, bad records into every consumed topic, SIGKILL of env, reward and feeder; configured
throughout: env steps that hang or raise, a reward endpoint that fails (503 and 400) and stalls.
Redundancy 0 (the default): members lost to env faults are replaced on demand; no stall is allowed.

Under ``bus.processing_guarantee: exactly_once`` (the transactional hops' duplicates must be 0 on the
log itself, not only in training); at-least-once with Redis de-duplication is what the kill, flush
and resume tests of the stages and of the bus contract run.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from rollart.chaos.inject import KILLABLE
from rollart.chaos.run import ChaosDriver
from rollart.config import RollartConfig
from rollart.local.processes import StageProcess
from tests.conftest import REPO

STEPS = 16
SCHEDULE = ["kill:generation", "redis-flush", "kill:broker", "kill:trainer", "bad-messages", "kill:env", "kill:reward",
            "kill:feeder"]


def orphan_engines() -> set[int]:
    """vLLM engine processes whose parent died (a SIGKILLed stage that left its engine behind)."""
    out = set()
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/stat") as fh:
                stat = fh.read()
        except OSError:
            continue
        name, fields = stat[stat.index("(") + 1:stat.rindex(")")], stat[stat.rindex(")") + 2:].split()
        if name.startswith("VLLM::") and fields[1] == "1":
            out.add(int(pid))
    return out


@pytest.mark.timeout(900)
def test_every_fault_type_is_survived_and_every_trajectory_accounted_for(tiny_model, tmp_path):
    before = orphan_engines()
    out = tmp_path / "chaos" / "result.json"
    # No endpoints: the campaign starts a stack of its own, whose broker it may kill.
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("ROLLART_")},
           "ROLLART_HOME": str(tmp_path / "home"), "ROLLART_MODEL_PATH": str(tiny_model),
           "ROLLART_MODEL_INIT_TINY": "false", "ROLLART_BUS_PROCESSING_GUARANTEE": "exactly_once",
           "ROLLART_GENERATION_TRANSPORT": "direct"}  # the demo's turn path: a killed member's turns go elsewhere
    result = subprocess.run([sys.executable, "-m", "rollart.cli", "chaos", "--steps", str(STEPS), "--interval", "1",
                             "--schedule", ",".join(SCHEDULE), "--broker", "kafka", "--baseline-steps", "0",
                             "--out", str(out)],
                            cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
    assert out.exists(), result.stdout[-3000:] + result.stderr[-3000:]
    report = json.loads(out.read_text())
    audit = report["audit"]
    assert result.returncode == 0, json.dumps(audit)[:3000]
    assert [e["kind"] for e in report["events"]] == [s.split(":")[0] for s in SCHEDULE], "every fault injected"
    assert all(e["recovered_s"] is not None for e in report["events"]), "training went on after every fault"
    assert report["trajectories_lost"] == 0 and report["duplicates_trained"] == 0
    # exactly-once hops: a stage killed mid-transaction leaves only aborted records, which no reader
    # sees; the feeder's tasks are at-least-once (a killed feeder re-sends; env de-duplicates them)
    duplicates = report["duplicates_produced"]
    assert set(duplicates) == {"tasks", "trajectories.completed", "rewards.results"}
    assert duplicates["trajectories.completed"] == 0 and duplicates["rewards.results"] == 0, \
        (duplicates, audit["duplicate_examples"])
    assert isinstance(duplicates["tasks"], int) and duplicates["tasks"] >= 0
    assert audit["holds"] and report["stages_alive"] and report["faults_survived"] == report["faults_injected"]
    assert audit["bad_injected"] >= 4 * 5 and not audit["bad_not_in_dlq"], "every bad record dead-lettered"
    assert audit["staleness_max"] <= 1 and audit["trained"] == STEPS * 16
    assert set(report["restarts"]) == {"gen-default-0", "trainer", "env-0", "reward-0", "feeder"}
    assert report["aborted"].get("env_step_failed", 0) > 0, "the env faults happened"
    assert audit["replacements"] > 0, "redundancy 0: members lost to env faults were replaced"
    assert audit["reward_replacements"] >= min(1, audit["reward_dead_lettered"]), "dead-lettered members replaced"
    assert not audit["stalled"] and audit["longest_stall_s"] > 0
    assert report["reward_calls"]["transient"] > 0 and report["reward_calls"]["slow"] > 0
    assert set(report["recovery_s"]) == {"kill", "redis-flush", "bad-messages"} | {f"kill:{s}" for s in KILLABLE} \
        | {"kill:broker"}
    broker_kill = next(e for e in report["events"] if e["target"].startswith("kafka pid"))
    assert broker_kill["recovered_s"] is not None, "training went on after the broker came back on its log"
    assert orphan_engines() <= before, "a killed generation stage left its vLLM engine running"


def test_a_killed_stage_leaves_no_children_behind(tmp_path):
    """Regression (found by the chaos run): SIGKILL of a generation stage orphaned its vLLM engine core."""
    child_pid_file = tmp_path / "child.pid"
    proc = subprocess.Popen(["bash", "-c", f"sleep 300 & echo $! > {child_pid_file}; wait"], start_new_session=True)
    stage = StageProcess("gen-x-0", [], tmp_path / "log", proc)
    deadline = time.monotonic() + 10
    while not child_pid_file.exists() or not child_pid_file.read_text().strip():
        assert time.monotonic() < deadline
        time.sleep(0.05)
    child = int(child_pid_file.read_text())
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    os.kill(child, 0)  # the orphan is still there
    stage.reap_group()
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        try:
            with open(f"/proc/{child}/stat") as fh:
                if fh.read().split(")")[1].split()[0] == "Z":
                    break
        except FileNotFoundError:
            break
        time.sleep(0.05)
    else:
        raise AssertionError("the stage's child survived reap_group")


def test_the_driver_reads_the_trainers_record_while_a_line_is_half_written(tmp_path):
    """Regression (CI, 2026-12-06): the driver read ``record.jsonl`` as the trainer appended to it and
    stopped the campaign on the half-written line's JSONDecodeError."""
    record = tmp_path / "checkpoints" / "record.jsonl"
    record.parent.mkdir()
    driver = ChaosDriver(RollartConfig(), None, tmp_path, {"kill"}, interval_s=1, seed=0, target_steps=4)
    assert driver.steps() == []
    record.write_text(json.dumps({"step": 1, "time": 1.0}) + "\n" + json.dumps({"event": "publish"}) + "\n"
                      + '{"step": 2, "time": 2.0, "trajectory_ids": ["g1-')
    assert [r["step"] for r in driver.steps()] == [1]
    with open(record, "a") as fh:
        fh.write('0"]}\n')
    assert [r["step"] for r in driver.steps()] == [1, 2]
