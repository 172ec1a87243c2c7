"""Processes from rollart's fork server (vLLM's engine core and CPU worker) run in the environment they were
started in, with the preloads and the OpenMP binding vLLM gives the processes it spawns."""

from __future__ import annotations

import os

from rollart.engines import forkserver


def _environment(names: list[str], queue) -> None:
    import setproctitle

    setproctitle.setproctitle("VLLM::Test")  # as vLLM names its engine core
    with open(f"/proc/{os.getpid()}/cmdline") as cmdline:
        queue.put({**{name: os.environ.get(name) for name in names}, "title": cmdline.read().strip("\0 ")})


def test_a_forked_process_has_the_environment_of_its_start_not_the_servers(monkeypatch):
    """The server is started first (as an engine's start does); variables set and removed after it
    (vLLM sets some just before it starts its engine core) are what the child sees, and the child can
    still set its process title (rollart finds the engine core by it)."""
    monkeypatch.setenv("ROLLART_TEST_REMOVED", "server")
    forkserver.start_server()
    monkeypatch.setenv("ROLLART_TEST_SET", "at start")
    monkeypatch.delenv("ROLLART_TEST_REMOVED")
    context = forkserver.engine_core_context()
    queue = context.Queue()
    child = context.Process(target=_environment, args=(["ROLLART_TEST_SET", "ROLLART_TEST_REMOVED"], queue))
    child.start()
    seen = queue.get(timeout=60)
    child.join(timeout=60)
    assert child.exitcode == 0
    assert seen == {"ROLLART_TEST_SET": "at start", "ROLLART_TEST_REMOVED": None, "title": "VLLM::Test"}


def test_an_engine_core_start_method_can_be_switched_back_to_vllms_own():
    import vllm.utils.system_utils as system_utils
    import vllm.v1.engine.utils as engine_utils

    forkserver.start_engine_core_with("forkserver")
    assert engine_utils.get_mp_context().get_start_method() == "forkserver"
    forkserver.start_engine_core_with("spawn")
    try:
        assert engine_utils.get_mp_context is system_utils.get_mp_context  # vLLM's own (spawn on CPU)
    finally:
        forkserver.start_engine_core_with("forkserver")


def _threads(queue) -> None:
    import torch

    torch.ones(2**18).add_(1.0)  # a parallel region, as the worker's first forward pass is
    queue.put({"torch": torch.get_num_threads(), "parent": os.getppid(),
               "affinity": {int(t): sorted(os.sched_getaffinity(int(t))) for t in os.listdir("/proc/self/task")}})


def _start_worker(queue) -> None:
    """An engine core's part: start a worker as vLLM's executor would, from the context rollart gives it."""
    forkserver._use_inherited_server()
    os.environ["OMP_NUM_THREADS"], os.environ["GOMP_CPU_AFFINITY"] = "1", "1"
    worker = forkserver.WorkerContext().Process(target=_threads, args=(queue,))
    worker.start()
    worker.join(timeout=60)
    queue.put({"exitcode": worker.exitcode, "core": os.getpid(), "server": os.getppid()})


def _worker_threads(environ: dict[str, str], monkeypatch) -> dict:
    forkserver.start_server()
    for name in ("OMP_NUM_THREADS", "GOMP_CPU_AFFINITY", "OMP_PLACES", "OMP_PROC_BIND", "KMP_AFFINITY"):
        monkeypatch.delenv(name, raising=False)
    for name, value in environ.items():
        monkeypatch.setenv(name, value)
    context = forkserver.WorkerContext()
    queue = context.Queue()
    worker = context.Process(target=_threads, args=(queue,))
    worker.start()
    seen = queue.get(timeout=60)
    worker.join(timeout=60)
    assert worker.exitcode == 0
    return seen


def test_a_forked_worker_binds_one_openmp_thread_per_cpu_as_vllm_asks(monkeypatch):
    """vLLM binds a CPU worker's OpenMP threads through variables the OpenMP runtime reads as it loads,
    which in a fork it did in the server: rollart applies them. GOMP_CPU_AFFINITY "0 1": two threads,
    the main one (OpenMP's thread 0) on CPU 0, the pool's one on CPU 1."""
    if len(os.sched_getaffinity(0)) < 2:
        raise AssertionError("this test needs 2 CPUs (the project's machines have them)")
    seen = _worker_threads({"OMP_NUM_THREADS": "2", "GOMP_CPU_AFFINITY": "0 1"}, monkeypatch)
    assert seen["torch"] == 2
    pinned = sorted(cpus for cpus in seen["affinity"].values() if len(cpus) == 1)
    assert pinned == [[0], [1]], seen["affinity"]


def test_a_forked_worker_on_openmp_places_keeps_its_threads_on_the_set(monkeypatch):
    seen = _worker_threads({"OMP_NUM_THREADS": "1", "OMP_PLACES": "{1}", "OMP_PROC_BIND": "true"}, monkeypatch)
    assert seen["torch"] == 1
    assert set(map(tuple, seen["affinity"].values())) == {(1,)}, seen["affinity"]


def test_an_engine_core_forks_its_worker_from_the_same_server():
    """The engine core (a child of the server) asks the server for its worker rather than starting a
    server of its own (which would import everything again): the worker is the core's sibling, with
    the core's binding."""
    forkserver.start_server()
    context = forkserver.engine_core_context()
    queue = context.Queue()
    core = context.Process(target=_start_worker, args=(queue,))
    core.start()
    worker, started = queue.get(timeout=60), queue.get(timeout=60)
    core.join(timeout=60)
    assert core.exitcode == 0 and started["exitcode"] == 0
    assert worker["parent"] == started["server"] != started["core"]
    assert worker["torch"] == 1 and [0] not in worker["affinity"].values()
    assert set(map(tuple, worker["affinity"].values())) == {(1,)}, worker["affinity"]


def test_the_server_preloads_what_vllms_cpu_platform_preloads():
    """vLLM's CPU platform preloads PyTorch's OpenMP runtime into the processes it starts; the server's
    children are forked from a process that had it so (one OpenMP runtime for every library)."""
    import multiprocessing.forkserver

    assert forkserver.vllm_on_cpu()
    preloads = forkserver.cpu_preloads()
    assert any("libgomp" in p for p in preloads), preloads
    before = os.environ.get("LD_PRELOAD")
    forkserver.start_server()
    assert os.environ.get("LD_PRELOAD") == before  # this process's own is left as it was
    server = multiprocessing.forkserver._forkserver._forkserver_pid
    with open(f"/proc/{server}/environ", "rb") as environ:
        variables = dict(v.split(b"=", 1) for v in environ.read().split(b"\0") if b"=" in v)
    assert set(preloads) <= set(variables[b"LD_PRELOAD"].decode().split(":"))
