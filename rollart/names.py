"""Every Redis key a job uses, declared once: ``<key_prefix>:<job>:<name>``, each with its bound.

Nothing else spells a key (``tests/test_names.py`` greps for formats outside this module). A key
is either short-lived (a TTL), rewritten in place (one value, a hash of live members, a counter), or a
list trimmed on every push: none grows with the length of a run.
"""

from __future__ import annotations

from dataclasses import dataclass

LOADS_KEPT = 1000  # weights:loads: the newest loads (a 150-step run with 4 pool members makes ~600)


@dataclass(frozen=True)
class RedisKeys:
    prefix: str
    job: str

    @classmethod
    def of(cls, config) -> "RedisKeys":
        return cls(config.redis.key_prefix, config.job)

    def _key(self, name: str) -> str:
        return f"{self.prefix}:{self.job}:{name}"

    @property
    def job_pattern(self) -> str:
        """SCAN pattern matching every key of the job (chaos' Redis flush)."""
        return self._key("*")

    # -- bus ----------------------------------------------------------------------------------------

    def dedup_prefix(self, group: str) -> str:
        """``+ message id``: processed ids of a consumer group (TTL ``bus.dedup_ttl_s``)."""
        return self._key(f"dedup:{group}:")

    # -- trainer and versions -----------------------------------------------------------------------

    @property
    def policy_version(self) -> str:
        """The latest published version (one value)."""
        return self._key("policy_version")

    @property
    def policy_version_writer(self) -> str:
        """The single writer's lease on the version (TTL: the lease)."""
        return self._key("policy_version_writer")

    @property
    def trainer_starving(self) -> str:
        """Unix time the trainer started waiting for a batch (short TTL, set while it waits)."""
        return self._key("trainer:starving-since")

    # -- feeder and admission -----------------------------------------------------------------------

    @property
    def feeder_released(self) -> str:
        """Groups the feeder released (a counter)."""
        return self._key("feeder:released")

    @property
    def admission(self) -> str:
        """The admission counters (a hash of a few counters)."""
        return self._key("admission")

    @property
    def admission_accepted_groups(self) -> str:
        """Ids of groups accepted and not yet trained or given back (a set)."""
        return self._key("admission:accepted-groups")

    # -- generation pools and weights ---------------------------------------------------------------

    @property
    def pool_prefix(self) -> str:
        """``+ pool``: a pool's live members (heartbeats with TTL); ``+ pool:member:<m>``: its info."""
        return self._key("pool:")

    @property
    def weights_loads(self) -> str:
        """A list of the followers' loads (JSON), trimmed to the newest ``LOADS_KEPT`` on every push."""
        return self._key("weights:loads")

    @property
    def weights_pulling(self) -> str:
        """A hash: member → the version it is pulling and until when (entries expire by their time)."""
        return self._key("weights:pulling")

    @property
    def eval_pinned(self) -> str:
        """A hash: version → the announcement the eval stage pinned (at most two slots)."""
        return self._key("eval:pinned")
