"""The eval task set: the same tasks at every evaluated version, none of them ever trained on.

* A tag without a dataset (seeded env tasks): ``eval.tasks_per_tag`` seeds from ``2^31`` up. The
  feeder draws training seeds below ``2^31`` (:func:`rollart.stages.feeder.task_spec`), so the two
  sets are disjoint by construction.
* A tag with a dataset: its held-out rows (``dataset.eval_rows`` / ``eval_split``), or every row of a
  tag that does not train (weight 0), the first ``tasks_per_tag`` of them in order.

Group ids are ``<job>-v<version>-e<i>``: an eval task is a pure function of (config, version, i), so a
restarted eval stage re-releases exactly the tasks it released before (the env stage drops the copies).
"""

from __future__ import annotations

import re
import time
from dataclasses import dataclass

from rollart.config import ConfigError, RollartConfig
from rollart.datasets import Row, eval_rows
from rollart.messages import TaskSpec

EVAL_SEED_BASE = 1 << 31  # training seeds lie below (the feeder draws randrange(1 << 31))
_GROUP = re.compile(r"-v(\d+)-e(\d+)$")


@dataclass(frozen=True)
class EvalSource:
    tag: str
    env: str
    prompts: tuple[Row, ...] = ()


def eval_sources(config: RollartConfig) -> list[EvalSource]:
    """The eval tags' task sources; a held-out dataset that cannot load fails naming the tag."""
    if config.eval is None:
        return []
    sources = []
    for tag in config.eval.tags:
        spec = config.tags[tag]
        try:
            rows = eval_rows(spec.dataset) if spec.dataset else ()
        except ValueError as exc:
            raise ConfigError(f"tags.{tag}.dataset (eval): {exc}") from None
        sources.append(EvalSource(tag, spec.env, rows))
    return sources


def eval_group_id(job: str, version: int, index: int) -> str:
    return f"{job}-v{version}-e{index}"


def eval_group_version(group_id: str) -> int | None:
    """The version an eval group id is pinned to; None for any other group id."""
    match = _GROUP.search(group_id)
    return int(match.group(1)) if match else None


def eval_tasks(config: RollartConfig, sources: list[EvalSource], version: int) -> list[TaskSpec]:
    """Every eval task of ``version``, in a fixed order (the same seeds and rows at every version)."""
    cfg = config.eval
    tasks = []
    for source in sources:
        count = min(cfg.tasks_per_tag, len(source.prompts)) if source.prompts else cfg.tasks_per_tag
        for k in range(count):
            prompt, labels = source.prompts[k] if source.prompts else ("", {})
            tasks.append(TaskSpec(group_id=eval_group_id(config.job, version, len(tasks)), env=source.env,
                                  tag=source.tag, group_size=cfg.group_size,
                                  seed=EVAL_SEED_BASE + cfg.seed * 100_003 + k, prompt=prompt, labels=labels,
                                  admitted_version=version, eval_version=version, created_at=time.time()))
    return tasks


def due(config: RollartConfig, version: int) -> bool:
    """Whether ``version`` is one the eval stage evaluates."""
    cfg = config.eval
    return cfg is not None and ((version == 0 and cfg.initial) or (version > 0 and version % cfg.every_versions == 0))


def latest_due(config: RollartConfig, version: int) -> int | None:
    """The newest version up to ``version`` that is due (None: none yet)."""
    cfg = config.eval
    if cfg is None:
        return None
    newest = version - version % cfg.every_versions
    if newest > 0:
        return newest
    return 0 if cfg.initial else None
