"""The trainer stage in-process on the real broker and Redis, with the tiny model (no engine).

Scored trajectories are produced to ``rewards.results`` as the reward stage would; the trainer
trains, checkpoints, publishes weights (Mooncake of the test stack) and announces versions.
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import replace

import pytest

from rollart.messages import Abort, GroupEnded, Int32Array, ScoredTrajectory
from rollart.messages.samples import sample_trajectory
from rollart.state import VersionStore, VersionWriter
from rollart.stages.trainer import TrainerStage, build_backend, trainer_loop
from rollart.training.checkpoint import CheckpointStore
from rollart.weights import WeightPublisher, make_transport
from tests.conftest import eventually, make_config


def scored(group: int, member: int, *, reward: float, version: int = 0, job: str = "j") -> ScoredTrajectory:
    t = sample_trajectory(f"{job}-g{group}-t{member}", n_prompt=6, n_gen=4, version=version)
    t = replace(t, group_id=f"{job}-g{group}", token_ids=Int32Array([5 + (i * 7 + member) % 300 for i in range(10)]))
    return ScoredTrajectory(trajectory=t, reward=reward, scorer="test")


class Harness:
    def __init__(self, rt, tmp_path, tiny_model):
        self.rt = rt
        self.config = rt.config
        self.checkpoints = CheckpointStore(tmp_path / "ckpt")
        self.backend = build_backend(self.config)
        self.transport = make_transport(self.config.weights, rt.endpoints)
        self.writer = VersionWriter(self.config, rt.endpoints, rt.redis, rt.producer)
        self.stage = TrainerStage(rt, self.backend, self.checkpoints,
                                  WeightPublisher.from_config(self.transport, self.config.job, self.config.weights),
                                  self.writer, pad_id=0)
        self.stop = asyncio.Event()

    async def start(self, loops, max_steps=None, *, steps=True):
        """``steps=False``: no step loop, for a test that publishes itself (the loop's start-up publish
        check would race with it)."""
        await self.writer.acquire()
        await loops.start(trainer_loop(self.rt, self.stage))
        self.training = asyncio.create_task(self.stage.run(self.stop, max_steps)) if steps else None

    async def produce(self, items):
        for item in items:
            await self.rt.producer.send_and_wait("rewards.results", item, key=item.trajectory.group_id)

    def steps(self):
        return [r for r in self.checkpoints.read_record() if "event" not in r]

    async def close(self):
        self.stop.set()
        if self.training is not None:
            await self.training
        self.transport.close()


@pytest.fixture
async def trainer(endpoints, tmp_path, tiny_model, request):
    from rollart.runtime import open_runtime
    from rollart.topics import expand_catalog
    from rollart.topics.admin import apply_topics

    options = {"feeder": {"group_size": 2, "groups_per_batch": 2, "alpha": 1},
               "trainer": {"lr": 1e-2, "checkpoint_dir": str(tmp_path / "ckpt"), "micro_batch": 4},
               "model": {"path": str(tiny_model)}, "weights": {"bucket_bytes": 1 << 20}}
    marker = request.node.get_closest_marker("trainer")
    for section, values in (marker.kwargs if marker else {}).items():
        options.setdefault(section, {}).update(values)
    config = make_config(endpoints, **options)
    await apply_topics(config, endpoints, expand_catalog(config))
    async with open_runtime(config, serve=False) as rt:
        harness = Harness(rt, tmp_path, tiny_model)
        yield harness
        await harness.close()


@pytest.mark.trainer(bus={"bulk_fetch": {"min_bytes": 4096, "max_wait_ms": 80}})
async def test_the_trainer_fetches_its_samples_in_bulk_as_configured(trainer, loops):
    """Kafka's fetch.min.bytes / fetch.max.wait.ms of the trainer's consumer are ``bus.bulk_fetch``'s."""
    await trainer.start(loops, steps=False)
    client = trainer.stage.consumer._consumer.kafka
    assert (client._fetch_min_bytes, client._fetch_max_wait_ms) == (4096, 80)
    await trainer.produce([scored(1, m, reward=float(m)) for m in range(2)])
    await eventually(lambda: len(trainer.stage.buffer.complete_groups()) == 1, what="the group arrives")


async def test_trains_publishes_and_announces_each_version(trainer, loops, redis):
    job = trainer.config.job
    await trainer.start(loops)
    await trainer.produce([scored(g, m, reward=float(m), job=job) for g in range(4) for m in range(2)])
    await eventually(lambda: len(trainer.steps()) == 2, what="two training steps")
    store = VersionStore(trainer.config, trainer.rt.endpoints, redis)
    await eventually(lambda: trainer.stage.version == 2, what="version 2 announced")
    assert await store.current() == 2
    latest = await store.latest_announcement()
    assert latest.version == 2 and latest.step == 2
    assert latest.manifest.transport == trainer.transport.name and latest.manifest.total_bytes > 0
    rows = trainer.steps()
    assert [r["samples"] for r in rows] == [4, 4]
    assert all(r["staleness_max"] <= 1 for r in rows)
    # every token of these samples is from its trajectory's start version: both measures agree
    assert [r["token_staleness_mean"] for r in rows] == [r["staleness_mean"] for r in rows]
    assert all(r["mixed_precision"] == "no" for r in rows)
    # the training thread's own clock: on a core and waiting for one, both within the step's time
    assert all(0 < r["train_cpu_s"] and r["train_cpu_s"] + r["train_queue_s"] <= r["train_s"] * 1.05 + 0.002
               for r in rows)
    assert trainer.checkpoints.latest().name == "step-2"
    state = json.loads((trainer.checkpoints.latest() / "trainer.json").read_text())
    assert state["version"] == 2 and len(state["trained_ids"]) == 8


async def test_duplicates_and_stale_groups_are_never_trained(trainer, loops):
    job = trainer.config.job
    await trainer.start(loops)
    first = [scored(g, m, reward=float(m), job=job) for g in range(2) for m in range(2)]
    await trainer.produce(first + first[:2])  # a redelivered copy of group 0
    await eventually(lambda: trainer.stage.version == 1, what="version 1")
    await trainer.produce(first)  # already trained: dropped, never forms a batch
    # Versions now 1: a group whose tokens came from version 0 is fine (staleness 1 = alpha) ...
    fresh = [scored(g, m, reward=float(m), version=0, job=job) for g in (10, 11) for m in range(2)]
    await trainer.produce(fresh)
    await eventually(lambda: trainer.stage.version == 2, what="version 2")
    # ... at version 2, version-0 samples are 2 behind alpha = 1: evicted, not trained.
    stale = [scored(g, m, reward=float(m), version=0, job=job) for g in (20, 21) for m in range(2)]
    fresher = [scored(g, m, reward=float(m), version=2, job=job) for g in (30, 31) for m in range(2)]
    admission = trainer.stage.admission
    for group in (20, 21, 30, 31):  # as the env stage does: admitted, then accepted into the buffer
        await admission.force_admit(1)
        await admission.finish(accepted=True, group_id=f"{job}-g{group}")
    await trainer.produce(stale)
    await eventually(lambda: trainer.stage.buffer.stats.evicted_stale_groups == 2, timeout=120,
                     what="stale groups evicted")
    await trainer.produce(fresher)
    await eventually(lambda: len(trainer.steps()) == 3, what="step 3")
    snap = await admission.snapshot()
    assert (snap.accepted, snap.dropped) == (2, 2), "the evicted groups gave their admission places back"
    # the step's row is written before its groups are settled: wait for the settling, not the row
    await eventually(lambda: _none_accepted(trainer.rt.redis, admission), what="trained and dropped ids forgotten")
    ids = [i for r in trainer.steps() for i in r["traj_ids"]]
    assert len(ids) == len(set(ids)) == 12
    assert not any(f"-g2{n}-" in i for i in ids for n in (0, 1)), "a stale sample was trained"
    assert max(r["staleness_max"] for r in trainer.steps()) <= 1


async def _none_accepted(redis, admission) -> bool:
    return await redis.scard(admission.accepted_groups_key) == 0


@pytest.mark.trainer(trainer={"min_group_size": 1})
async def test_a_group_that_will_not_fill_trains_partially_or_leaves_at_once(trainer, loops):
    """The env stage's GroupEnded (which members completed) and the reward stage's reward_failed
    aborts on rewards.results: a group short of members trains with those scored (min_group_size),
    one with none is dropped at once and gives its admission place back, not held until overflow."""
    job = trainer.config.job
    admission = trainer.stage.admission
    for group in (1, 2):
        await admission.force_admit(1)
        await admission.finish(accepted=True, group_id=f"{job}-g{group}")
    await trainer.start(loops)
    send = trainer.rt.producer.send_and_wait
    full = [scored(0, m, reward=float(m), job=job) for m in range(2)]
    short = scored(1, 0, reward=1.0, job=job)
    await send("rewards.results", GroupEnded(group_id=f"{job}-g1", tag="t", completed=(
        short.trajectory.traj_id, f"{job}-g1-t1")), key=f"{job}-g1")
    await send("rewards.results", GroupEnded(group_id=f"{job}-g2", tag="t", completed=()), key=f"{job}-g2")
    await trainer.produce([*full, short])
    await asyncio.sleep(1.0)
    assert trainer.steps() == [], "g1's second member completed: it may still be scored"
    await send("rewards.results", Abort(traj_id=f"{job}-g1-t1", turn=1, reason="reward_failed", group_id=f"{job}-g1"),
               key=f"{job}-g1")
    await eventually(lambda: len(trainer.steps()) == 1, what="a step of the full group and the partial one")
    row = trainer.steps()[0]
    assert row["samples"] == 3 and row["groups"] == 2 and row["partial_groups"] == 1
    assert trainer.stage.buffer.stats.unfillable_groups == 1
    await eventually(lambda: not trainer.stage.waiting, what="every sample and marker settled")
    snap = await admission.snapshot()
    assert snap.dropped == 1, "the group that ended with no member gave its place back"


@pytest.mark.trainer(trainer={"capacity_groups": 2}, feeder={"alpha": 100})
async def test_buffer_stays_bounded_when_training_is_slow(trainer, loops):
    job = trainer.config.job
    gate = asyncio.Event()
    train_step = trainer.backend.train_step

    def slow_step(batch):  # the trainer is far slower than rollout until the gate opens
        import time

        while not gate.is_set():
            time.sleep(0.01)
        return train_step(batch)

    trainer.backend.train_step = slow_step
    await trainer.start(loops)
    await trainer.produce([scored(g, m, reward=float(m), job=job) for g in range(30) for m in range(2)])
    bound = trainer.stage.max_in_flight
    assert bound == 4  # 2 groups of 2
    peak = 0
    for _ in range(40):
        peak = max(peak, len(trainer.stage.waiting), sum(len(g.members) for g in trainer.stage.buffer.groups.values()))
        await asyncio.sleep(0.05)
    assert 0 < peak <= bound, f"buffer held {peak} samples with a bound of {bound}"
    gate.set()
    await eventually(lambda: len(trainer.steps()) >= 3, what="training resumes once the trainer catches up")


@pytest.mark.trainer(trainer={"capacity_groups": 2}, feeder={"alpha": 100})
async def test_redelivered_copies_filling_the_consumer_do_not_stall_the_trainer(trainer, loops):
    """Copies of a buffered sample (a reward stage's redo) wait for their twin and hold consumer
    slots; when they fill all of them no new sample can complete a group. The trainer must see the
    full consumer, not only its own count, and drop the incomplete group."""
    job = trainer.config.job
    await trainer.start(loops)
    lone = scored(0, 0, reward=0.0, job=job)
    await trainer.produce([lone] * 4)  # max_in_flight = 4: the sample and three copies fill the loop
    await eventually(lambda: trainer.stage.buffer.stats.evicted_full_groups == 1,
                     what="the group that cannot complete dropped once the copies fill the consumer")
    await trainer.produce([scored(g, m, reward=float(m), job=job) for g in (1, 2) for m in range(2)])
    await eventually(lambda: len(trainer.steps()) == 1, what="a step: the consumer has room again")
    assert trainer.stage.buffer.stats.evicted_full_groups == 1 and trainer.stage.buffer.stats.late_members == 3
    assert {i.split("-t")[0] for i in trainer.steps()[0]["traj_ids"]} == {f"{job}-g1", f"{job}-g2"}


async def test_a_revoked_partition_takes_its_unsettled_samples_back(trainer, loops):
    """After a rebalance cancels a handler, its sample is redelivered: the buffer must accept that
    copy (as the sample), not drop it as a duplicate whose offset then commits untrained."""
    from aiokafka import TopicPartition

    job = trainer.config.job
    await trainer.start(loops)
    await trainer.produce([scored(0, 0, reward=0.0, job=job)])
    await eventually(lambda: trainer.stage.waiting, what="the sample buffered")
    (where,) = {w for _, w, _ in trainer.stage.waiting.values()}
    topic, partition = where.rsplit(":", 1)
    await trainer.stage.forget_revoked({TopicPartition(topic, int(partition))})
    assert not trainer.stage.waiting and len(trainer.stage.buffer) == 0
    assert trainer.stage.buffer.add(scored(0, 0, reward=0.0, job=job)), "the redelivered copy is the sample"


async def test_version_comes_back_from_the_log_after_a_redis_flush(trainer, loops, redis):
    job = trainer.config.job
    await trainer.start(loops)
    await trainer.produce([scored(g, m, reward=float(m), job=job) for g in range(2) for m in range(2)])
    await eventually(lambda: len(trainer.steps()) == 1, what="step 1")
    await eventually(lambda: trainer.stage.version == 1, what="version 1 announced")
    async for key in redis.scan_iter(match=f"{trainer.config.redis.key_prefix}:{job}:*"):
        await redis.delete(key)  # the job's whole Redis state is gone
    await trainer.produce([scored(g, m, reward=float(m), job=job) for g in (5, 6) for m in range(2)])
    await eventually(lambda: len(trainer.steps()) == 2, what="step 2 after the flush")
    store = VersionStore(trainer.config, trainer.rt.endpoints, redis)
    await eventually(lambda: trainer.stage.version == 2, what="version 2")
    assert await store.current() == 2, "the version was rebuilt from policy.versions and bumped from there"


async def test_old_versions_are_collected_unless_a_consumer_is_pulling_them(trainer, loops, redis):
    import time

    from rollart.weights.follower import pulling_key

    job = trainer.config.job
    publisher = trainer.stage.publisher
    key = pulling_key(trainer.config.redis.key_prefix, job)
    await trainer.start(loops)
    await trainer.produce([scored(g, m, reward=float(m), job=job) for g in range(2) for m in range(2)])
    await eventually(lambda: trainer.stage.version == 1, what="version 1")
    # A generation member is pulling version 1 (a dead one's mark has expired).
    await redis.hset(key, mapping={"gen-a": json.dumps({"version": 1, "until": time.time() + 60}),
                                   "gen-dead": json.dumps({"version": 0, "until": time.time() - 1})})
    for n in (1, 2):
        await trainer.produce([scored(10 * n + g, m, reward=float(m), version=n, job=job)
                               for g in range(2) for m in range(2)])
        await eventually(lambda n=n: trainer.stage.version == n + 1, what=f"version {n + 1}")
    assert sorted(publisher.published) == [1, 2, 3], "version 1 is kept while gen-a pulls it"
    assert await redis.hkeys(key) == [b"gen-a"], "the expired mark was removed"
    await redis.hdel(key, "gen-a")
    await trainer.produce([scored(40 + g, m, reward=float(m), version=3, job=job) for g in range(2) for m in range(2)])
    await eventually(lambda: trainer.stage.version == 4, what="version 4")
    # (the version is announced before the old ones are collected: wait for the collection)
    await eventually(lambda: sorted(publisher.published) == [3, 4],
                     what="keep_versions = 2 once nobody pulls the old ones")


@pytest.mark.trainer(weights={"sync": "delta", "bucket_bytes": 1 << 18})
async def test_delta_sync_shares_unchanged_buckets_and_collects_them_once_unnamed(trainer, loops, tmp_path):
    """weights.sync: delta through the test stack's Mooncake: a version whose weights did not change
    writes nothing; a changed tensor rewrites its bucket only; a bucket key lives as long as a kept
    version names it; a follower holding the previous version pulls only what changed."""
    import torch

    from rollart.weights import WeightTransportError, read_staged
    from rollart.weights.publish import StagedVersion, manifest_keys, sync_version

    stage, publisher, transport = trainer.stage, trainer.stage.publisher, trainer.transport
    await trainer.start(loops, steps=False)  # the versions are published here
    for _ in range(3):  # versions 1-3 of the same weights (keep_versions = 2 keeps 2 and 3)
        await stage.publish(step=0)
    first, third = publisher.published.get(1), publisher.published[3]
    assert first is None and sorted(publisher.published) == [2, 3]
    assert publisher.last.written_bytes == 0 and all(b.key.split("/")[-2] == "v1" for b in third.buckets), \
        "nothing rewritten: version 3 names version 1's buckets, kept alive though version 1 was collected"
    staged = sync_version(transport, third, 3, tmp_path / "staging")
    name = "model.layers.0.mlp.down_proj.weight"
    with torch.no_grad():
        trainer.backend.state_dict()[name].add_(1.0)
    await stage.publish(step=1)
    fourth = publisher.published[4]
    changed = [b for b in fourth.buckets if name in b.tensors]
    assert publisher.last.changed == 1 and changed[0].key.split("/")[-2] == "v4"
    pulled = sync_version(transport, fourth, 4, tmp_path / "staging", StagedVersion(3, staged.directory, third))
    assert (pulled.reused, pulled.deltas + pulled.whole) == (len(fourth.buckets) - 1, 1)
    state = trainer.backend.state_dict()
    for tensor_name, tensor in read_staged(pulled.directory):
        assert torch.equal(tensor, state[tensor_name].to(tensor.dtype)), tensor_name
    await stage.publish(step=2)  # version 5: collects 3, and with it the last name of the old bucket
    (old_key,) = {b.key for b in third.buckets if name in b.tensors}
    assert old_key not in manifest_keys(publisher.published[5])

    def collected() -> bool:  # Mooncake leases a key it served (the pull above) for a moment
        publisher.collect(keep_from=4)
        return 3 not in publisher.published

    await eventually(collected, what="version 3 collected")
    with pytest.raises(WeightTransportError):
        transport.get(old_key)
    for key in manifest_keys(publisher.published[5]):
        assert transport.get(key), key


async def test_each_step_goes_to_the_configured_trackers(trainer, loops, tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from rollart.config import TrackingConfig
    from rollart.tracking import Trackers

    job = trainer.config.job
    tracking = TrackingConfig(tensorboard={"dir": str(tmp_path / "tb")})
    trainer.stage.tracking = Trackers.from_config(trainer.config.model_copy(update={"tracking": tracking}))
    await trainer.start(loops)
    await trainer.produce([scored(g, m, reward=float(m), job=job) for g in range(4) for m in range(2)])
    # version 2 is published after step 2's row went to the trackers (the record's row comes before them)
    await eventually(lambda: trainer.stage.version == 2, what="two training steps, tracked and published")
    trainer.stage.tracking.close()
    events = EventAccumulator(str(tmp_path / "tb" / job))
    events.Reload()
    rewards = [(e.step, e.value) for e in events.Scalars("train/reward_mean")]
    assert rewards == [(r["step"], r["reward_mean"]) for r in trainer.steps()] == [(1, 0.5), (2, 0.5)]
    assert "train/loss/grad_norm" in events.Tags()["scalars"], "the backend's loss terms too"


TWO_TAGS = {"fast": {"env": "frozenlake"}, "slow": {"env": "frozenlake"}}


@pytest.mark.trainer(tags=TWO_TAGS)
async def test_a_fast_tag_does_not_crowd_a_slow_one_out_of_the_batches(trainer, loops):
    await _fast_and_slow(trainer, loops)
    assert trainer.stage.building is None


@pytest.mark.trainer(tags=TWO_TAGS, trainer={"stream_batch": True})
async def test_a_streamed_batch_trains_a_complete_group_before_the_batch_is_whole(trainer, loops):
    """The fast tag's share of the batch is trained while the batch waits for the slow tag; the step
    then holds both, and only the slow group's part was left once the batch was whole."""
    await _fast_and_slow(trainer, loops, streamed=True)
    step = trainer.steps()[0]
    assert 0 < step["train_tail_s"] <= step["train_s"] + 0.05


async def _fast_and_slow(trainer, loops, *, streamed: bool = False) -> None:
    job = trainer.config.job

    def of(tag: str, group: int) -> list[ScoredTrajectory]:
        return [replace(s, trajectory=replace(s.trajectory, tag=tag))
                for s in (scored(group, m, reward=float(m), job=job) for m in range(2))]

    await trainer.start(loops)
    await trainer.produce([s for g in range(3) for s in of("fast", g)])
    await asyncio.sleep(2.0)  # three fast groups, enough for a batch of two: held for the slow tag's share
    held = len(trainer.stage.buffer.complete_groups())
    assert trainer.steps() == []
    if streamed:
        assert [g.tag for g in trainer.stage.building.groups] == ["fast"], "the fast share, trained already"
        assert trainer.stage.building.times.wall_s > 0 and held == 2, "the fast surplus stays buffered"
    else:
        assert held == 3
    await trainer.produce(of("slow", 10))
    await eventually(lambda: len(trainer.steps()) == 1, what="a step once the slow tag has a group")
    assert trainer.steps()[0]["groups_by_tag"] == {"fast": 1, "slow": 1}


def test_token_staleness_counts_the_turns_newer_weights_generated():
    """A trajectory started on version 3 whose last turn came from version 5 after an in-flight weight
    update: trained at 5, its start is 2 versions old but only its first turns' tokens are."""
    from rollart.stages.trainer import token_staleness_mean

    t = sample_trajectory("g0-t0", n_prompt=4, n_gen=6, version=3)
    mixed = replace(t, versions=Int32Array([-1] * 4 + [3, 3, 4, 4, 5, 5]))
    fresh = replace(t, traj_id="g0-t1", versions=Int32Array([-1] * 4 + [5] * 6))
    samples = [ScoredTrajectory(trajectory=mixed, reward=1.0), ScoredTrajectory(trajectory=fresh, reward=0.0)]
    assert token_staleness_mean(samples, 5) == pytest.approx((2 + 2 + 1 + 1) / 12)
    assert token_staleness_mean(samples[:1], 5) == pytest.approx(1.0)
    assert token_staleness_mean(samples[1:], 6) == pytest.approx(1.0)
