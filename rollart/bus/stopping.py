"""One stop request per stage process, from SIGTERM or SIGINT at any moment of its life.

Kubernetes (and `rollart run`'s own shutdown) sends SIGTERM whenever it likes: while a generation
member is still loading its engine as well as while it consumes. The request is installed when the
process starts, before anything slow, so a signal during start-up is not fatal (Python's default
action would kill the process, exit -15); whatever starts later (a consumer loop, the trainer's step
loop) subscribes with :meth:`StopRequest.on_request` and is stopped at once if the request came first.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
from typing import Awaitable, Callable, TypeVar

T = TypeVar("T")

SIGNALS = (signal.SIGTERM, signal.SIGINT)


class StopRequest:
    def __init__(self) -> None:
        self._event = asyncio.Event()
        self._callbacks: list[Callable[[], object]] = []

    @classmethod
    def installed(cls) -> "StopRequest":
        """A request that SIGTERM and SIGINT set (call inside the running event loop)."""
        request = cls()
        loop = asyncio.get_running_loop()
        for sig in SIGNALS:
            loop.add_signal_handler(sig, request.request)
        return request

    def request(self) -> None:
        """Ask everything subscribed to stop (idempotent; safe from a signal handler)."""
        if self._event.is_set():
            return
        self._event.set()
        for callback in self._callbacks:
            callback()

    def on_request(self, callback: Callable[[], object]) -> None:
        """Call ``callback`` when stop is requested: now, if it already was."""
        self._callbacks.append(callback)
        if self._event.is_set():
            callback()

    async def unless_requested(self, work: Awaitable[T]) -> T | None:
        """Await ``work`` unless a stop is requested first: then cancel it and return None (start-up
        steps such as an engine's warm-up are not worth finishing for a member about to leave)."""
        task = asyncio.ensure_future(work)
        waiting = asyncio.create_task(self._event.wait())
        try:
            await asyncio.wait({task, waiting}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            waiting.cancel()
            if not task.done():
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
        return None if task.cancelled() else task.result()
