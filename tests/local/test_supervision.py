"""The CPU plan of a run on one machine: ``machine.scheduling`` names stages (and ``stack``, the local
stack's services), and a typo fails at start-up; a member starts under its stage's start-up policy
and takes its run scheduling once its readiness probe passes."""

from __future__ import annotations

import os
import sys
import textwrap
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from rollart.config import ConfigError, StageScheduling, build_config
from rollart.endpoints import Endpoints
from rollart.local.processes import StageProcess, StageProcesses
from rollart.local.supervision import settle_startups, stage_scheduling
from rollart.proctree import descendants, process_table


def test_machine_scheduling_names_registered_stages_and_a_typo_fails_naming_it():
    plan = stage_scheduling(build_config({"machine": {"scheduling": {"env": {"nice": 5, "policy": "batch"},
                                                                     "stack": {"nice": 10}}}}))
    assert plan == {"env": StageScheduling(nice=5, policy="batch"), "stack": StageScheduling(nice=10)}
    with pytest.raises(ConfigError, match=r"machine\.scheduling: gen is not a stage; the stages are generation, env"):
        stage_scheduling(build_config({"machine": {"scheduling": {"gen": {"nice": 5}}}}))


def test_a_colocated_stage_not_named_is_scheduled_as_generation():
    """envgen holds the generation member's engine, whose start is the run's critical path."""
    generation, env = StageScheduling(nice=5, policy="batch", startup_policy="normal"), StageScheduling(nice=5)
    scheduling = {"machine": {"scheduling": {"env": env, "generation": generation}}}
    colocated = {"generation": {"transport": "direct"}, "env": {"colocate_pool": "default"}}
    assert stage_scheduling(build_config({**scheduling, **colocated}))["envgen"] == generation
    assert "envgen" not in stage_scheduling(build_config(scheduling)), "a job apart runs no envgen"
    named = StageScheduling(nice=2)
    both = {**scheduling, **colocated, "machine": {"scheduling": {"envgen": named, "generation": generation}}}
    assert stage_scheduling(build_config(both))["envgen"] == named


@pytest.mark.parametrize("stage, field", [({"nice": 20}, "nice"), ({"nice": -21}, "nice"),
                                          ({"policy": "fifo"}, "policy"), ({"share": 2}, "share"),
                                          ({"slice_ms": 0.01}, "slice_ms"), ({"slice_ms": 500}, "slice_ms"),
                                          ({"startup_policy": "fifo"}, "startup_policy")])
def test_a_bad_stage_scheduling_names_the_field(stage, field):
    with pytest.raises(ConfigError, match=rf"machine\.scheduling\.env\.{field}: "):
        build_config({"machine": {"scheduling": {"env": stage}}})


def test_a_slice_under_the_idle_policy_fails_naming_both():
    with pytest.raises(ConfigError, match=r"machine\.scheduling\.env: .*slice_ms is set but policy is idle"):
        build_config({"machine": {"scheduling": {"env": {"policy": "idle", "slice_ms": 5}}}})


# Stands in for `python -m rollart.cli consume STAGE` (what the runner starts is this script, whatever the
# argv): it serves /readyz on the port the runner gave it, 503 until READY_FILE exists, as a stage does
# while it loads its engine, and has a child of its own, as a generation member has vLLM's engine core.
STAGE = textwrap.dedent("""
    import http.server, os, pathlib, subprocess, sys
    ready = pathlib.Path(os.environ["READY_FILE"])
    engine = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])

    class Probe(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200 if self.path == "/readyz" and ready.exists() else 503)
            self.end_headers()

        def log_message(self, *args):
            pass

    http.server.ThreadingHTTPServer(("127.0.0.1", int(os.environ["ROLLART_METRICS_PORT"])), Probe).serve_forever()
""")


def _policies(process: StageProcess) -> set[int]:
    """The scheduling policy of every thread of the member and of its children."""
    pids = [process.proc.pid, *descendants(process.proc.pid, process_table())]
    return {os.sched_getscheduler(int(tid)) for pid in pids for tid in os.listdir(f"/proc/{pid}/task")}


def _wait_serving(procs: StageProcesses, name: str) -> None:
    """Until the member answers its probe (with 503 while it starts) and has started its child."""
    url = f"http://127.0.0.1:{procs.metrics_ports[name][1]}/readyz"
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            urllib.request.urlopen(url, timeout=1)
            return
        except urllib.error.HTTPError:
            if descendants(procs.stages[name].proc.pid, process_table()):
                return
        except OSError:
            pass
        time.sleep(0.05)
    raise AssertionError(f"{name} never served its probe:\n{procs.tail(name)}")


def test_a_member_starts_under_its_start_up_policy_and_takes_its_run_scheduling_once_ready(tmp_path, monkeypatch):
    (tmp_path / "stage.py").write_text(STAGE)
    wrapper = tmp_path / "stage.sh"
    wrapper.write_text(f'#!/bin/sh\nexec "{sys.executable}" "{tmp_path / "stage.py"}" "$@"\n')
    wrapper.chmod(0o755)
    monkeypatch.setattr(sys, "executable", str(wrapper))
    ready = tmp_path / "ready"
    procs = StageProcesses(Path("job.yaml"), Endpoints("127.0.0.1:1", "redis://x", "test"), "job", tmp_path / "logs",
                           extra_env={"READY_FILE": str(ready)}, metrics_targets=tmp_path / "prometheus" / "targets.json",
                           scheduling={"generation": StageScheduling(policy="idle", startup_policy="normal"),
                                       "env": StageScheduling(policy="batch")})
    try:
        gen = procs.start("gen-default-0", "generation", "--pool", "default")
        env = procs.start("env-0", "env")
        for name in ("gen-default-0", "env-0"):
            _wait_serving(procs, name)
        for process in (gen, env):
            # One session with the runner: Linux's autogroup gives each session an equal share first, so
            # a stage in a session of its own would get its share whatever its policy says
            assert os.getsid(process.proc.pid) == os.getsid(0)
            assert os.getpgid(process.proc.pid) == process.proc.pid, "a process group of its own (Ctrl-C, killpg)"
        assert _policies(gen) == {os.SCHED_OTHER}, "it starts under its start-up policy, its child too"
        assert _policies(env) == {os.SCHED_BATCH} and "env-0" not in procs.starting, "no start-up policy: its own"
        assert settle_startups(procs) == [] and _policies(gen) == {os.SCHED_OTHER}, "not ready: unchanged"

        ready.touch()
        assert settle_startups(procs) == ["gen-default-0"]
        assert _policies(gen) == {os.SCHED_IDLE}, "ready: every thread of it and of its child under its run policy"
        assert settle_startups(procs) == [] and procs.starting == {}

        ready.unlink()
        gen = procs.start("gen-default-0", "generation", "--pool", "default")  # a restart starts up again
        _wait_serving(procs, "gen-default-0")
        assert _policies(gen) == {os.SCHED_OTHER} and set(procs.starting) == {"gen-default-0"}
    finally:
        procs.stop_all(grace_s=2, budget_s=4)


def test_a_start_up_under_idle_is_dropped_where_the_runner_could_not_leave_it(monkeypatch, caplog):
    """Out of SCHED_IDLE takes CAP_SYS_NICE: without it the stage starts as it runs, and the runner says so."""
    import rollart.local.supervision as supervision

    config = build_config({"machine": {"scheduling": {"trainer": {"startup_policy": "idle"},
                                                      "generation": {"policy": "idle", "startup_policy": "normal"}}}})
    assert stage_scheduling(config)["trainer"].startup_policy == "idle"
    monkeypatch.setattr(supervision, "may_raise_priority", lambda nice: False)
    plan = stage_scheduling(config)
    assert plan["trainer"] == StageScheduling(), "idle at start-up dropped: it starts under its run policy"
    assert plan["generation"].startup_policy == "normal", "out of a higher policy needs no privilege"
    assert "machine.scheduling.trainer.startup_policy: idle is ignored" in caplog.text
