"""A group's rollouts (GroupRun): replacements on demand for members ended by a fault, bounded and
counted; redundant extras aborted; the group's end (GroupEnded) emitted last.

The trajectory runner here is scripted (each trajectory id ends as told, after a delay), so the
group logic is tested alone; the env stage runs it with real envs in tests/stages/test_rollout_stages.py
and the chaos campaign (tests/chaos/test_chaos.py) with injected env faults."""

from __future__ import annotations

import asyncio
from dataclasses import replace

from rollart.config import build_config
from rollart.messages import Abort, CompletedTrajectory, GroupEnded, TaskSpec
from rollart.messages.samples import sample_trajectory
from rollart.stages.env import abort, run_group


class ScriptedRunner:
    """Ends trajectory ``id`` as ``script[id]`` says: ("ok" | an abort reason, delay in seconds);
    ids not in the script complete at once. Records which ids it was asked to run."""

    def __init__(self, script: dict[str, tuple[str, float]], max_replacements: int = 4):
        self.config = build_config({"job": "j", "feeder": {"max_replacements": max_replacements}}, "test")
        self.script = script
        self.started: list[str] = []

    async def run(self, task: TaskSpec, traj_id: str) -> CompletedTrajectory | Abort:
        self.started.append(traj_id)
        outcome, delay = self.script.get(traj_id, ("ok", 0.0))
        await asyncio.sleep(delay)
        if outcome == "ok":
            return replace(sample_trajectory(traj_id), group_id=task.group_id)
        return abort(task, traj_id, 1, outcome)


async def run(runner: ScriptedRunner, *, group_size: int = 2, redundancy: int = 0) -> tuple[list, GroupEnded]:
    task = TaskSpec(group_id="g", env="frozenlake", tag="t", group_size=group_size, redundancy=redundancy)
    emitted: list = []

    async def emit(outcome) -> None:
        emitted.append(outcome)

    return emitted, await run_group(runner, task, emit)


async def test_a_member_ended_by_a_fault_is_replaced_and_the_group_completes():
    runner = ScriptedRunner({"g-1": ("env_step_failed", 0.0)})
    emitted, ended = await run(runner)
    assert runner.started == ["g-0", "g-1", "g-r0"]
    failed = next(m for m in emitted if isinstance(m, Abort))
    assert (failed.traj_id, failed.reason, failed.replacement) == ("g-1", "env_step_failed", "g-r0")
    assert emitted[-1] == ended and set(ended.completed) == {"g-0", "g-r0"}
    assert (ended.aborted, ended.replacements) == (1, 1)


async def test_replacements_are_bounded_per_group():
    """A persistently broken env: every rollout fails; the group ends after max_replacements more."""
    runner = ScriptedRunner({tid: ("env_reset_failed", 0.0) for tid in ("g-0", "g-1", "g-r0", "g-r1", "g-r2")},
                            max_replacements=3)
    emitted, ended = await run(runner)
    assert runner.started == ["g-0", "g-1", "g-r0", "g-r1", "g-r2"]
    assert ended.completed == () and (ended.aborted, ended.replacements) == (5, 3)
    replaced = [m.replacement for m in emitted if isinstance(m, Abort)]
    assert replaced == ["g-r0", "g-r1", "g-r2", "", ""], "the last two had no replacement left"


async def test_no_replacement_while_the_redundant_extras_can_still_fill_the_group():
    runner = ScriptedRunner({"g-0": ("generation_timeout", 0.0), "g-2": ("ok", 0.05)})
    emitted, ended = await run(runner, redundancy=1)
    assert runner.started == ["g-0", "g-1", "g-2"], "g-2 (redundant) was still running: no replacement"
    assert set(ended.completed) == {"g-1", "g-2"} and ended.replacements == 0


async def test_not_a_fault_is_not_replaced_and_extras_end_redundant():
    runner = ScriptedRunner({"g-0": ("stale", 0.0), "g-3": ("ok", 5.0)})
    emitted, ended = await run(runner, group_size=2, redundancy=2)
    assert "g-r0" not in runner.started, "a stale rollout is not a fault of the env"
    reasons = {m.traj_id: m.reason for m in emitted if isinstance(m, Abort)}
    assert reasons == {"g-0": "stale", "g-3": "redundant"}, "the slow extra was cancelled once two completed"
    assert set(ended.completed) == {"g-1", "g-2"} and ended.aborted == 1
    assert [type(m) for m in emitted].count(CompletedTrajectory) == 2


async def test_a_dead_lettered_members_replacement_task_runs_its_own_lineage():
    """The reward stage's replacement task for g-1 (its reward dead-lettered): one rollout, g-1.d-0,
    itself replaced on a fault (g-1.d-r0); its GroupEnded names what it replaces."""
    runner = ScriptedRunner({"g-1.d-0": ("env_step_failed", 0.0)})
    task = TaskSpec(group_id="g", env="frozenlake", tag="t", group_size=1, replaces="g-1")
    emitted: list = []

    async def emit(outcome) -> None:
        emitted.append(outcome)

    ended = await run_group(runner, task, emit)
    assert runner.started == ["g-1.d-0", "g-1.d-r0"]
    assert (ended.group_id, ended.replaces, ended.completed) == ("g", "g-1", ("g-1.d-r0",))
    assert task.message_id() != replace(task, replaces=None).message_id(), "not taken for the group's own task"
