"""kill -9 a generation consumer and an env consumer mid-rollout: every trajectory still ends."""

from __future__ import annotations

import signal
import uuid
from collections import defaultdict

import yaml

from rollart.config import load_config
from rollart.endpoints import Endpoints
from rollart.local.endpoints import run_config
from rollart.local.processes import StageProcesses
from rollart.messages import Abort, CompletedTrajectory, ScoredTrajectory
from rollart.runtime import open_runtime
from rollart.topics.admin import apply_topics
from tests.conftest import RunningLoops, eventually

GROUPS, GROUP_SIZE, REDUNDANCY = 12, 2, 1


async def test_rollout_survives_killed_generation_and_env_consumers(stack, tiny_model, tmp_path):
    path = tmp_path / "crash.yaml"
    path.write_text(yaml.safe_dump({
        "job": "crash", "pools": ["p"],
        "model": {"path": str(tiny_model), "init_tiny": False},
        "bus": {"fetch_max_wait_ms": 5, "session_timeout_ms": 3000, "heartbeat_interval_ms": 300,
                "commit_interval_s": 0.2},
        "generation": {"max_concurrency": 32, "heartbeat_ttl_s": 2.0},
        "feeder": {"alpha": None, "max_groups": GROUPS, "group_size": GROUP_SIZE, "redundancy": REDUNDANCY},
        "env": {"max_groups": 3, "generation_timeout_s": 120, "shutdown_grace_s": 1},
        "tags": {"frozenlake": {"env": "frozenlake", "env_kwargs": {"fixed_map": False}}},
    }))
    endpoints = Endpoints(stack.kafka_bootstrap, stack.redis_url, "test stack", broker=stack.broker_kind)
    config = load_config(path)
    job = f"crash-{uuid.uuid4().hex[:8]}"
    cfg = run_config(config, endpoints, job)
    await apply_topics(cfg, endpoints)
    procs = StageProcesses(path, endpoints, job, tmp_path / "logs")
    ended: dict[str, dict[str, str]] = defaultdict(dict)  # group -> traj -> "completed" | abort reason

    async def observe(envelope, ctx) -> None:
        message = envelope.message
        if isinstance(message, ScoredTrajectory):  # an env reward: scored by its env member, no hop
            message = message.trajectory
        if isinstance(message, CompletedTrajectory):
            ended[message.group_id][message.traj_id] = "completed"
        elif isinstance(message, Abort):
            ended[message.group_id].setdefault(message.traj_id, message.reason)

    loops = RunningLoops()
    try:
        for name in ("gen-a", "gen-b"):
            procs.start(name, "generation", "--pool", "p")
        for name in ("env-a", "env-b"):
            procs.start(name, "env")
        procs.start("feeder", "feeder")
        async with open_runtime(cfg, serve=False) as rt:
            await loops.start(rt.consumer_loop("observer", ["trajectories.completed", "rewards.results"], observe, dedup=False,
                                               ordering="none"), wait_assigned=False)
            await eventually(lambda: sum(len(v) for v in ended.values()) >= 4, timeout=240,
                             what="the rollout under way")
            assert not procs.failed(), procs.tail(procs.failed()[0])
            procs.kill("gen-a", signal.SIGKILL)
            procs.kill("env-a", signal.SIGKILL)
            n = GROUP_SIZE + REDUNDANCY
            groups = [f"{job}-g{i}" for i in range(GROUPS)]
            await eventually(lambda: all(len(ended[g]) == n for g in groups), timeout=300,
                             what=f"all {GROUPS} groups to end; so far {dict(ended)}")
            await loops.stop_all()
    finally:
        procs.stop_all(grace_s=10)

    for group in groups:
        outcomes = ended[group]
        assert set(outcomes) == {f"{group}-{i}" for i in range(n)}, "every started trajectory ends"
        completed = [t for t, o in outcomes.items() if o == "completed"]
        assert len(completed) >= GROUP_SIZE, f"{group} filled its group: {outcomes}"
        assert set(outcomes.values()) <= {"completed", "redundant"}, outcomes
