"""Every stage of the loop, declared once.

A :class:`Stage` says what the rest of rollart needs to know about a stage: the consumer groups its
members join (the topic catalog's ``consumers:`` name them, and :mod:`rollart.topics.access` derives a
stage's ACLs from both), the coroutine that runs one member, whether there is one per generation pool,
whether it is a single writer, which job needs it, and how `rollart run` and `rollart rollout` start it.
`rollart consume`, the local runners, chaos, `rollart deploy render/status` and the ACLs all read
:data:`STAGES`; a test holds the catalog to it. Adding a stage is an entry here, its module, and
``consumers/<name>.py``. A stage's runner builds what its member runs (a
:class:`rollart.stages.runner.Member`: loops in stop order, background work, cleanup) and hands it to
:func:`rollart.stages.runner.run_member`, which owns the rest of the member's life.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any, Literal

Run = Literal["always", "training"]  # which local runs start it: rollout and training, or training only


@dataclass(frozen=True)
class Stage:
    name: str
    groups: tuple[str, ...]  # consumer groups of its members ("{pool}": the member's generation pool)
    runner: str  # "module:function": async def (config, stop, **options) running one member until stop
    summary: str  # what it does, in a few words (`rollart consume --help`)
    per_pool: bool = False  # one stage per generation pool: a member serves one pool (`--pool`)
    single_writer: bool = False  # one member at a time: a Recreate rollout, never autoscaled
    requires: str | None = None  # a job config section without which the job has no such stage
    runs: Run = "always"
    scale_groups: tuple[str, ...] | None = None  # groups whose lag scales it (None: all of its groups)
    options: tuple[str, ...] = ()  # keyword options of its runner that `rollart consume` passes on
    short: str | None = None  # its name in process and Kubernetes object names (generation: gen)
    # "module:function" (config) -> None, called before the runner's module is imported: work that may
    # start while this process imports the stage's own modules (generation: the engine's fork server)
    prelude: str | None = None
    # After a clean stop its process leaves at once, past the interpreter's teardown, where native
    # threads and destructors (vLLM's engine client, oneDNN, the Mooncake client, gloo) can crash it:
    # a drained member would exit -11 and its supervisor count it failed (seen once in CI, generation)
    exit_at_stop: bool = False
    # The stages whose members run inside this one's process where the job co-locates them
    # (``env.colocate_pool``): this stage then runs in their place, and only then (the ACLs and the
    # topic catalog's producers and readers name those stages: it is given theirs).
    hosts: tuple[str, ...] = ()

    def pools(self, config) -> list[str | None]:
        """The pools the job runs members of this stage for ([None]: members of no pool); [] when the job
        has no such stage: one whose ``requires`` section is unset, the co-located stage when nothing is
        co-located, an env stage whose members are co-located, the co-located pool's generation stage."""
        if self.requires is not None and getattr(config, self.requires) is None:
            return []
        colocated = config.env.colocate_pool
        if self.hosts:
            return [colocated] if colocated is not None else []
        hosted = colocated is not None and any(self.name in s.hosts for s in STAGES.values())
        if not self.per_pool:
            return [] if hosted else [None]
        return [p for p in config.pools if not (hosted and p == colocated)]

    def group_ids(self, pool: str | None = None) -> tuple[str, ...]:
        return tuple(g.format(pool=pool) for g in self.groups)

    def scaling_groups(self, pool: str | None = None) -> tuple[str, ...]:
        groups = self.groups if self.scale_groups is None else self.scale_groups
        return tuple(g.format(pool=pool) for g in groups)

    def runs_stage(self, name: str) -> bool:
        """Whether this stage's members are members of stage ``name`` (itself, or one it hosts)."""
        return name == self.name or name in self.hosts

    def label(self) -> str:
        return self.short or self.name

    def member_name(self, pool: str | None, index: int) -> str:
        """A local member's process name (``env-1``, ``gen-default-0``; a single writer has one: its label)."""
        if self.single_writer:
            return self.label()
        return "-".join([self.label(), *([pool] if pool else []), str(index)])

    def command(self, pool: str | None = None) -> tuple[str, ...]:
        """The arguments of `rollart consume` for one member (of ``pool``)."""
        return (self.name, *(("--pool", pool) if self.per_pool else ()))

    def load(self):
        return _resolve(self.runner)

    def start_prelude(self, config) -> None:
        if self.prelude is not None:
            _resolve(self.prelude)(config)


def _resolve(name: str):
    module, _, function = name.partition(":")
    return getattr(importlib.import_module(module), function)


STAGES: dict[str, Stage] = {stage.name: stage for stage in (
    # Declaration order is start order: consumers first, the feeder (which releases work) last.
    Stage("generation", ("gen-{pool}",), "rollart.stages.generation:run_generation",
          "an LLM engine serving one pool's requests", per_pool=True, options=("pool",), short="gen",
          prelude="rollart.engines.forkserver:start_for_job", exit_at_stop=True),
    Stage("env", ("env", "env-actions"), "rollart.stages.env:run_env", "runs trajectories (groups of tasks)",
          scale_groups=("env",)),
    # In place of both where env.colocate_pool names a pool: each turn a function call, no socket.
    Stage("envgen", ("env", "env-actions", "gen-{pool}"), "rollart.stages.envgen:run_envgen",
          "an env member beside a generation member of the co-located pool, in one process", per_pool=True,
          options=("pool",), scale_groups=("env",), prelude="rollart.engines.forkserver:start_for_job",
          exit_at_stop=True, hosts=("generation", "env")),
    Stage("reward", ("reward", "reward-judge"), "rollart.stages.reward:run_reward", "scores completed trajectories"),
    Stage("trainer", ("trainer",), "rollart.stages.trainer:run_trainer", "trains and publishes weights",
          single_writer=True, runs="training", scale_groups=(), options=("resume",), exit_at_stop=True),
    Stage("eval", ("eval",), "rollart.stages.evaluation:run_eval", "held-out evaluation pinned to versions",
          single_writer=True, requires="eval", runs="training", scale_groups=()),
    Stage("feeder", (), "rollart.stages.feeder:run_feeder", "releases task groups under the staleness bound",
          single_writer=True, scale_groups=()),
)}


# Consumer groups of the local runners' observer (rollart.local.observer), not of a stage: `rollart run`
# and `rollart rollout` watch trajectories.completed and rewards.results (where the env scored it).
RUN_MONITOR = "run-monitor"
ROLLOUT_COLLECTOR = "rollout-collector"
OBSERVER_GROUPS = (RUN_MONITOR, ROLLOUT_COLLECTOR)


def stage_named(name: str) -> Stage:
    if name not in STAGES:
        raise ValueError(f"unknown stage {name!r}; choose one of {', '.join(STAGES)}")
    return STAGES[name]


def stage_of_process(process: str) -> str:
    """The stage of a local process name (``gen-default-0`` → generation, ``env-0`` → env)."""
    head = process.split("-", 1)[0]
    return next((s.name for s in STAGES.values() if s.label() == head), head)


def local_processes(config, *, training: bool, members: dict[str, int] | None = None,
                    resume: bool = False) -> list[tuple[str, tuple[str, ...]]]:
    """(process name, `rollart consume` arguments) of every member a local run starts, in start order:
    ``members`` per stage (default 1; generation: per pool; co-located members: as many as env members
    are asked for), the trainer with ``--resume`` if asked."""
    members = members or {}
    out: list[tuple[str, tuple[str, ...]]] = []
    for stage in STAGES.values():
        if stage.runs == "training" and not training:
            continue
        count = members.get(stage.name, members.get("env", 1) if "env" in stage.hosts else 1)
        for pool in stage.pools(config):
            for i in range(count):
                name = stage.member_name(pool, i)
                resumed = ("--resume",) if resume and "resume" in stage.options else ()
                out.append((name, (*stage.command(pool), *resumed)))
    return out


async def run_stage(name: str, config, stop, **options: Any) -> None:
    """Run one member of stage ``name`` until ``stop``; ``options`` are those the stage declares."""
    stage = stage_named(name)
    unknown = set(options) - set(stage.options)
    if unknown:
        raise ValueError(f"stage {name} takes no {', '.join(sorted(unknown))}")
    stage.start_prelude(config)
    await stage.load()(config, stop, **options)
