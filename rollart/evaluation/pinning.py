"""Pinning an evaluation to one policy version, from the eval stage to the eval pool's engine.

The eval stage evaluates one version at a time. Before it releases a version's tasks it *pins* the
version: the announcement (with its weight manifest) goes into a Redis hash the eval pool reads, and a
mark in the trainer's pulling hash keeps the trainer's collector from removing the buckets while the
evaluation runs (the same mark a follower sets while it pulls). The newest due version seen while an
evaluation runs is pinned as the *next* one, so it is still there when its turn comes.

The eval pool's generation consumers do not follow ``policy.versions``. Each request of an eval task
carries ``exact_version``; :class:`PinnedWeights` serves it only while the engine holds exactly that
version. A request for another version waits until the requests in flight have finished, then the
engine loads the version it asks for; so every token of an eval trajectory comes from its version.
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

import msgspec

from rollart.bus import PermanentError
from rollart.messages import VersionAnnouncement
from rollart.weights.follower import LOAD_SECONDS, LOADED_VERSION, PULL_MARK_TTL_S, PULL_SECONDS, pull_and_load, \
    pulling_key
from rollart.weights.transport import make_transport
from rollart.names import RedisKeys

log = logging.getLogger(__name__)

PIN_SLOTS = ("eval:current", "eval:next")  # the eval stage's members in the trainer's pulling hash


def pinned_key(prefix: str, job: str) -> str:
    """A hash: version → the msgpack VersionAnnouncement the eval stage pinned."""
    return RedisKeys(prefix, job).eval_pinned


async def pin(redis, prefix: str, job: str, slot: str, announcement: VersionAnnouncement) -> None:
    """Keep ``announcement``'s weights available (``slot``: one of PIN_SLOTS; refresh within PULL_MARK_TTL_S)."""
    await redis.hset(pinned_key(prefix, job), str(announcement.version), msgspec.msgpack.encode(announcement))
    await redis.hset(pulling_key(prefix, job), slot,
                     json.dumps({"version": announcement.version, "until": time.time() + PULL_MARK_TTL_S}))


async def unpin(redis, prefix: str, job: str, slot: str, version: int) -> None:
    await redis.hdel(pulling_key(prefix, job), slot)
    await redis.hdel(pinned_key(prefix, job), str(version))


class PinnedWeights:
    def __init__(self, rt, engine, *, pool: str, member: str):
        self.rt, self.engine, self.pool, self.member = rt, engine, pool, member
        self.labels = (rt.config.job, pool)
        staging = rt.config.generation.weight_staging_dir
        self.staging = Path(staging or tempfile.mkdtemp(prefix="rollart-eval-weights-")) / member
        self._transport = None
        self._changed = asyncio.Condition()
        self._serving = 0

    @contextlib.asynccontextmanager
    async def serving(self, version: int):
        """Inside, the engine holds exactly ``version`` (loaded first if it held another)."""
        async with self._changed:
            await self._changed.wait_for(lambda: self.engine.version == version or self._serving == 0)
            if self.engine.version != version:
                await self._load(version)  # nothing in flight: no request sees two versions
            self._serving += 1
        try:
            yield
        finally:
            async with self._changed:
                self._serving -= 1
                self._changed.notify_all()

    async def _load(self, version: int) -> None:
        announcement = await self._announcement(version)
        if announcement is None or announcement.manifest is None:
            raise PermanentError(f"eval pool {self.pool}: no weights of version {version} to load (not pinned by the "
                                 f"eval stage; version 0 is the model the engine starts from, loaded only then)")
        if self._transport is None:
            self._transport = await asyncio.to_thread(make_transport, self.rt.config.weights, self.rt.endpoints)
        pull_s, load_s = await pull_and_load(self.engine, self._transport, announcement, self.staging)
        PULL_SECONDS.labels(*self.labels).observe(pull_s)
        LOAD_SECONDS.labels(*self.labels).observe(load_s)
        LOADED_VERSION.labels(*self.labels).set(version)
        log.info("%s: loaded version %d for evaluation (pull %.3fs, pause %.3fs)", self.member, version, pull_s, load_s)

    async def _announcement(self, version: int) -> VersionAnnouncement | None:
        config = self.rt.config
        raw = await self.rt.redis.hget(pinned_key(config.redis.key_prefix, config.job), str(version))
        if raw is None:
            return None
        return msgspec.msgpack.decode(raw, type=VersionAnnouncement)

    def close(self) -> None:
        if self._transport is not None:
            self._transport.close()
        shutil.rmtree(self.staging, ignore_errors=True)
