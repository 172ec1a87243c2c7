"""Admission counters for bounded staleness (AReaL-style), updated atomically in Redis.

The feeder releases a task group only while

    accepted + running < (alpha + version + 1) * groups_per_batch

where ``running`` counts groups released and not yet finished, and ``accepted`` counts groups that
finished into the trainer's buffer (cumulative). Groups that end aborted leave ``running`` without
entering ``accepted``. The check and the increment are one Lua script, so several feeders cannot
over-admit together. Like every Redis value here this is a cache: the feeder rebuilds it from the
log with :meth:`AdmissionCounters.rebuild` after Redis loses it.
"""

from __future__ import annotations

from dataclasses import dataclass

from redis.asyncio import Redis

_TRY_ADMIT = """
local accepted = tonumber(redis.call('HGET', KEYS[1], 'accepted') or '0')
local running = tonumber(redis.call('HGET', KEYS[1], 'running') or '0')
local capacity = (tonumber(ARGV[1]) + tonumber(ARGV[2]) + 1) * tonumber(ARGV[3])
local n = tonumber(ARGV[4])
if accepted + running + n <= capacity then
  redis.call('HINCRBY', KEYS[1], 'running', n)
  redis.call('HINCRBY', KEYS[1], 'admitted', n)
  return 1
end
return 0
"""

_FINISH = """
local running = tonumber(redis.call('HGET', KEYS[1], 'running') or '0')
local n = math.min(tonumber(ARGV[1]), running)
redis.call('HINCRBY', KEYS[1], 'running', -n)
if ARGV[2] == '1' then
  redis.call('HINCRBY', KEYS[1], 'accepted', n)
else
  redis.call('HINCRBY', KEYS[1], 'dropped', n)
end
return n
"""


@dataclass(frozen=True)
class AdmissionSnapshot:
    accepted: int
    running: int
    admitted: int
    dropped: int


def starving_key(prefix: str, job: str) -> str:
    """Set by the trainer while it waits for a batch: the Unix time it started waiting (short TTL)."""
    return f"{prefix}:{job}:trainer:starving-since"


class AdmissionCounters:
    def __init__(self, redis: Redis, *, prefix: str, job: str):
        self.redis = redis
        self.key = f"{prefix}:{job}:admission"
        self._try_admit = redis.register_script(_TRY_ADMIT)
        self._finish = redis.register_script(_FINISH)

    @staticmethod
    def capacity(version: int, alpha: int, groups_per_batch: int) -> int:
        return (alpha + version + 1) * groups_per_batch

    async def try_admit(self, *, version: int, alpha: int, groups_per_batch: int, groups: int = 1) -> bool:
        """Reserve ``groups`` running slots if the staleness bound allows it."""
        if alpha < 0 or groups_per_batch < 1 or groups < 1:
            raise ValueError("alpha must be >= 0, groups_per_batch and groups >= 1")
        ok = await self._try_admit(keys=[self.key], args=[alpha, version, groups_per_batch, groups])
        return bool(ok)

    async def force_admit(self, groups: int = 1) -> None:
        """Reserve ``groups`` running slots past the bound (the feeder's starvation release)."""
        async with self.redis.pipeline(transaction=True) as pipe:
            pipe.hincrby(self.key, "running", groups)
            pipe.hincrby(self.key, "admitted", groups)
            await pipe.execute()

    async def finish(self, *, groups: int = 1, accepted: bool) -> int:
        """A running group ended: into the trainer's buffer (accepted) or dropped."""
        return int(await self._finish(keys=[self.key], args=[groups, "1" if accepted else "0"]))

    async def snapshot(self) -> AdmissionSnapshot:
        raw = await self.redis.hgetall(self.key)
        get = lambda name: int(raw.get(name.encode(), 0))  # noqa: E731
        return AdmissionSnapshot(get("accepted"), get("running"), get("admitted"), get("dropped"))

    async def rebuild(self, *, accepted: int, running: int) -> None:
        async with self.redis.pipeline(transaction=True) as pipe:
            pipe.delete(self.key)
            pipe.hset(self.key, mapping={"accepted": accepted, "running": running, "admitted": accepted + running,
                                         "dropped": 0})
            await pipe.execute()
