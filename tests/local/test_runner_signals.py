"""A runner stopped by SIGINT, SIGTERM or SIGKILL leaves no process of its stack behind.

`rollart run`, on a stack of its own (the broker, an embedded Redis where none answers, the Mooncake
store where installed), is stopped each way; then neither a recorded pid, nor a process that was below
the runner, nor any process naming the test's folder (a stage's --config, a service's ROLLART_STACK
mark) may be left. `rollout` (SIGKILL), `chaos` (SIGTERM), `soak` (SIGINT) and `bench` (SIGKILL) are
each stopped one of the three ways once their stack is up, and a test checks that every runner gets
the SIGTERM handling; the SIGKILL run checks on the way that its stages run at the niceness
and policy ``machine.scheduling`` gives them, in the runner's session (so that those count between them). Two more: a service forked from a passing thread outlives that thread (the
death signal follows the forking thread), and a stack's next start reaps a dead owner's leftovers.

Cost (a CI on 2 cores): SIGINT and SIGTERM arrive once the stack is up, before the stages start
(stages told to stop while they import torch take tens of seconds to leave, and stopping them is
the runner's long-tested stop_all); SIGKILL once the stages are spawned, so that their death signal
is tested too. SIGINT, which always unwound, runs on Tansu; the others on the suite's broker.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import psutil
import pytest
import yaml

from rollart.local.processes import thread_slice_ns
from rollart.local.stack import (STACK_ENV, STACK_FILE, LocalStack, StackState, _spawn, pid_alive, reap_stale,
                                 stack_of)
from tests.conftest import REPO, SUITE_BROKER
from tests.job.harness import ctrl_c_reaches_it

ROLLART = [sys.executable, "-m", "rollart.cli"]
GONE_WITHIN_S = 20.0  # a JVM's shutdown, and a stage told to stop while it imports torch, on 2 busy cores


def _env(tmp_path: Path, **extra: str) -> dict[str, str]:
    """No configured endpoints and an empty ROLLART_HOME: the runner starts a stack of its own."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("ROLLART_")}
    return {**env, "ROLLART_HOME": str(tmp_path / "home"), **extra}


def _mentions(pid: int, folder: str) -> bool:
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace")
    except OSError:
        return False
    return folder in cmdline or folder in (stack_of(pid) or "")


def descendants(root: int) -> list[int]:
    """Every process below ``root`` now (a stage's engine processes name no folder of ours)."""
    parents = {}
    for entry in Path("/proc").iterdir():
        try:
            parents[int(entry.name)] = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
        except (ValueError, OSError, IndexError):
            continue
    found, frontier = [], [root]
    while frontier:
        children = [pid for pid, ppid in parents.items() if ppid in frontier]
        found += children
        frontier = children
    return found


def survivors(folder: Path, pids: list[int]) -> list[str]:
    """The live processes among ``pids`` and among all that name ``folder`` (zombies are dead)."""
    found = {pid for pid in pids if pid_alive(pid)}
    found |= {int(p.name) for p in Path("/proc").iterdir()
              if p.name.isdigit() and int(p.name) != os.getpid() and _mentions(int(p.name), str(folder))
              and pid_alive(int(p.name))}
    return [f"{pid}: {Path(f'/proc/{pid}/cmdline').read_bytes()[:160]!r}" for pid in sorted(found)
            if Path(f"/proc/{pid}").exists()]


def assert_none_survive(folder: Path, pids: list[int], within_s: float = GONE_WITHIN_S) -> None:
    deadline = time.monotonic() + within_s
    while (left := survivors(folder, pids)) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not left, f"still running {within_s:.0f}s after their runner went:\n" + "\n".join(left)


def start(argv: list[str], tmp_path: Path, env: dict[str, str]) -> subprocess.Popen:
    with open(tmp_path / "runner.log", "w") as log:
        return subprocess.Popen(argv, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, preexec_fn=ctrl_c_reaches_it)


def output(tmp_path: Path) -> str:
    return (tmp_path / "runner.log").read_text(errors="replace")[-3000:]


def wait_for(predicate, proc: subprocess.Popen, what: str, tmp_path: Path, timeout_s: float = 180.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if proc.poll() is not None:
            raise AssertionError(f"the runner exited with {proc.returncode} before {what}:\n{output(tmp_path)}")
        assert time.monotonic() < deadline, f"timed out waiting for {what}:\n{output(tmp_path)}"
        time.sleep(0.1)


def stack_pids(stack_file: Path) -> list[int]:
    state = StackState.read(stack_file)
    assert state is not None and state.owner_pid, f"{stack_file} records no owned stack"
    return [pid for pid in state.pids() if pid]


def stop(proc: subprocess.Popen, sig: int) -> tuple[int, list[int]]:
    """Send ``sig``; returns the exit status and the processes the runner had below it."""
    below = descendants(proc.pid)
    proc.send_signal(sig)
    return proc.wait(150), below  # the stages share a 40 s stop budget; the broker flushes its log


JOB = {"job": "sigtest", "pools": ["default"], "feeder": {"group_size": 2, "groups_per_batch": 1},
       "trainer": {"micro_batch": 2}, "machine": {"scheduling": {
           "env": {"nice": 3, "policy": "batch"}, "reward": {"policy": "idle"}, "feeder": {"nice": 2},
           "trainer": {"slice_ms": 20}, "stack": {"nice": 4, "policy": "batch"}}},
       "tags": {"frozenlake": {"env": "frozenlake", "env_kwargs": {}, "max_turns": 2, "reward": {"type": "env"}}}}


@pytest.mark.timeout(300)
@pytest.mark.parametrize("sig, broker, once", [(signal.SIGINT, "tansu", f"stack/{STACK_FILE}"),
                                               (signal.SIGTERM, SUITE_BROKER, f"stack/{STACK_FILE}"),
                                               (signal.SIGKILL, SUITE_BROKER, "pids.json")],
                         ids=["SIGINT", "SIGTERM", "SIGKILL"])
def test_rollart_run_leaves_nothing_behind(sig, broker, once, tiny_model, tmp_path):
    """``once``: the file in --out whose appearance says the runner got that far."""
    (tmp_path / "job.yaml").write_text(yaml.safe_dump({**JOB, "model": {"path": str(tiny_model)}}))
    out = tmp_path / "out"
    proc = start([*ROLLART, "run", str(tmp_path / "job.yaml"), "--steps", "50", "--out", str(out),
                  "--broker", broker], tmp_path, _env(tmp_path))
    try:
        wait_for((out / once).exists, proc, f"its {once}", tmp_path)
        pids = stack_pids(out / "stack" / STACK_FILE)
        if (out / "pids.json").exists():
            stages = json.loads((out / "pids.json").read_text())
            pids += stages.values()
            scheduled = {name: (psutil.Process(pid).nice() - os.nice(0), os.sched_getscheduler(pid))
                         for name, pid in stages.items()}
            assert scheduled == {"gen-default-0": (0, os.SCHED_OTHER), "env-0": (3, os.SCHED_BATCH),
                                 "reward-0": (0, os.SCHED_IDLE), "trainer": (0, os.SCHED_OTHER),
                                 "feeder": (2, os.SCHED_OTHER)}, \
                "each stage runs at the niceness and policy machine.scheduling gives it"
            assert thread_slice_ns(stages["trainer"]) == 20_000_000, "the trainer asked for its 20 ms slice"
            assert thread_slice_ns(stages["env-0"]) != 20_000_000, "a stage that asks for none keeps the default"
            threads = [int(t) for pid in stack_pids(out / "stack" / STACK_FILE) for t in os.listdir(f"/proc/{pid}/task")]
            assert {(os.getpriority(os.PRIO_PROCESS, t) - os.nice(0), os.sched_getscheduler(t)) for t in threads} \
                == {(4, os.SCHED_BATCH)}, "every thread of the run's own stack (the broker's JVM too) as `stack` says"
            # Linux's autogroup shares the CPU between sessions before their threads' policies count
            assert {os.getsid(pid) for pid in pids} == {os.getsid(proc.pid)}, "stages and stack: the runner's session"
        code, below = stop(proc, sig)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    if sig != signal.SIGKILL:  # it unwound (stopped what it started), not died of the signal
        assert code >= 0, f"rollart run died of {signal.Signals(-code).name} instead of stopping:\n{output(tmp_path)}"
        assert not [pid for pid in pids if pid_alive(pid)], "unwound: its stack was stopped before it exited"
        report = json.loads((out / "report.json").read_text())
        assert report["interrupted"] and report["steps"] == [], "an interrupted run still reports (nothing trained)"
    assert_none_survive(tmp_path, pids + below)


def test_the_runner_commands_and_only_they_turn_sigterm_into_ctrl_c(monkeypatch):
    import rollart.cli as cli
    from typer.testing import CliRunner

    installed = []
    monkeypatch.setattr(cli, "sigterm_as_sigint", lambda: installed.append(True) or (lambda: None))
    for command in ("run", "rollout", "chaos", "soak", "bench", "consume", "local"):
        installed.clear()
        assert CliRunner().invoke(cli.app, [command, "--help"]).exit_code == 0
        assert bool(installed) == (command in cli.RUNNERS), command
    assert {"run", "rollout", "chaos", "soak", "bench"} <= cli.RUNNERS


SPAWN_FROM_A_THREAD = textwrap.dedent("""
    import sys, threading, time
    from pathlib import Path
    from rollart.local.stack import _spawn

    procs = []
    worker = threading.Thread(target=lambda: procs.append(_spawn(["sleep", "60"], Path(sys.argv[1]) / "x.log")))
    worker.start()
    worker.join()  # the forking thread is gone: the death signal must not follow it
    print(procs[0].pid, flush=True)
    time.sleep(60)
""")


def test_a_service_spawned_from_a_passing_thread_lives_as_long_as_its_process(tmp_path):
    proc = subprocess.Popen([sys.executable, "-c", SPAWN_FROM_A_THREAD, str(tmp_path)], cwd=REPO,
                            stdout=subprocess.PIPE, text=True)
    try:
        child = int(proc.stdout.readline())
        time.sleep(0.5)
        assert pid_alive(child), "the service died with the thread that forked it"
        assert stack_of(child) == str(tmp_path), f"{STACK_ENV} marks the service's stack"
    finally:
        proc.kill()
        proc.wait()
    assert_none_survive(tmp_path, [child], 5)


def test_the_next_start_reaps_a_dead_owners_services_and_nothing_else(tmp_path):
    """The guard behind the death signal: a stack starting in a folder first stops what the dead
    owner of that folder's last stack left running (it would hold ports and the Kafka log's lock)."""
    marked = _spawn(["sleep", "60"], tmp_path / "logs" / "x.log", detached=True)
    stranger = subprocess.Popen(["sleep", "60"])  # a recycled pid: recorded, but not the stack's
    dead = subprocess.Popen(["true"])
    dead.wait()
    stack_file = tmp_path / "logs" / STACK_FILE
    state = StackState(kafka_bootstrap="127.0.0.1:1", redis_url="", broker_pid=marked.pid, redis_pid=None,
                       log_dir=str(tmp_path / "logs"), started_at=0.0, mooncake_pids=[stranger.pid],
                       owner_pid=dead.pid)
    try:
        state.write(stack_file)
        with LocalStack(log_dir=tmp_path / "logs", broker="tansu", mooncake=False, state_file=stack_file) as new:
            assert marked.wait(5) is not None and stranger.poll() is None
            assert new.owner_pid == os.getpid() and StackState.read(stack_file) == new
        state.owner_pid = os.getpid()  # a live owner's stack is its own business
        state.write(stack_file)
        assert reap_stale(stack_file) == [] and stack_file.exists()
    finally:
        for proc in (marked, stranger):
            proc.kill()
            proc.wait()


def _stack_file(tmp_path: Path) -> Path | None:
    return next(tmp_path.rglob(STACK_FILE), None)


OTHER_RUNNERS = {  # the rest of the runners, each stopped one of the three ways
    "rollout": (signal.SIGKILL, lambda job, out: ["rollout", job, "--trajectories", "200", "--out", str(out)]),
    "chaos": (signal.SIGTERM, lambda job, out: ["chaos", job, "--steps", "20", "--baseline-steps", "0",
                                                "--broker", "kafka", "--out", str(out / "result.json")]),
    "soak": (signal.SIGINT, lambda job, out: ["soak", job, "--minutes", "5", "--out", str(out / "result.json")]),
    "bench": (signal.SIGKILL, lambda job, out: ["bench", "serverless-reward", "-c", job, "--out", str(out / "b.json")]),
}


@pytest.mark.timeout(300)
@pytest.mark.parametrize("runner", sorted(OTHER_RUNNERS))
def test_the_other_runners_leave_nothing_behind(runner, tiny_model, tmp_path):
    """Each is stopped once its own stack is up (a bench's is in a temporary folder: TMPDIR is the
    test's); then nothing of that stack, nor anything below the runner, may be left."""
    sig, argv = OTHER_RUNNERS[runner]
    (tmp_path / "job.yaml").write_text(yaml.safe_dump({**JOB, "model": {"path": str(tiny_model)}}))
    (tmp_path / "tmp").mkdir()
    proc = start([*ROLLART, *argv(str(tmp_path / "job.yaml"), tmp_path / "out")], tmp_path,
                 _env(tmp_path, TMPDIR=str(tmp_path / "tmp")))
    try:
        wait_for(lambda: _stack_file(tmp_path) is not None, proc, "its stack", tmp_path)
        wait_for(lambda: StackState.read(_stack_file(tmp_path)) is not None, proc, "its stack's state", tmp_path)
        pids = stack_pids(_stack_file(tmp_path))
        code, below = stop(proc, sig)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    if sig != signal.SIGKILL:
        assert code >= 0, f"rollart {runner} died of {signal.Signals(-code).name} instead of stopping:\n" \
                          f"{output(tmp_path)}"
    assert_none_survive(tmp_path, pids + below)
