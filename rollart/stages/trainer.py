"""The trainer stage: scored trajectories → sample buffer → training steps → published versions.

The trainer consumes ``rewards.results`` with a handler that does not return until its sample is
settled: trained and checkpointed, or dropped (duplicate, stale, unusable). The consumer loop only
commits offsets of settled messages, so the committed offsets never pass a sample that a crash
could lose, and ``max_in_flight`` (the buffer's capacity in trajectories) is the backpressure: when
the trainer is slower than rollout, the loop pauses its partitions instead of growing the buffer.

A training step: take a batch of complete, fresh groups (stale ones evicted first, alpha bound)
→ train (in a thread; consumption goes on) → record and checkpoint (model, optimizer, step,
version, recently trained ids) → settle the samples → publish the weights in buckets → bump the
version in Redis and announce it on ``policy.versions`` → collect old versions.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING

from prometheus_client import Counter, Gauge, Histogram

from rollart.bus import ConsumerLoop, MessageContext, StopRequest
from rollart.config import ConfigError, RollartConfig
from rollart.messages import Abort, Envelope, GroupEnded, ScoredTrajectory
from rollart.runtime import Runtime
from rollart.state import VersionWriter
from rollart.training.algorithms import PolicyLossConfig
from rollart.training.buffer import Group, SampleBuffer
from rollart.tracking import Trackers
from rollart.training.checkpoint import CheckpointStore, TrainerState
from rollart.training.thread_clock import ThreadTimes, in_thread
from rollart.weights import WeightPublisher, make_transport
from rollart.state.admission import AdmissionCounters, starving_key
from rollart.weights.follower import pulling_versions
from rollart.names import REWARDS_RESULTS
from rollart.stages.runner import Member, Work, run_member
from rollart.timeouts import wait_for

if TYPE_CHECKING:  # torch is imported by the backend that trains, not by this module
    from rollart.training.streamed_step import StreamedStep

log = logging.getLogger(__name__)

STEPS = Counter("rollart_trainer_steps_total", "Training steps", ("job",))
SAMPLES = Counter("rollart_trainer_samples_total", "Trajectories trained on", ("job",))
DROPPED = Counter("rollart_trainer_dropped_total", "Scored trajectories not trained, by reason", ("job", "reason"))
STEP_SECONDS = Histogram("rollart_trainer_step_phase_seconds", "Time per training-step phase", ("job", "phase"),
                         buckets=(0.001, 0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300))
STALENESS = Histogram("rollart_trainer_sample_staleness_versions", "Policy versions between a sample's oldest "
                      "token and the weights it was trained on", ("job",), buckets=(0, 1, 2, 3, 4, 6, 8, 16))
TOKEN_STALENESS = Gauge("rollart_trainer_batch_token_staleness_versions", "Policy versions between the last trained "
                        "batch's generated tokens and its weights, mean (weights updated in flight make a "
                        "trajectory's later turns fresher than its start)", ("job",))
BUFFER_GROUPS = Gauge("rollart_trainer_buffer_groups", "Task groups held in the sample buffer", ("job",))
REWARD = Gauge("rollart_trainer_batch_reward_mean", "Mean reward of the last trained batch", ("job",))
VERSION = Gauge("rollart_trainer_policy_version", "Policy version last published", ("job",))
TRAIN_THREAD_SECONDS = Counter("rollart_trainer_train_thread_seconds", "The training thread's seconds in its "
                               "steps: on a core (on_cpu) and runnable but waiting for one (queued; Linux)",
                               ("job", "state"))
PUBLISH_SECONDS = Histogram("rollart_trainer_weight_publish_seconds", "Writing one version's buckets",
                            ("job", "transport"), buckets=(0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1, 5, 30))

DROP_REASONS = ("duplicate_or_overflow", "stale", "uninformative", "incomplete_group")
STARVING_LOG_S = 15.0  # how often a trainer with no batch says what its buffer holds
RECENT_STEPS_KEPT = 64  # steps whose trained ids the checkpoint keeps (redelivery happens within seconds)


def loss_config(config: RollartConfig) -> PolicyLossConfig:
    t = config.trainer
    return PolicyLossConfig(algorithm=t.algorithm, clip_low=t.clip_low, clip_high=t.clip_high, dual_clip=t.dual_clip,
                            decoupled=t.decoupled, proximal=t.proximal, importance_cap=t.importance_cap,
                            kl_coef=t.kl_coef, entropy_coef=t.entropy_coef,
                            token_mean=t.loss_aggregation == "token_mean", skip_zero_advantage=t.skip_zero_advantage)


def trainer_alpha(config: RollartConfig) -> int:
    if config.feeder.alpha is None:
        raise ConfigError("feeder.alpha: a trainer needs a staleness bound (0 = synchronous); it is null")
    return config.feeder.alpha


class TrainerStage:
    def __init__(self, rt: Runtime, backend, checkpoints: CheckpointStore, publisher: WeightPublisher,
                 writer: VersionWriter, *, pad_id: int, state: TrainerState | None = None,
                 tracking: Trackers | None = None):
        self.rt = rt
        self.config = rt.config
        self.tracking = tracking  # experiment trackers, each step's figures (rollart.tracking)
        self._starving_since: float | None = None  # waiting for a batch since (Unix time)
        self._starving_marked = 0.0
        self._starving_logged = 0.0
        self.consumer: ConsumerLoop | None = None  # the loop feeding handle(), for its in-flight count
        self.building: StreamedStep | None = None  # the step being built from the next batch's groups
        cfg = self.config
        self.backend = backend
        self.checkpoints = checkpoints
        self.publisher = publisher
        self.writer = writer
        self.pad_id = pad_id
        self.state = state or TrainerState()
        self.version = self.state.version
        self.buffer = SampleBuffer(group_size=cfg.feeder.group_size, groups_per_batch=cfg.feeder.groups_per_batch,
                                   alpha=trainer_alpha(cfg), capacity=cfg.trainer.capacity_groups,
                                   drop_uninformative=cfg.trainer.dynamic_sampling,
                                   min_group_size=cfg.min_group_size(), quotas=cfg.tag_quotas(),
                                   mix_wait_s=cfg.trainer.task_mix_wait_s)
        self.buffer.trained.update(self.state.trained_ids)
        self.recent: deque[list[str]] = deque([self.state.trained_ids], maxlen=RECENT_STEPS_KEPT)
        self.offsets: dict[str, int] = dict(self.state.offsets)
        self.waiting: dict[str, tuple[asyncio.Future, str, int]] = {}  # traj id -> (settled, "topic:partition", offset)
        self.arrived = asyncio.Event()
        self.labels = (cfg.job,)
        for reason in DROP_REASONS:  # series at 0 from the start
            DROPPED.labels(*self.labels, reason)
        self.max_in_flight = self.buffer.capacity * cfg.feeder.group_size
        self.admission = AdmissionCounters(rt.redis, prefix=cfg.redis.key_prefix, job=cfg.job)

    # -- the handler ----------------------------------------------------------------------------

    async def handle(self, envelope: Envelope, ctx: MessageContext) -> None:
        """Hold a sample (or a group's end, or a member's failed reward) until its group is settled."""
        message = envelope.message
        if isinstance(message, ScoredTrajectory):
            if not self.buffer.add(message):
                DROPPED.labels(*self.labels, "duplicate_or_overflow").inc()
                return
            key = message.trajectory.traj_id
        elif isinstance(message, GroupEnded):
            key = self.buffer.end(message)  # a group's end, or a replacement task's
            if key is None:
                return  # its group is over, or this is a second copy: nothing to hold
        elif isinstance(message, Abort):
            key = self.buffer.member_failed(message)
            if key is None:
                return
        else:
            return
        settled = asyncio.get_running_loop().create_future()
        self.waiting[key] = (settled, f"{ctx.record.topic}:{ctx.record.partition}", ctx.record.offset)
        BUFFER_GROUPS.labels(*self.labels).set(len(self.buffer))
        self.arrived.set()
        await settled

    def _settle(self, groups: list[Group], reason: str | None) -> None:
        for group in groups:
            for key in group.keys:
                entry = self.waiting.pop(key, None)
                if entry is None:
                    continue
                future, where, offset = entry
                if reason is not None and key in group.members:
                    DROPPED.labels(*self.labels, reason).inc()
                else:
                    self.offsets[where] = max(self.offsets.get(where, 0), offset + 1)
                if not future.done():
                    future.set_result(None)
        BUFFER_GROUPS.labels(*self.labels).set(len(self.buffer))

    async def forget_revoked(self, revoked) -> None:
        """A rebalance took partitions: their handlers were cancelled, so their samples are no longer
        in flight and will be redelivered (to us or the new owner). Take them out of the buffer;
        kept, the redelivered copy would be dropped as a duplicate and committed, and a crash before
        the sample trains would lose it."""
        gone = {f"{tp.topic}:{tp.partition}" for tp in revoked}
        for key, (_, where, _) in list(self.waiting.items()):
            if where in gone:
                del self.waiting[key]
                self.buffer.forget(key)
        BUFFER_GROUPS.labels(*self.labels).set(len(self.buffer))

    def _consumer_full(self) -> bool:
        """No more samples can arrive: every slot of the consumer loop is taken (by buffered samples,
        or by redelivered copies waiting for the twin the buffer holds)."""
        if len(self.waiting) >= self.max_in_flight:
            return True
        return self.consumer is not None and self.consumer.in_flight >= self.consumer.max_in_flight

    async def _drop(self, groups: list[Group], reason: str) -> None:
        """Settle groups that will not be trained, and give their admission places back."""
        if groups:
            self._settle(groups, reason)
            await self.admission.give_back([g.group_id for g in groups])

    # -- the training loop ----------------------------------------------------------------------

    async def next_batch(self, stop: asyncio.Event, step: StreamedStep | None = None) -> list[Group] | None:
        """The next batch's groups; with ``step``, the groups it holds are trained as they complete and
        only the rest is returned (None: stopped)."""
        while not stop.is_set():
            await self._drop(self.buffer.evict_stale(self.version), "stale")
            await self._drop(self.buffer.drop_uninformative_groups(), "uninformative")
            await self._drop(self.buffer.drop_unfillable(), "incomplete_group")
            if step is not None:
                await step.add(self.buffer.take_ready(self.version, step.groups))
            batch = self.buffer.take_batch(self.version, taken=step.groups if step is not None else ())
            if batch is not None:
                self._starving_since = None
                return batch
            if self._consumer_full():
                group = self.buffer.evict_oldest_incomplete()
                if group is not None:
                    await self._drop([group], "incomplete_group")
                    continue
            await self._mark_starving()
            self.arrived.clear()
            with contextlib.suppress(asyncio.TimeoutError):
                await wait_for(self.arrived.wait(), 0.5)
        return None

    async def _mark_starving(self) -> None:
        """Tell the feeder how long we have waited for a batch (see feeder.starvation_release_s)."""
        now = time.time()
        if self._starving_since is None:
            self._starving_since = now
        if now - self._starving_since >= STARVING_LOG_S and now - self._starving_logged >= STARVING_LOG_S:
            self._starving_logged = now
            complete = len(self.buffer.complete_groups())
            log.info("no batch for %.0fs: %d groups buffered (%d complete, %d needed, %d trained already), "
                     "%d samples waiting, consumer %s in flight", now - self._starving_since, len(self.buffer),
                     complete, self.buffer.groups_per_batch, len(self.building.groups) if self.building else 0,
                     len(self.waiting),
                     "?" if self.consumer is None else f"{self.consumer.in_flight}/{self.consumer.max_in_flight}")
        if now - self._starving_marked >= 1.0:
            self._starving_marked = now
            await self.rt.redis.set(starving_key(self.config.redis.key_prefix, self.config.job),
                                    repr(self._starving_since), ex=5)

    async def run(self, stop: asyncio.Event, max_steps: int | None = None) -> None:
        await self.ensure_published()
        while not stop.is_set() and (max_steps is None or self.state.step < max_steps):
            waited = time.perf_counter()
            step = self.building = self.streamed_step()
            batch = await self.next_batch(stop, step)
            if batch is None:
                return
            await self.train_on(batch, wait_s=time.perf_counter() - waited, step=step)

    def streamed_step(self) -> StreamedStep | None:
        """A step to build from the batch's groups as they complete (``trainer.stream_batch``), or None."""
        if not self.config.trainer.stream_batch:
            return None
        from rollart.training.streamed_step import StreamedStep

        t = self.config.trainer
        return StreamedStep(self.backend, norm=t.advantage_norm, per_step=t.samples == "step", version=self.version,
                            pad_id=self.pad_id)

    async def ensure_published(self) -> None:
        """On start: make the log's version match these weights (a resumed trainer whose last step was
        checkpointed but not announced, or a log that ran ahead of the checkpoint, publishes now)."""
        latest = await self.writer.current()
        if self.state.step == 0 and latest == 0:
            return  # the initial weights are the model directory every engine starts from
        # Versions an earlier trainer process published are collected like our own.
        for announcement in await self.writer.announcements():
            if announcement.manifest is not None:
                self.publisher.published.setdefault(announcement.version, announcement.manifest)
        if latest != self.state.version:
            await self.publish(step=self.state.step)
        VERSION.labels(*self.labels).set(self.version)

    async def train_on(self, groups: list[Group], *, wait_s: float, step: StreamedStep | None = None) -> dict:
        """One optimiser step on ``groups`` (with ``step``: on its groups too, trained as they completed)."""
        cfg = self.config.trainer
        whole_at = time.perf_counter()
        if step is None:
            samples, staleness, metrics, train = await train_groups(self.backend, groups, self.config,
                                                                    version=self.version, pad_id=self.pad_id)
        else:
            await step.add(groups)
            metrics = await step.finish()
            groups, samples, train = step.groups, step.samples, step.times
            staleness = sample_staleness(samples, self.version)
        self.state.step += 1
        trained_ids = [s.trajectory.traj_id for s in samples]
        self.recent.append(trained_ids)
        row = step_record(step=self.state.step, version=self.version, samples=samples, staleness=staleness,
                          metrics=metrics, wait_s=wait_s, train=train, buffer=self.buffer,
                          mixed_precision=cfg.mixed_precision)
        # train_s: all of the step's compute; this: what was left of it once the batch was whole
        row["train_tail_s"] = round(time.perf_counter() - whole_at, 6)
        self.checkpoints.append_record(row)  # before the checkpoint: a resume cuts rows it does not cover
        if self.tracking:
            await asyncio.to_thread(self.tracking.log, self.state.step, row)
        started = time.perf_counter()
        if self.state.step % cfg.checkpoint_every == 0 or (cfg.max_steps and self.state.step >= cfg.max_steps):
            await self.checkpoint()
        checkpoint_s = time.perf_counter() - started
        self._settle(groups, None)
        await self.admission.trained([g.group_id for g in groups])
        publish_s = await self.publish(step=self.state.step)
        for phase, seconds in (("wait", wait_s), ("train", train.wall_s), ("checkpoint", checkpoint_s),
                               ("publish", publish_s)):
            STEP_SECONDS.labels(*self.labels, phase).observe(seconds)
        for state, seconds in (("on_cpu", train.cpu_s), ("queued", train.queue_s)):
            if seconds is not None:
                TRAIN_THREAD_SECONDS.labels(*self.labels, state).inc(seconds)
        STEPS.labels(*self.labels).inc()
        SAMPLES.labels(*self.labels).inc(len(samples))
        REWARD.labels(*self.labels).set(row["reward_mean"])
        TOKEN_STALENESS.labels(*self.labels).set(row["token_staleness_mean"])
        for value in staleness:
            STALENESS.labels(*self.labels).observe(value)
        log.info("step %d: reward %.3f success %.2f staleness<=%d version %d (%.2fs train)", self.state.step,
                 row["reward_mean"], row["success_rate"], row["staleness_max"], self.version, train.wall_s)
        return row

    async def checkpoint(self) -> None:
        self.state.trained_ids = [i for ids in self.recent for i in ids]
        self.state.offsets = dict(self.offsets)
        self.state.version = self.version + 1  # what these weights are about to be announced as
        await asyncio.to_thread(self.checkpoints.save, self.backend, self.state)

    async def publish(self, *, step: int) -> float:
        """Write the current weights, bump and announce the version; returns the publish seconds."""
        started = time.perf_counter()
        latest = await self.writer.current()
        manifest, put_s = await asyncio.to_thread(self.publisher.publish, latest + 1, self.backend.state_dict())
        announcement = await self.writer.bump(step=step, manifest=manifest)
        self.version = announcement.version
        self.state.version = self.version
        PUBLISH_SECONDS.labels(self.config.job, manifest.transport).observe(put_s)
        VERSION.labels(*self.labels).set(self.version)
        await self.collect_versions()
        elapsed = time.perf_counter() - started
        self.checkpoints.append_record({"event": "publish", "step": step, "version": self.version,
                                        "publish_s": round(elapsed, 6), "put_s": round(put_s, 6),
                                        "bytes": manifest.total_bytes, "transport": manifest.transport,
                                        "written_bytes": self.publisher.last.written_bytes,
                                        "changed_buckets": self.publisher.last.changed,
                                        "buckets": self.publisher.last.buckets,
                                        "time": time.time()})
        return elapsed

    async def collect_versions(self) -> None:
        """Remove versions no generation consumer can still need: below both the last
        ``keep_versions`` and every version a consumer is pulling right now."""
        prefix, job = self.config.redis.key_prefix, self.config.job
        keep_from = min([self.version - self.config.trainer.keep_versions + 1,
                         *await pulling_versions(self.rt.redis, prefix, job)])
        await asyncio.to_thread(self.publisher.collect, keep_from)


async def train_groups(backend, groups: list[Group], config: RollartConfig, *, version: int,
                       pad_id: int) -> tuple[list[ScoredTrajectory], list[int], dict, ThreadTimes]:
    """One optimiser step on ``groups`` (collated and trained in a worker thread, the consumer going on
    meanwhile): the samples, their staleness against ``version``, the backend's metrics and the step's
    times in that thread (wall, on a core, waiting for one)."""
    samples = [s for g in groups for s in g.members.values()]
    staleness = sample_staleness(samples, version)
    metrics, times = await in_thread(partial(collated_step, backend, samples, config, version=version, pad_id=pad_id))
    return samples, staleness, metrics, times


def collated_step(backend, samples: list[ScoredTrajectory], config: RollartConfig, *, version: int,
                  pad_id: int) -> dict:
    """The trainer's step on ``samples`` in the calling thread: collated, then one optimiser step; the
    backend's metrics (``rollart bench trainer-step`` replays a run's steps through it)."""
    from rollart.training.torch_backend import collate

    cfg = config.trainer
    return backend.train_step(collate(samples, pad_id=pad_id, norm=cfg.advantage_norm,
                                      per_step=cfg.samples == "step", version=version))


def sample_staleness(samples: list[ScoredTrajectory], version: int) -> list[int]:
    """Versions between ``version`` and each sample's start."""
    return [version - s.trajectory.start_version for s in samples]


def token_staleness_mean(samples: list[ScoredTrajectory], version: int) -> float:
    """Versions between ``version`` and the weights that generated each trained token, averaged over the
    generated tokens. ``staleness_mean`` counts from each trajectory's start; with in-flight weight
    updates (``generation.on_weight_update``) a trajectory's later turns come from newer weights, and
    this says how far off-policy the batch's tokens were when trained (0: all from the trained weights)."""
    import numpy as np

    total = count = 0
    for s in samples:
        generated = np.frombuffer(s.trajectory.loss_mask, dtype=np.uint8) > 0
        made_by = np.frombuffer(s.trajectory.versions, dtype=np.int32)[generated]
        total += int(np.maximum(version - made_by, 0).sum())
        count += len(made_by)
    return total / count if count else 0.0


def step_record(*, step: int, version: int, samples: list[ScoredTrajectory], staleness: list[int], metrics: dict,
                wait_s: float, train: ThreadTimes, buffer: SampleBuffer, mixed_precision: str) -> dict:
    """One row of the trainer's record (``record.jsonl``) for a trained batch; the in-process loop of
    ``rollart bench time-to-quality`` writes the same rows, so both runs are read by one reader."""
    rewards = [s.reward for s in samples]
    st = buffer.stats
    return {
        "step": step, "trained_version": version, "time": time.time(),
        "samples": len(samples), "groups": len({s.trajectory.group_id for s in samples}),
        "reward_mean": sum(rewards) / len(rewards),
        "success_rate": sum(s.trajectory.metrics.get("success", 0.0) for s in samples) / len(samples),
        "staleness_max": max(staleness), "staleness_mean": sum(staleness) / len(staleness),
        "token_staleness_mean": token_staleness_mean(samples, version),
        "tokens": int(sum(sum(s.trajectory.loss_mask) for s in samples)),
        "turns_mean": sum(s.trajectory.turns for s in samples) / len(samples),
        "traj_ids": [s.trajectory.traj_id for s in samples],
        # the batch's shape, so `rollart bench trainer-step` can time the same step alone
        "lengths": [len(s.trajectory.token_ids) for s in samples],
        "generated": [int(sum(s.trajectory.loss_mask)) for s in samples],
        "rewards": [round(float(s.reward), 6) for s in samples],  # which groups train (equal rewards: none)
        **_shared_prefixes(samples),
        "torch_threads": _torch_threads(), "mixed_precision": mixed_precision,
        "wait_s": round(wait_s, 6), "train_s": round(train.wall_s, 6),
        # of train_s, the training thread's time on a core and runnable but waiting for one (Linux)
        "train_cpu_s": _rounded(train.cpu_s), "train_queue_s": _rounded(train.queue_s),
        "buffer_groups": len(buffer),
        "dropped": {"duplicates": st.duplicates, "overflow": st.overflow, "stale_groups": st.evicted_stale_groups,
                    "incomplete_groups": st.evicted_full_groups + st.unfillable_groups,
                    "uninformative_groups": st.uninformative_groups, "late_members": st.late_members},
        "partial_groups": st.partial_groups,
        "groups_by_tag": _groups_by_tag(samples),
        "mix_shortfall": st.mix_shortfall,
        "metrics": {k: round(float(v), 6) for k, v in metrics.items()},
    }


def _shared_prefixes(samples: list[ScoredTrajectory]) -> dict:
    """How the batch's samples share prefixes: ``shared_prefix``, ``[sample, tokens shared with the
    sample before it]`` in lexicographic order (so `rollart bench trainer-step` replays the same tree),
    and ``distinct_tokens``, the tokens of the batch's distinct prefixes (what the prefix-tree forward
    runs, before micro-batching splits the tree)."""
    from rollart.training.prefix_tree import sorted_rows

    links = sorted_rows([s.trajectory.token_ids.tolist() for s in samples])
    lengths = sum(len(s.trajectory.token_ids) for s in samples)
    return {"shared_prefix": [list(link) for link in links], "distinct_tokens": lengths - sum(n for _, n in links)}


def _groups_by_tag(samples: list[ScoredTrajectory]) -> dict[str, int]:
    tags = {s.trajectory.group_id: s.trajectory.tag for s in samples}
    return {tag: list(tags.values()).count(tag) for tag in sorted(set(tags.values()))}


def _rounded(seconds: float | None) -> float | None:
    return None if seconds is None else round(seconds, 6)


def _torch_threads() -> int | None:
    import sys

    torch = sys.modules.get("torch")  # loaded by any backend that trains; not imported for this
    return torch.get_num_threads() if torch is not None else None


def trainer_loop(rt: Runtime, stage: TrainerStage):
    # Every buffered sample is in flight until settled: max_in_flight is the buffer bound.
    loop = rt.consumer_loop("trainer", [REWARDS_RESULTS], stage.handle, ordering="none", dedup=False,
                            max_in_flight=stage.max_in_flight, drain_timeout_s=0.0,
                            on_revoke=stage.forget_revoked, **rt.config.bus.bulk_fetch.consumer_kwargs())
    stage.consumer = loop
    return loop


def build_backend(config: RollartConfig):
    from rollart.models.tiny import ensure_model

    t = config.trainer
    if t.torch_threads is not None:
        import torch

        torch.set_num_threads(t.torch_threads)
    if t.backend == "megatron":
        from rollart.training.megatron_backend import MegatronBackend

        try:
            backend = MegatronBackend(ensure_model(config.model), lr=t.lr, micro_batch=t.micro_batch,
                                      loss=loss_config(config), grad_clip=t.grad_clip, device=t.device)
        except (ImportError, RuntimeError) as exc:
            raise ConfigError(f"trainer.backend: megatron cannot start here: {exc}") from None
    else:
        import torch

        from rollart.training.torch_backend import TorchBackend

        torch.manual_seed(t.seed)
        log.info("torch intra-op threads: %d", torch.get_num_threads())
        backend = TorchBackend(ensure_model(config.model), lr=t.lr, micro_batch=t.micro_batch, device=t.device,
                               loss=loss_config(config), grad_clip=t.grad_clip, prefix_tree=t.prefix_tree)
    from rollart.training.torch_backend import autocast_dtype

    backend.mixed_precision = autocast_dtype(t.mixed_precision, backend.device)
    return backend


def writer_token(checkpoints: CheckpointStore, resume: bool) -> str:
    import uuid

    path = checkpoints.root / "writer.token"
    if resume and path.exists():
        return path.read_text().strip()
    checkpoints.root.mkdir(parents=True, exist_ok=True)
    token = uuid.uuid4().hex
    path.write_text(token)
    return token


async def run_trainer(config: RollartConfig, stop: StopRequest, *, resume: bool = False) -> None:
    """Run the trainer until ``trainer.max_steps`` or ``stop`` (SIGTERM); ``resume`` continues from
    the latest checkpoint in ``trainer.checkpoint_dir``. With ``trainer.world_size`` > 1 this process
    is one rank: rank 0 runs the stage, the others follow it (rollart/training/distributed.py)."""
    from rollart.training import distributed
    from rollart.training.ranks import Rendezvous

    trainer_alpha(config)
    rdzv = Rendezvous.from_env(config.trainer.world_size) if config.trainer.world_size > 1 else None
    if rdzv is not None and rdzv.rank > 0:
        await asyncio.to_thread(distributed.run_rank, config, rdzv)
        distributed.exit_stopped_rank()  # (torchrun, a Kubernetes rank pod) nothing else to close
    checkpoints = CheckpointStore(Path(config.trainer.checkpoint_dir))
    if not resume and checkpoints.latest() is not None:
        raise ConfigError(f"trainer.checkpoint_dir {checkpoints.root} already holds a checkpoint: pass --resume "
                          "to continue it, or point the trainer at an empty directory")
    children: list = []
    if config.trainer.world_size > 1 and rdzv is None:  # the launcher: rank 0 here, the others our children
        rdzv = Rendezvous.local(config.trainer.world_size)
        children = distributed.start_local_ranks(config, rdzv, checkpoints.root / "ranks")
    if rdzv is None:
        backend = await asyncio.to_thread(build_backend, config)
    else:
        distributed.bind_local_device(rdzv)
        backend = await asyncio.to_thread(distributed.data_parallel, config, rdzv, children, build_backend)
    try:
        await _train(config, stop, backend, checkpoints, resume=resume)
    finally:
        if isinstance(backend, distributed.DataParallelBackend):
            await asyncio.to_thread(backend.close)


async def _train(config: RollartConfig, stop: StopRequest, backend, checkpoints: CheckpointStore, *,
                 resume: bool) -> None:
    from transformers import AutoTokenizer

    state = await asyncio.to_thread(checkpoints.load, backend) if resume else None
    if state is not None:
        checkpoints.truncate_record(state.step)
        log.info("resumed from step %d (version %d)", state.step, state.version)
    pad_id = AutoTokenizer.from_pretrained(str(config.model.path)).pad_token_id

    async def member(rt: Runtime) -> Member:
        transport = await asyncio.to_thread(make_transport, config.weights, rt.endpoints)
        publisher = WeightPublisher.from_config(transport, config.job, config.weights)
        writer = VersionWriter(config, rt.endpoints, rt.redis, rt.producer,
                               token=writer_token(checkpoints, resume))
        await writer.acquire()
        tracking = Trackers.from_config(config)  # a tracker configured but not installed fails here
        stage = TrainerStage(rt, backend, checkpoints, publisher, writer, pad_id=pad_id, state=state,
                             tracking=tracking)
        loop = trainer_loop(rt, stage)
        return Member(loops=[step_loop(stage, loop), loop], cleanup=[writer.release, transport.close, tracking.close])

    await run_member(config, stop, member, client_id="trainer")


def step_loop(stage: TrainerStage, loop: ConsumerLoop) -> Work:
    """The training steps until ``trainer.max_steps``. Its stop is the finish event (SIGTERM, or the
    consumer loop ended): it ends the consumer loop too, both at once."""
    finish = asyncio.Event()

    def end() -> None:
        finish.set()
        loop.stop()

    return Work(lambda: stage.run(finish, stage.config.trainer.max_steps), end)
