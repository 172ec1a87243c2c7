"""The eval stage on the bus (no engine: the records the reward stage would send are produced here):
it resumes from the log after a restart, releases a version's tasks, pins the version while it runs,
and summarises when every eval trajectory is scored or failed."""

from __future__ import annotations

import asyncio
import json
from dataclasses import replace

from rollart.bus.reader import read_to_end
from rollart.evaluation.pinning import pinned_key
from rollart.messages import DEFAULT_CODEC, Abort, EvalSummary, GroupEnded, ScoredTrajectory, VersionAnnouncement, \
    WeightManifest
from rollart.messages.samples import sample_trajectory
from rollart.runtime import open_runtime
from rollart.stages.evaluation import EvalStage
from rollart.topics import expand_catalog
from rollart.topics.admin import apply_topics
from rollart.weights.follower import pulling_versions
from rollart.timeouts import wait_for
from tests.conftest import eventually, make_config


def scored(config, version: int, i: int, member: int, reward: float) -> ScoredTrajectory:
    group = f"{config.job}-v{version}-e{i}"
    t = replace(sample_trajectory(f"{group}-{member}", version=version), group_id=group, tag="held",
                eval_version=version, metrics={"success": float(reward > 0)})
    return ScoredTrajectory(trajectory=t, reward=reward)


async def read(rt, topic: str) -> list:
    return [DEFAULT_CODEC.decode(r.value, r.headers).message
            async for r in read_to_end(rt.config, rt.endpoints, f"{rt.config.job}.{topic}")]


async def test_the_eval_stage_resumes_releases_pins_and_summarises(endpoints, tmp_path):
    config = make_config(endpoints, pools=["default", "eval"], tags={"train": {"env": "frozenlake"},
                                                                     "held": {"env": "frozenlake", "weight": 0}},
                         eval={"tags": ["held"], "pool": "eval", "every_versions": 2, "tasks_per_tag": 2,
                               "record": str(tmp_path / "eval.jsonl")})
    await apply_topics(config, endpoints, expand_catalog(config))
    async with open_runtime(config, serve=False) as rt:
        # Before the "restart": version 0 was summarised, version 2 half done.
        await rt.producer.send_and_wait("eval.summaries", EvalSummary(job=config.job, version=0), key="0")
        await rt.producer.send_and_wait("eval.results", scored(config, 2, 0, 0, 1.0), key="g")
        announcement = VersionAnnouncement(job=config.job, version=2, step=2, manifest=WeightManifest(transport="fs"))
        stage = EvalStage(rt)
        await stage.recover()
        await stage.on_announcement(announcement)
        assert stage.done == {0} and stage.next_version() == 2, "resume version 2, not evaluate 0 again"

        evaluating = asyncio.create_task(stage.evaluate(2))
        await eventually(lambda: _released(rt, 2), what="version 2's eval tasks on `tasks`")
        prefix = config.redis.key_prefix
        assert 2 in await pulling_versions(rt.redis, prefix, config.job), "the trainer keeps version 2's buckets"
        assert await rt.redis.hexists(pinned_key(prefix, config.job), "2"), "the eval pool can find its manifest"
        for message in (GroupEnded(group_id=f"{config.job}-v2-e0", tag="held", completed=(f"{config.job}-v2-e0-0",),
                                   eval_version=2),
                        scored(config, 2, 0, 0, 1.0),  # a redelivered copy
                        GroupEnded(group_id=f"{config.job}-v2-e1", tag="held", completed=(f"{config.job}-v2-e1-0",),
                                   eval_version=2)):
            stage.take(message)
        await asyncio.sleep(0.2)
        assert not evaluating.done(), "member e1-0 is neither scored nor failed yet"
        stage.take(Abort(traj_id=f"{config.job}-v2-e1-0", turn=1, reason="reward_failed",
                         group_id=f"{config.job}-v2-e1", tag="held"))
        summary = await wait_for(evaluating, 10)

        held = summary.tags["held"]
        assert (summary.version, summary.step, summary.complete) == (2, 2, True)
        assert (held.tasks, held.scored, held.failed, held.success_rate) == (2, 1, 1, 1.0)
        assert [s.version for s in await read(rt, "eval.summaries")] == [0, 2]
        assert 2 not in await pulling_versions(rt.redis, prefix, config.job), "unpinned once summarised"
        row = json.loads((tmp_path / "eval.jsonl").read_text())
        assert row["version"] == 2 and row["tags"]["held"]["scored"] == 1 and len(row["trajectories"]) == 1
        assert stage.next_version() is None


async def _released(rt, version: int) -> bool:
    tasks = [t for t in await read(rt, "tasks") if t.eval_version == version]
    return sorted(t.group_id for t in tasks) == [f"{rt.config.job}-v{version}-e{i}" for i in range(2)]
