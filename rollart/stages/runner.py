"""One member of a stage, from its runtime's opening to its last drain.

A stage says *what* a member runs, as a :class:`Member`: its loops (consumer loops, a step loop,
the feeder's release loop) in stop order, its background work, what it holds while the loops run,
its cleanup. :func:`run_member` does the rest, the same way for every stage:

1. open the runtime (producer, Redis, the metrics and health server) and build the member on it;
2. subscribe the first loop to the stop request (SIGTERM; already requested: nothing joins a group);
3. start the background work, enter what the member holds, start the loops (the last first: a
   downstream loop is up before the loop whose handlers wait on it);
4. wait until the stop request ends the first loop, any loop ends by itself, or anything fails;
5. stop the loops in order, each drained before the next is stopped (an upstream loop's handlers
   still wait on replies a downstream loop delivers), leave what it held, stop the background work
   (stop, then cancel), run the cleanup, close the runtime;
6. re-raise the first failure: the loops' in stop order, then the background work's.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import inspect
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass
from typing import Any, Awaitable, Callable, Protocol, Sequence

from rollart.bus.stopping import StopRequest
from rollart.config import RollartConfig
from rollart.runtime import Runtime, open_runtime


class Service(Protocol):
    """Something a member runs until told to stop: a consumer loop, the feeder, a weight follower."""

    def run(self) -> Awaitable[object]: ...

    def stop(self) -> None: ...


@dataclass(frozen=True)
class Work:
    """A coroutine function as a :class:`Service`; without ``halt`` it stops only when cancelled
    (a background watcher that tails a log)."""

    body: Callable[[], Awaitable[object]]
    halt: Callable[[], object] | None = None

    def run(self) -> Awaitable[object]:
        return self.body()

    def stop(self) -> None:
        if self.halt is not None:
            self.halt()


Cleanup = Callable[[], object]  # called once everything stopped; awaited if it returns an awaitable


@dataclass(frozen=True)
class Member:
    """What one member of a stage runs (see the module's docstring for how)."""

    loops: Sequence[Service]  # in stop order: upstream first; when one ends, the member ends
    background: Sequence[Service] = ()  # runs beside the loops; stopped and cancelled after them
    holding: Sequence[AbstractAsyncContextManager[object]] = ()  # entered before the loops, left after
    cleanup: Sequence[Cleanup] = ()  # in order, after everything stopped, failure or not

    def __post_init__(self) -> None:
        if not self.loops:
            raise ValueError("a member runs at least one loop")


Build = Callable[[Runtime], Member | Awaitable[Member]]  # the stage's part: its member, on the runtime


async def run_member(config: RollartConfig, stop: StopRequest, build: Build, *,
                     client_id: str | None = None) -> None:
    """Open the runtime, build the member on it, run it until ``stop`` (see the module docstring)."""
    async with open_runtime(config, client_id=client_id) as rt:
        member = build(rt)
        await supervise(member if isinstance(member, Member) else await member, stop)


async def supervise(member: Member, stop: StopRequest) -> None:
    """Run ``member`` until ``stop`` or until one of its loops ends; stop it in order; clean up;
    re-raise the first failure."""
    try:
        subscribe(member.loops, stop)
        async with _Background(member.background) as background:
            async with contextlib.AsyncExitStack() as held:
                for context in member.holding:
                    await held.enter_async_context(context)
                freeze_startup_heap()
                await run_loops(member.loops, until=background.failed)
    finally:
        await clean_up(member.cleanup)


def freeze_startup_heap() -> None:
    """What start-up built (the imports: torch, vLLM, transformers; an engine's client, a tokenizer, a
    model) leaves the garbage collector's generations. A full collection walks every tracked object:
    0.28 s with vLLM imported here (654k objects), about every 30 s in a generation member, stalling
    every turn in flight. Frozen, it walks only what was made since. Garbage is collected first, so
    only what lives is frozen."""
    gc.collect()
    gc.freeze()


def subscribe(loops: Sequence[Service], stop: StopRequest) -> None:
    """A stop request stops the first loop (the rest follow it in order). One made before the
    loops start stops them all at once: a member told to stop during start-up joins no group."""
    if stop.requested:
        for loop in loops:
            loop.stop()
    stop.on_request(loops[0].stop)


async def run_loops(loops: Sequence[Service], *, until: asyncio.Future[None]) -> None:
    """Run the loops until one ends (or ``until`` completes), then stop them in order; re-raise
    the first failure in that order."""
    # The last loop starts first: a downstream loop is up before an upstream one asks it for replies.
    tasks = [_task(loop) for loop in reversed(loops)][::-1]
    try:
        waiting: set[asyncio.Future[Any]] = {*tasks, until}
        await asyncio.wait(waiting, return_when=asyncio.FIRST_COMPLETED)
    finally:
        errors = await stop_in_order(loops, tasks)
    if errors:
        raise errors[0]


async def stop_in_order(loops: Sequence[Service], tasks: Sequence[asyncio.Task[object]]) -> list[BaseException]:
    """Stop each loop and wait until it has drained before stopping the next; their failures."""
    errors = []
    for loop, task in zip(loops, tasks):
        loop.stop()
        outcome = (await asyncio.gather(task, return_exceptions=True))[0]
        if isinstance(outcome, BaseException):
            errors.append(outcome)
    return errors


async def clean_up(steps: Sequence[Cleanup]) -> None:
    for step in steps:
        result = step()
        if inspect.isawaitable(result):
            await result


class _Background:
    """The member's background work: started on entry; on exit stopped, cancelled and awaited, its
    first failure re-raised (unless the block raises already). :attr:`failed` is done once one of
    them failed: a failure in the background ends the member as a loop's would."""

    def __init__(self, services: Sequence[Service]) -> None:
        self.services = services
        self.tasks: list[asyncio.Task[object]] = []
        self.failed: asyncio.Future[None] = asyncio.get_running_loop().create_future()

    async def __aenter__(self) -> "_Background":
        self.tasks = [_task(service) for service in self.services]
        for task in self.tasks:
            task.add_done_callback(self._on_done)
        return self

    def _on_done(self, task: asyncio.Task[object]) -> None:
        if not self.failed.done() and not task.cancelled() and task.exception() is not None:
            self.failed.set_result(None)

    async def __aexit__(self, *exc_info: object) -> None:
        for service, task in zip(self.services, self.tasks):
            service.stop()
            task.cancel()
        outcomes = await asyncio.gather(*self.tasks, return_exceptions=True)
        errors = [o for o in outcomes if isinstance(o, BaseException) and not isinstance(o, asyncio.CancelledError)]
        if errors and exc_info[0] is None:
            raise errors[0]


def _task(service: Service) -> asyncio.Task[object]:
    async def running() -> object:
        return await service.run()

    return asyncio.create_task(running())
