"""Admission counters for bounded staleness (AReaL-style), updated atomically in Redis.

The feeder releases a task group only while

    accepted + running < (alpha + version + 1) * groups_per_batch

where ``running`` counts groups released and not yet finished, and ``accepted`` counts groups that
finished into the trainer's buffer (cumulative). Groups that end aborted leave ``running`` without
entering ``accepted``. A group the env stage accepted that the trainer then cannot use (a member's
reward dead-lettered, evicted as stale, filtered by dynamic sampling) is given back: ``accepted``
would otherwise keep its place forever, and over a long run the bound would shrink until only the
feeder's starvation release moved it. The env stage records each accepted group id in a set; the
trainer removes ids it trained (no change) or dropped (``accepted`` -1), so nothing is given back twice
and a group the env never accepted is never given back. The check and the increment are one Lua
script, so several feeders cannot
over-admit together. Like every Redis value here this is a cache: the feeder rebuilds it from the
log with :meth:`AdmissionCounters.rebuild` after Redis loses it.

Whatever may move the bound (a group ending or given back, the counters rebuilt, a new policy version)
is announced on the ``admission_changed`` channel: a blocked feeder waits there (:class:`AdmissionChanges`)
instead of polling Redis every few milliseconds.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass

from redis.asyncio import Redis
from redis.exceptions import RedisError

from rollart.names import RedisKeys

log = logging.getLogger(__name__)

# As many of ARGV[4] groups as the bound leaves room for (0 when it holds): the feeder releases the
# rest of a batch in one go when a new version opens room for it.
_ADMIT_UP_TO = """
local accepted = tonumber(redis.call('HGET', KEYS[1], 'accepted') or '0')
local running = tonumber(redis.call('HGET', KEYS[1], 'running') or '0')
local capacity = (tonumber(ARGV[1]) + tonumber(ARGV[2]) + 1) * tonumber(ARGV[3])
local n = math.min(tonumber(ARGV[4]), capacity - accepted - running)
if n <= 0 then return 0 end
redis.call('HINCRBY', KEYS[1], 'running', n)
redis.call('HINCRBY', KEYS[1], 'admitted', n)
return n
"""

# finished_at: when a group last ended, complete or not (the feeder's starvation release waits while
# groups are still ending: the loop moves, the trainer waits for rollouts, not for admission places).
# Only on counters that exist: after a Redis flush the feeder must find them missing and rebuild them.
# n is 0 when nothing is counted running (the counters were rebuilt after a Redis flush while groups
# ran): then nothing moves. Lua writes -0 as "-0", which HINCRBY refuses ("not an integer"), so the
# increments are skipped rather than made with 0.
_FINISH = """
if redis.call('EXISTS', KEYS[1]) == 1 then redis.call('HSET', KEYS[1], 'finished_at', ARGV[4]) end
local running = tonumber(redis.call('HGET', KEYS[1], 'running') or '0')
local n = math.min(tonumber(ARGV[1]), running)
if n <= 0 then return 0 end
redis.call('HINCRBY', KEYS[1], 'running', -n)
redis.call('PUBLISH', ARGV[5], 'finish')
if ARGV[2] == '1' then
  redis.call('HINCRBY', KEYS[1], 'accepted', n)
  if ARGV[3] ~= '' then redis.call('SADD', KEYS[2], ARGV[3]) end
else
  redis.call('HINCRBY', KEYS[1], 'dropped', n)
end
return n
"""


_GIVE_BACK = """
local n = 0
for i = 2, #ARGV do
  n = n + redis.call('SREM', KEYS[2], ARGV[i])
end
n = math.min(n, tonumber(redis.call('HGET', KEYS[1], 'accepted') or '0'))
if n > 0 then
  redis.call('HINCRBY', KEYS[1], 'accepted', -n)
  redis.call('HINCRBY', KEYS[1], 'dropped', n)
  redis.call('PUBLISH', ARGV[1], 'give-back')
end
return n
"""


@dataclass(frozen=True)
class AdmissionSnapshot:
    accepted: int
    running: int
    admitted: int
    dropped: int
    finished_at: float = 0.0  # Unix time a group last ended (0: none yet)


def starving_key(prefix: str, job: str) -> str:
    """Set by the trainer while it waits for a batch: the Unix time it started waiting (short TTL)."""
    return RedisKeys(prefix, job).trainer_starving


class AdmissionCounters:
    def __init__(self, redis: Redis, *, prefix: str, job: str):
        self.redis = redis
        keys = RedisKeys(prefix, job)
        self.key, self.accepted_groups_key = keys.admission, keys.admission_accepted_groups
        self.changed_channel = keys.admission_changed
        self._admit_up_to = redis.register_script(_ADMIT_UP_TO)
        self._finish = redis.register_script(_FINISH)
        self._give_back = redis.register_script(_GIVE_BACK)

    @staticmethod
    def capacity(version: int, alpha: int, groups_per_batch: int) -> int:
        return (alpha + version + 1) * groups_per_batch

    async def admit_up_to(self, *, version: int, alpha: int, groups_per_batch: int, groups: int) -> int:
        """Reserve up to ``groups`` running slots, as many as the staleness bound allows; how many."""
        if alpha < 0 or groups_per_batch < 1 or groups < 1:
            raise ValueError("alpha must be >= 0, groups_per_batch and groups >= 1")
        return int(await self._admit_up_to(keys=[self.key], args=[alpha, version, groups_per_batch, groups]))

    async def force_admit(self, groups: int = 1) -> None:
        """Reserve ``groups`` running slots past the bound (the feeder's starvation release)."""
        async with self.redis.pipeline(transaction=True) as pipe:
            pipe.hincrby(self.key, "running", groups)
            pipe.hincrby(self.key, "admitted", groups)
            await pipe.execute()

    async def finish(self, *, groups: int = 1, accepted: bool, group_id: str = "") -> int:
        """A running group ended: into the trainer's buffer (accepted) or dropped. ``group_id`` (one
        group) lets the trainer give the place back if it cannot use the group after all."""
        return int(await self._finish(keys=[self.key, self.accepted_groups_key],
                                      args=[groups, "1" if accepted else "0", group_id, repr(time.time()),
                                            self.changed_channel]))

    async def give_back(self, group_ids: list[str]) -> int:
        """The trainer dropped these groups: those the env stage accepted leave ``accepted``."""
        if not group_ids:
            return 0
        return int(await self._give_back(keys=[self.key, self.accepted_groups_key],
                                         args=[self.changed_channel, *group_ids]))

    async def trained(self, group_ids: list[str]) -> None:
        """The trainer used these groups: they keep their place (forget the ids)."""
        if group_ids:
            await self.redis.srem(self.accepted_groups_key, *group_ids)

    async def snapshot(self) -> AdmissionSnapshot:
        raw = await self.redis.hgetall(self.key)
        def get(name: str) -> int:
            return int(raw.get(name.encode(), 0))

        return AdmissionSnapshot(get("accepted"), get("running"), get("admitted"), get("dropped"),
                                 float(raw.get(b"finished_at", 0)))

    async def rebuild(self, *, accepted: int, running: int) -> None:
        async with self.redis.pipeline(transaction=True) as pipe:
            pipe.delete(self.key)
            pipe.hset(self.key, mapping={"accepted": accepted, "running": running, "admitted": accepted + running,
                                         "dropped": 0, "finished_at": repr(time.time())})
            pipe.publish(self.changed_channel, "rebuild")
            await pipe.execute()

    def changes(self) -> "AdmissionChanges":
        return AdmissionChanges(self.redis, self.changed_channel)


class AdmissionChanges:
    """A subscription to the admission channel. ``wait`` returns when a change is announced, ``stop`` is
    set, or ``timeout`` passes (the fallback: time-driven checks such as the starvation release, and
    changes announced while Redis was away). Subscribed before the first check, so an announcement
    between a check and the wait is buffered, not lost."""

    def __init__(self, redis: Redis, channel: str):
        self.channel = channel
        self.pubsub = redis.pubsub(ignore_subscribe_messages=True)

    async def __aenter__(self) -> "AdmissionChanges":
        try:
            await self.pubsub.subscribe(self.channel)
        except RedisError as exc:  # Redis away: wait() falls back to its timeout until it is back
            log.warning("admission: cannot subscribe to %s (%s); polling", self.channel, exc)
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.pubsub.aclose()

    async def wait(self, timeout: float, stop: asyncio.Event) -> bool:
        """True when a change was announced (every buffered announcement is consumed)."""
        message = asyncio.ensure_future(self._next(timeout))
        stopping = asyncio.ensure_future(stop.wait())
        done, _ = await asyncio.wait({message, stopping}, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
        for task in (message, stopping):
            task.cancel()
        await asyncio.gather(message, stopping, return_exceptions=True)
        if message not in done or message.cancelled() or message.exception() is not None:
            return False
        return bool(message.result())

    async def _next(self, timeout: float) -> bool:
        try:
            if not self.pubsub.subscribed:
                await self.pubsub.subscribe(self.channel)
            got = await self.pubsub.get_message(timeout=timeout) is not None
            while got and await self.pubsub.get_message(timeout=0.0) is not None:
                pass  # several announcements at once: one check covers them all
            return got
        except (RedisError, OSError, RuntimeError) as exc:  # RuntimeError: redis-py's "not subscribed"
            log.debug("admission: change channel unavailable (%s)", exc)
            await asyncio.sleep(timeout)
            return False
