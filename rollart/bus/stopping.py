"""One stop request per stage process, from SIGTERM or SIGINT at any moment of its life.

Kubernetes (and `rollart run`'s own shutdown) sends SIGTERM whenever it likes: while a generation
member is still loading its engine as well as while it consumes. The request is installed when the
process starts, before anything slow, so a signal during start-up is not fatal (Python's default
action would kill the process, exit -15); whatever starts later (a consumer loop, the trainer's step
loop) subscribes with :meth:`StopRequest.on_request` and is stopped at once if the request came first.

A start-up step that blocks the event loop for long (vLLM's engine constructor: tens of seconds on a
loaded CPU) runs inside :func:`interruptible`: there a signal raises :class:`StartupInterrupted` in
the blocking call itself, so a member told to stop while loading leaves now, not when the load ends.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import sys
import threading
from types import FrameType
from typing import Awaitable, Callable, Iterator, NoReturn, TypeVar

T = TypeVar("T")

SIGNALS = (signal.SIGTERM, signal.SIGINT)


class StartupInterrupted(BaseException):
    """A stop was requested while a blocking start-up step ran (see :func:`interruptible`). A
    BaseException, as KeyboardInterrupt is: the blocking library code must not swallow it."""


_installed: "StopRequest | None" = None  # the process's request, once installed


class StopRequest:
    def __init__(self) -> None:
        self._event = asyncio.Event()
        self._callbacks: list[Callable[[], object]] = []

    @classmethod
    def installed(cls) -> "StopRequest":
        """A request that SIGTERM and SIGINT set (call inside the running event loop)."""
        global _installed
        request = cls()
        request._handle_signals()
        _installed = request
        return request

    def _handle_signals(self) -> None:
        loop = asyncio.get_running_loop()
        for sig in SIGNALS:
            loop.add_signal_handler(sig, self.request)

    @property
    def requested(self) -> bool:
        return self._event.is_set()

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


@contextlib.contextmanager
def interruptible() -> Iterator[None]:
    """Run a blocking start-up step (one that holds the event loop) so that SIGTERM or SIGINT raise
    :class:`StartupInterrupted` inside it, after setting the stop request. Only around synchronous
    code: an exception raised while the event loop itself runs would break the loop. Without an
    installed request, or off the main thread, it changes nothing."""
    request = _installed
    if request is None or threading.current_thread() is not threading.main_thread():
        yield
        return
    if request.requested:
        raise StartupInterrupted("stop requested before the step began")

    def raise_now(signum: int, frame: FrameType | None) -> None:
        request.request()
        raise StartupInterrupted(f"{signal.Signals(signum).name} during a blocking start-up step")

    for sig in SIGNALS:
        signal.signal(sig, raise_now)
    try:
        yield
    finally:
        request._handle_signals()  # back to the event loop's handlers


def exit_without_teardown(code: int = 0) -> NoReturn:
    """Leave the process now with ``code``, once its work is stopped and closed: logs flushed, then
    ``os._exit``, skipping the interpreter's teardown (module globals cleared, native destructors run
    while native threads still live), where a library's native code can abort or crash a process
    that finished cleanly."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
