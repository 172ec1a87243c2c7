"""The naming module owns every topic name and Redis key of a job, and no key grows with the run."""

from __future__ import annotations

import re

from rollart import names
from rollart.names import LOADS_KEPT, RedisKeys
from rollart.topics import load_catalog
from rollart.weights.follower import loads_key, record_load
from tests.conftest import REPO

# an f-string that starts a key with the configured prefix: "{prefix}:..." or "{config.redis.key_prefix}:..."
KEY_FORMAT = re.compile(r"""f["'][^"'\n]*\{[^}\n]*prefix\}:""")
# a topic spelled in code: a quoted logical name (every one but "tasks" has a dot), or "tasks" handed to
# the producer, a consumer loop or a reader
TOPIC_LITERAL = re.compile(r"""["'](gen\.requests\.?|env\.actions|rewards\.(judge|results)|trajectories\.completed"""
                           r"""|policy\.versions|eval\.(results|summaries))""")
TASKS_LITERAL = re.compile(r"""(send|send_and_wait|produce|physical|consumer_loop|_messages|_read)\([^)]*["']tasks["']"""
                           r"""|(?<![\w)\]])\[["']tasks["']\]""")


def test_the_catalog_defines_exactly_the_named_topics():
    assert sorted(load_catalog(None)) == sorted(names.TOPICS)


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


def _spelled_outside_names(*patterns: re.Pattern) -> list[str]:
    offenders = []
    for path in sorted([*(REPO / "rollart").rglob("*.py"), *(REPO / "consumers").rglob("*.py")]):
        if path == REPO / "rollart" / "names.py":
            continue
        for number, line in enumerate(path.read_text().splitlines(), 1):
            code = line.split("  #")[0]  # comments may name a topic
            if not code.lstrip().startswith("#") and any(p.search(code) for p in patterns):
                offenders.append(f"{path.relative_to(REPO)}:{number}: {line.strip()}")
    return offenders


def test_no_redis_key_or_topic_is_spelled_outside_the_naming_module():
    offenders = _spelled_outside_names(KEY_FORMAT, TOPIC_LITERAL, TASKS_LITERAL)
    assert not offenders, "topic names and Redis keys belong in rollart/names.py:\n" + "\n".join(offenders)
    assert KEY_FORMAT.search('self.key = f"{config.redis.key_prefix}:{config.job}:admission"'), "the grep finds one"
    assert TOPIC_LITERAL.search('await producer.send("env.actions", result)')
    assert TOPIC_LITERAL.search('topic = f"gen.requests.{pool}"')
    assert TASKS_LITERAL.search('rt.consumer_loop("env", ["tasks"], handle)')


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
