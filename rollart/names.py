"""The names a job uses, declared once: its topics and every Redis key.

Topics: the logical names below (the catalog, ``topics/*.yaml``, defines each one's partitions,
retention and kinds; a test holds the two to each other); on the wire a topic is ``<job>.<logical>``
(:class:`rollart.topics.TopicNames`). Redis keys: ``<key_prefix>:<job>:<name>``, each with its bound:
short-lived (a TTL), rewritten in place (one value, a hash of live members, a counter), or a list
trimmed on every push; none grows with the length of a run.

Nothing else spells a topic or a key (``tests/test_names.py`` greps for them outside this module).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

# -- topics (logical names) ---------------------------------------------------------------------------

TASKS = "tasks"  # feeder (and eval stage) -> env stage
GEN_REQUESTS = "gen.requests.{pool}"  # env / reward (judge) -> one generation pool, per pool
ENV_ACTIONS = "env.actions"  # generation -> the env member that asked (its reply partition)
REWARDS_JUDGE = "rewards.judge"  # generation -> the reward member that asked a judge
TRAJECTORIES_COMPLETED = "trajectories.completed"  # env -> reward
REWARDS_RESULTS = "rewards.results"  # reward -> trainer
POLICY_VERSIONS = "policy.versions"  # trainer -> every stage (compacted)
EVAL_RESULTS = "eval.results"  # reward -> eval stage (held-out trajectories, never trained)
EVAL_SUMMARIES = "eval.summaries"  # eval stage -> dashboards, trackers (compacted)
DLQ_SUFFIX = ".dlq"  # <physical topic>.dlq: what a consumer of that topic could not handle

TOPICS = (TASKS, GEN_REQUESTS, ENV_ACTIONS, REWARDS_JUDGE, TRAJECTORIES_COMPLETED, REWARDS_RESULTS,
          POLICY_VERSIONS, EVAL_RESULTS, EVAL_SUMMARIES)


def gen_requests(pool: str) -> str:
    """The requests topic of one generation pool."""
    return GEN_REQUESTS.format(pool=pool)


# -- Redis keys -----------------------------------------------------------------------------------

LOADS_KEPT = 1000  # weights:loads: the newest loads (a 150-step run with 4 pool members makes ~600)


@dataclass(frozen=True)
class RedisKeys:
    prefix: str
    job: str

    @classmethod
    def of(cls, config: Any) -> "RedisKeys":  # a RollartConfig (this module imports nothing of rollart)
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

    @property
    def admission_changed(self) -> str:
        """Pub/sub channel: the admission bound may have moved (a new version, a group ended or given
        back, the counters rebuilt); a blocked feeder waits on it instead of polling."""
        return self._key("admission:changed")

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
    def stage_members(self) -> str:
        """A hash: ``stage`` or ``stage:pool`` → the members a local run should keep (``rollart scale``);
        one field per scalable stage and pool."""
        return self._key("stage:members")

    @property
    def eval_pinned(self) -> str:
        """A hash: version → the announcement the eval stage pinned (at most two slots)."""
        return self._key("eval:pinned")
