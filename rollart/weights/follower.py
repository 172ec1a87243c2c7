"""A generation consumer follows ``policy.versions``: pull in the background, then a short load.

The follower reads the compacted announcement topic outside any consumer group (every member needs
every announcement). For the newest version it has not loaded, it pulls the buckets into a local
staging directory while the engine keeps generating, then calls the engine's ``load_weights``
(pause → load → resume). Announcements that arrive during a pull are not queued: the next pull
takes the newest. The pull and the exposed pause are timed separately (metrics and a per-job Redis
list the run report reads).

Under ``weights.sync: delta`` (the manifest carries digests) the follower keeps the version it last
loaded in its staging directory: the next pull links the buckets that did not change and rebuilds
changed ones from deltas, pulling whole only what it cannot rebuild (a version it missed, a bad delta).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import shutil
import tempfile
import time
from pathlib import Path
from typing import Awaitable, Callable

from prometheus_client import Counter, Gauge, Histogram

from rollart.bus.reader import tail
from rollart.messages import DEFAULT_CODEC, MessageDecodeError, VersionAnnouncement
from rollart.weights.publish import PullResult, StagedVersion, pull_version, sync_version
from rollart.weights.transport import make_transport
from rollart.names import LOADS_KEPT, POLICY_VERSIONS, RedisKeys
from rollart.timeouts import wait_for

log = logging.getLogger(__name__)

_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30)
PULL_SECONDS = Histogram("rollart_generation_weight_pull_seconds",
                         "Background pull of one version's buckets into local staging", ("job", "pool"),
                         buckets=_BUCKETS)
LOAD_SECONDS = Histogram("rollart_generation_weight_load_seconds",
                         "Exposed engine pause to load one version (pause, load, resume)", ("job", "pool"),
                         buckets=_BUCKETS)
PULLED_BYTES = Counter("rollart_generation_weight_pulled_bytes", "Bytes read from the weight transport",
                       ("job", "pool"))
BUCKETS_SYNCED = Counter("rollart_generation_weight_buckets_total", "Buckets staged, by how: reused (held "
                         "already), delta (rebuilt), whole (pulled), fallback (a delta not applied)",
                         ("job", "pool", "how"))
LOADED_VERSION = Gauge("rollart_generation_policy_version", "Policy version the engine holds", ("job", "pool"))


def loads_key(prefix: str, job: str) -> str:
    return RedisKeys(prefix, job).weights_loads


def pulling_key(prefix: str, job: str) -> str:
    """A hash: generation member -> ``{"version": v, "until": unix seconds}`` while it pulls ``v``."""
    return RedisKeys(prefix, job).weights_pulling


async def record_load(redis, key: str, load: dict, kept: int = LOADS_KEPT) -> None:
    """Append one load to the job's list (``rollart run``'s report reads it), keeping the newest ``kept``."""
    async with redis.pipeline(transaction=False) as pipe:
        pipe.rpush(key, json.dumps(load))
        pipe.ltrim(key, -kept, -1)
        await pipe.execute()


PULL_MARK_TTL_S = 120.0  # a member that died mid-pull stops protecting its version after this


async def pulling_versions(redis, prefix: str, job: str) -> list[int]:
    """Versions some live member is pulling right now; expired marks are removed."""
    key = pulling_key(prefix, job)
    now = time.time()
    versions = []
    for member, raw in (await redis.hgetall(key)).items():
        try:
            mark = json.loads(raw)
            expired = mark["until"] < now
        except (ValueError, KeyError, TypeError):
            expired = True
        if expired:
            await redis.hdel(key, member)
        else:
            versions.append(int(mark["version"]))
    return versions


async def pull_and_load(engine, transport, announcement: VersionAnnouncement, staging: Path) -> tuple[float, float]:
    """Pull a version's buckets into ``staging`` (in a thread), load them into the engine and remove
    them; returns (pull seconds, exposed load seconds)."""
    started = time.perf_counter()
    directory = await asyncio.to_thread(pull_version, transport, announcement.manifest, announcement.version, staging)
    pull_s = time.perf_counter() - started
    try:
        load_s = await engine.load_weights(directory, announcement.version)
    finally:
        shutil.rmtree(directory, ignore_errors=True)
    return pull_s, load_s


async def stage_version(transport, announcement: VersionAnnouncement, staging: Path,
                        base: StagedVersion | None) -> tuple[PullResult, StagedVersion | None, float]:
    """Stage a version against ``base`` (in a thread); returns the pull, the base of the next pull (this
    version when its manifest has digests, else none: a copy kept for nothing) and the pull seconds.
    The older base is removed once this version is staged (its unchanged buckets are linked)."""
    manifest = announcement.manifest
    started = time.perf_counter()
    pulled = await asyncio.to_thread(sync_version, transport, manifest, announcement.version, staging, base)
    pull_s = time.perf_counter() - started
    if base is not None and base.directory != pulled.directory:
        shutil.rmtree(base.directory, ignore_errors=True)
    keep = StagedVersion(announcement.version, pulled.directory, manifest) if manifest.digest else None
    return pulled, keep, pull_s


async def watch_versions(rt, client_id: str, seen: Callable[[VersionAnnouncement], Awaitable[None]]) -> None:
    """Call ``seen`` with every announcement of the job on ``policy.versions``, from the start of the log
    and then as they come (outside any consumer group: every reader needs every announcement); runs
    until cancelled."""
    config = rt.config
    topic = rt.producer.names.physical(POLICY_VERSIONS)
    async for record in tail(config, rt.endpoints, topic, client_id=client_id):
        try:
            message = DEFAULT_CODEC.decode(record.value, record.headers, accept=(VersionAnnouncement,)).message
        except MessageDecodeError:
            continue  # not ours to dead-letter: the topic has no consumer group
        if message.job == config.job:
            await seen(message)


class WeightFollower:
    def __init__(self, rt, engine, *, pool: str, member: str):
        self.rt = rt
        self.config = rt.config
        self.engine = engine
        self.pool = pool
        self.member = member
        self.labels = (self.config.job, pool)
        configured = self.config.generation.weight_staging_dir
        root = Path(configured) if configured else Path(tempfile.mkdtemp(prefix="rollart-weights-"))
        self._own_root = None if configured else root  # made here: removed whole when the follower stops
        self.staging = root / member
        self._latest: VersionAnnouncement | None = None
        self._changed = asyncio.Condition()
        self._transport = None
        self._stop = asyncio.Event()
        self._base: StagedVersion | None = None  # the version staged last (delta sync's base)

    @property
    def version(self) -> int:
        return self.engine.version

    def stop(self) -> None:
        self._stop.set()

    async def wait_for(self, version: int) -> None:
        """Return once the engine holds ``version`` or newer."""
        if self.engine.version >= version:
            return
        async with self._changed:
            await self._changed.wait_for(lambda: self.engine.version >= version or self._stop.is_set())

    async def run(self) -> None:
        LOADED_VERSION.labels(*self.labels).set(self.engine.version)
        watcher = asyncio.create_task(self._watch())
        try:
            while not self._stop.is_set():
                target = self._latest
                if target is None or target.version <= self.engine.version or target.manifest is None:
                    await self._wait_changed(1.0)
                    continue
                try:
                    await self._apply(target)
                except Exception:
                    log.exception("%s: loading version %d failed; retrying", self.member, target.version)
                    await self._wait_changed(1.0)
        finally:
            watcher.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await watcher
            async with self._changed:
                self._changed.notify_all()
            if self._transport is not None:
                self._transport.close()
            shutil.rmtree(self._own_root or self.staging, ignore_errors=True)

    async def _wait_changed(self, timeout: float) -> None:
        async with self._changed:
            with contextlib.suppress(asyncio.TimeoutError):
                await wait_for(self._changed.wait(), timeout)

    async def _watch(self) -> None:
        async def seen(message: VersionAnnouncement) -> None:
            if self._latest is None or message.version > self._latest.version:
                self._latest = message
                async with self._changed:
                    self._changed.notify_all()

        await watch_versions(self.rt, f"{self.member}-versions", seen)

    async def _apply(self, announcement: VersionAnnouncement) -> None:
        prefix, job = self.config.redis.key_prefix, self.config.job
        version = announcement.version
        # Tell the trainer's garbage collector this version is being read.
        await self.rt.redis.hset(pulling_key(prefix, job), self.member,
                                 json.dumps({"version": version, "until": time.time() + PULL_MARK_TTL_S}))
        if self._transport is None:
            self._transport = await asyncio.to_thread(make_transport, self.config.weights, self.rt.endpoints)
        # the new base is set before the load: a failed load retries from it (nothing to pull again)
        pulled, self._base, pull_s = await stage_version(self._transport, announcement, self.staging, self._base)
        try:
            load_s = await self.engine.load_weights(pulled.directory, version)
        finally:
            if self._base is None:
                shutil.rmtree(pulled.directory, ignore_errors=True)
        await self.rt.redis.hdel(pulling_key(prefix, job), self.member)
        self._observe(pulled, pull_s, load_s, version)
        await record_load(self.rt.redis, loads_key(prefix, job), {
            "member": self.member, "pool": self.pool, "version": version, "pull_s": round(pull_s, 6),
            "load_s": round(load_s, 6), "bytes": announcement.manifest.total_bytes,
            "pulled_bytes": pulled.pulled_bytes, "reused": pulled.reused, "deltas": pulled.deltas,
            "fallbacks": pulled.fallbacks, "lag_s": round(time.time() - announcement.published_at, 6)})
        async with self._changed:
            self._changed.notify_all()
        log.info("%s: loaded version %d (pull %.3fs, %d bytes; pause %.3fs)", self.member, version, pull_s,
                 pulled.pulled_bytes, load_s)

    def _observe(self, pulled: PullResult, pull_s: float, load_s: float, version: int) -> None:
        PULL_SECONDS.labels(*self.labels).observe(pull_s)
        LOAD_SECONDS.labels(*self.labels).observe(load_s)
        LOADED_VERSION.labels(*self.labels).set(version)
        PULLED_BYTES.labels(*self.labels).inc(pulled.pulled_bytes)
        for how, count in (("reused", pulled.reused), ("delta", pulled.deltas), ("whole", pulled.whole),
                           ("fallback", pulled.fallbacks)):
            BUCKETS_SYNCED.labels(*self.labels, how).inc(count)
