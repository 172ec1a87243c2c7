"""Admission: accepted + running < (alpha + version + 1) * groups_per_batch, atomically."""

from __future__ import annotations

import asyncio

from rollart.state import AdmissionCounters


async def admit(counters: AdmissionCounters, *, groups: int = 1, **bound: int) -> bool:
    """All ``groups`` admitted (the feeder asks for up to the rest of a batch)."""
    return await counters.admit_up_to(groups=groups, **bound) == groups


def _counters(runtime) -> AdmissionCounters:
    return AdmissionCounters(runtime.redis, prefix=runtime.config.redis.key_prefix, job=runtime.config.job)


async def test_bound_follows_version_and_alpha(runtime):
    counters = _counters(runtime)
    admitted = [await admit(counters, version=0, alpha=1, groups_per_batch=2) for _ in range(6)]
    assert admitted == [True] * 4 + [False] * 2  # (1 + 0 + 1) * 2 = 4 groups
    await counters.finish(groups=2, accepted=True)  # two groups reached the trainer's buffer
    assert not await admit(counters, version=0, alpha=1, groups_per_batch=2), "accepted still counts"
    assert await admit(counters, version=1, alpha=1, groups_per_batch=2), "a new version opens room"
    await counters.finish(groups=1, accepted=False)  # an aborted group frees its slot
    snap = await counters.snapshot()
    assert (snap.accepted, snap.running, snap.admitted, snap.dropped) == (2, 2, 5, 1)


async def test_alpha_zero_is_one_batch_at_a_time(runtime):
    counters = _counters(runtime)
    assert await admit(counters, version=0, alpha=0, groups_per_batch=3, groups=3)
    assert not await admit(counters, version=0, alpha=0, groups_per_batch=3)


async def test_concurrent_feeders_never_over_admit(runtime):
    counters = _counters(runtime)
    results = await asyncio.gather(*(admit(counters, version=2, alpha=2, groups_per_batch=4) for _ in range(50)))
    assert sum(results) == (2 + 2 + 1) * 4
    assert (await counters.snapshot()).running == 20


async def test_rebuild_restores_counters(runtime):
    counters = _counters(runtime)
    await counters.rebuild(accepted=7, running=1)
    assert not await admit(counters, version=0, alpha=7, groups_per_batch=1)
    snap = await counters.snapshot()
    assert (snap.accepted, snap.running) == (7, 1)


async def test_a_group_the_trainer_drops_gives_its_place_back_once(runtime):
    counters = _counters(runtime)
    for _ in range(3):
        assert await admit(counters, version=0, alpha=0, groups_per_batch=3)
    await counters.finish(accepted=True, group_id="g1")
    await counters.finish(accepted=True, group_id="g2")
    await counters.finish(accepted=False, group_id="g3")  # aborted at the env stage: never accepted
    snap = await counters.snapshot()
    assert (snap.accepted, snap.running, snap.dropped) == (2, 0, 1)
    # g1: a member's reward was dead-lettered, the trainer evicts it; g3 it never had in full
    assert await counters.give_back(["g1", "g3"]) == 1
    assert await counters.give_back(["g1"]) == 0, "given back once"
    await counters.trained(["g2"])
    assert await counters.give_back(["g2"]) == 0, "a trained group keeps its place"
    snap = await counters.snapshot()
    assert (snap.accepted, snap.dropped) == (1, 2)
    assert await runtime.redis.scard(counters.accepted_groups_key) == 0, "the id set does not grow"
    # the freed place is admissible again under the same version
    assert await admit(counters, version=0, alpha=0, groups_per_batch=3, groups=2)
    assert not await admit(counters, version=0, alpha=0, groups_per_batch=3)


async def test_a_group_finishing_after_a_rebuild_with_nothing_running_moves_nothing(runtime):
    """Regression (the exactly-once chaos campaign): after a Redis flush the feeder rebuilds the counters
    with nothing running; a group that was running then finished and the script's HINCRBY by -0 failed
    ("not an integer"), failing the env handler three times, so the group's task was dead-lettered."""
    counters = _counters(runtime)
    await counters.rebuild(accepted=3, running=0)
    assert await counters.finish(groups=1, accepted=True, group_id="g-late") == 0
    assert await counters.finish(groups=1, accepted=False) == 0
    snap = await counters.snapshot()
    assert (snap.accepted, snap.running, snap.dropped) == (3, 0, 0)


async def test_a_group_finishing_after_a_flush_leaves_the_counters_missing_for_the_feeder_to_rebuild(runtime):
    """A finish on flushed counters must not create them (at 0 accepted, 0 running the feeder would
    find them and admit a whole bound's worth of groups past everything still in flight)."""
    counters = _counters(runtime)
    assert await counters.finish(groups=1, accepted=True, group_id="g1") == 0
    assert not await runtime.redis.exists(counters.key)
    await counters.rebuild(accepted=2, running=1)
    assert (await counters.snapshot()).finished_at > 0, "a rebuild counts as a group ending (no release at once)"


async def test_admit_up_to_takes_what_room_the_bound_leaves(runtime):
    counters = _counters(runtime)
    assert await counters.admit_up_to(version=0, alpha=1, groups_per_batch=3, groups=2) == 2
    assert await counters.admit_up_to(version=0, alpha=1, groups_per_batch=3, groups=8) == 4, "(1 + 0 + 1) * 3 = 6"
    assert await counters.admit_up_to(version=0, alpha=1, groups_per_batch=3, groups=1) == 0
    await counters.finish(groups=3, accepted=True)
    assert await counters.admit_up_to(version=1, alpha=1, groups_per_batch=3, groups=3) == 3, "a new version: a batch"
    snap = await counters.snapshot()
    assert (snap.accepted, snap.running, snap.admitted) == (3, 6, 9)
