"""The message kinds exchanged between stages (see ARCHITECTURE.md, "Stages and topics").

Every kind is a frozen, slotted dataclass with:

* ``KIND``: the name in the ``rollart-schema`` header,
* ``SCHEMA``: ``(major, minor)``. Adding an optional field bumps the minor (old readers ignore it);
  removing or retyping a field bumps the major (old readers send it to the DLQ),
* ``message_id()``: a deterministic id (traj_id + turn + kind, ...) used for de-duplication, so a
  redelivered or re-produced message is recognised as the same message.

String and container sizes are bounded so that a hostile or corrupt message cannot make a decoder
allocate without limit; the codec also caps the whole value size.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Annotated, ClassVar, Literal

import msgspec

from rollart.messages.arrays import Float32Array, Int32Array, UInt8Array
from rollart.names import ENV_ACTIONS

# Bounded scalar types: ids are short, free text (prompts, observations) may be long.
Id = Annotated[str, msgspec.Meta(min_length=1, max_length=256)]
Name = Annotated[str, msgspec.Meta(max_length=256)]
Text = Annotated[str, msgspec.Meta(max_length=4 << 20)]
NonNegInt = Annotated[int, msgspec.Meta(ge=0)]
Version = Annotated[int, msgspec.Meta(ge=0)]
Metrics = Annotated[dict[Name, float], msgspec.Meta(max_length=1024)]
Labels = Annotated[dict[Name, Text], msgspec.Meta(max_length=1024)]
# Marks a dead-lettered member's replacement lineage in trajectory ids (<traj>.d-0): ids hold no other
# dot (job names cannot), so the depth of a lineage is the number of marks.
REPLACEMENT_MARK = ".d"


@dataclass(frozen=True, slots=True)
class TaskSpec:
    """One task group released by the feeder: ``group_size`` rollouts of the same env seed/prompt."""

    KIND: ClassVar[str] = "TaskSpec"
    SCHEMA: ClassVar[tuple[int, int]] = (1, 2)

    group_id: Id
    env: Name  # registry name or import path of the environment class
    tag: Name  # task domain; selects the generation pool and the reward spec
    group_size: Annotated[int, msgspec.Meta(ge=1, le=4096)]
    seed: int = 0
    prompt: Text = ""
    redundancy: Annotated[int, msgspec.Meta(ge=0, le=4096)] = 0  # extra rollouts started, aborted when done
    admitted_version: Version = 0
    created_at: float = 0.0
    labels: Labels = field(default_factory=dict)
    # A replacement rollout for a member whose reward was dead-lettered (released by the reward stage,
    # not the feeder): one trajectory, ``<replaces>.d-0``, that counts in the group, not in admission.
    replaces: Id | None = None
    # An evaluation task (released by the eval stage, not the feeder): served on eval.pool with exactly
    # this version's weights, its results go to eval.results and never to the trainer.
    eval_version: Version | None = None

    def message_id(self) -> str:
        return f"task:{self.group_id}" + (f":{self.replaces}" if self.replaces else "")

    def member_prefix(self) -> str:
        """Trajectory ids of this task's rollouts are ``<prefix>-<i>`` and ``<prefix>-r<k>``."""
        return f"{self.replaces}{REPLACEMENT_MARK}" if self.replaces else self.group_id


@dataclass(frozen=True, slots=True)
class SamplingParams:
    temperature: Annotated[float, msgspec.Meta(ge=0.0)] = 1.0
    top_p: Annotated[float, msgspec.Meta(gt=0.0, le=1.0)] = 1.0
    top_k: int = -1  # -1: disabled (vLLM convention)
    max_tokens: Annotated[int, msgspec.Meta(ge=1, le=1 << 20)] = 256
    stop: Annotated[tuple[Text, ...], msgspec.Meta(max_length=64)] = ()
    stop_token_ids: Annotated[tuple[int, ...], msgspec.Meta(max_length=256)] = ()
    seed: int | None = None


@dataclass(frozen=True, slots=True)
class GenerationRequest:
    """Ask a generation pool for the next LLM turn of a trajectory (full token context)."""

    KIND: ClassVar[str] = "GenerationRequest"
    SCHEMA: ClassVar[tuple[int, int]] = (1, 3)

    traj_id: Id
    turn: NonNegInt
    group_id: Id
    tag: Name
    pool: Name
    prompt_ids: Int32Array
    reply_partition: NonNegInt  # the env.actions partition owned by the requesting env consumer
    owner: Name = ""  # member id of the env consumer that owns the trajectory
    sampling: SamplingParams = field(default_factory=SamplingParams)
    created_at: float = 0.0
    attempt: NonNegInt = 0  # re-issued after the reply partition moved to another env consumer
    # One run of the trajectory: a group rerun after a crash reuses traj ids, and its requests must
    # not be mistaken for the dead run's (which the generation group has already de-duplicated).
    episode: Name = ""
    reply_topic: Name = ENV_ACTIONS  # logical topic of the reply (rewards.judge for LLM-judge rewards)
    # Serve with weights of at least this version (the version the task was admitted under): with
    # alpha = 0 this makes every turn of the next batch come from the policy just published.
    min_version: Version = 0
    # Serve with exactly this version's weights (an eval task's pinned version; only the eval pool can).
    exact_version: Version | None = None
    # When the feeder admitted the trajectory's group (TaskSpec.created_at): under generation.serve_order
    # oldest_group an engine with more turns than slots serves the oldest groups' first. 0: unknown
    # (the request's own created_at counts).
    admitted_at: float = 0.0

    def message_id(self) -> str:
        return f"gen:{self.traj_id}:{self.episode}:{self.turn}:{self.attempt}"

    @property
    def request_id(self) -> str:
        return f"{self.traj_id}:{self.episode}:{self.turn}:{self.attempt}"

    def cancellation(self) -> "Abort":
        """The Abort that tells the engine serving this request to stop (its run: ``episode``)."""
        return Abort(traj_id=self.traj_id, turn=self.turn, reason="cancelled", group_id=self.group_id, tag=self.tag,
                     created_at=time.time(), episode=self.episode)


@dataclass(frozen=True, slots=True)
class Abort:
    """Cancel a trajectory's generation (sent on the pool topic) or report an abandoned trajectory."""

    KIND: ClassVar[str] = "Abort"
    SCHEMA: ClassVar[tuple[int, int]] = (1, 1)

    traj_id: Id
    turn: NonNegInt
    reason: Name
    group_id: Name = ""
    tag: Name = ""
    created_at: float = 0.0
    episode: Name = ""  # on a pool topic: cancel only this run's requests ("" = every run's)
    replacement: Name = ""  # the trajectory started in this one's place (a fault's replacement rollout)

    def message_id(self) -> str:
        return f"abort:{self.traj_id}:{self.episode}:{self.turn}"


@dataclass(frozen=True, slots=True)
class GroupEnded:
    """A task group's rollouts are over (env → reward → trainer): the members that completed and go on
    to scoring. With it the trainer knows when a group will not fill (its members aborted, their
    replacements ran out, a reward dead-lettered) instead of holding it until the buffer overflows."""

    KIND: ClassVar[str] = "GroupEnded"
    SCHEMA: ClassVar[tuple[int, int]] = (1, 2)

    group_id: Id
    tag: Name
    completed: Annotated[tuple[Id, ...], msgspec.Meta(max_length=4096)]
    aborted: NonNegInt = 0  # members ended by a fault (not counting redundant extras)
    replacements: NonNegInt = 0  # replacement rollouts started for them
    created_at: float = 0.0
    replaces: Id | None = None  # the end of a dead-lettered member's replacement task (TaskSpec.replaces)
    eval_version: Version | None = None  # an eval task's group (TaskSpec.eval_version)

    def message_id(self) -> str:
        return f"group-ended:{self.group_id}" + (f":{self.replaces}" if self.replaces else "")


FinishReason = Literal["stop", "length", "abort", "error"]


@dataclass(frozen=True, slots=True)
class GenerationResult:
    """One LLM turn: the generated tokens with logprobs and the policy version of each token."""

    KIND: ClassVar[str] = "GenerationResult"
    SCHEMA: ClassVar[tuple[int, int]] = (1, 0)

    traj_id: Id
    turn: NonNegInt
    token_ids: Int32Array
    logprobs: Float32Array
    versions: Int32Array  # policy version that produced each token (weights can change mid-turn)
    finish_reason: FinishReason
    pool: Name = ""
    instance: Name = ""
    prompt_tokens: NonNegInt = 0
    latency_s: float = 0.0
    error: Text = ""
    attempt: NonNegInt = 0
    episode: Name = ""

    def message_id(self) -> str:
        return f"genres:{self.traj_id}:{self.episode}:{self.turn}:{self.attempt}"

    def __post_init__(self) -> None:
        if not (len(self.token_ids) == len(self.logprobs) == len(self.versions)):
            raise ValueError(
                f"token_ids/logprobs/versions lengths differ: "
                f"{len(self.token_ids)}/{len(self.logprobs)}/{len(self.versions)}"
            )


TrajectoryStatus = Literal["done", "max_turns", "truncated"]


@dataclass(frozen=True, slots=True)
class CompletedTrajectory:
    """A finished multi-turn trajectory as one token sequence with a loss mask over LLM tokens."""

    KIND: ClassVar[str] = "CompletedTrajectory"
    SCHEMA: ClassVar[tuple[int, int]] = (1, 1)

    traj_id: Id
    group_id: Id
    tag: Name
    env: Name
    token_ids: Int32Array
    loss_mask: UInt8Array  # 1 on LLM-generated tokens only
    logprobs: Float32Array  # behaviour-policy logprobs; 0 where loss_mask is 0
    versions: Int32Array  # policy version per token; -1 where loss_mask is 0
    prompt_len: NonNegInt
    turns: NonNegInt
    env_reward: float
    status: TrajectoryStatus = "done"
    seed: int = 0
    start_version: Version = 0
    end_version: Version = 0
    metrics: Metrics = field(default_factory=dict)
    timings: Metrics = field(default_factory=dict)  # seconds: env_reset, env_step, generation, total
    labels: Labels = field(default_factory=dict)  # e.g. the verified answer of a math task
    eval_version: Version | None = None  # an eval trajectory, pinned to this version (TaskSpec.eval_version)

    def message_id(self) -> str:
        return f"traj:{self.traj_id}"

    def __post_init__(self) -> None:
        n = len(self.token_ids)
        if not (len(self.loss_mask) == len(self.logprobs) == len(self.versions) == n):
            raise ValueError("token_ids/loss_mask/logprobs/versions lengths differ")


@dataclass(frozen=True, slots=True)
class ScoredTrajectory:
    """A completed trajectory with its final reward, ready for the trainer."""

    KIND: ClassVar[str] = "ScoredTrajectory"
    SCHEMA: ClassVar[tuple[int, int]] = (1, 0)

    trajectory: CompletedTrajectory
    reward: float
    reward_components: Metrics = field(default_factory=dict)
    scorer: Name = ""
    scored_at: float = 0.0

    def message_id(self) -> str:
        return f"score:{self.trajectory.traj_id}"


Digest = Annotated[str, msgspec.Meta(max_length=128)]  # hex; "" where the publisher wrote none


@dataclass(frozen=True, slots=True)
class BucketDelta:
    """A changed bucket's bytes XOR its previous content (``base_digest``), compressed (``codec``)."""

    key: Name
    nbytes: NonNegInt
    base_digest: Digest
    codec: Name = "xor+zlib"


@dataclass(frozen=True, slots=True)
class WeightBucket:
    # Where the bucket's full bytes lie in the transport (Mooncake key, file name, Redis key). Always
    # the full bytes, so a reader that knows nothing of deltas pulls every version whole. A bucket that
    # did not change keeps the key of the version that wrote it (buckets are shared between versions).
    key: Name
    nbytes: NonNegInt
    tensors: Annotated[tuple[Name, ...], msgspec.Meta(max_length=1 << 16)] = ()
    digest: Digest = ""  # of the full bytes (weights.sync: delta)
    delta: BucketDelta | None = None  # the cheaper way to the full bytes for a reader holding the base


@dataclass(frozen=True, slots=True)
class WeightManifest:
    transport: Name  # "mooncake", "fs", "redis", ...
    location: Text = ""  # transport-specific root (a directory, a key prefix)
    buckets: Annotated[tuple[WeightBucket, ...], msgspec.Meta(max_length=1 << 16)] = ()
    total_bytes: NonNegInt = 0
    dtype: Name = ""
    digest: Digest = ""  # of the whole version: over the buckets' digests in order (weights.sync: delta)


@dataclass(frozen=True, slots=True)
class VersionAnnouncement:
    """The trainer published new weights: ``version`` is now current. Compacted, keyed by job."""

    KIND: ClassVar[str] = "VersionAnnouncement"
    SCHEMA: ClassVar[tuple[int, int]] = (1, 1)  # 1.1: bucket and version digests, bucket deltas

    job: Id
    version: Version
    step: NonNegInt = 0
    manifest: WeightManifest | None = None
    published_at: float = 0.0

    def message_id(self) -> str:
        return f"version:{self.job}:{self.version}"


@dataclass(frozen=True, slots=True)
class EvalTagResult:
    tasks: NonNegInt  # eval task groups released
    scored: NonNegInt  # trajectories scored
    failed: NonNegInt = 0  # trajectories that ended without a score (aborted, reward dead-lettered, not over in time)
    success_rate: float = 0.0  # over scored trajectories
    reward_mean: float = 0.0
    turns_mean: float = 0.0


@dataclass(frozen=True, slots=True)
class EvalSummary:
    """One policy version's evaluation (eval stage → ``eval.summaries``, compacted by version)."""

    KIND: ClassVar[str] = "EvalSummary"
    SCHEMA: ClassVar[tuple[int, int]] = (1, 0)

    job: Id
    version: Version
    step: NonNegInt = 0  # the training step that produced the version (0: the initial policy)
    tags: Annotated[dict[Name, EvalTagResult], msgspec.Meta(max_length=1024)] = field(default_factory=dict)
    complete: bool = True  # every eval trajectory ended before eval.timeout_s
    off_version_tokens: NonNegInt = 0  # generated tokens not from ``version`` (the pin's check: 0)
    started_at: float = 0.0
    finished_at: float = 0.0

    def message_id(self) -> str:
        return f"eval:{self.job}:{self.version}"


MESSAGE_KINDS: tuple[type, ...] = (
    TaskSpec,
    GenerationRequest,
    Abort,
    GroupEnded,
    GenerationResult,
    CompletedTrajectory,
    ScoredTrajectory,
    VersionAnnouncement,
    EvalSummary,
)
