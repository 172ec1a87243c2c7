"""The run observer: what the stages of a local run report, counted by the runner that started them.

``rollart run`` (and chaos, soak, the benchmarks through it) counts completed and aborted trajectories
on ``trajectories.completed`` for its report; ``rollart rollout`` collects scored trajectories from
``rewards.results`` until it has as many as asked. One :class:`RunObserver` serves both, and
:func:`observing` runs it as a consumer group of its own for as long as the runner waits.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import Counter, defaultdict
from typing import AsyncIterator, Sequence

from rollart.config import RollartConfig
from rollart.messages import Abort, CompletedTrajectory, Envelope, ScoredTrajectory
from rollart.runtime import Runtime, open_runtime

log = logging.getLogger(__name__)


class RunObserver:
    """Counts the first copy of each trajectory id: completed ones (with the tokens generated), scored
    ones per tag, aborts per reason. With a ``target``, :attr:`done` is set once that many are scored
    and, with ``shares`` (tag -> trajectories, the tags' weights applied to the target), every tag has
    its share: a fast tag does not fill a rollout alone."""

    def __init__(self, target: int | None = None, shares: dict[str, int] | None = None):
        self.target = target
        self.shares = shares or {}
        self.completed: set[str] = set()
        self.tokens = 0
        self.scored: dict[str, ScoredTrajectory] = {}
        self.per_tag: Counter = Counter()
        self.aborted: Counter = Counter()
        self.aborted_ids: set[str] = set()
        self.started_at = 0.0  # when the stages were started (the run's clock)
        self.done = asyncio.Event()

    def complete(self) -> bool:
        return (self.target is not None and len(self.scored) >= self.target
                and all(self.per_tag[t] >= n for t, n in self.shares.items()))

    async def handle(self, envelope: Envelope, ctx) -> None:
        message = envelope.message
        if isinstance(message, CompletedTrajectory):
            self._completed(message)
        elif isinstance(message, ScoredTrajectory):
            self._completed(message.trajectory)  # one scored by its env member was on no other topic
            if message.trajectory.traj_id not in self.scored:
                self.scored[message.trajectory.traj_id] = message
                self.per_tag[message.trajectory.tag] += 1
            if self.complete():
                self.done.set()
        elif isinstance(message, Abort) and message.traj_id not in self.aborted_ids:
            self.aborted_ids.add(message.traj_id)
            self.aborted[message.reason] += 1

    def _completed(self, trajectory: CompletedTrajectory) -> None:
        if trajectory.traj_id not in self.completed:
            self.completed.add(trajectory.traj_id)
            self.tokens += sum(trajectory.loss_mask)

    def summary(self) -> dict:
        """What the env stage reported (the run's report and progress lines)."""
        return {"completed": len(self.completed), "aborted": dict(self.aborted), "tokens": self.tokens}

    def scored_summary(self, elapsed_s: float) -> dict:
        """What was scored, per tag (a rollout's ``summary.json``)."""
        by_tag: dict[str, list[ScoredTrajectory]] = defaultdict(list)
        for scored in self.scored.values():
            by_tag[scored.trajectory.tag].append(scored)
        tokens = sum(sum(s.trajectory.loss_mask) for s in self.scored.values())
        return {
            "completed": len(self.scored),
            "aborted": dict(self.aborted),
            "by_tag": {tag: {
                "completed": len(items),
                "share": self.shares.get(tag),
                "reward_mean": sum(s.reward for s in items) / len(items),
                "turns_mean": sum(s.trajectory.turns for s in items) / len(items),
                "success_rate": sum(s.trajectory.metrics.get("success", 0.0) for s in items) / len(items),
            } for tag, items in sorted(by_tag.items())},
            "tokens_generated": tokens,
            "elapsed_s": round(elapsed_s, 3),
            "trajectories_per_s": round(len(self.scored) / elapsed_s, 3) if elapsed_s else 0.0,
        }


@contextlib.asynccontextmanager
async def observing(config: RollartConfig, observer: RunObserver, group: str, topics: Sequence[str], *,
                    required: bool, bulk: bool = False) -> AsyncIterator[Runtime]:
    """``observer`` fed from ``topics`` as consumer group ``group`` while the block runs (its runtime
    is yielded: the runner's Redis). ``required``: the observation is the run's result (a rollout's
    trajectories), so a failure of its loop is raised on the way out; otherwise (a run's counts for
    its report) it is logged and the run's own outcome stands. ``bulk``: ``bus.bulk_fetch.min_bytes``
    at a time, or what came within the bus's long-poll (a run's counts need no haste)."""
    async with open_runtime(config, client_id=group, serve=False) as rt:
        fetch = {"fetch_min_bytes": config.bus.bulk_fetch.min_bytes} if bulk else {}
        loop = rt.consumer_loop(group, list(topics), observer.handle, ordering="none", dedup=False, **fetch)
        runner = asyncio.create_task(loop.run())
        try:
            yield rt
        finally:
            loop.stop()
            if required:
                await runner
            else:
                try:
                    await runner
                except Exception:  # noqa: BLE001
                    log.warning("the run observer's loop (%s) failed; its counts may be short", group, exc_info=True)
