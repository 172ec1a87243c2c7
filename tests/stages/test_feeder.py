"""The feeder releases task groups under the staleness admission bound."""

from __future__ import annotations

import asyncio
import json


from rollart.bus.reader import read_to_end
from rollart.messages import DEFAULT_CODEC
from rollart.names import RedisKeys
from rollart.runtime import open_runtime
from rollart.stages.feeder import Feeder, sources_from, task_spec
from rollart.state import AdmissionCounters, VersionWriter
from rollart.topics import expand_catalog
from rollart.topics.admin import apply_topics
from rollart.timeouts import wait_for
from tests.conftest import eventually, make_config


async def _released(rt) -> list:
    """Every released task, in release order (they are spread over the topic's partitions)."""
    tasks = [DEFAULT_CODEC.decode(r.value, r.headers).message
             async for r in read_to_end(rt.config, rt.endpoints, f"{rt.config.job}.tasks")]
    return sorted(tasks, key=lambda t: int(t.group_id.rsplit("-g", 1)[1]))


async def test_admission_bound_holds_the_feeder_until_the_version_moves(endpoints, tmp_path):
    """The blocked feeder is woken by the announcements of what moves the bound (a version, a dropped
    group), not by polling: its fallback poll is longer than every wait here."""
    dataset = tmp_path / "math.jsonl"
    dataset.write_text(json.dumps({"prompt": "What is 6 * 7?", "answer": "42"}) + "\n")
    config = make_config(endpoints, feeder={"alpha": 1, "groups_per_batch": 2, "group_size": 3, "redundancy": 1,
                                            "poll_interval_s": 120},
                         tags={"math": {"env": "math", "dataset": str(dataset)},
                               "frozenlake": {"env": "frozenlake", "weight": 2}})
    await apply_topics(config, endpoints, expand_catalog(config))
    async with open_runtime(config, serve=False) as rt:
        feeder = Feeder(rt)
        run = asyncio.create_task(feeder.run())
        await eventually(lambda: _count(rt, 4), what="(alpha + 0 + 1) * 2 = 4 groups")
        await asyncio.sleep(0.3)
        assert len(await _released(rt)) == 4, "the bound holds the feeder back"

        writer = VersionWriter(config, rt.endpoints, rt.redis, rt.producer)
        await writer.acquire()
        await writer.bump(step=1)  # version 1: (1 + 1 + 1) * 2 = 6 slots
        await eventually(lambda: _count(rt, 6), timeout=20, what="two more groups after the version bump")
        counters = AdmissionCounters(rt.redis, prefix=config.redis.key_prefix, job=config.job)
        await counters.finish(groups=2, accepted=True)  # announced, but accepted groups keep their places
        await asyncio.sleep(0.3)
        assert len(await _released(rt)) == 6, "the bound holds again"
        await counters.finish(groups=1, accepted=False)  # a dropped group gives its place back
        await eventually(lambda: _count(rt, 7), timeout=20, what="one more group after a group was dropped")
        feeder.stop()
        await wait_for(run, 10)  # a stop ends the wait at once, not after poll_interval_s

    tasks = await _released(rt)
    assert [t.group_id for t in tasks] == [f"{config.job}-g{i}" for i in range(7)]
    assert all(t.group_size == 3 and t.redundancy == 1 for t in tasks)
    assert [t.admitted_version for t in tasks] == [0, 0, 0, 0, 1, 1, 1]
    math = [t for t in tasks if t.tag == "math"]
    assert all(t.prompt == "What is 6 * 7?" and t.labels == {"answer": "42"} for t in math)
    assert {t.tag for t in tasks} <= {"math", "frozenlake"}


async def test_a_version_releases_the_rest_of_a_batch_in_one_admission(endpoints):
    """When a version opens room for a batch, its groups are admitted together and go out together,
    not one round of Redis and Kafka trips per group (the engine waited on those between batches)."""
    config = make_config(endpoints, feeder={"alpha": 0, "groups_per_batch": 4, "poll_interval_s": 120},
                         tags={"f": {"env": "frozenlake"}})
    await apply_topics(config, endpoints, expand_catalog(config))
    async with open_runtime(config, serve=False) as rt:
        feeder = Feeder(rt)
        asked: list[tuple[int, int]] = []  # (groups asked for, groups admitted)
        admit_up_to = feeder.admission.admit_up_to

        async def recording(**kwargs) -> int:
            admitted = await admit_up_to(**kwargs)
            asked.append((kwargs["groups"], admitted))
            return admitted

        feeder.admission.admit_up_to = recording  # type: ignore[method-assign]
        run = asyncio.create_task(feeder.run())
        await eventually(lambda: _count(rt, 4), what="the first batch")
        writer = VersionWriter(config, rt.endpoints, rt.redis, rt.producer)
        await writer.acquire()
        await AdmissionCounters(rt.redis, prefix=config.redis.key_prefix, job=config.job).finish(groups=4, accepted=True)
        await writer.bump(step=1)
        await eventually(lambda: _count(rt, 8), timeout=20, what="the second batch")
        feeder.stop()
        await wait_for(run, 10)
    assert [a for a in asked if a[1]] == [(4, 4), (4, 4)], asked


async def _count(rt, n: int) -> bool:
    return len(await _released(rt)) >= n


async def test_restarted_feeder_continues_where_it_stopped(endpoints):
    config = make_config(endpoints, feeder={"alpha": None, "max_groups": 3}, tags={"f": {"env": "frozenlake"}})
    await apply_topics(config, endpoints, expand_catalog(config))
    async with open_runtime(config, serve=False) as rt:
        assert await Feeder(rt).run() == 3
        assert await Feeder(rt).run() == 0, "max_groups already released"
        more = config.model_copy(update={"feeder": config.feeder.model_copy(update={"max_groups": 5})})
        rt.config = more
        assert await Feeder(rt).run() == 2
        released = await _released(rt)
    assert [t.group_id for t in released] == [f"{config.job}-g{i}" for i in range(5)], "no group repeated or skipped"
    # the n-th task is a pure function of (seed, n): computed again, it is the task released
    again = [task_spec(config, sources_from(config), n) for n in range(5)]
    assert [(t.group_id, t.env, t.seed) for t in again] == [(t.group_id, t.env, t.seed) for t in released]


async def test_a_feeder_killed_before_counting_its_sent_tasks_is_not_repeated(endpoints):
    """Regression (the chaos campaign): a feeder SIGKILLed between its tasks' acks and the released
    counter's update left the counter behind the log, and its successor released those groups again."""
    config = make_config(endpoints, feeder={"alpha": None, "max_groups": 3}, tags={"f": {"env": "frozenlake"}})
    await apply_topics(config, endpoints, expand_catalog(config))
    async with open_runtime(config, serve=False) as rt:
        assert await Feeder(rt).run() == 3
        await rt.redis.set(RedisKeys.of(config).feeder_released, 1)  # as if killed after sending g1 and g2
        more = config.model_copy(update={"feeder": config.feeder.model_copy(update={"max_groups": 5})})
        rt.config = more
        assert await Feeder(rt).run() == 2
        released = await _released(rt)
    assert [t.group_id for t in released] == [f"{config.job}-g{i}" for i in range(5)], "no group repeated"


async def test_a_starving_trainer_gets_one_batch_past_an_over_counted_bound(endpoints):
    """Regression (found by `rollart chaos`): after crashes the admission counters over-count (a group
    accepted at the env stage that the trainer could not use, a slot reserved by a killed feeder), the
    bound held the feeder back forever while the trainer waited for a batch: the run stopped. The
    release is for that only: not while no pool is live, not before the first batch trained, not while
    groups are merely failing (Regression, `rollart chaos` with redundancy 0: released every 5 s past
    the bound, it only made more doomed groups)."""
    import time

    from rollart.state import PoolRegistry, VersionStore
    from rollart.state.admission import starving_key

    config = make_config(endpoints, feeder={"alpha": 1, "groups_per_batch": 2, "group_size": 2,
                                            "poll_interval_s": 0.02, "starvation_release_s": 3.0},
                         tags={"frozenlake": {"env": "frozenlake"}})
    await apply_topics(config, endpoints, expand_catalog(config))
    async with open_runtime(config, serve=False) as rt:
        counters = AdmissionCounters(rt.redis, prefix=config.redis.key_prefix, job=config.job)
        await counters.rebuild(accepted=4, running=0)  # at version 0 the bound (1 + 0 + 1) * 2 = 4 is full
        feeder = Feeder(rt)
        run = asyncio.create_task(feeder.run())
        key = starving_key(config.redis.key_prefix, config.job)
        await rt.redis.set(key, repr(time.time() - 10), ex=30)  # starving for 10 s ...
        pools = PoolRegistry(rt.redis, prefix=config.redis.key_prefix, job=config.job)
        await pools.heartbeat(config.pools[0], "gen-a", ttl_s=30)
        await asyncio.sleep(1.0)
        assert await _released(rt) == [], "... but before the first batch trained: the engines are starting"
        versions = VersionStore(config, rt.endpoints, rt.redis)
        await rt.redis.set(versions.key, 1)
        await counters.rebuild(accepted=6, running=0)  # the bound at version 1, full again
        await pools.leave(config.pools[0], "gen-a")
        await asyncio.sleep(1.0)
        assert await _released(rt) == [], "no pool is live: admitting more would not feed the trainer"
        await rt.redis.delete(key)
        await pools.heartbeat(config.pools[0], "gen-a", ttl_s=30)
        await asyncio.sleep(1.0)
        assert await _released(rt) == [], "a trainer that is not starving gets nothing past the bound"
        await counters.finish(groups=1, accepted=False)  # a group just ended incomplete (its members failed)
        await rt.redis.set(key, repr(time.time() - 10), ex=10)
        await asyncio.sleep(1.0)
        assert await _released(rt) == [], "groups are still ending, failing: more past the bound would fail too"
        await rt.redis.delete(key)
        await asyncio.sleep(2.5)  # now no group has ended for starvation_release_s
        await rt.redis.set(key, repr(time.time()), ex=10)  # waiting, but not long enough (slack for slow reads)
        await asyncio.sleep(0.3)
        assert await _released(rt) == []
        await rt.redis.set(key, repr(time.time() - 10), ex=10)
        await eventually(lambda: _count(rt, 2), what="one batch released past the bound")
        await rt.redis.delete(key)  # the trainer got its batch
        await asyncio.sleep(0.5)
        assert len(await _released(rt)) == 2, "one batch (of groups_per_batch groups), no more"
        assert (await counters.snapshot()).running == 2
        feeder.stop()
        await run


async def test_counters_lost_to_a_redis_flush_are_rebuilt_from_the_log(endpoints):
    """Regression (`rollart chaos`, five Redis flushes in 22 minutes): the rebuild counted every group
    ever released as accepted, so groups dropped earlier held the bound shut after a flush and only
    the starvation release moved the feeder, a batch of soon-stale groups at a time. Now: running =
    the tasks the env group has not committed, accepted = the groups trained (version x batch)."""
    from aiokafka import AIOKafkaConsumer, TopicPartition

    from rollart.state import VersionStore

    config = make_config(endpoints, feeder={"alpha": 1, "groups_per_batch": 2, "group_size": 1,
                                            "poll_interval_s": 0.02, "starvation_release_s": None},
                         tags={"frozenlake": {"env": "frozenlake"}})
    await apply_topics(config, endpoints, expand_catalog(config))
    async with open_runtime(config, serve=False) as rt:
        feeder = Feeder(rt)
        run = asyncio.create_task(feeder.run())
        await eventually(lambda: _count(rt, 4), what="the bound at version 0: 4 groups")
        # the env group ran every task (committed to the end), the trainer trained one batch ...
        topic = f"{config.job}.tasks"
        env = AIOKafkaConsumer(bootstrap_servers=endpoints.kafka_bootstrap, group_id=f"{config.job}.env",
                               enable_auto_commit=False)
        await env.start()
        try:
            partitions = next(t.partitions for t in expand_catalog(config) if t.name == topic)
            tps = [TopicPartition(topic, p) for p in range(partitions)]
            env.assign(tps)
            await env.commit(await env.end_offsets(tps))
        finally:
            await env.stop()
        await rt.redis.set(VersionStore(config, rt.endpoints, rt.redis).key, 1)
        await rt.redis.delete(feeder.admission.key)  # ... and then Redis lost the counters
        await eventually(lambda: _count(rt, 8), what="(1 + 1 + 1) x 2 = 6 places, 2 of them trained: 4 more groups")
        await asyncio.sleep(0.3)
        assert len(await _released(rt)) == 8
        snap = await feeder.admission.snapshot()
        assert (snap.accepted, snap.running) == (2, 4)
        feeder.stop()
        await run
