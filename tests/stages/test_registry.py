"""The stage registry is the one declaration of the stages: the topic catalog, `rollart consume`, the
local runners, chaos, deploy and the ACLs follow it, and a new stage is one entry."""

from __future__ import annotations

import signal
import subprocess
import sys

import pytest
from typer.testing import CliRunner

from rollart.chaos.inject import KILLABLE, killable, stage_of
from rollart.cli import app
from rollart.config import build_config
from rollart.deploy import render_job
from rollart.stages.registry import OBSERVER_GROUPS, STAGES, Stage, local_processes
from rollart.topics import load_catalog
from rollart.topics.access import job_access
from tests.conftest import REPO


def test_the_catalog_and_the_registry_agree():
    groups = {g for s in STAGES.values() for g in s.groups}
    names = set(STAGES) | groups
    consumed = set()
    for spec in load_catalog().values():
        assert set(spec.consumers) <= groups | set(OBSERVER_GROUPS), f"{spec.name}: consumers {spec.consumers} are not registered groups"
        assert set(spec.producers) <= names, f"{spec.name}: producers {spec.producers} are not registered stages"
        assert set(spec.readers) - {"*"} <= names, f"{spec.name}: readers {spec.readers} are not registered stages"
        consumed |= set(spec.consumers) - set(OBSERVER_GROUPS)
    assert consumed == groups, f"groups that consume no topic: {sorted(groups - consumed)}"


def test_local_runs_start_what_the_job_needs_in_order():
    plain = build_config({"pools": ["a", "b"]})
    assert local_processes(plain, training=True, members={"env": 2}, resume=True) == [
        ("gen-a-0", ("generation", "--pool", "a")), ("gen-b-0", ("generation", "--pool", "b")),
        ("env-0", ("env",)), ("env-1", ("env",)), ("reward-0", ("reward",)), ("trainer", ("trainer", "--resume")),
        ("feeder", ("feeder",))]
    assert [n for n, _ in local_processes(plain, training=False)] == ["gen-a-0", "gen-b-0", "env-0", "reward-0",
                                                                      "feeder"], "a rollout trains nothing"
    evaluated = build_config({"pools": ["a", "e"], "tags": {"h": {"env": "frozenlake", "weight": 0}},
                              "eval": {"tags": ["h"], "pool": "e"}})
    assert ("eval", ("eval",)) in local_processes(evaluated, training=True)
    assert [stage_of(n) for n, _ in local_processes(evaluated, training=True)] == [
        "generation", "generation", "env", "reward", "trainer", "eval", "feeder"]
    assert "eval" not in KILLABLE and "trainer" in KILLABLE


def test_a_new_stage_is_one_registry_entry(monkeypatch, tmp_path):
    from tests.stages import toy_stage

    monkeypatch.setitem(STAGES, "toy", Stage("toy", ("toy",), "tests.stages.toy_stage:run_toy", "a toy stage"))
    config = build_config({"job": "toyjob"})
    assert ("toy-0", ("toy",)) in local_processes(config, training=True)
    deployments = {d["metadata"]["name"]: d for d in render_job(config) if d["kind"] == "Deployment"}
    assert deployments["toyjob-toy"]["spec"]["template"]["spec"]["containers"][0]["command"][:3] == \
        ["rollart", "consume", "toy"]
    toy = next(a for a in job_access(config) if a.stage == "toy")
    assert toy.groups == ("toyjob.toy",) and toy.principal == "toyjob-toy"
    (tmp_path / "job.yaml").write_text("job: toyjob\n")
    result = CliRunner().invoke(app, ["consume", "toy", "--config", str(tmp_path / "job.yaml")])
    assert result.exit_code == 0, result.output
    assert toy_stage.RAN == ["toyjob"], "`rollart consume toy` ran its runner"
    refused = CliRunner().invoke(app, ["consume", "toy", "--pool", "a", "--config", str(tmp_path / "job.yaml")])
    assert refused.exit_code == 2 and "not toy" in refused.output


def test_a_colocated_pool_runs_env_and_generation_members_as_one_stage_everywhere():
    """env.colocate_pool: the local runners, Kubernetes and the ACLs run ``envgen`` in place of the env
    stage and that pool's generation stage; another pool's generation stage is as before."""
    from rollart.config import ConfigError
    from rollart.job.scale import ScaleRequest, validated

    apart = build_config({"pools": ["a", "b"], "generation": {"transport": "direct"}})
    together = apart.with_updates(env={"colocate_pool": "a"})
    assert local_processes(together, training=True, members={"env": 2, "generation": 3}) == [
        ("gen-b-0", ("generation", "--pool", "b")), ("gen-b-1", ("generation", "--pool", "b")),
        ("gen-b-2", ("generation", "--pool", "b")), ("envgen-a-0", ("envgen", "--pool", "a")),
        ("envgen-a-1", ("envgen", "--pool", "a")), ("reward-0", ("reward",)), ("trainer", ("trainer",)),
        ("feeder", ("feeder",))]
    assert "envgen" not in {stage_of(n) for n, _ in local_processes(apart, training=True)}
    assert killable(apart) == KILLABLE and "envgen" not in KILLABLE  # what a chaos campaign's kill picks from
    assert killable(together) == ("generation", "envgen", "reward", "trainer", "feeder")

    access = {(a.stage, a.pool): a for a in job_access(together)}
    assert set(access) == {("generation", "b"), ("envgen", "a"), ("reward", None), ("trainer", None), ("feeder", None)}
    separate = {(a.stage, a.pool): a for a in job_access(apart)}
    envgen, env, gen_a = access["envgen", "a"], separate["env", None], separate["generation", "a"]
    assert set(envgen.groups) == set(env.groups) | set(gen_a.groups)
    assert set(envgen.read) == set(env.read) | set(gen_a.read)
    assert set(envgen.write) == set(env.write) | set(gen_a.write)

    rendered = render_job(together.with_updates(deploy={"prometheus_url": "http://prometheus:9090"}))
    deployments = {d["metadata"]["name"]: d for d in rendered if d["kind"] == "Deployment"}
    assert "rollart-envgen-a" in deployments and "rollart-gen-b" in deployments
    assert "rollart-env" not in deployments and "rollart-gen-a" not in deployments
    container = deployments["rollart-envgen-a"]["spec"]["template"]["spec"]["containers"][0]
    assert container["command"][:5] == ["rollart", "consume", "envgen", "--pool", "a"]
    assert container["resources"]["limits"].get("nvidia.com/gpu") == 1, "the pool's hardware"
    assert any(port["name"] == "turns" for port in container["ports"]), "other env members reach it directly"

    assert validated(together, ScaleRequest("envgen", 3, "a")).members == 3
    for refused, says in ((ScaleRequest("env", 3), "runs no env members"),
                          (ScaleRequest("generation", 3, "a"), "choose one of b")):
        with pytest.raises(ConfigError, match=says):
            validated(together, refused)


def test_envgen_refuses_a_job_that_does_not_colocate_naming_the_field(tmp_path):
    (tmp_path / "job.yaml").write_text("job: apartjob\n")
    done = subprocess.run([sys.executable, "-m", "rollart.cli", "consume", "envgen", "--pool", "default", "--config",
                           str(tmp_path / "job.yaml")], capture_output=True, text=True, timeout=120, cwd=REPO)
    assert done.returncode != 0 and "env.colocate_pool" in done.stdout + done.stderr, done.stderr[-2000:]


@pytest.mark.parametrize("exit_at_stop", [True, False])
def test_a_stage_that_exits_at_stop_leaves_past_a_crashing_teardown(tmp_path, exit_at_stop):
    """A member that stopped cleanly exits 0 although its interpreter's teardown would crash (CI saw a
    drained generation member exit -11); without ``exit_at_stop`` the same crash is its exit code."""
    (tmp_path / "job.yaml").write_text("job: toyjob\n")
    script = (
        "import sys\n"
        "from rollart.cli import app\n"
        "from rollart.stages.registry import STAGES, Stage\n"
        "STAGES['toy'] = Stage('toy', ('toy',), 'tests.stages.toy_stage:run_toy_crashing_at_teardown', 'a toy',\n"
        f"                     exit_at_stop={exit_at_stop})\n"
        "app(['consume', 'toy', '--config', sys.argv[1]])\n")
    result = subprocess.run([sys.executable, "-c", script, str(tmp_path / "job.yaml")], capture_output=True,
                            text=True, timeout=120, cwd=REPO)
    assert "toy member of toyjob stopped" in result.stdout, result.stderr
    assert result.returncode == (0 if exit_at_stop else -signal.SIGSEGV), result.stderr
    assert STAGES["generation"].exit_at_stop and STAGES["trainer"].exit_at_stop


def test_a_stages_prelude_runs_before_its_own_modules_are_imported():
    """The generation stage's prelude starts the engine's fork server (only for ``engine_core_start:
    forkserver``) before the member imports its stage module and, with it, torch and vLLM."""
    script = (
        "import sys, multiprocessing.forkserver as fs\n"
        "from rollart.config import build_config\n"
        "from rollart.stages.registry import STAGES\n"
        "for start in ('spawn', 'forkserver'):\n"
        "    STAGES['generation'].start_prelude(build_config({'job': 'j', 'generation': {'engine_core_start': start}}))\n"
        "    print(start, fs._forkserver._forkserver_pid is not None, 'torch' in sys.modules,\n"
        "          'rollart.stages.generation' in sys.modules)\n")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == ["spawn False False False", "forkserver True False False"]
