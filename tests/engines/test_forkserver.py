"""Processes from rollart's fork server (vLLM's engine core) run in the environment they were started in."""

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
