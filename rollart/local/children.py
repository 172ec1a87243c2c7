"""Child processes that die with the process that started them (the kernel's PR_SET_PDEATHSIG): the
local stack's services, a run's stages, a trainer's local ranks. A leaf: it imports nothing of
rollart, so the library (rollart.training.distributed) may use it without the local job's machinery.
"""

from __future__ import annotations

import os
import signal
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, TypeVar

T = TypeVar("T")


def _libc_prctl():
    import ctypes

    try:
        return ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):  # not Linux: the reaper (reap_stale) is the only guard
        return None


_PRCTL = _libc_prctl()  # looked up here: a forked child of a threaded parent must not dlopen
PR_SET_PDEATHSIG = 1


def die_with_parent(sig: int = signal.SIGKILL, parent: int | None = None) -> None:
    """In a child between fork and exec: have the kernel send ``sig`` when the thread that forked it
    exits. The setting survives exec (not of a set-uid binary). ``parent``: the forking process's
    pid; if it died before the prctl, the signal would never come, so leave now."""
    if _PRCTL is not None:
        _PRCTL(PR_SET_PDEATHSIG, int(sig))
    if parent is not None and os.getppid() != parent:
        os._exit(1)


_spawner: ThreadPoolExecutor | None = None
_spawner_lock = threading.Lock()


def on_lasting_thread(fork: Callable[[], T]) -> T:
    """Call ``fork`` (it starts a child that dies with its parent) on a thread that lives as long as
    this process. PR_SET_PDEATHSIG fires when the *thread* that forked the child exits, not the
    process: a broker restarted from asyncio.to_thread's worker (the chaos driver does) would die
    with that worker. The main thread lasts; any other caller hands the fork to one spawner thread,
    which runs until the interpreter exits."""
    global _spawner
    if threading.current_thread() is threading.main_thread():
        return fork()
    with _spawner_lock:
        if _spawner is None:
            _spawner = ThreadPoolExecutor(1, thread_name_prefix="rollart-spawner")
    return _spawner.submit(fork).result()
