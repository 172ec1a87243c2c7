"""`rollart scale`: stages of a running job grow and shrink; nothing is lost or trained twice."""

from __future__ import annotations

import json
import signal
import subprocess
import sys

import pytest

from rollart.config import ConfigError, build_config
from rollart.job.scale import ScaleRequest, validated
from rollart.state import PoolRegistry
from tests.conftest import REPO
from tests.job.harness import ended, small_job, start, trained_steps, wait


def test_a_scale_request_is_checked_naming_what_is_wrong():
    config = build_config({"pools": ["default"]})
    assert validated(config, ScaleRequest("generation", 2, "default")).field == "generation:default"
    assert ScaleRequest.parse(b"generation:default", b"3") == ScaleRequest("generation", 3, "default")
    for request, words in [(ScaleRequest("trainer", 2), "single writer"), (ScaleRequest("feeder", 2), "single writer"),
                           (ScaleRequest("generation", 2), "--pool"), (ScaleRequest("env", 2, "default"), "--pool"),
                           (ScaleRequest("env", 0), "members"), (ScaleRequest("nope", 1), "stage")]:
        with pytest.raises(ConfigError, match=words):
            validated(config, request)


def scale(job_yaml, job: str, stage: str, members: int, *pool: str) -> None:
    result = subprocess.run([sys.executable, "-m", "rollart.cli", "scale", job, stage, str(members), *pool,
                             "-c", str(job_yaml)], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr


def request(endpoints, job_yaml, job: str, stage: str, members: int, pool: str | None = None) -> None:
    """The same request as the CLI's, without starting a Python process for it."""
    import asyncio

    from rollart.config import load_config
    from rollart.job.scale import request_scale
    from rollart.state import connect_redis

    async def send() -> None:
        redis = connect_redis(endpoints)
        try:
            await request_scale(redis, load_config(job_yaml).with_updates("test", job=job),
                                ScaleRequest(stage, members, pool))
        finally:
            await redis.aclose()

    asyncio.run(send())


def gen_members(endpoints, config: dict, job: str) -> list[str]:
    import asyncio

    from rollart.state import connect_redis

    async def read() -> list[str]:
        redis = connect_redis(endpoints)
        try:
            pools = PoolRegistry(redis, prefix="rollart", job=job)
            return (await pools.live_pools(config["pools"]))["default"]
        finally:
            await redis.aclose()

    return asyncio.run(read())


@pytest.mark.timeout(900)
def test_generation_and_env_grow_then_shrink_mid_run(endpoints, tiny_model, tmp_path):
    """1 → 2 members of generation and env after the first steps, back to 1 a few steps later: the new
    members take work, the leaving ones drain and exit 0, every step trains a full fresh batch once.
    The run is asked for more steps than the test needs (a second engine loads for a minute on a busy
    machine) and stopped with SIGINT once the members are back to one: its report covers what it trained."""
    config = small_job(endpoints, tiny_model)
    proc, out = start(config, tmp_path, 1000)
    job_yaml = tmp_path / "job.yaml"
    retired = out / "retired.json"
    try:
        wait(lambda: len(trained_steps(out)) >= 2, 300, "2 training steps", proc)
        job = json.loads((out / "run.json").read_text())["job"]
        scale(job_yaml, job, "generation", 2, "--pool", "default")
        request(endpoints, job_yaml, job, "env", 2)

        def pids() -> dict:
            return json.loads((out / "pids.json").read_text())

        wait(lambda: {"gen-default-1", "env-1"} <= set(pids()), 60, "the new members started", proc)
        wait(lambda: len(gen_members(endpoints, config, job)) == 2, 300, "two live generation members", proc)
        grown_at = len(trained_steps(out))
        wait(lambda: len(trained_steps(out)) >= grown_at + 2, 300, "2 steps with the grown stages", proc)
        request(endpoints, job_yaml, job, "generation", 1, "default")
        request(endpoints, job_yaml, job, "env", 1)
        wait(lambda: retired.exists() and len(json.loads(retired.read_text())) == 2, 180, "both retired", proc)
        shrunk_at = len(trained_steps(out))
        wait(lambda: len(trained_steps(out)) >= shrunk_at + 1, 300, "a step after shrinking", proc)
        assert {"gen-default-1", "env-1"}.isdisjoint(pids()), "a retired member is not restarted"
        proc.send_signal(signal.SIGINT)  # rollart run stops its stages and writes the report of what it trained
        ended(proc, 180)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    codes = json.loads(retired.read_text())
    logs = {name: (out / "logs" / f"{name}.log").read_text(errors="replace")[-6000:] for name, code in codes.items() if code}
    assert codes == {"gen-default-1": 0, "env-1": 0}, f"the leaving members drained, exit 0; their logs: {logs}"
    report = json.loads((out / "report.json").read_text())
    steps = [s["step"] for s in report["steps"]]
    assert steps == list(range(1, len(steps) + 1)) and len(steps) >= grown_at + 3, "no step lost or repeated"
    assert report["trained_duplicates"] == 0 and all(s["samples"] == 8 for s in report["steps"])
    assert report["staleness_max"] <= 1
    assert not set(report["restarts"]), "no member failed, none was restarted"
