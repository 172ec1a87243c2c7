"""Shared state in Redis: the policy version cache, pool membership, admission counters."""

from rollart.state.admission import AdmissionCounters, AdmissionSnapshot
from rollart.state.pools import PoolRegistry
from rollart.state.redis import connect_redis
from rollart.state.version_store import VERSIONS_TOPIC, VersionStore, VersionWriter, WriterConflict

__all__ = [
    "AdmissionCounters",
    "AdmissionSnapshot",
    "PoolRegistry",
    "VERSIONS_TOPIC",
    "VersionStore",
    "VersionWriter",
    "WriterConflict",
    "connect_redis",
]
