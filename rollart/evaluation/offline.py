"""``rollart eval CONFIG --checkpoint DIR``: one evaluation of one checkpoint, offline, in this process.

The checkpoint (a ``step-N`` folder, a checkpoints folder or a run's OUT: its latest step; or a Hugging
Face model directory, e.g. the base model) is exported to a Hugging Face directory and served by an
engine of its own; the job's eval tasks (:mod:`rollart.evaluation.tasks`, the very tasks the eval stage
releases) run through the env stage's trajectory runner with ``eval.sampling`` and are scored by the
reward bridge's local scorer; the summary is the eval stage's. No broker, Redis or trainer: what it
leaves out is only the bus. An LLM-judge reward needs its pool, so it is refused here.
"""

from __future__ import annotations

import asyncio
import json
import tempfile
import time
from pathlib import Path

from rollart.config import ConfigError, RollartConfig
from rollart.evaluation.ledger import VersionEval, summary_row
from rollart.evaluation.tasks import eval_sources, eval_tasks
from rollart.messages import Abort, CompletedTrajectory, GenerationRequest, GenerationResult, GroupEnded, TaskSpec
from rollart.rewards.http import RewardCallFailed
from rollart.rewards.scoring import LocalScorer, reward_spec, scored_trajectory
from rollart.rollout.chat import ChatFormat
from rollart.rollout.trajectory import TrajectoryBuilder
from rollart.stages.env import TrajectoryRunner, run_group, turn_sampling


def model_of(checkpoint: Path, base_model: Path, scratch: Path) -> tuple[Path, int, int]:
    """(a Hugging Face directory of the checkpoint's weights, its policy version, its step)."""
    from rollart.training.export import export_checkpoint

    if (checkpoint / "config.json").exists() and not (checkpoint / "trainer.pt").exists():
        info = json.loads((checkpoint / "rollart_export.json").read_text()) \
            if (checkpoint / "rollart_export.json").exists() else {}
        return checkpoint, int(info.get("version") or 0), int(info.get("step") or 0)
    info = export_checkpoint(checkpoint, base_model, scratch / "model")
    return scratch / "model", int(info.get("version") or 0), int(info.get("step") or 0)


class OfflineEval:
    def __init__(self, config: RollartConfig, engine, chat: ChatFormat, version: int, step: int):
        self.config, self.engine, self.chat = config, engine, chat
        self.version, self.step = version, step
        self.scorer = LocalScorer(chat)
        self.sampling = turn_sampling(config, chat, evaluation=True)
        self.trajectories = TrajectoryRunner(config, chat, self._generate)
        self.slots = asyncio.Semaphore(config.generation.max_concurrency)

    async def run(self) -> dict:
        tasks = eval_tasks(self.config, eval_sources(self.config), self.version)
        run = VersionEval(self.version, self.step, {t.group_id: t.tag for t in tasks}, self.config.eval.group_size)
        try:
            await asyncio.gather(*(self._group(task, run) for task in tasks))
        finally:
            await self.scorer.close()
        return summary_row(run.summary(self.config.job, complete=run.over()), list(run.rows.values()))

    async def _group(self, task: TaskSpec, run: VersionEval) -> None:
        async def emit(outcome: CompletedTrajectory | Abort | GroupEnded) -> None:
            if isinstance(outcome, CompletedTrajectory):
                spec = reward_spec(self.config, outcome.tag)
                try:
                    reward, components = await self.scorer.score(outcome, spec)
                except (RewardCallFailed, ValueError):
                    run.add(Abort(traj_id=outcome.traj_id, turn=outcome.turns, reason="reward_failed",
                                  group_id=outcome.group_id, tag=outcome.tag, created_at=time.time()))
                    return
                run.add(scored_trajectory(outcome, reward, components, spec))
            elif isinstance(outcome, GroupEnded):
                run.add(outcome)

        await run_group(self.trajectories, task, emit)

    async def _generate(self, task: TaskSpec, traj_id: str, turn: int, builder: TrajectoryBuilder) -> GenerationResult:
        request = GenerationRequest(traj_id=traj_id, turn=turn, episode=builder.episode, group_id=task.group_id,
                                    tag=task.tag, pool="offline", prompt_ids=builder.tokens, reply_partition=0,
                                    sampling=self.sampling, created_at=time.time(), exact_version=self.version)
        async with self.slots:
            result = await self.engine.generate(request)
        builder.add_time("generation", result.latency_s)
        return result


async def evaluate_checkpoint(config: RollartConfig, checkpoint: Path) -> dict:
    """The eval summary (with its trajectories) of ``checkpoint``; see the module doc."""
    from rollart.engines.vllm_engine import VLLMEngine
    from rollart.models.tiny import ensure_model

    if config.eval is None:
        raise ConfigError("rollart eval needs an eval: section in the job config (tags, pool, tasks_per_tag)")
    judged = [t for t in config.eval.tags if config.tags[t].reward.type == "judge"]
    if judged:
        raise ConfigError(f"eval.tags {judged}: an LLM-judge reward needs its generation pool; evaluate them "
                          "with the eval stage of a run")
    base = await asyncio.to_thread(ensure_model, config.model)
    with tempfile.TemporaryDirectory(prefix="rollart-eval-") as scratch:
        model, version, step = await asyncio.to_thread(model_of, Path(checkpoint), base, Path(scratch))
        engine = await VLLMEngine(model, config.generation).start()
        engine.version = version  # every token is stamped with the checkpoint's policy version
        try:
            started = time.perf_counter()
            row = await OfflineEval(config, engine, ChatFormat.from_pretrained(model), version, step).run()
        finally:
            engine.shutdown()
    return {**row, "checkpoint": str(checkpoint), "seconds": round(time.perf_counter() - started, 3)}
