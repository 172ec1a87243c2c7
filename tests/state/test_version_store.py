"""The policy version: serial bumps from the one writer, rebuilt from the log after FLUSHALL."""

from __future__ import annotations

import asyncio

import pytest

from rollart.bus.reader import read_to_end
from rollart.messages import DEFAULT_CODEC, WeightManifest
from rollart.state import VersionStore, VersionWriter, WriterConflict


async def test_concurrent_bumps_from_one_writer_are_serial(runtime):
    writer = VersionWriter(runtime.config, runtime.endpoints, runtime.redis, runtime.producer)
    await writer.acquire()
    announcements = await asyncio.gather(*(writer.bump(step=i) for i in range(20)))
    assert sorted(a.version for a in announcements) == list(range(1, 21))
    assert await VersionStore(runtime.config, runtime.endpoints, runtime.redis).current() == 20

    logged = [DEFAULT_CODEC.decode(r.value, r.headers).message
              async for r in read_to_end(runtime.config, runtime.endpoints, f"{runtime.config.job}.policy.versions")]
    assert [a.version for a in logged] == list(range(1, 21)), "the log holds every version once, in order"


async def test_version_comes_back_from_the_topic_after_flushall(runtime):
    writer = VersionWriter(runtime.config, runtime.endpoints, runtime.redis, runtime.producer)
    await writer.acquire()
    manifest = WeightManifest(transport="fs", location="/tmp/w", total_bytes=10)
    for step in range(3):
        await writer.bump(step=step, manifest=manifest)
    reader = VersionStore(runtime.config, runtime.endpoints, runtime.redis)
    assert await reader.current() == 3

    await runtime.redis.flushall()
    assert await runtime.redis.get(reader.key) is None
    assert await reader.current() == 3, "rebuilt from policy.versions"
    assert int(await runtime.redis.get(reader.key)) == 3, "and cached again"
    latest = await reader.latest_announcement()
    assert latest.manifest == manifest and latest.step == 2

    await writer.acquire()  # the lease went with FLUSHALL; the writer takes it again
    assert (await writer.bump(step=3)).version == 4, "the writer continues from the log, not from zero"


async def test_an_empty_log_means_version_zero(runtime):
    assert await VersionStore(runtime.config, runtime.endpoints, runtime.redis).current() == 0


async def test_a_second_writer_is_refused(runtime):
    first = VersionWriter(runtime.config, runtime.endpoints, runtime.redis, runtime.producer)
    second = VersionWriter(runtime.config, runtime.endpoints, runtime.redis, runtime.producer)
    await first.acquire()
    with pytest.raises(WriterConflict, match="another trainer"):
        await second.acquire()
    with pytest.raises(WriterConflict):
        await second.bump()
    await first.release()
    await second.acquire()
    assert (await second.bump()).version == 1
