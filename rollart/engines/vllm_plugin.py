"""A vLLM general plugin (entry point ``vllm.general_plugins``): vLLM loads it in each of its
processes (the engine core and its workers), which is where this change has to happen.

On CPU, the engine core and its worker process pass every step through a shared-memory queue whose
reader, for a second after each read, polls with ``sched_yield`` (vLLM's ``SpinCondition``): two
processes that each take a core while the engine is busy or just idle. On a small machine those
cores are the ones the env, generation, trainer and bus clients need. ``generation.engine_wait``
(the engine passes it as ``ROLLART_VLLM_ENGINE_WAIT``) says how a reader waits there instead:

* ``notify`` (default): it polls with the ``sleep`` mode's sleep for the first
  ``generation.engine_notify_after_us`` of a wait (``ROLLART_VLLM_NOTIFY_AFTER_US``; the answer to a
  short step comes at a poll's pace), then blocks on the notification the writer already sends after
  every write (vLLM's idle branch, on the same ZeroMQ socket), at most ``NOTIFY_WAIT_CAP_MS`` before
  it looks again. A long wait costs one wake-up instead of one per poll: about half the engine's
  context switches of ``sleep``, and a demo step 0.87-0.92x as long, since the trainer shares the
  cores (README, CPU plan; ``rollart bench engine-wait``). Without the polls first, an engine alone
  answers more slowly: a notification crosses ZeroMQ's I/O threads.
* ``sleep``: a ``generation.engine_poll_sleep_us`` sleep between polls (``ROLLART_VLLM_POLL_SLEEP_US``;
  `rollart bench pipeline-efficiency` measured 0.61 with the spin and 0.75 with a 200 µs sleep).
* ``spin``: vLLM's own ``sched_yield`` loop.

GPUs are left as they are: there the spin is what keeps a step's launch latency low.

Also on CPU, with ``generation.weight_reload: direct`` (``ROLLART_VLLM_KEEP_GEMM_WEIGHTS=1``), linear
layers keep their plain weights beside the packed GEMM copies (:func:`keep_gemm_weights`).
"""

from __future__ import annotations

import logging
import os
import time
from typing import Callable

log = logging.getLogger(__name__)

ENGINE_WAIT_ENV = "ROLLART_VLLM_ENGINE_WAIT"
POLL_SLEEP_ENV = "ROLLART_VLLM_POLL_SLEEP_US"
NOTIFY_AFTER_ENV = "ROLLART_VLLM_NOTIFY_AFTER_US"
KEEP_GEMM_WEIGHTS_ENV = "ROLLART_VLLM_KEEP_GEMM_WEIGHTS"  # "1": generation.weight_reload is direct
DEFAULT_ENGINE_WAIT = "notify"
DEFAULT_POLL_SLEEP_US = 200
DEFAULT_NOTIFY_AFTER_US = 1000
ENGINE_WAITS = ("notify", "sleep", "spin")
# The writer notifies after every write, so the cap only bounds a wake-up that was somehow missed.
NOTIFY_WAIT_CAP_MS = 2


def engine_wait() -> str:
    mode = os.environ.get(ENGINE_WAIT_ENV, DEFAULT_ENGINE_WAIT)
    if mode not in ENGINE_WAITS:
        raise ValueError(f"{ENGINE_WAIT_ENV}={mode!r}: expected one of {', '.join(ENGINE_WAITS)}")
    return mode


def poll_sleep_s() -> float:
    return max(0, int(os.environ.get(POLL_SLEEP_ENV, DEFAULT_POLL_SLEEP_US))) / 1e6


def notify_after_s() -> float:
    return max(0, int(os.environ.get(NOTIFY_AFTER_ENV, DEFAULT_NOTIFY_AFTER_US))) / 1e6


def register() -> None:
    """Called by vLLM's ``load_general_plugins`` in every vLLM process."""
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return
    if os.environ.get(KEEP_GEMM_WEIGHTS_ENV) == "1":
        keep_gemm_weights()
    mode, sleep_s = engine_wait(), poll_sleep_s()
    if mode == "spin" or (mode == "sleep" and sleep_s == 0):
        return
    patch_spin_condition(mode, sleep_s, notify_after_s())


def keep_gemm_weights() -> bool:
    """Linear layers keep their plain weight beside the packed copy vLLM's CPU backend makes at load
    (it drops the weight to save memory), so that ``generation.weight_reload: direct`` can copy a new
    version into it and re-pack (rollart.engines.weight_loader). False (and a warning) if this vLLM
    has no such packing step. Idempotent."""
    try:
        from vllm.model_executor.layers import utils
    except ImportError:
        utils = None
    dispatch = getattr(utils, "dispatch_cpu_unquantized_gemm", None)
    if dispatch is None:
        log.warning("rollart: vLLM's dispatch_cpu_unquantized_gemm is gone; weights reload layerwise")
        return False
    if getattr(dispatch, "rollart_keeps_weight", False):
        return True

    def keeping(layer, remove_weight: bool) -> None:
        dispatch(layer, remove_weight=False)

    keeping.rollart_keeps_weight = True  # type: ignore[attr-defined]
    utils.dispatch_cpu_unquantized_gemm = keeping  # the linear method imports it at each load
    return True


def patch_spin_condition(mode: str, sleep_s: float = DEFAULT_POLL_SLEEP_US / 1e6,
                         notify_after_s: float = DEFAULT_NOTIFY_AFTER_US / 1e6) -> bool:
    """Make the shared-memory queue's reader wait as ``mode`` says (``notify`` or ``sleep``) while it
    would busy-wait; False (and a warning) if this vLLM has no such reader (the queue changed: nothing
    is patched). Idempotent: the first patch in a process stays."""
    try:
        from vllm.distributed.device_communicators.shm_broadcast import SpinCondition
    except ImportError:
        SpinCondition = None
    if SpinCondition is None or not hasattr(SpinCondition, "wait"):
        log.warning("rollart: vLLM's SpinCondition is gone; its readers keep their own busy-wait")
        return False
    if getattr(SpinCondition.wait, "rollart_engine_wait", None) is not None:
        return True
    spin_wait = SpinCondition.wait
    busy_wait = _polled_then_notified(sleep_s, notify_after_s) if mode == "notify" else _sleeper(sleep_s)

    def wait(self, timeout_ms: int | None = None) -> None:
        # vLLM's branch for "read within busy_loop_s" is a sched_yield; its idle branch is unchanged.
        if self.is_reader and time.monotonic() <= self.last_read + self.busy_loop_s:
            busy_wait(self)
            return
        spin_wait(self, timeout_ms)

    wait.rollart_engine_wait = mode  # type: ignore[attr-defined]
    wait.rollart_original = spin_wait  # type: ignore[attr-defined]
    SpinCondition.wait = wait
    return True


def _notified(condition) -> None:
    """Block until the writer's next notification (or the cancel socket, or the cap), then take it:
    the socket keeps only the newest (zmq.CONFLATE), so a stale one costs one extra look at the queue."""
    import zmq

    events = dict(condition.poller.poll(timeout=NOTIFY_WAIT_CAP_MS))
    if condition.local_notify_socket in events:
        try:
            condition.local_notify_socket.recv(flags=zmq.NOBLOCK, copy=False)
        except zmq.Again:
            pass


def _sleeper(sleep_s: float) -> Callable[[object], None]:
    def sleep(condition: object) -> None:
        time.sleep(sleep_s)
    return sleep


def _polled_then_notified(sleep_s: float, notify_after_s: float) -> Callable[[object], None]:
    """Sleep-poll for the first ``notify_after_s`` of a wait (the other side's answer to a short step
    is found at a poll's pace), then block on the writer's notification (a long step costs one
    wake-up, not one per poll). A wait starts with the reader's last read."""
    def wait(condition) -> None:
        now = time.monotonic()
        if getattr(condition, "_rollart_wait_read", None) != condition.last_read:
            condition._rollart_wait_read, condition._rollart_wait_since = condition.last_read, now
        if now - condition._rollart_wait_since < notify_after_s:
            time.sleep(sleep_s)
        else:
            _notified(condition)
    return wait
