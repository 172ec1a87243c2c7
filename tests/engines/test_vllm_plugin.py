"""The vLLM plugin that stops the engine's internal queue readers spinning on CPU cores."""

from __future__ import annotations

import time

import pytest
import zmq

from rollart.engines.vllm_plugin import NOTIFY_WAIT_CAP_MS, patch_spin_condition


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
    yield condition, yields, writer
    for socket in (condition.local_notify_socket, condition.read_cancel_socket, condition.write_cancel_socket,
                   writer.local_notify_socket):
        socket.close(linger=0)
    context.term()


def test_a_reader_sleeps_between_polls_instead_of_yielding_the_cpu(reader):
    condition, yields, _ = reader
    condition.record_read()
    condition.wait()
    assert yields, "vLLM's own reader spins with sched_yield while it is within busy_loop_s of a read"
    yields.clear()
    assert patch_spin_condition("sleep", 0.002) and patch_spin_condition("sleep", 0.002), \
        "idempotent (vLLM loads plugins per process)"
    condition.record_read()
    started = time.monotonic()
    for _ in range(5):
        condition.wait()
    assert not yields and time.monotonic() - started >= 5 * 0.002, "each poll slept instead of spinning"


@pytest.mark.parametrize("mode", ["notify", "sleep"])
def test_an_idle_reader_still_waits_for_the_writers_notification(reader, mode):
    condition, yields, _ = reader
    patch_spin_condition(mode, 0.002)
    condition.last_read = time.monotonic() - condition.busy_loop_s - 1  # idle: past the busy window
    started = time.monotonic()
    condition.wait(timeout_ms=200)  # nobody writes: the poller times out
    assert not yields and time.monotonic() - started >= 0.15


def notified(condition, writer) -> None:
    """The writer notifies after every write; wait until its subscription is up and one arrived."""
    deadline = time.monotonic() + 10
    while not condition.local_notify_socket.poll(0):
        assert time.monotonic() < deadline, "the writer's notification never reached the reader"
        writer.notify()
        time.sleep(0.01)


def test_a_busy_reader_blocks_on_the_writers_notification_and_takes_it(reader):
    condition, yields, writer = reader
    assert patch_spin_condition("notify", notify_after_s=0)
    condition.record_read()
    # nothing written: the reader blocks (no yield, no busy loop) until the cap, then looks again.
    # ZeroMQ's poll keeps time on a clock of 1 ms precision, so its cap may end up to 1 ms early
    # (CI once saw 1.3 of 2 ms).
    started = time.monotonic()
    condition.wait()
    assert not yields and time.monotonic() - started >= (NOTIFY_WAIT_CAP_MS - 1) / 1000 * 0.9
    notified(condition, writer)
    condition.record_read()
    condition.wait()
    assert not condition.local_notify_socket.poll(0), "the notification was taken: the next wait blocks again"
    assert not yields


def test_a_waits_first_stretch_is_polled_and_the_rest_blocks_on_the_notification(reader):
    condition, yields, writer = reader
    assert patch_spin_condition("notify", 0.0005, notify_after_s=0.2)
    notified(condition, writer)
    condition.record_read()  # a wait starts
    for _ in range(3):
        condition.wait()
        assert condition.local_notify_socket.poll(0), "inside the first stretch a wait polls: nothing taken"
    time.sleep(0.25)
    condition.wait()
    assert not condition.local_notify_socket.poll(0), "past it, the wait took the writer's notification"
    assert not yields


def test_an_unknown_engine_wait_names_the_variable(monkeypatch):
    from rollart.engines.vllm_plugin import ENGINE_WAIT_ENV, engine_wait

    monkeypatch.setenv(ENGINE_WAIT_ENV, "busy")
    with pytest.raises(ValueError, match=ENGINE_WAIT_ENV):
        engine_wait()
