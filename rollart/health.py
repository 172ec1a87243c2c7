"""Liveness and readiness of a stage process, served beside ``/metrics`` for Kubernetes probes.

Every loop that does a stage's work (a consumer loop, the feeder's release loop) calls
:func:`beat` each time round. The probes then mean something:

* ``/readyz`` answers 200 once every registered loop has started and beaten recently: the member
  has joined its group (or, for the feeder, is releasing) and takes work. Until the first loop
  registers (a generation member loading its model), it answers 503: use it as the startup probe.
* ``/healthz`` answers 503 when a registered loop has not beaten for ``stall_s`` (a wedged event
  loop, a handler blocking the loop, a broker call that never returns); otherwise 200. A process
  still starting up is live. Kubernetes restarts a member that stays unhealthy; its uncommitted
  work is redelivered to whoever owns the partitions next.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass

DEFAULT_STALL_S = 120.0


@dataclass(frozen=True)
class Verdict:
    ok: bool
    detail: str


class Health:
    def __init__(self, stall_s: float = DEFAULT_STALL_S, clock=time.monotonic):
        self.stall_s = stall_s
        self._clock = clock
        self._beats: dict[str, float] = {}
        self._lock = threading.Lock()  # probes are answered from the metrics server's threads

    def beat(self, loop: str) -> None:
        with self._lock:
            self._beats[loop] = self._clock()

    def forget(self, loop: str) -> None:
        """A loop that stopped on purpose (graceful shutdown) no longer counts."""
        with self._lock:
            self._beats.pop(loop, None)

    def ages(self) -> dict[str, float]:
        """Seconds since each registered loop last beat."""
        now = self._clock()
        with self._lock:
            return {loop: now - at for loop, at in self._beats.items()}

    def _stalled(self, limit_s: float) -> tuple[dict[str, float], list[str]]:
        ages = self.ages()
        return ages, sorted(loop for loop, age in ages.items() if age > limit_s)

    def liveness(self) -> Verdict:
        ages, stalled = self._stalled(self.stall_s)
        if stalled:
            return Verdict(False, "stalled: " + ", ".join(f"{loop} ({ages[loop]:.0f}s)" for loop in stalled))
        return Verdict(True, "ok" if ages else "starting")

    def readiness(self) -> Verdict:
        # Ready means taking work now: a tighter bound than liveness (a loop polls every 200 ms).
        ages, stalled = self._stalled(min(self.stall_s, 30.0))
        if not ages:
            return Verdict(False, "no work loop has started")
        if stalled:
            return Verdict(False, "not polling: " + ", ".join(stalled))
        return Verdict(True, "ok: " + ", ".join(sorted(ages)))


HEALTH = Health()


def beat(loop: str) -> None:
    HEALTH.beat(loop)


def forget(loop: str) -> None:
    HEALTH.forget(loop)
