"""A vLLM general plugin (entry point ``vllm.general_plugins``): vLLM loads it in each of its
processes (the engine core and its workers), which is where this change has to happen.

On CPU, the engine core and its worker process pass every step through a shared-memory queue whose
reader, for a second after each read, polls with ``sched_yield`` (vLLM's ``SpinCondition``): two
processes that each take a core while the engine is busy or just idle. On a small machine those
cores are the ones the env, generation and bus clients need: `rollart bench pipeline-efficiency`
measured 0.61 with the spin and 0.75 with a 200 µs sleep between polls (per-turn bus overhead p50
138 → 74 ms), the raw engine's tokens/s unchanged. ``generation.engine_poll_sleep_us`` sets the sleep
(the engine passes it as ``ROLLART_VLLM_POLL_SLEEP_US``); 0 keeps vLLM's own spin. GPUs are left as
they are: there the spin is what keeps a step's launch latency low.
"""

from __future__ import annotations

import logging
import os
import time

log = logging.getLogger(__name__)

POLL_SLEEP_ENV = "ROLLART_VLLM_POLL_SLEEP_US"
DEFAULT_POLL_SLEEP_US = 200


def poll_sleep_s() -> float:
    return max(0, int(os.environ.get(POLL_SLEEP_ENV, DEFAULT_POLL_SLEEP_US))) / 1e6


def register() -> None:
    """Called by vLLM's ``load_general_plugins`` in every vLLM process."""
    sleep_s = poll_sleep_s()
    if sleep_s == 0:
        return
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return
    patch_spin_condition(sleep_s)


def patch_spin_condition(sleep_s: float) -> bool:
    """Make the shared-memory queue's reader sleep ``sleep_s`` between polls while it busy-waits;
    False (and a warning) if this vLLM has no such reader (the queue changed: nothing is patched)."""
    try:
        from vllm.distributed.device_communicators.shm_broadcast import SpinCondition
    except ImportError:
        SpinCondition = None
    if SpinCondition is None or not hasattr(SpinCondition, "wait"):
        log.warning("rollart: vLLM's SpinCondition is gone; its readers keep their own busy-wait")
        return False
    if getattr(SpinCondition.wait, "rollart_poll_sleep_s", None) is not None:
        return True
    spin_wait = SpinCondition.wait

    def wait(self, timeout_ms: int | None = None) -> None:
        # vLLM's branch for "read within busy_loop_s": sched_yield; the idle branch is unchanged.
        if self.is_reader and time.monotonic() <= self.last_read + self.busy_loop_s:
            time.sleep(sleep_s)
            return
        spin_wait(self, timeout_ms)

    wait.rollart_poll_sleep_s = sleep_s
    wait.rollart_original = spin_wait
    SpinCondition.wait = wait
    return True
