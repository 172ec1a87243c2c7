"""Run stages as separate processes on this machine (the local job runner), same code as production.

Each stage is ``python -m rollart.cli consume <stage> --config CONFIG`` with the endpoints and the
job name passed in the environment, its output in ``<log_dir>/<name>.log``. Stopping sends SIGTERM
(graceful: drain, commit, exit) and SIGKILL after a grace period.
"""

from __future__ import annotations

import ctypes
import errno
import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from rollart.config import StageScheduling
from rollart.endpoints import Endpoints
from rollart.local.children import die_with_parent, on_lasting_thread


# machine.scheduling's policies (StageScheduling.policy) as Linux's
POLICIES = {"normal": os.SCHED_OTHER, "batch": os.SCHED_BATCH, "idle": os.SCHED_IDLE}


class _SchedAttr(ctypes.Structure):
    """Linux's struct sched_attr (sched_setattr(2))."""

    _fields_ = [("size", ctypes.c_uint32), ("sched_policy", ctypes.c_uint32), ("sched_flags", ctypes.c_uint64),
                ("sched_nice", ctypes.c_int32), ("sched_priority", ctypes.c_uint32),
                ("sched_runtime", ctypes.c_uint64), ("sched_deadline", ctypes.c_uint64),
                ("sched_period", ctypes.c_uint64), ("sched_util_min", ctypes.c_uint32),
                ("sched_util_max", ctypes.c_uint32)]


# (sched_setattr, sched_getattr) by machine; Python's os module wraps neither
_SCHED_ATTR_CALLS = {"x86_64": (314, 315), "aarch64": (274, 275)}


def _sched_attr_call(get: bool, tid: int, attr: _SchedAttr) -> None:
    """sched_getattr(tid, attr, size, 0) when ``get``, else sched_setattr(tid, attr, 0)."""
    calls = _SCHED_ATTR_CALLS.get(os.uname().machine)
    if calls is None:
        raise OSError(f"sched_setattr: no syscall number known for {os.uname().machine}")
    libc = ctypes.CDLL(None, use_errno=True)
    size = (ctypes.sizeof(_SchedAttr),) if get else ()
    if libc.syscall(calls[get], tid, ctypes.byref(attr), *size, 0) != 0:
        err = ctypes.get_errno()
        raise (ProcessLookupError if err == errno.ESRCH else OSError)(err, os.strerror(err))


def may_raise_priority(nice: int) -> bool:
    """Whether this process may raise a thread of its children to niceness ``nice`` (below the thread's
    own), or move it at ``nice`` from ``SCHED_IDLE`` back to a fair policy: sched_setscheduler(2) and
    setpriority(2) allow both with CAP_SYS_NICE, or where RLIMIT_NICE allows that niceness."""
    import resource

    if 20 - nice <= resource.getrlimit(resource.RLIMIT_NICE)[0]:
        return True
    with open("/proc/self/status") as status:
        effective = next((int(line.split()[1], 16) for line in status if line.startswith("CapEff:")), 0)
    return bool(effective >> 23 & 1)  # CAP_SYS_NICE


def thread_slice_ns(tid: int) -> int:
    """The time slice thread ``tid`` runs with (EEVDF's sched_runtime; its default when none was asked for)."""
    attr = _SchedAttr()
    _sched_attr_call(True, tid, attr)
    return attr.sched_runtime


def apply_scheduling(tid: int, setting: StageScheduling, nice: int) -> None:
    """Thread ``tid`` (0: this one) under ``setting``'s policy and time slice at niceness ``nice``."""
    slice_ns = 0 if setting.slice_ms is None else int(setting.slice_ms * 1_000_000)  # 0: the kernel's default
    _sched_attr_call(False, tid, _SchedAttr(size=ctypes.sizeof(_SchedAttr), sched_policy=POLICIES[setting.policy],
                                            sched_nice=nice, sched_runtime=slice_ns))
    os.setpriority(os.PRIO_PROCESS, tid, nice)  # sched_setattr to SCHED_IDLE keeps the old niceness (and slice)


def _in_child(cpus: tuple[int, ...] | None, parent: int, scheduling: StageScheduling) -> None:
    """In the stage process before exec: SIGTERM it when the runner dies (a runner killed with
    SIGKILL would otherwise leave every stage running, detached in its own session), pin it, and
    schedule it as ``machine.scheduling`` says (its children inherit all three)."""
    die_with_parent(signal.SIGTERM, parent)
    if cpus:
        os.sched_setaffinity(0, cpus)
    if scheduling != StageScheduling():  # the runner's own scheduling is inherited as it is
        apply_scheduling(0, scheduling, os.nice(0) + scheduling.nice)


@dataclass
class StageProcess:
    name: str
    argv: list[str]
    log: Path
    proc: subprocess.Popen | None = None

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def reap_group(self) -> None:
        """SIGKILL whatever is left of the stage's process group: a stage killed with SIGKILL leaves
        its children (vLLM's engine core and workers, gigabytes) orphaned otherwise."""
        if self.proc is None:
            return
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass


@dataclass
class StageProcesses:
    config_path: Path
    endpoints: Endpoints
    job: str
    log_dir: Path
    extra_env: dict[str, str] = field(default_factory=dict)
    stages: dict[str, StageProcess] = field(default_factory=dict)
    # When set, each stage serves /metrics on a port of its own (kept across restarts) and this file
    # lists them in Prometheus' file_sd format, so a local Prometheus can scrape the run.
    metrics_targets: Path | None = None
    metrics_ports: dict[str, tuple[str, int]] = field(default_factory=dict)  # name -> (stage, port)
    # stage -> CPUs its processes (and their children: vLLM's engine core) may run on, and as many
    # compute threads (torch, OpenMP, vLLM's CPU binding) as CPUs
    cpu_affinity: dict[str, tuple[int, ...]] = field(default_factory=dict)
    scheduling: dict[str, StageScheduling] = field(default_factory=dict)  # stage -> machine.scheduling
    # Members still under their stage's start-up policy (StageScheduling.startup_policy), with the
    # scheduling they take once their readiness probe passes (rollart.local.supervision.settle_startups).
    # Only where stages serve their probes (metrics_targets); elsewhere they start under their run's.
    starting: dict[str, StageScheduling] = field(default_factory=dict)
    # (stage, pool) -> environment of that stage only (its own Kafka login on a secured stack)
    stage_env: dict[tuple[str, str | None], dict[str, str]] = field(default_factory=dict)
    # Members scaled away (SIGTERM sent: they drain, commit and leave their groups), no longer
    # supervised; name -> (process, SIGKILL deadline)
    retiring: dict[str, tuple[StageProcess, float]] = field(default_factory=dict)

    def env(self) -> dict[str, str]:
        env = dict(os.environ)
        env.update(ROLLART_KAFKA_BOOTSTRAP=self.endpoints.kafka_bootstrap, ROLLART_REDIS_URL=self.endpoints.redis_url,
                   ROLLART_KAFKA_BROKER=self.endpoints.broker, ROLLART_JOB=self.job, PYTHONUNBUFFERED="1")
        if self.endpoints.mooncake_master and self.endpoints.mooncake_metadata:
            env.update(ROLLART_MOONCAKE_MASTER=self.endpoints.mooncake_master,
                       ROLLART_MOONCAKE_METADATA_SERVER=self.endpoints.mooncake_metadata)
        env.update(self.extra_env)
        return env

    def start(self, name: str, stage: str, *args: str) -> StageProcess:
        self.log_dir.mkdir(parents=True, exist_ok=True)
        if name in self.stages:  # a restart: clear out what the dead member left behind
            self.stages[name].reap_group()
        argv = [sys.executable, "-m", "rollart.cli", "consume", stage, "--config", str(self.config_path), *args]
        process = StageProcess(name, argv, self.log_dir / f"{name}.log")
        env = self.env()
        env["ROLLART_MEMBER"] = name  # stable across restarts: a restarted member fences its predecessor
        pool = args[args.index("--pool") + 1] if "--pool" in args else None
        env.update(self.stage_env.get((stage, pool), {}))
        cpus, scheduling = self.cpu_affinity.get(stage), self.scheduling.get(stage, StageScheduling())
        self.starting.pop(name, None)
        if self.metrics_targets is not None and scheduling.startup_policy is not None:
            self.starting[name], scheduling = scheduling, scheduling.at_startup()
        if cpus:
            env.update(OMP_NUM_THREADS=str(len(cpus)), VLLM_CPU_OMP_THREADS_BIND=",".join(map(str, cpus)))
        if self.metrics_targets is not None:
            env.update(ROLLART_METRICS_PORT=str(self._metrics_port(name, stage)), ROLLART_METRICS_HOST="127.0.0.1")
        parent = os.getpid()

        # A process group of its own (the shell's Ctrl-C does not reach it; reap_group kills the group) in
        # the runner's session: Linux's autogroup shares the CPU between sessions before their threads,
        # so in a session of its own a stage got a session's share whatever machine.scheduling said.
        def popen() -> subprocess.Popen:
            with open(process.log, "ab") as out:
                return subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, env=env,
                                        stdin=subprocess.DEVNULL, process_group=0,
                                        preexec_fn=lambda: _in_child(cpus, parent, scheduling))
        process.proc = on_lasting_thread(popen)  # the death signal follows the forking thread
        self.stages[name] = process
        return process

    def ready(self, name: str, timeout_s: float = 0.25) -> bool:
        """Whether member ``name`` answers its readiness probe (``/readyz``, rollart.health) with 200."""
        if name not in self.metrics_ports:
            return False
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.metrics_ports[name][1]}/readyz",
                                        timeout=timeout_s) as answer:
                return bool(answer.status == 200)
        except OSError:  # refused (not serving yet), 503 (HTTPError), or too slow to answer
            return False

    def _metrics_port(self, name: str, stage: str) -> int:
        from rollart.local.stack import free_port

        if name not in self.metrics_ports:
            self.metrics_ports[name] = (stage, free_port(taken={port for _, port in self.metrics_ports.values()}))
            targets = [{"targets": [f"127.0.0.1:{port}"], "labels": {"instance": n, "stage": s}}
                       for n, (s, port) in self.metrics_ports.items()]
            self.metrics_targets.parent.mkdir(parents=True, exist_ok=True)
            tmp = self.metrics_targets.with_suffix(".tmp")
            tmp.write_text(json.dumps(targets, indent=1))
            tmp.replace(self.metrics_targets)  # Prometheus re-reads file_sd files on change
        return self.metrics_ports[name][1]

    def kill(self, name: str, sig: int = signal.SIGKILL, process: StageProcess | None = None) -> None:
        process = process or self.stages[name]
        if process.alive():
            process.proc.send_signal(sig)
            process.proc.wait()
        if sig == signal.SIGKILL:
            process.reap_group()

    def retire(self, name: str, grace_s: float = 60.0) -> None:
        """Stop a member for good, gracefully: SIGTERM now (the stage drains what it holds, commits and
        leaves its groups, so the others take its partitions over), SIGKILL if it is still there after
        ``grace_s`` (:meth:`reap_retired`). It is not restarted."""
        process = self.stages.pop(name)
        if process.alive():
            process.proc.send_signal(signal.SIGTERM)
        self.retiring[name] = (process, time.monotonic() + grace_s)

    def reap_retired(self) -> dict[str, int | None]:
        """Retired members that are gone now, with their exit codes (SIGKILLed past their grace)."""
        gone = {}
        for name, (process, deadline) in list(self.retiring.items()):
            if process.alive() and time.monotonic() > deadline:
                self.kill(name, signal.SIGKILL, process)
            if not process.alive():
                process.reap_group()
                gone[name] = process.proc.returncode if process.proc else None
                del self.retiring[name]
        return gone

    def failed(self) -> list[str]:
        """Stages that exited with an error (a feeder that released all its groups exits 0)."""
        return [name for name, p in self.stages.items() if p.proc is not None and p.proc.poll() not in (None, 0)]

    def stop_all(self, grace_s: float = 20.0, budget_s: float = 40.0,
                 last_grace_s: float = 2.0) -> dict[str, int | None]:
        """SIGTERM each stage, the last started first (the feeder before the env stage before the
        engines), waiting for each so upstream work drains into live downstream stages. Each waits at
        most ``grace_s``, and all together ``budget_s``: stages told to stop while they import torch
        or load an engine take their time, and one at a time they would hold a Ctrl-C for minutes.
        Past the budget each remaining stage gets ``last_grace_s``; then SIGKILL (nothing is lost:
        what a stage had not committed is redelivered)."""
        for name, (process, _) in self.retiring.items():  # already leaving: its grace ends now
            self.stages.setdefault(name, process)
        self.retiring.clear()
        deadline = time.monotonic() + budget_s
        for process in reversed(list(self.stages.values())):
            if not process.alive():
                continue
            process.proc.send_signal(signal.SIGTERM)
            try:
                process.proc.wait(min(grace_s, max(last_grace_s, deadline - time.monotonic())))
            except subprocess.TimeoutExpired:
                process.proc.kill()
                process.proc.wait()
        for process in self.stages.values():
            process.reap_group()  # children a stage did not take down with it
        return {name: p.proc.returncode if p.proc else None for name, p in self.stages.items()}

    def tail(self, name: str, lines: int = 30) -> str:
        try:
            return "\n".join(self.stages[name].log.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""


def write_prometheus_config(directory: Path, scrape_interval_s: float = 5.0) -> Path:
    """``prometheus.yml`` scraping every stage of the run (``prometheus --config.file DIR/prometheus.yml``);
    returns the targets file the stage runner keeps current (``StageProcesses.metrics_targets``)."""
    directory.mkdir(parents=True, exist_ok=True)
    config = {"global": {"scrape_interval": f"{scrape_interval_s:g}s", "evaluation_interval": f"{scrape_interval_s:g}s"},
              "scrape_configs": [{"job_name": "rollart", "honor_labels": True,  # keep our `job` label
                                  "file_sd_configs": [{"files": ["targets.json"], "refresh_interval": "5s"}]}]}
    (directory / "prometheus.yml").write_text(json.dumps(config, indent=1))  # JSON is YAML
    return directory / "targets.json"
