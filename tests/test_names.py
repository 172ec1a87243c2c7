"""The naming module owns every Redis key of a job, and no key grows with the run."""

from __future__ import annotations

import re

from rollart.names import LOADS_KEPT, RedisKeys
from rollart.weights.follower import loads_key, record_load
from tests.conftest import REPO

# an f-string that starts a key with the configured prefix: "{prefix}:..." or "{config.redis.key_prefix}:..."
KEY_FORMAT = re.compile(r"""f["'][^"'\n]*\{[^}\n]*prefix\}:""")


def test_every_key_is_the_jobs_own_and_distinct():
    keys = RedisKeys("rollart", "job-a")
    names = [getattr(keys, name) for name in ("policy_version", "policy_version_writer", "trainer_starving",
                                              "feeder_released", "admission", "admission_accepted_groups",
                                              "pool_prefix", "weights_loads", "weights_pulling", "eval_pinned")]
    names.append(keys.dedup_prefix("env"))
    assert all(name.startswith("rollart:job-a:") for name in names)
    assert len(set(names)) == len(names)
    assert re.fullmatch(keys.job_pattern.replace("*", ".*"), keys.weights_loads)
    other = RedisKeys("rollart", "job-ab")  # a job whose name extends another's shares none of its keys
    assert not other.policy_version.startswith(keys.policy_version + ":")
    assert not re.fullmatch(keys.job_pattern.replace("*", ".*"), other.admission)


def test_no_redis_key_is_spelled_outside_the_naming_module():
    offenders = []
    for path in sorted((REPO / "rollart").rglob("*.py")):
        if path == REPO / "rollart" / "names.py":
            continue
        for number, line in enumerate(path.read_text().splitlines(), 1):
            if KEY_FORMAT.search(line):
                offenders.append(f"{path.relative_to(REPO)}:{number}: {line.strip()}")
    assert not offenders, "Redis keys belong in rollart/names.py:\n" + "\n".join(offenders)
    assert KEY_FORMAT.search('self.key = f"{config.redis.key_prefix}:{config.job}:admission"'), "the grep finds one"


async def test_the_weight_loads_list_keeps_only_the_newest(redis):
    key = loads_key("rollart-test", "loads-bounded")
    await redis.delete(key)
    try:
        for version in range(LOADS_KEPT + 7):
            await record_load(redis, key, {"version": version}, kept=LOADS_KEPT)
        assert await redis.llen(key) == LOADS_KEPT
        assert b'"version": 7}' in await redis.lindex(key, 0)  # the first 7 were trimmed
        assert str(LOADS_KEPT + 6).encode() in await redis.lindex(key, -1)
    finally:
        await redis.delete(key)
