"""The policy version: one writer (the trainer), read everywhere, durable in the log.

The compacted ``policy.versions`` topic is the source of truth. Redis holds the current version as
a fast cache (``<prefix>:<job>:policy_version``); when the key is missing (Redis flushed or
restarted) a reader rebuilds it from the topic. The writer appends the announcement to the log
first and only then raises the cached value (never lowers it), so a reader never sees a version
that the log does not hold.
"""

from __future__ import annotations

import asyncio
import time
import uuid

from redis.asyncio import Redis

from rollart.bus.producer import BusProducer
from rollart.bus.reader import read_to_end
from rollart.config import RollartConfig
from rollart.endpoints import Endpoints
from rollart.messages import DEFAULT_CODEC, MessageDecodeError, VersionAnnouncement, WeightManifest
from rollart.names import RedisKeys
from rollart.names import POLICY_VERSIONS

VERSIONS_TOPIC = POLICY_VERSIONS

# Raise the cached version to ARGV[1] unless it already is at least that high.
_SET_MAX = """
local current = tonumber(redis.call('GET', KEYS[1]) or '-1')
local proposed = tonumber(ARGV[1])
if proposed > current then
  redis.call('SET', KEYS[1], ARGV[1])
  return proposed
end
return current
"""

# Refresh the writer lease only if we still hold it.
_RENEW = """
if redis.call('GET', KEYS[1]) == ARGV[1] then
  return redis.call('PEXPIRE', KEYS[1], ARGV[2])
end
return 0
"""


class WriterConflict(RuntimeError):
    """Another process holds the version writer lease."""


class VersionStore:
    """Reads the current policy version (any stage)."""

    def __init__(self, config: RollartConfig, endpoints: Endpoints, redis: Redis):
        self.config = config
        self.endpoints = endpoints
        self.redis = redis
        self.key = RedisKeys.of(config).policy_version
        self._set_max = redis.register_script(_SET_MAX)

    async def current(self) -> int:
        raw = await self.redis.get(self.key)
        if raw is not None:
            return int(raw)
        return await self.rebuild()

    async def rebuild(self) -> int:
        """Recompute the version from the log and cache it; 0 when nothing was ever announced."""
        latest = await self.latest_announcement()
        version = latest.version if latest is not None else 0
        return int(await self._set_max(keys=[self.key], args=[version]))

    async def announcements(self) -> list[VersionAnnouncement]:
        """Every announcement of this job in the log, in log order."""
        topic = f"{self.config.job}.{VERSIONS_TOPIC}"
        found = []
        async for record in read_to_end(self.config, self.endpoints, topic):
            try:
                message = DEFAULT_CODEC.decode(record.value, record.headers, accept=(VersionAnnouncement,)).message
            except MessageDecodeError:
                continue  # the consumers' DLQ handles bad records; here they just do not count
            if message.job == self.config.job:
                found.append(message)
        return found

    async def latest_announcement(self) -> VersionAnnouncement | None:
        return max(await self.announcements(), key=lambda a: a.version, default=None)


class VersionWriter(VersionStore):
    """The single writer. Bumps are serialised in-process and fenced across processes by a lease."""

    def __init__(self, config: RollartConfig, endpoints: Endpoints, redis: Redis, producer: BusProducer,
                 *, lease_s: float = 30.0, token: str | None = None):
        super().__init__(config, endpoints, redis)
        self.producer = producer
        self.lease_key = RedisKeys.of(config).policy_version_writer
        self.lease_ms = int(lease_s * 1000)
        # A resumed trainer passes the token it held before (kept beside its checkpoints), so the
        # lease of its own crashed predecessor does not lock it out.
        self.token = token or uuid.uuid4().hex
        self._lock = asyncio.Lock()
        self._renew = redis.register_script(_RENEW)

    async def acquire(self) -> None:
        if await self.redis.set(self.lease_key, self.token, nx=True, px=self.lease_ms):
            return
        holder = await self.redis.get(self.lease_key)
        if holder is not None and (holder.decode() if isinstance(holder, bytes) else holder) == self.token:
            return
        raise WriterConflict(f"another trainer holds the policy version lease ({self.lease_key}); "
                             f"wait {self.lease_ms / 1000:.0f}s for it to expire or stop that trainer")

    async def release(self) -> None:
        if await self.redis.get(self.lease_key) == self.token.encode():
            await self.redis.delete(self.lease_key)

    async def bump(self, *, step: int = 0, manifest: WeightManifest | None = None) -> VersionAnnouncement:
        """Announce version ``current + 1``: log first, then the cache. Concurrent calls are serial."""
        async with self._lock:
            if not await self._renew(keys=[self.lease_key], args=[self.token, self.lease_ms]):
                await self.acquire()  # expired while idle; fails if another writer took over
            latest = await self.current()
            announcement = VersionAnnouncement(job=self.config.job, version=latest + 1, step=step,
                                               manifest=manifest, published_at=time.time())
            await self.producer.send_and_wait(VERSIONS_TOPIC, announcement, key=self.config.job,
                                              policy_version=announcement.version)
            await self._set_max(keys=[self.key], args=[announcement.version])
            # A new version moves the admission bound: a blocked feeder is waiting for this.
            await self.redis.publish(RedisKeys.of(self.config).admission_changed, announcement.version)
            return announcement
