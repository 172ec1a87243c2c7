"""The eval task set (held out from training, the same at every version), the schedule of versions,
and the ledger that decides when a version's evaluation is over."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from rollart.config import ConfigError, build_config
from rollart.evaluation.ledger import VersionEval, summary_row
from rollart.evaluation.tasks import EVAL_SEED_BASE, due, eval_group_version, eval_sources, eval_tasks, latest_due
from rollart.messages import Abort, GroupEnded, ScoredTrajectory, VersionAnnouncement
from rollart.messages.samples import sample_trajectory
from rollart.stages.evaluation import EvalStage
from rollart.stages.feeder import sources_from, task_spec


def job(tmp_path, **eval_section):
    rows = [{"prompt": f"q{i}", "answer": str(i)} for i in range(10)]
    (tmp_path / "math.jsonl").write_text("\n".join(map(json.dumps, rows)))
    return build_config({
        "job": "j", "pools": ["default", "eval"],
        "tags": {"grid": {"env": "frozenlake"},
                 "math": {"env": "math", "dataset": {"path": str(tmp_path / "math.jsonl"), "eval_rows": 3}}},
        "eval": {"tags": ["grid", "math"], "pool": "eval", "tasks_per_tag": 4, **eval_section}})


def test_eval_tasks_are_held_out_and_the_same_at_every_version(tmp_path):
    config = job(tmp_path)
    sources = eval_sources(config)
    v2, v4 = eval_tasks(config, sources, 2), eval_tasks(config, sources, 4)
    assert [t.group_id for t in v2] == [f"j-v2-e{i}" for i in range(7)], "4 seeded tasks, then the 3 held-out rows"
    assert [(t.tag, t.seed, t.prompt) for t in v2] == [(t.tag, t.seed, t.prompt) for t in v4]
    assert all(t.eval_version == 2 and t.group_size == 1 for t in v2)
    assert [eval_group_version(t.group_id) for t in v4] == [4] * 7 and eval_group_version("j-g12-0") is None
    training = [task_spec(config, sources_from(config), n) for n in range(500)]
    assert all(t.seed < EVAL_SEED_BASE for t in training) and all(t.seed >= EVAL_SEED_BASE for t in v2[:4])
    assert {t.prompt for t in v2[4:]} == {"q7", "q8", "q9"}, "the last eval_rows rows"
    assert not {t.prompt for t in training} & {"q7", "q8", "q9"}, "held-out rows are never trained on"


def test_eval_config_is_checked_at_start_naming_the_field(tmp_path):
    with pytest.raises(ConfigError, match="eval.pool 'default' serves tags.grid, which trains"):
        build_config({"tags": {"grid": {"env": "frozenlake"}}, "eval": {"tags": ["grid"], "pool": "default"}})
    with pytest.raises(ConfigError, match="eval.tags: 'nope' is not one of tags"):
        build_config({"pools": ["a", "b"], "tags": {"grid": {"env": "frozenlake"}},
                      "eval": {"tags": ["nope"], "pool": "b"}})
    (tmp_path / "d.jsonl").write_text('{"prompt": "p", "answer": "1"}\n')
    with pytest.raises(ConfigError, match="trains on its whole dataset"):
        build_config({"pools": ["a", "b"], "tags": {"m": {"env": "math", "dataset": str(tmp_path / "d.jsonl")}},
                      "eval": {"tags": ["m"], "pool": "b"}})
    one_row = build_config({"pools": ["a", "b"], "tags": {"m": {"env": "math", "dataset": {
        "path": str(tmp_path / "d.jsonl"), "eval_rows": 1}}}, "eval": {"tags": ["m"], "pool": "b"}})
    with pytest.raises(ConfigError, match="tags.m.dataset: .*leaves none of its 1 rows to train on"):
        sources_from(one_row)


def test_due_versions_and_the_schedule(tmp_path):
    config = job(tmp_path, every_versions=3)
    assert [v for v in range(10) if due(config, v)] == [0, 3, 6, 9]
    assert [latest_due(config, v) for v in (0, 2, 3, 8)] == [0, 0, 3, 6]
    assert latest_due(job(tmp_path, every_versions=3, initial=False), 2) is None
    stage = EvalStage(SimpleNamespace(config=config))
    assert stage.next_version() == 0, "the initial policy needs no announced weights"
    sampling = config.eval_sampling()
    assert (sampling.temperature, sampling.max_tokens) == (0.0, config.env.sampling.max_tokens), \
        "greedy, with the training turns' length"
    stage.done.add(0)
    stage.latest = 7
    assert stage.next_version() is None, "version 6 is due, but its weights are not announced yet"
    for v in (3, 6, 7):
        stage.announcements[v] = VersionAnnouncement(job="j", version=v, step=v)
    assert stage.next_version() == 6, "training outpaced evaluation: the newest due version, 3 skipped"
    stage.seen[3] = {}
    assert stage.next_version() == 3, "an evaluation in progress (after a restart) is finished first"


def scored(traj_id: str, group: str, version: int, reward: float = 1.0) -> ScoredTrajectory:
    t = sample_trajectory(traj_id, version=version)
    from dataclasses import replace

    t = replace(t, group_id=group, tag="grid", eval_version=version)
    return ScoredTrajectory(trajectory=t, reward=reward)


def test_the_ledger_ends_when_every_member_is_scored_or_failed():
    run = VersionEval(2, 2, {"j-v2-e0": "grid", "j-v2-e1": "grid"}, group_size=2)
    assert run.add(scored("j-v2-e0-0", "j-v2-e0", 2, 1.0))
    assert not run.add(scored("j-v2-e0-0", "j-v2-e0", 2, 1.0)), "a redelivered copy changes nothing"
    assert not run.add(scored("j-v4-e0-0", "j-v4-e0", 4)), "another version's record"
    run.add(GroupEnded(group_id="j-v2-e0", tag="grid", completed=("j-v2-e0-0", "j-v2-e0-1")))
    run.add(GroupEnded(group_id="j-v2-e1", tag="grid", completed=("j-v2-e1-0",), aborted=1))
    assert not run.over(), "two completed members are not scored yet"
    run.add(scored("j-v2-e0-1", "j-v2-e0", 2, 0.0))
    run.add(Abort(traj_id="j-v2-e1-0", turn=1, reason="reward_failed", group_id="j-v2-e1", tag="grid"))
    assert run.over()
    summary = run.summary("j", complete=True)
    grid = summary.tags["grid"]
    assert (grid.tasks, grid.scored, grid.failed, grid.reward_mean) == (2, 2, 2, 0.5)
    assert summary.off_version_tokens == 0
    off = VersionEval(2, 2, {"j-v2-e0": "grid"}, group_size=1)
    off.add(scored("j-v2-e0-0", "j-v2-e0", 1))
    assert off.summary("j", complete=False).off_version_tokens == 8, "tokens of another version are counted"
    assert summary_row(off.summary("j", complete=False), list(off.rows.values()))["trajectories"][0]["versions"] == [1]
