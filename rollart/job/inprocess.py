"""The in-process synchronous loop: generate a batch, score it, train on it, load the new weights, repeat
— one process, no bus, no Redis. The baseline ``rollart bench time-to-quality`` holds the pipeline to.

Everything that decides *what* is learned is the pipeline's own code: the feeder's task sequence
(:func:`~rollart.stages.feeder.task_spec`), the env stage's trajectory runner and group rule, the
reward bridge's local scorer, the trainer's sample buffer, collate, backend and record rows, and the
engine's weight loading from staged buckets. What it leaves out is what disaggregation adds: topics,
consumer groups, Redis, processes, and the overlap of rollout with training (alpha = 0 by
construction: every turn of a batch comes from the weights trained on the batch before). With ``lag``
the engine serves the version that many steps behind the trained one instead: every batch as stale as
the pipeline's bound alpha = ``lag`` allows, without the pipeline (``rollart bench off-policy``).
"""

from __future__ import annotations

import asyncio
import logging
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from rollart.config import RollartConfig
from rollart.messages import Abort, CompletedTrajectory, GenerationRequest, GenerationResult, GroupEnded, \
    ScoredTrajectory, TaskSpec
from rollart.rewards.scoring import LocalScorer, reward_spec, scored_trajectory
from rollart.rollout.chat import ChatFormat
from rollart.rollout.trajectory import TrajectoryBuilder
from rollart.stages.env import TrajectoryRunner, run_group, turn_sampling
from rollart.stages.feeder import sources_from, task_spec
from rollart.stages.trainer import step_record, train_groups
from rollart.training.buffer import SampleBuffer
from rollart.training.checkpoint import CheckpointStore

log = logging.getLogger(__name__)

MEMBER = "in-process"


@dataclass
class InProcessLoop:
    config: RollartConfig
    engine: object  # a started VLLMEngine (or anything with its generate / load_weights)
    backend: object  # a training backend (build_backend)
    chat: ChatFormat
    pad_id: int
    record: CheckpointStore  # rows go to its record.jsonl, as the trainer stage's do
    staging: Path  # where each version's buckets are written for the engine to load
    version: int = 0
    groups_released: int = 0
    on_rollout_end: Callable[[int], None] | None = None  # called with the step once its batch is rolled out
    lag: int = 0  # the engine serves the version this many steps behind the trained one
    buffer: SampleBuffer = field(init=False)

    def __post_init__(self) -> None:
        cfg = self.config
        self.buffer = SampleBuffer(group_size=cfg.feeder.group_size, groups_per_batch=cfg.feeder.groups_per_batch,
                                   alpha=self.lag, drop_uninformative=cfg.trainer.dynamic_sampling,
                                   min_group_size=cfg.min_group_size())
        self.sources = sources_from(cfg)
        self.scorer = LocalScorer(self.chat)
        self.sampling = turn_sampling(cfg, self.chat)
        self.pool = cfg.pools[0]
        self.trajectories = TrajectoryRunner(cfg, self.chat, self._generate)

    async def run(self, steps: int, progress: Callable[[dict], None] | None = None) -> list[dict]:
        rows = []
        try:
            for step in range(1, steps + 1):
                rows.append(await self.step(step))
                if progress is not None:
                    progress({**rows[-1], "target": steps})
        finally:
            await self.scorer.close()
        return rows

    async def step(self, step: int) -> dict:
        started = time.perf_counter()
        batch = await self._rollout()
        rollout_s = time.perf_counter() - started
        if self.on_rollout_end is not None:
            self.on_rollout_end(step)
        samples, staleness, metrics, train = await train_groups(self.backend, batch, self.config,
                                                                version=self.version, pad_id=self.pad_id)
        row = step_record(step=step, version=self.version, samples=samples, staleness=staleness, metrics=metrics,
                          wait_s=rollout_s, train=train, buffer=self.buffer,
                          mixed_precision=self.config.trainer.mixed_precision)
        row["sync_s"] = round(await self._load_weights(), 6)
        self.record.append_record(row)
        log.info("step %d: reward %.3f success %.2f (%.2fs rollout, %.2fs train, %.2fs weights)", step,
                 row["reward_mean"], row["success_rate"], rollout_s, train.wall_s, row["sync_s"])
        return row

    async def _rollout(self):
        """Run groups until the buffer yields a batch (incomplete and, with dynamic sampling,
        uninformative groups are replaced by new ones, as the feeder's admission would)."""
        while True:
            self.buffer.drop_uninformative_groups()
            batch = self.buffer.take_batch(self.version)
            if batch is not None:
                return batch
            while self.buffer.evict_oldest_incomplete() is not None:
                pass  # every group has ended: one short of members had some aborted, and cannot complete
            missing = self.buffer.groups_per_batch - len(self.buffer.complete_groups())
            tasks = [task_spec(self.config, self.sources, self.groups_released + i) for i in range(missing)]
            self.groups_released += missing
            await asyncio.gather(*(self._run_group(task) for task in tasks))

    async def _run_group(self, task: TaskSpec) -> None:
        async def emit(outcome: CompletedTrajectory | Abort | GroupEnded) -> None:
            if isinstance(outcome, CompletedTrajectory):
                self.buffer.add(await self._score(outcome))
            elif isinstance(outcome, GroupEnded):  # emitted last: every completed member is scored
                self.buffer.end(outcome)

        await run_group(self.trajectories, task, emit)

    async def _score(self, trajectory: CompletedTrajectory) -> ScoredTrajectory:
        spec = reward_spec(self.config, trajectory.tag)
        reward, components = await self.scorer.score(trajectory, spec)
        return scored_trajectory(trajectory, reward, components, spec)

    async def _generate(self, task: TaskSpec, traj_id: str, turn: int, builder: TrajectoryBuilder) -> GenerationResult:
        request = GenerationRequest(traj_id=traj_id, turn=turn, episode=builder.episode, group_id=task.group_id,
                                    tag=task.tag, pool=self.pool, prompt_ids=builder.tokens, reply_partition=0,
                                    owner=MEMBER, sampling=self.sampling, created_at=time.time())
        result = await self.engine.generate(request)
        builder.add_time("generation", result.latency_s)
        return result

    async def _load_weights(self) -> float:
        """The trained weights into the engine, through the same staged buckets a generation consumer
        loads (written here, not pulled: there is no other process to hand them to); with ``lag``, the
        version that many steps back (the engine keeps its initial weights until there is one)."""
        from rollart.weights.buckets import stage_state
        from rollart.weights.publish import WEIGHT_DTYPES

        started = time.perf_counter()
        self.version += 1
        target = self.staging / f"v{self.version}"
        await asyncio.to_thread(stage_state, self.backend.state_dict(), target,
                                bucket_bytes=self.config.weights.bucket_bytes,
                                dtype=WEIGHT_DTYPES[self.config.weights.dtype])
        served = self.version - self.lag
        if served >= 1:
            await self.engine.load_weights(self.staging / f"v{served}", served)
            shutil.rmtree(self.staging / f"v{served - 1}", ignore_errors=True)
        return time.perf_counter() - started


async def run_in_process(config: RollartConfig, out: Path, steps: int, *,
                         progress: Callable[[dict], None] | None = None,
                         on_rollout_end: Callable[[int], None] | None = None, lag: int = 0) -> dict:
    """Start an engine and a backend, run ``steps`` synchronous steps; returns timings and the rows.
    ``started_at`` is before the engine starts (the pipeline's run also pays its engine start);
    ``progress`` gets each step's row, ``on_rollout_end`` each step's number between its two phases;
    ``lag``: the engine that many versions behind (:class:`InProcessLoop`)."""
    from transformers import AutoTokenizer

    from rollart.engines.vllm_engine import VLLMEngine
    from rollart.models.tiny import ensure_model
    from rollart.stages.runner import freeze_startup_heap
    from rollart.stages.trainer import build_backend

    model = await asyncio.to_thread(ensure_model, config.model)
    record = CheckpointStore(out / "checkpoints")
    shutil.rmtree(record.root, ignore_errors=True)
    started_at = time.time()
    engine = await VLLMEngine(model, config.generation).start()
    try:
        backend = await asyncio.to_thread(build_backend, config)
        chat = ChatFormat.from_pretrained(model)
        pad_id = AutoTokenizer.from_pretrained(str(model)).pad_token_id
        loop = InProcessLoop(config, engine, backend, chat, pad_id, record, out / "staging",
                             on_rollout_end=on_rollout_end, lag=lag)
        freeze_startup_heap()  # as every stage member does before its loops
        ready_at = time.time()
        rows = await loop.run(steps, progress)
    finally:
        engine.shutdown()
    return {"started_at": started_at, "ready_at": ready_at, "finished_at": time.time(), "rows": rows}


def main(argv: list[str] | None = None) -> None:
    """``python -m rollart.job.inprocess CONFIG.json OUT STEPS``: the loop as a process of its own, so
    that it is timed from its launch (imports included) as a pipeline stage is (``rollart bench
    time-to-quality``); CONFIG.json is a dumped :class:`RollartConfig`, the rows go to OUT's record."""
    import sys

    config_json, out, steps = argv if argv is not None else sys.argv[1:]
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    config = RollartConfig.model_validate_json(Path(config_json).read_text())
    asyncio.run(run_in_process(config, Path(out), int(steps)))


if __name__ == "__main__":
    main()
