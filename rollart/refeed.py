"""Copy selected messages of one job's topic into a topic of another job, exactly once.

For debugging and experiments: re-score a job's completed trajectories with another reward (feed
``trajectories.completed`` of a new job whose reward stage is configured differently), or retrain on
chosen scored trajectories (feed ``rewards.results``). The source topic is only read, outside any
consumer group. Messages keep their ids (they derive from content: ``traj:<id>``, ``score:<id>``);
the destination is read first and ids already there are skipped, so running the same re-feed twice,
or resuming one that died half way, writes each message once. The consumers' de-duplication by id
covers the rest (a broker-level retry of one produce).
"""

from __future__ import annotations

from dataclasses import dataclass

from rollart.bus import BusProducer
from rollart.bus.reader import read_to_end
from rollart.config import RollartConfig
from rollart.endpoints import Endpoints
from rollart.messages import MessageDecodeError
from rollart.messages.codec import H_ID, H_POLICY_VERSION
from rollart.replay import ReplayFilter, replay
from rollart.topics import expand_catalog, load_catalog, spec_for
from rollart.topics.admin import apply_topics


@dataclass(frozen=True)
class RefeedResult:
    selected: int
    produced: int
    already_there: int
    skipped_undecodable: int


async def destination_ids(config: RollartConfig, endpoints: Endpoints, physical_topic: str) -> set[str]:
    ids = set()
    async for record in read_to_end(config, endpoints, physical_topic):
        header = dict(record.headers or ()).get(H_ID)
        if header:
            ids.add(header.decode())
    return ids


def check_kinds(topic: str, to_topic: str, catalog) -> None:
    source, dest = spec_for(topic, catalog), spec_for(to_topic, catalog)
    if not set(source.kinds) & set(dest.kinds):
        raise ValueError(f"{topic} carries {list(source.kinds)} but {to_topic} accepts {list(dest.kinds)}")


async def refeed(source: RollartConfig, endpoints: Endpoints, topic: str, flt: ReplayFilter, *, to_job: str,
                 to_topic: str | None = None) -> RefeedResult:
    """Produce every message of ``source``'s ``topic`` that passes ``flt`` into ``to_job``'s ``to_topic``."""
    to_topic = to_topic or topic
    if to_job == source.job and to_topic == topic:
        raise ValueError("re-feeding a topic into itself would duplicate it; name another job or topic")
    catalog = load_catalog(source.topics)
    check_kinds(topic, to_topic, catalog)
    dest = source.with_updates("--refeed-to", job=to_job)
    await apply_topics(dest, endpoints, expand_catalog(dest, catalog))  # the new job's topics exist
    physical = f"{to_job}.{to_topic}"
    present = await destination_ids(dest, endpoints, physical)
    accepted = spec_for(to_topic, catalog).message_kinds
    selected = produced = already = undecodable = 0
    async with BusProducer(dest, endpoints, client_id="rollart-refeed") as producer:
        pending = []
        async for record, message in replay(source, endpoints, topic, flt):
            if isinstance(message, MessageDecodeError):
                undecodable += 1
                continue
            if not isinstance(message, accepted):
                continue
            selected += 1
            message_id = message.message_id()
            if message_id in present:
                already += 1
                continue
            present.add(message_id)  # the same id twice in the source is fed once
            version = dict(record.headers or ()).get(H_POLICY_VERSION)
            pending.append(await producer.send(to_topic, message, key=record.key,
                                               policy_version=int(version) if version else None))
            produced += 1
        for future in pending:
            await future  # acknowledged by the broker (acks=all) before we report success
    return RefeedResult(selected, produced, already, undecodable)

