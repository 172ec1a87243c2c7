"""The feeder: turns the task sources into TaskSpec groups under the staleness admission bound.

Each configured tag is a source with a sampling weight; a tag with a ``dataset`` (JSONL, parquet or a
Hugging Face dataset directory, see :mod:`rollart.datasets`) yields prompt tasks, others yield
seeded env tasks. A group is
released only while ``accepted + running < (alpha + version + 1) * groups_per_batch`` (see
:mod:`rollart.state.admission`); ``feeder.alpha: null`` disables the bound (rollout without a trainer).
Group ids are deterministic (``<job>-g<n>``) and the feeder resumes its count from Redis, so a
restarted feeder neither repeats nor skips groups.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from dataclasses import dataclass, replace

from prometheus_client import Counter, Gauge

from rollart import health
from rollart.bus.reader import read_to_end
from rollart.bus.stopping import StopRequest
from rollart.lag import consumer_lag
from rollart.config import ConfigError, RollartConfig
from rollart.datasets import Row, training_rows
from rollart.messages import TaskSpec
from rollart.runtime import Runtime
from rollart.state import AdmissionCounters, PoolRegistry, VersionStore
from rollart.state.admission import AdmissionChanges, starving_key
from rollart.names import RedisKeys
from rollart.names import TASKS
from rollart.stages.runner import Member, run_member
from rollart.timeouts import wait_for

RELEASED = Counter("rollart_feeder_groups_released_total", "Task groups released", ("job", "tag"))
log = logging.getLogger(__name__)

STARVATION_RELEASES = Counter("rollart_feeder_starvation_releases_total",
                              "Batches released past the bound because the trainer was starving", ("job",))
BLOCKED = Gauge("rollart_feeder_admission_blocked", "1 while the staleness bound holds the feeder back", ("job",))


@dataclass(frozen=True)
class Source:
    tag: str
    env: str
    weight: float
    prompts: tuple[Row, ...] = ()  # (prompt, labels) rows of the tag's dataset


def sources_from(config: RollartConfig) -> list[Source]:
    if not config.tags:
        raise ValueError("the feeder needs at least one entry under tags:")
    sources = []
    for tag, spec in config.tags.items():
        if spec.weight <= 0:
            continue
        try:
            rows = training_rows(spec.dataset) if spec.dataset else ()
        except ValueError as exc:
            raise ConfigError(f"tags.{tag}.dataset: {exc}") from None
        sources.append(Source(tag, spec.env, spec.weight, rows))
    return sources


def task_spec(config: RollartConfig, sources: list[Source], n: int) -> TaskSpec:
    """The n-th task group: a pure function of (feeder seed, n), so a restarted feeder repeats nothing
    and the in-process loop of ``rollart bench time-to-quality`` sees the same tasks as a run."""
    rng = random.Random(config.feeder.seed * 1_000_003 + n)
    source = rng.choices(sources, weights=[s.weight for s in sources])[0]
    prompt, labels = "", {}
    if source.prompts:
        prompt, labels = source.prompts[rng.randrange(len(source.prompts))]
    cfg = config.feeder
    return TaskSpec(group_id=f"{config.job}-g{n}", env=source.env, tag=source.tag, group_size=cfg.group_size,
                    seed=rng.randrange(1 << 31), prompt=prompt, redundancy=cfg.redundancy, labels=labels,
                    created_at=time.time())


class Feeder:
    def __init__(self, runtime: Runtime):
        self.rt = runtime
        self.config = runtime.config
        self.sources = sources_from(self.config)
        self._forced_left, self._last_forced = 0, 0.0
        self.admission = AdmissionCounters(runtime.redis, prefix=self.config.redis.key_prefix, job=self.config.job)
        self.versions = VersionStore(self.config, runtime.endpoints, runtime.redis)
        self.pools = PoolRegistry(runtime.redis, prefix=self.config.redis.key_prefix, job=self.config.job)
        self.counter_key = RedisKeys.of(self.config).feeder_released
        self._stop = asyncio.Event()

    def stop(self) -> None:
        self._stop.set()

    def task(self, n: int) -> TaskSpec:
        return task_spec(self.config, self.sources, n)

    async def released_count(self) -> int:
        """Groups released so far: the Redis counter, or (after Redis lost it) the log's highest group
        number + 1, so a flushed Redis never makes the feeder reuse group ids."""
        raw = await self.rt.redis.get(self.counter_key)
        if raw is not None:
            return int(raw)
        count = await self._logged_count()
        await self.rt.redis.set(self.counter_key, count, nx=True)
        return int(await self.rt.redis.get(self.counter_key) or count)

    async def _logged_count(self) -> int:
        """The highest group number on the tasks topic + 1 (0 when none is)."""
        count = 0
        prefix = f"{self.config.job}-g"
        async for record in read_to_end(self.config, self.rt.endpoints, self.rt.producer.names.physical(TASKS)):
            key = (record.key or b"").decode(errors="replace")
            if key.startswith(prefix) and key[len(prefix):].isdigit():
                count = max(count, int(key[len(prefix):]) + 1)
        return count

    async def _count_what_a_dead_feeder_sent(self) -> None:
        """At start: the counter past every group already on the log. A feeder killed between its
        tasks' acks and the counter's update would otherwise release those groups again (the chaos
        campaign caught one). The feeder is the topic's single writer, so a read and a set suffice."""
        raw = await self.rt.redis.get(self.counter_key)
        logged = await self._logged_count()
        if raw is not None and int(raw) < logged:
            log.warning("the released counter was %s but the log holds groups up to %d: continuing after them",
                        raw.decode() if isinstance(raw, bytes) else raw, logged - 1)
            await self.rt.redis.set(self.counter_key, logged)

    async def _admit(self, released: int, wanted: int) -> tuple[int, int]:
        """Reserve up to ``wanted`` group slots; returns the version admitted under and how many (0
        while the bound holds)."""
        cfg = self.config.feeder
        version = await self.versions.current()
        if cfg.alpha is None:
            return version, wanted
        if not await self.rt.redis.exists(self.admission.key):
            await self._rebuild_admission(released, version)
        count = await self.admission.admit_up_to(version=version, alpha=cfg.alpha,
                                                 groups_per_batch=cfg.groups_per_batch, groups=wanted)
        if not count and await self._starvation_release(version):
            await self.admission.force_admit(1)
            return version, 1
        return version, count

    async def _rebuild_admission(self, released: int, version: int) -> None:
        """Redis lost the counters: rebuild them from the log. Running: the tasks the env group has not
        committed (queued or rolling out); accepted: the groups trained so far (version × batch).
        Groups in the trainer's buffer, not yet trained, are left out: the bound then admits at most
        a buffer's worth extra, which staleness eviction bounds. (Counting every released group as
        accepted, the earlier rule, kept every group ever dropped in the bound: after a flush the
        feeder stayed held back and only the starvation release moved it, a batch of stale groups
        at a time.)"""
        try:  # nothing released yet (a new job): nothing to read
            rows = await wait_for(consumer_lag(self.config, self.rt.endpoints), 30) if released else []
            running = min(released, sum(r.lag for r in rows if r.group == "env" and r.topic == TASKS))
        except Exception as exc:  # noqa: BLE001 - e.g. no ACL to read the env group's offsets, or a timeout
            log.warning("admission counters lost and the env group's offsets unreadable (%s): counting every "
                        "released group as running", exc)
            running = released
        accepted = min(released - running, version * self.config.feeder.groups_per_batch)
        if released:
            log.warning("admission counters lost (Redis flushed?): rebuilt from the log as %d running, %d accepted",
                        running, accepted)
        await self.admission.rebuild(accepted=accepted, running=running)

    async def _starvation_release(self, version: int) -> bool:
        """One more group (of a batch) past the bound when the trainer has starved long enough.

        The release is for counters that over-count after crashes, not for a loop still starting or
        merely failing: it never fires before the first batch was trained (version 0: the bound admits
        two batches' worth, the wait is the engines loading and the first rollouts), nor while no
        generation pool has a live member (nothing admitted could be generated; the bound is not what
        holds it up), nor while groups are still ending, complete or not (the loop moves: failed
        groups give their places back, and more groups past the bound would only be more doomed ones)."""
        cfg = self.config.feeder
        if self._forced_left > 0:
            self._forced_left -= 1
            return True
        if cfg.starvation_release_s is None or version == 0:
            return False
        since = await self.rt.redis.get(starving_key(self.config.redis.key_prefix, self.config.job))
        now = time.time()
        if since is None or now - float(since) < cfg.starvation_release_s \
                or now - self._last_forced < cfg.starvation_release_s:
            return False
        if not any((await self.pools.live_pools(self.config.pools)).values()):
            return False
        if now - (await self.admission.snapshot()).finished_at < cfg.starvation_release_s:
            return False
        self._last_forced, self._forced_left = now, cfg.groups_per_batch - 1
        STARVATION_RELEASES.labels(self.config.job).inc()
        log.warning("the trainer has waited %.0fs for a batch while the staleness bound holds the feeder back: "
                    "releasing one batch past it", now - float(since))
        return True

    async def _previous_batch_ended(self) -> bool:
        """No group is running (batch release: the next batch waits for the last one's stragglers)."""
        return (await self.admission.snapshot()).running <= 0

    async def run(self) -> int:
        """Release groups until ``feeder.max_groups`` or stop(); returns how many this run released."""
        try:
            await self._count_what_a_dead_feeder_sent()
            async with self.admission.changes() as changes:
                return await self._release(self.config.feeder, changes)
        finally:
            health.forget("feeder")  # done or stopping: no longer a loop the probes should watch

    async def _release(self, cfg, changes: AdmissionChanges) -> int:
        """While the bound (or batch release) holds it back, the feeder waits for an announced change,
        ``poll_interval_s`` at most (polling Redis every 50 ms instead cost the demo's feeder and
        Redis ~5% of a core, on the trainer's cores)."""
        released = 0
        while not self._stop.is_set():
            health.beat("feeder")
            n = await self.released_count()
            if cfg.max_groups is not None and n >= cfg.max_groups:
                break
            if cfg.release == "batch" and n % cfg.groups_per_batch == 0 and not await self._previous_batch_ended():
                await changes.wait(cfg.poll_interval_s, self._stop)
                continue
            version, count = await self._admit(n, self._rest_of_batch(n))
            BLOCKED.labels(self.config.job).set(0 if count else 1)
            if not count:
                await changes.wait(cfg.poll_interval_s, self._stop)
                continue
            await self._send_tasks(n, count, version)
            released += count
        return released

    def _rest_of_batch(self, released: int) -> int:
        """The groups the feeder asks room for at once: the rest of the batch ``released`` is in (within
        ``max_groups``). When a new version opens room for a batch, its groups go out together: one
        group at a time (five round trips each, the feeder yielding the CPU to the rollout) took
        ~0.13 s to start a demo batch, while the engine waited for work."""
        cfg = self.config.feeder
        rest = cfg.groups_per_batch - released % cfg.groups_per_batch
        return rest if cfg.max_groups is None else max(1, min(rest, cfg.max_groups - released))

    async def _send_tasks(self, first: int, count: int, version: int) -> None:
        """Groups ``first`` .. ``first + count - 1`` to the tasks topic (sent together, then every ack
        awaited), then the released counter past them (a successor of a feeder that died before that
        finds them on the log: ``_count_what_a_dead_feeder_sent``)."""
        tasks = [replace(self.task(first + i), admitted_version=version) for i in range(count)]
        acks = [await self.rt.producer.send(TASKS, task, key=task.group_id, policy_version=version) for task in tasks]
        await asyncio.gather(*acks)
        await self.rt.redis.set(self.counter_key, first + count)
        for task in tasks:
            RELEASED.labels(self.config.job, task.tag).inc()


async def run_feeder(config: RollartConfig, stop: StopRequest) -> None:
    """Release task groups until ``feeder.max_groups`` or ``stop`` (SIGTERM)."""
    await run_member(config, stop, lambda rt: Member(loops=[Feeder(rt)]), client_id="feeder")
