"""A local run's stages, started and kept running as Kubernetes would: every member of every stage
the run needs, in start order; a stage that dies is restarted (the trainer with ``--resume``, from
its last checkpoint) up to a limit; the CPU plan of stages sharing one machine."""

from __future__ import annotations

import json
import logging
import os
from collections import Counter
from pathlib import Path

from rollart.config import ConfigError, RollartConfig, StageScheduling
from rollart.local.processes import StageProcesses, apply_scheduling, may_raise_priority
from rollart.stages.registry import STAGES, local_processes

log = logging.getLogger(__name__)


def start_stages(procs: StageProcesses, cfg: RollartConfig, members: dict[str, int], *, training: bool,
                 resume: bool = False) -> None:
    """Every member the run needs (``members`` per stage; a rollout: no trainer, no eval stage)."""
    for name, argv in local_processes(cfg, training=training, members=members, resume=resume):
        procs.start(name, *argv)


def supervise(procs: StageProcesses, restarts: Counter, max_restarts: int) -> None:
    """Restart stages that died (the trainer from its checkpoint); give up after max_restarts."""
    for name in procs.failed():
        if restarts[name] >= max_restarts:
            raise RuntimeError(f"stage {name} failed {restarts[name] + 1} times; last log lines:\n" + procs.tail(name))
        restarts[name] += 1
        process = procs.stages[name]
        argv = process.argv[process.argv.index("consume") + 1:]
        argv = [a for a in argv if a not in ("--config", str(procs.config_path))]
        if name == "trainer" and "--resume" not in argv:
            argv.append("--resume")
        procs.start(name, *argv)


def settle_startups(procs: StageProcesses) -> list[str]:
    """Members whose readiness probe passed since the last call, each moved (every thread of it and of
    its children) from its stage's start-up policy to its run scheduling. Lowering a priority needs no
    privilege, so a start-up policy above the run's works for any user."""
    settled = []
    for name, setting in list(procs.starting.items()):
        process = procs.stages.get(name)
        if process is None or not process.alive():  # gone; a restart puts it back under its start-up policy
            del procs.starting[name]
        elif procs.ready(name):
            threads = schedule_threads([process.proc.pid], setting, os.nice(0))
            del procs.starting[name]
            settled.append(name)
            log.info("%s is ready: %d threads now %s", name, threads, setting.policy)
    return settled


def write_pids(procs: StageProcesses, path: Path) -> None:
    """Which process is which stage (for operators, and for tests that kill one)."""
    pids = {name: p.proc.pid for name, p in procs.stages.items() if p.alive()}
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(pids))
    tmp.replace(path)


def shared_machine_threads(config: RollartConfig) -> dict[str, str]:
    """The CPU plan of a run whose stages share one machine: the trainer gets half the cores for
    torch's intra-op threads unless ``trainer.torch_threads`` says otherwise (the engine's worker
    binds its own OpenMP threads and torch on every core competes with it: on 2 cores a 40-step demo
    trained its steps in 2.0-2.1 s with 1 thread against 2.7-2.8 s with 2; over 150 steps the two
    means were the same, within this machine's noise; see the README's CPU plan)."""
    if config.trainer.torch_threads is not None:
        return {}
    return {"ROLLART_TRAINER_TORCH_THREADS": str(max(1, (os.cpu_count() or 2) // 2))}


STACK = "stack"  # machine.scheduling's key for the local stack's services (broker, Redis, Mooncake)


def stage_scheduling(config: RollartConfig) -> dict[str, StageScheduling]:
    """``machine.scheduling``, its keys held to the registry's stages and ``stack`` (a typo would
    otherwise schedule nothing differently); envgen, unless named, as generation (its engine's start is
    the run's critical path, as that stage's is)."""
    unknown = sorted(set(config.machine.scheduling) - set(STAGES) - {STACK})
    if unknown:
        raise ConfigError(f"machine.scheduling: {', '.join(unknown)} is not a stage; the stages are "
                          f"{', '.join(STAGES)}, and {STACK} is the local stack's services")
    settings = dict(config.machine.scheduling)
    for stage in STAGES.values():  # a stage hosting others, not named, runs as the first of them named does
        inherited = next((settings[h] for h in stage.hosts if h in settings), None)
        if stage.name not in settings and inherited is not None and stage.pools(config):
            settings[stage.name] = inherited
    return {stage: _startup_allowed(stage, setting) for stage, setting in settings.items()}


def _startup_allowed(stage: str, setting: StageScheduling) -> StageScheduling:
    """``setting``, without its start-up policy where the runner could not take the stage out of it:
    leaving SCHED_IDLE for a fair policy needs CAP_SYS_NICE (or RLIMIT_NICE)."""
    if setting.startup_policy != "idle" or setting.policy == "idle" or may_raise_priority(os.nice(0) + setting.nice):
        return setting
    log.warning("machine.scheduling.%s.startup_policy: idle is ignored; moving the stage out of SCHED_IDLE once "
                "it is ready needs CAP_SYS_NICE, which this process lacks: it starts as policy %s", stage, setting.policy)
    return setting.model_copy(update={"startup_policy": None})


def schedule_threads(pids: list[int], setting: StageScheduling, base_nice: int) -> int:
    """Every thread of ``pids`` and of their descendants under ``setting`` (niceness relative to
    ``base_nice``); returns how many threads were set. Threads that end meanwhile are skipped."""
    from rollart.proctree import descendants, process_table

    table = process_table()
    done = 0
    for pid in {p for root in pids for p in (root, *descendants(root, table))}:
        try:
            tids = [int(t) for t in os.listdir(f"/proc/{pid}/task")]
        except OSError:
            continue
        for tid in tids:
            try:
                apply_scheduling(tid, setting, base_nice + setting.nice)
            except ProcessLookupError:
                continue
            done += 1
    return done


def own_stack_pids(stack_dir: Path) -> list[int]:
    """The services of the stack this process started in ``stack_dir``: none when the run uses
    configured endpoints or another's stack, or the folder holds a dead run's record."""
    from rollart.local.stack import STACK_FILE
    from rollart.local.state import StackState

    state = StackState.read(stack_dir / STACK_FILE)
    if state is None or state.owner_pid != os.getpid():
        return []
    return [p for p in state.pids() if p is not None]


def schedule_stack(config: RollartConfig, stack_dir: Path) -> int:
    """This process's own stack services in ``stack_dir`` under ``machine.scheduling.stack``:
    threads set. Set once they serve: a thread a service starts later inherits its creator's setting."""
    setting = config.machine.scheduling.get(STACK)
    return 0 if setting is None else schedule_threads(own_stack_pids(stack_dir), setting, os.nice(0))
