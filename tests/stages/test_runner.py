"""The stage runner (rollart.stages.runner): one lifecycle for every stage's members. Fake loops for
the rules (no broker, no Redis), then real consumer loops on the in-memory broker."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import uuid

import pytest

from rollart.bus import BusProducer
from rollart.bus.memory import InMemoryBroker
from rollart.bus.stopping import StopRequest
from rollart.endpoints import Endpoints, resolve_endpoints
from rollart.messages import TaskSpec
from rollart.stages.runner import Member, Work, run_member, supervise
from rollart.timeouts import wait_for
from tests.conftest import make_config


class FakeLoop:
    """A loop that runs until stopped, noting what happens to it in ``events``."""

    def __init__(self, name: str, events: list[str], *, fails: BaseException | None = None,
                 ends_after: float | None = None, drain_s: float = 0.0):
        self.name, self.events = name, events
        self.fails, self.ends_after, self.drain_s = fails, ends_after, drain_s
        self.stopping = asyncio.Event()
        self.started = asyncio.Event()

    def stop(self) -> None:
        if not self.stopping.is_set():
            self.events.append(f"stop {self.name}")
        self.stopping.set()

    async def run(self) -> None:
        if self.stopping.is_set():
            self.events.append(f"{self.name} never ran")
            return
        self.events.append(f"start {self.name}")
        self.started.set()
        with contextlib.suppress(asyncio.TimeoutError):
            await wait_for(self.stopping.wait(), self.ends_after)
        if self.fails is not None:
            self.events.append(f"{self.name} failed")
            raise self.fails
        await asyncio.sleep(self.drain_s)
        self.events.append(f"{self.name} drained")


def request_when_started(stop: StopRequest, *loops: FakeLoop) -> asyncio.Task[None]:
    async def later() -> None:
        for loop in loops:
            await loop.started.wait()
        stop.request()

    return asyncio.create_task(later())


async def test_a_stop_request_stops_the_loops_in_order_each_drained_before_the_next():
    events: list[str] = []
    upstream, downstream = FakeLoop("up", events, drain_s=0.05), FakeLoop("down", events)
    stop = StopRequest()
    request_when_started(stop, upstream, downstream)
    await supervise(Member(loops=[upstream, downstream]), stop)
    assert events == ["start down", "start up", "stop up", "up drained", "stop down", "down drained"], \
        "the last loop starts first; upstream drains before downstream is told to stop"


async def test_a_loop_that_ends_by_itself_ends_the_member():
    events: list[str] = []
    done, other = FakeLoop("steps", events, ends_after=0.05), FakeLoop("consumer", events)
    await supervise(Member(loops=[done, other]), StopRequest())
    assert events == ["start consumer", "start steps", "steps drained", "stop steps", "stop consumer",
                      "consumer drained"]


async def test_the_first_failure_in_stop_order_is_raised_after_everything_stopped_and_cleaned_up():
    events: list[str] = []
    first, second = FakeLoop("a", events), FakeLoop("b", events, fails=KeyError("b"), ends_after=0.05)
    cleaned: list[str] = []

    async def close() -> None:
        cleaned.append("async close")

    with pytest.raises(KeyError, match="b"):
        await supervise(Member(loops=[first, second], cleanup=[lambda: cleaned.append("close"), close]),
                        StopRequest())
    assert events[-4:] == ["b failed", "stop a", "a drained", "stop b"], "a failure stops the others in order"
    assert cleaned == ["close", "async close"], "the cleanup runs in order, failure or not, awaited when async"

    events.clear()
    upstream = FakeLoop("up", events, fails=ValueError("up"))
    downstream = FakeLoop("down", events, fails=KeyError("down"))
    stop = StopRequest()
    request_when_started(stop, upstream, downstream)
    with pytest.raises(ValueError, match="up"):
        await supervise(Member(loops=[upstream, downstream]), stop)


async def test_a_stop_requested_before_the_start_runs_no_loop():
    events: list[str] = []
    stop = StopRequest()
    stop.request()  # SIGTERM while the stage was still starting (loading, recovering)
    await supervise(Member(loops=[FakeLoop("up", events), FakeLoop("down", events)]), stop)
    assert sorted(events) == ["down never ran", "stop down", "stop up", "up never ran"]


async def test_background_work_and_what_the_member_holds_wrap_the_loops():
    events: list[str] = []
    follower = FakeLoop("follower", events)
    watching = asyncio.Event()

    async def watch() -> None:  # runs until cancelled, as a log tail does
        try:
            watching.set()
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            events.append("watcher cancelled")
            raise

    @contextlib.asynccontextmanager
    async def membership():
        events.append("joined")
        yield
        events.append("left")

    loop = FakeLoop("loop", events)
    stop = StopRequest()
    request_when_started(stop, loop, follower)
    member = Member(loops=[loop], background=[follower, Work(watch)], holding=[membership()],
                    cleanup=[lambda: events.append("cleaned")])
    await supervise(member, stop)
    assert watching.is_set()
    assert events.index("joined") < events.index("start loop")
    assert events[events.index("stop loop"):] == ["stop loop", "loop drained", "left", "stop follower",
                                                  "watcher cancelled", "cleaned"]


async def test_a_failure_in_the_background_ends_the_member():
    events: list[str] = []
    loop = FakeLoop("loop", events)

    async def broken() -> None:
        await loop.started.wait()
        raise RuntimeError("the weight follower broke")

    with pytest.raises(RuntimeError, match="follower broke"):
        await wait_for(supervise(Member(loops=[loop], background=[Work(broken)]), StopRequest()), 10)
    assert events == ["start loop", "stop loop", "loop drained"]


async def test_the_trainers_finish_ends_the_step_loop_and_the_consumer_loop_at_once():
    """The trainer's shape: its step loop's stop (the finish event) stops its consumer loop too."""
    events: list[str] = []
    consumer = FakeLoop("consumer", events)
    finish = asyncio.Event()

    async def steps() -> None:
        events.append("start steps")
        await finish.wait()
        await asyncio.sleep(0.05)  # the last step ends
        events.append("steps done")

    def end() -> None:
        finish.set()
        consumer.stop()

    stop = StopRequest()
    request_when_started(stop, consumer)
    await supervise(Member(loops=[Work(steps, end), consumer]), stop)
    assert events[-3:] == ["stop consumer", "consumer drained", "steps done"]


def test_a_member_runs_a_loop():
    with pytest.raises(ValueError, match="at least one loop"):
        Member(loops=[])


# -- real consumer loops, on the in-memory broker ---------------------------------------------------


async def test_run_member_drains_the_upstream_loop_while_the_downstream_loop_delivers_its_replies():
    """As the env stage: the upstream handler waits on a reply the downstream loop consumes; a stop
    request while it waits lets it finish (the downstream loop is still up) and commit, then stops
    the downstream loop. The runtime (producer, Redis client) is opened and closed by the runner."""
    bootstrap = f"memory://{uuid.uuid4().hex}"
    config = make_config(Endpoints(bootstrap, "redis://unused", "test", broker="memory"))
    broker = InMemoryBroker.at(bootstrap)
    for topic in ("requests", "replies"):
        broker.create_topic(f"{config.job}.{topic}", 1)
    stop = StopRequest()
    replies: dict[str, asyncio.Future[None]] = {}
    handled: list[str] = []

    async def ask(envelope, ctx) -> None:  # upstream: send a request, wait for its reply
        replies[envelope.message.group_id] = asyncio.get_running_loop().create_future()
        stop.request()  # SIGTERM while this handler is under way
        await asyncio.sleep(0.3)  # time enough for a downstream loop told to stop to leave
        await ctx.produce("replies", envelope.message, key=envelope.message.group_id)
        await replies[envelope.message.group_id]
        handled.append(envelope.message.group_id)

    async def answer(envelope, ctx) -> None:  # downstream: deliver the reply
        replies[envelope.message.group_id].set_result(None)

    def build(rt) -> Member:
        upstream = rt.consumer_loop("up", ["requests"], ask, dedup=False)
        downstream = rt.consumer_loop("down", ["replies"], answer, dedup=False)
        return Member(loops=[upstream, downstream])

    async with BusProducer(config, resolve_endpoints(config)) as producer:  # waiting when the member starts
        await producer.send_and_wait("requests", TaskSpec(group_id="g0", env="e", tag="t", group_size=1), key="g0")
    await wait_for(run_member(config, stop, build), 30)
    assert handled == ["g0"], "the upstream handler finished: the downstream loop still ran"
    committed = broker.group(f"{config.job}.up").committed
    assert sum(c.offset for c in committed.values()) == 1, "and its input was committed on the way out"


async def test_what_start_up_built_is_frozen_out_of_the_collector_before_the_loops_run():
    """A full collection then walks only what the loops make (with vLLM imported it walked every
    import's objects: a pause of every turn in flight)."""
    gc.unfreeze()
    events: list[str] = []
    loop, stop = FakeLoop("only", events), StopRequest()
    frozen: list[int] = []

    async def note_frozen() -> None:
        await loop.started.wait()
        frozen.append(gc.get_freeze_count())
        stop.request()

    try:
        noting = asyncio.create_task(note_frozen())
        await supervise(Member(loops=[loop]), stop)
        await noting
        assert frozen and frozen[0] > 1000, "the process's objects were frozen before the loop ran"
    finally:
        gc.unfreeze()  # the test process goes on as before
