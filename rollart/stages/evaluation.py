"""The eval stage: held-out evaluation, each run pinned to one policy version.

One member (like the feeder and the trainer it is a single writer). It reads ``policy.versions``; at
every due version (``eval.every_versions``, and version 0 with ``eval.initial``) it

1. pins the version (:mod:`rollart.evaluation.pinning`): the eval pool will load exactly it, and the
   trainer keeps its weights until the evaluation is over;
2. releases the version's eval tasks on ``tasks`` (:mod:`rollart.evaluation.tasks`: the same seeds and
   held-out rows every time, never trained on). The env stage runs them like any task, on the eval pool
   with ``eval.sampling`` and no staleness abort; the reward stage scores them onto ``eval.results``;
3. follows ``eval.results`` as consumer group ``eval`` until every eval trajectory of the version is
   scored or failed (or ``eval.timeout_s`` passed: the summary then says incomplete);
4. writes the summary: ``eval.summaries`` (compacted by version, the durable record), Prometheus
   gauges per tag, the experiment trackers, and ``eval.record`` (a JSON-lines file) when set.

Evaluations run one at a time, oldest due version first; when training outpaces them, the newest due
version is evaluated next and the ones between are skipped (counted). A restarted member reads the
summaries (versions done) and ``eval.results`` (an evaluation in progress) back from the log and goes
on; it re-releases the tasks of the version it resumes, which the env stage drops as copies.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import socket
import time

from prometheus_client import Counter, Gauge, Histogram

from rollart import health
from rollart.bus import MessageContext, StopRequest
from rollart.bus.reader import read_to_end
from rollart.config import RollartConfig
from rollart.evaluation.ledger import VersionEval, summary_row, tracker_scalars
from rollart.evaluation.pinning import PIN_SLOTS, pin, unpin
from rollart.evaluation.tasks import due, eval_group_version, eval_sources, eval_tasks, latest_due
from rollart.messages import DEFAULT_CODEC, Abort, Envelope, EvalSummary, GroupEnded, MessageDecodeError, \
    ScoredTrajectory, VersionAnnouncement
from rollart.runtime import Runtime
from rollart.tracking import Trackers
from rollart.weights.follower import watch_versions
from rollart.names import EVAL_RESULTS, EVAL_SUMMARIES, TASKS
from rollart.stages.runner import Member, Work, run_member
from rollart.timeouts import wait_for

log = logging.getLogger(__name__)

SUCCESS = Gauge("rollart_eval_success_ratio", "Eval success rate of the latest evaluated version", ("job", "tag"))
REWARD = Gauge("rollart_eval_reward_mean", "Eval mean reward of the latest evaluated version", ("job", "tag"))
TURNS = Gauge("rollart_eval_turns_mean", "Eval mean LLM turns of the latest evaluated version", ("job", "tag"))
EVALUATED = Gauge("rollart_eval_policy_version", "The latest evaluated policy version", ("job",))
DURATION = Histogram("rollart_eval_duration_seconds", "From releasing a version's eval tasks to its summary", ("job",),
                     buckets=(1, 2.5, 5, 10, 30, 60, 120, 300, 600, 1800))
VERSIONS = Counter("rollart_eval_versions_total", "Due versions, by outcome (complete, incomplete, skipped)",
                   ("job", "outcome"))
EvalRecord = ScoredTrajectory | GroupEnded | Abort


class EvalStage:
    def __init__(self, runtime: Runtime, trackers: Trackers | None = None):
        self.rt = runtime
        self.config: RollartConfig = runtime.config
        self.sources = eval_sources(self.config)
        self.trackers = trackers
        self.announcements: dict[int, VersionAnnouncement] = {}
        self.latest = 0
        self.done: set[int] = set()
        self.seen: dict[int, dict[str, EvalRecord]] = {}  # version → records by id, until summarised
        self.current: VersionEval | None = None
        self.changed = asyncio.Event()
        self._stop = asyncio.Event()
        self._prefix = self.config.redis.key_prefix

    def stop(self) -> None:
        self._stop.set()
        self.changed.set()

    # -- what comes back ---------------------------------------------------------------------------

    async def handle(self, envelope: Envelope, ctx: MessageContext) -> None:
        self.take(envelope.message)

    def take(self, message: EvalRecord) -> None:
        group = message.trajectory.group_id if isinstance(message, ScoredTrajectory) else message.group_id
        version = eval_group_version(group)
        if version is None or version in self.done:
            return  # not an eval group of this job, or a late copy for a version already summarised
        self.seen.setdefault(version, {})[message.message_id()] = message
        if self.current is not None and self.current.version == version and self.current.add(message):
            self.changed.set()

    async def recover(self) -> None:
        """Versions already summarised, and any evaluation in progress, from the log."""
        async for record in self._read(EVAL_SUMMARIES, EvalSummary):
            if record.job == self.config.job:
                self.done.add(record.version)
        async for record in self._read(EVAL_RESULTS, ScoredTrajectory, GroupEnded, Abort):
            self.take(record)
        if self.done:
            log.info("eval: versions %s already evaluated; %d in progress", sorted(self.done), len(self.seen))

    async def _read(self, topic: str, *kinds):
        async for record in read_to_end(self.config, self.rt.endpoints, self.rt.producer.names.physical(topic)):
            try:
                yield DEFAULT_CODEC.decode(record.value, record.headers, accept=kinds).message
            except MessageDecodeError:
                continue  # the consumer group dead-letters bad records; here they just do not count

    async def on_announcement(self, announcement: VersionAnnouncement) -> None:
        self.announcements[announcement.version] = announcement
        self.latest = max(self.latest, announcement.version)
        self.changed.set()

    # -- the schedule ------------------------------------------------------------------------------

    def next_version(self) -> int | None:
        """The version to evaluate next: the one in progress (after a restart), else the newest due
        version not evaluated yet, provided its weights are announced (version 0 needs none)."""
        pending = [v for v in self.seen if v not in self.done and (v == 0 or v in self.announcements)]
        if pending:
            return min(pending)
        newest = latest_due(self.config, self.latest)
        if newest is None or newest in self.done or newest <= max(self.done, default=-1):
            return None
        return newest if newest == 0 or newest in self.announcements else None

    async def run(self) -> None:
        try:
            while not self._stop.is_set():
                health.beat("eval")
                version = self.next_version()
                if version is None:
                    await self._wait(1.0)
                    continue
                self._count_skipped(version)
                await self.evaluate(version)
        finally:
            health.forget("eval")

    def _count_skipped(self, version: int) -> None:
        last = max(self.done, default=-1)
        skipped = sum(1 for v in range(last + 1, version) if due(self.config, v))
        if skipped:
            VERSIONS.labels(self.config.job, "skipped").inc(skipped)
            log.info("eval: skipping %d due version(s) before %d (training outpaced evaluation)", skipped, version)

    async def _wait(self, seconds: float) -> None:
        self.changed.clear()
        with contextlib.suppress(asyncio.TimeoutError):
            await wait_for(self.changed.wait(), seconds)

    async def evaluate(self, version: int) -> EvalSummary | None:
        """Run one version's evaluation to its summary (None when stopped first: it resumes on restart)."""
        cfg = self.config.eval
        tasks = eval_tasks(self.config, self.sources, version)
        announcement = self.announcements.get(version)
        run = VersionEval(version, announcement.step if announcement else 0, {t.group_id: t.tag for t in tasks},
                          cfg.group_size)
        self.current = run
        for message in self.seen.get(version, {}).values():
            run.add(message)
        await self._pin(PIN_SLOTS[0], announcement)
        if not run.over():
            for task in tasks:
                await self.rt.producer.send_and_wait(TASKS, task, key=task.group_id, policy_version=version)
        log.info("eval: version %d, %d tasks released", version, len(tasks))
        deadline = time.monotonic() + cfg.timeout_s
        while not run.over() and time.monotonic() < deadline and not self._stop.is_set():
            health.beat("eval")
            await self._pin(PIN_SLOTS[0], announcement)  # refresh the marks
            await self._pin_next(version)
            await self._wait(1.0)
        if not run.over() and self._stop.is_set():
            return None
        summary = run.summary(self.config.job, complete=run.over())
        await self.publish(summary, run)
        return summary

    async def _pin(self, slot: str, announcement: VersionAnnouncement | None) -> None:
        if announcement is not None and announcement.manifest is not None:
            await pin(self.rt.redis, self._prefix, self.config.job, slot, announcement)

    async def _pin_next(self, current: int) -> None:
        """Keep the newest due version's weights too: it is evaluated next, however far training gets."""
        newest = latest_due(self.config, self.latest)
        if newest is not None and newest > current and newest in self.announcements:
            await self._pin(PIN_SLOTS[1], self.announcements[newest])

    async def publish(self, summary: EvalSummary, run: VersionEval) -> None:
        job, version = self.config.job, summary.version
        await self.rt.producer.send_and_wait(EVAL_SUMMARIES, summary, key=str(version), policy_version=version)
        await unpin(self.rt.redis, self._prefix, job, PIN_SLOTS[0], version)
        self.done.add(version)
        self.seen.pop(version, None)
        self.current = None
        for tag, result in summary.tags.items():
            SUCCESS.labels(job, tag).set(result.success_rate)
            REWARD.labels(job, tag).set(result.reward_mean)
            TURNS.labels(job, tag).set(result.turns_mean)
        EVALUATED.labels(job).set(version)
        DURATION.labels(job).observe(summary.finished_at - summary.started_at)
        VERSIONS.labels(job, "complete" if summary.complete else "incomplete").inc()
        if self.trackers:
            await asyncio.to_thread(self.trackers.log_scalars, summary.step, tracker_scalars(summary))
        if self.config.eval.record is not None:
            await asyncio.to_thread(_append_line, self.config.eval.record,
                                    json.dumps(summary_row(summary, list(run.rows.values()))))
        log.info("eval: version %d (step %d) %s: %s", version, summary.step,
                 "complete" if summary.complete else "INCOMPLETE",
                 ", ".join(f"{t} success {r.success_rate:.2f} reward {r.reward_mean:.3f}" for t, r in summary.tags.items()))


def init_metrics(config: RollartConfig) -> None:
    for outcome in ("complete", "incomplete", "skipped"):
        VERSIONS.labels(config.job, outcome)


async def run_eval(config: RollartConfig, stop: StopRequest) -> None:
    """Run the eval stage until ``stop`` (SIGTERM)."""
    if config.eval is None:
        raise ValueError("the eval stage needs an eval: section in the job config")
    init_metrics(config)
    member = f"eval-{socket.gethostname()}-{os.getpid()}"
    trackers = Trackers.from_config(config, role="eval")  # a tracker configured but not installed fails now
    await run_member(config, stop, lambda rt: eval_member(rt, member, trackers), client_id=member)


async def eval_member(rt: Runtime, member: str, trackers: Trackers) -> Member:
    """The schedule, then the results loop that feeds it; beside them, a watcher of the announced versions."""
    stage = EvalStage(rt, trackers)
    await stage.recover()
    results = rt.consumer_loop("eval", [EVAL_RESULTS], stage.handle, ordering="none")
    watcher = Work(lambda: watch_versions(rt, f"{member}-versions", stage.on_announcement))  # runs until cancelled
    return Member(loops=[stage, results], background=[watcher], cleanup=[trackers.close])


def _append_line(path, line: str) -> None:
    with open(path, "a") as f:
        f.write(line + "\n")
