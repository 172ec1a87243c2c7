"""vLLM's engine core forked from a server that has vLLM imported, instead of spawned afresh.

vLLM starts its engine core (and on CPU, below it, a worker) as ``spawn``ed processes: each a fresh
interpreter that imports torch and vLLM again before it does anything, ~6 s of one core here, and the
engine core's start is on every engine's critical path. Python's ``forkserver`` start method takes that
import off it: a server process started at the beginning of :meth:`VLLMEngine.start` imports vLLM's
engine core modules while the engine's own process imports vLLM (two cores at once), then forks the
engine core from that state. vLLM's own API server does the same (``VLLM_WORKER_MULTIPROC_METHOD=
forkserver``), but ``AsyncLLM`` has no such option and vLLM's CPU platform forces ``spawn``, so the
engine core's context is set here (``generation.engine_core_start``). The worker is still spawned by
the engine core: on CPU its OpenMP binding comes from variables the OpenMP runtime reads when it loads.

A forked child starts with the server's environment, but vLLM sets variables for the engine core just
before it starts it: :class:`EnvironProcess` carries the starting process's environment over.
"""

from __future__ import annotations

import multiprocessing.context
import multiprocessing.forkserver
import os
from typing import Any, Callable

# What the engine core process imports to run (EngineCoreProc and the executor it builds); the server
# imports them once, before it forks the first child.
PRELOAD = ("vllm.v1.engine.core", "vllm.v1.executor.multiproc_executor")


class EnvironProcess(multiprocessing.context.ForkServerProcess):
    """A process forked by the server that runs with the environment of the process that started it, as
    of :meth:`start` (the object itself is pickled over to the child)."""

    _environ: dict[str, str]

    def start(self) -> None:
        self._environ = dict(os.environ)
        super().start()

    def run(self) -> None:
        _ready_process_title()
        os.environ.clear()
        os.environ.update(self._environ)
        super().run()


def _ready_process_title() -> None:
    """setproctitle (vLLM names its processes with it: ``VLLM::EngineCore``) finds the room for a title
    in the process's original environment block, which swapping the environment leaves behind: it has
    to look before that happens."""
    try:
        import setproctitle
    except ImportError:
        return
    setproctitle.getproctitle()


class EnvironForkServerContext(multiprocessing.context.ForkServerContext):
    Process = EnvironProcess  # type: ignore[assignment]


def start_server() -> None:
    """Start this process's fork server, importing :data:`PRELOAD` in it (in the background: a child
    asked for meanwhile is forked once the imports are done). Idempotent."""
    multiprocessing.forkserver.set_forkserver_preload(list(PRELOAD))
    multiprocessing.forkserver.ensure_running()


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
