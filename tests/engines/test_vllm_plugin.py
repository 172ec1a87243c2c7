"""The vLLM plugin that stops the engine's internal queue readers spinning on CPU cores."""

from __future__ import annotations

import time

import pytest
import zmq

from rollart.engines.vllm_plugin import patch_spin_condition


def test_the_plugin_is_registered_where_vllm_loads_general_plugins():
    from vllm.plugins import load_plugins_by_group

    plugins = load_plugins_by_group("vllm.general_plugins")
    assert "rollart_cpu_poll" in plugins and plugins["rollart_cpu_poll"].__module__ == "rollart.engines.vllm_plugin"


@pytest.fixture
def reader(monkeypatch):
    from vllm.distributed.device_communicators import shm_broadcast
    from vllm.utils.network_utils import get_open_zmq_ipc_path

    wait = shm_broadcast.SpinCondition.wait  # vLLM's own, even if an engine in this process loaded the plugin
    monkeypatch.setattr(shm_broadcast.SpinCondition, "wait", getattr(wait, "rollart_original", wait))
    yields = []
    monkeypatch.setattr(shm_broadcast, "sched_yield", lambda: yields.append(time.monotonic()))
    context = zmq.Context()
    address = get_open_zmq_ipc_path()
    writer = shm_broadcast.SpinCondition(is_reader=False, context=context, notify_address=address)
    condition = shm_broadcast.SpinCondition(is_reader=True, context=context, notify_address=address)
    yield condition, yields
    for socket in (condition.local_notify_socket, condition.read_cancel_socket, condition.write_cancel_socket,
                   writer.local_notify_socket):
        socket.close(linger=0)
    context.term()


def test_a_reader_sleeps_between_polls_instead_of_yielding_the_cpu(reader):
    condition, yields = reader
    condition.record_read()
    condition.wait()
    assert yields, "vLLM's own reader spins with sched_yield while it is within busy_loop_s of a read"
    yields.clear()
    assert patch_spin_condition(0.002) and patch_spin_condition(0.002), "idempotent (vLLM loads plugins per process)"
    condition.record_read()
    started = time.monotonic()
    for _ in range(5):
        condition.wait()
    assert not yields and time.monotonic() - started >= 5 * 0.002, "each poll slept instead of spinning"


def test_an_idle_reader_still_waits_for_the_writers_notification(reader):
    condition, yields = reader
    patch_spin_condition(0.002)
    condition.last_read = time.monotonic() - condition.busy_loop_s - 1  # idle: past the busy window
    started = time.monotonic()
    condition.wait(timeout_ms=200)  # nobody writes: the poller times out
    assert not yields and time.monotonic() - started >= 0.15
