"""The direct turn path's transport (rollart.rollout.direct) over real TCP connections on loopback.

The members here answer with a plain async function in place of the generation stage's ``serve``
(the stage with the vLLM engine behind it is tested in tests/stages/test_direct_rollout.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from zlib import crc32

import pytest

from rollart.messages import Abort, Float32Array, GenerationRequest, GenerationResult, Int32Array, SamplingParams
from rollart.rollout.direct import DIRECT_TURNS, DirectClient, DirectServer, FrameError, Frames, advertised_host
from rollart.timeouts import wait_for


def request(traj_id: str = "g0-t0", attempt: int = 0, turn: int = 0) -> GenerationRequest:
    return GenerationRequest(traj_id=traj_id, turn=turn, attempt=attempt, group_id="g0", tag="t", pool="p",
                             prompt_ids=Int32Array([1, 2, 3]), reply_partition=0,
                             sampling=SamplingParams(max_tokens=2))


def answer(req: GenerationRequest, instance: str) -> GenerationResult:
    """A result that says which member served which attempt of which request."""
    n = len(req.prompt_ids)
    return GenerationResult(traj_id=req.traj_id, turn=req.turn, attempt=req.attempt, episode=req.episode,
                            token_ids=Int32Array(list(req.prompt_ids)[::-1]), logprobs=Float32Array([-0.5] * n),
                            versions=Int32Array([7] * n), finish_reason="stop", instance=instance)


class Member:
    """A DirectServer answering with ``answer`` (or as ``behaviour`` says), run as a task."""

    def __init__(self, name: str, behaviour=None):
        self.name = name
        self.served: list[GenerationRequest] = []
        self.cancelled: list[Abort] = []
        self.release = asyncio.Event()
        self.behaviour = behaviour
        self.server = DirectServer(self.serve, self.cancel, bind_host="127.0.0.1", port=0, advertise=None,
                                   max_in_flight=8, labels=("test", name))
        self.task = asyncio.create_task(self.server.run())

    async def serve(self, req: GenerationRequest) -> GenerationResult | None:
        self.served.append(req)
        if self.behaviour == "hang":
            try:
                await self.release.wait()
            except asyncio.CancelledError:
                self.cancelled.append(req.cancellation())  # a call in this process is cancelled, not told
                raise
        if self.behaviour == "fail":
            raise RuntimeError("engine exploded")
        if self.behaviour == "aborted":
            return None
        return answer(req, self.name)

    async def cancel(self, abort: Abort) -> None:
        self.cancelled.append(abort)
        self.release.set()

    async def stop(self) -> None:
        self.release.set()
        self.server.stop()
        await self.task

    async def crash(self) -> None:
        """Gone mid-request: its socket closes with requests unanswered."""
        self.task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self.task


@pytest.fixture
async def client():
    client = DirectClient(timeout_s=10.0)
    yield client
    await client.close()


def served_by(members: list[Member]) -> dict[str, list[str]]:
    return {m.name: [r.traj_id for r in m.served] for m in members}


async def test_a_turn_is_answered_by_a_member_with_the_message_intact(client):
    member = Member("m0")
    before = DIRECT_TURNS.labels("test", "m0", "ok")._value.get()
    try:
        sent = time.perf_counter()
        delivery, next_attempt = await client.request([member.server.address], lambda attempt: request(attempt=attempt))
        assert delivery is not None and next_attempt == 1
        assert sent < delivery.at <= time.perf_counter()  # when the result reached this side
        result = delivery.result
        assert list(result.token_ids) == [3, 2, 1] and list(result.versions) == [7, 7, 7]
        assert result.instance == "m0" and result.traj_id == "g0-t0"
        assert member.served[0] == request()  # decoded back to the request that was built
        assert DIRECT_TURNS.labels("test", "m0", "ok")._value.get() == before + 1
    finally:
        await member.stop()


async def test_turns_of_one_trajectory_stick_to_one_member_and_trajectories_spread(client):
    members = [Member(f"m{i}") for i in range(3)]
    addresses = [m.server.address for m in members]
    try:
        for turn in range(3):
            await asyncio.gather(*(client.request(addresses, lambda a, i=i, t=turn: request(f"g0-t{i}", a, t))
                                   for i in range(12)))
        placements = {}
        for m in members:
            for req in m.served:
                placements.setdefault(req.traj_id, set()).add(m.name)
        assert len(placements) == 12 and all(len(where) == 1 for where in placements.values()), placements
        assert sum(1 for m in members if m.served) >= 2, served_by(members)
    finally:
        for m in members:
            await m.stop()


async def test_a_member_that_dies_mid_request_hands_the_turn_to_another_as_the_next_attempt(client):
    first, second = Member("first", behaviour="hang"), Member("second")
    addresses = [first.server.address, second.server.address]
    traj = next(f"g0-t{i}" for i in range(50)
                if sorted(addresses)[crc32(f"g0-t{i}".encode()) % 2] == first.server.address)
    try:
        pending = asyncio.create_task(client.request(addresses, lambda attempt: request(traj, attempt)))
        for _ in range(200):
            if first.served:
                break
            await asyncio.sleep(0.01)
        assert first.served, "the sticky member never got the request"
        await first.crash()
        delivery, next_attempt = await wait_for(pending, 8.0)
        assert delivery is not None and next_attempt == 2
        assert delivery.result.instance == "second" and delivery.result.attempt == 1
    finally:
        await second.stop()


async def test_a_handler_error_hands_the_turn_back_for_the_bus_with_the_next_attempt(client):
    member = Member("m0", behaviour="fail")
    try:
        result, next_attempt = await client.request([member.server.address], lambda attempt: request(attempt=attempt))
        assert result is None and next_attempt == 1  # the bus then sends attempt 1: never a duplicate request id
        assert len(member.served) == 1
    finally:
        await member.stop()


async def test_an_address_nobody_serves_hands_the_turn_back_without_waiting_a_generation_timeout(client):
    member = Member("m0")
    dead = member.server.address
    await member.stop()
    client.CONNECT_TIMEOUT_S = 0.5
    started = asyncio.get_running_loop().time()
    result, next_attempt = await client.request([dead], lambda attempt: request(attempt=attempt))
    assert result is None and next_attempt == 0  # nothing was sent
    assert asyncio.get_running_loop().time() - started < client.timeout_s
    # remembered as unreachable for a while: the next turn does not wait for it again
    started = asyncio.get_running_loop().time()
    assert (await client.request([dead], lambda attempt: request(attempt=attempt)))[0] is None
    assert asyncio.get_running_loop().time() - started < 0.2


async def test_a_timed_out_turn_is_cancelled_at_the_member(client):
    member = Member("m0", behaviour="hang")
    client.timeout_s = 0.5
    try:
        with pytest.raises(asyncio.TimeoutError):
            await client.request([member.server.address], lambda attempt: request(attempt=attempt))
        for _ in range(100):
            if member.cancelled:
                break
            await asyncio.sleep(0.01)
        assert [(a.traj_id, a.turn, a.reason) for a in member.cancelled] == [("g0-t0", 0, "cancelled")]
    finally:
        await member.stop()


async def test_a_result_aborted_at_the_member_is_asked_again_elsewhere(client):
    gone, alive = Member("gone", behaviour="aborted"), Member("alive")
    try:
        addresses = [gone.server.address, alive.server.address]
        for i in range(6):
            delivery, _ = await client.request(addresses, lambda attempt, i=i: request(f"g1-t{i}", attempt))
            assert delivery is not None and delivery.result.instance == "alive"
        assert gone.served, "no trajectory was placed on the member that aborts"
    finally:
        await gone.stop()
        await alive.stop()


async def test_stop_answers_what_is_in_flight_before_the_server_closes(client):
    member = Member("m0", behaviour="hang")
    try:
        pending = asyncio.create_task(client.request([member.server.address], lambda a: request(attempt=a)))
        for _ in range(200):
            if member.served:
                break
            await asyncio.sleep(0.01)
        member.server.stop()
        await asyncio.sleep(0.2)
        assert not member.task.done()  # still holding the request in flight
        member.release.set()
        delivery, _ = await wait_for(pending, 5.0)
        assert delivery is not None and delivery.result.instance == "m0"
        await wait_for(member.task, 5.0)
    finally:
        await member.stop()


def test_the_advertised_host_is_the_bind_host_unless_bound_to_every_interface():
    assert advertised_host("127.0.0.1", None) == "127.0.0.1"
    assert advertised_host("0.0.0.0", "10.1.2.3") == "10.1.2.3"
    assert advertised_host("0.0.0.0", None) not in ("0.0.0.0", "")



async def test_sockets_of_members_no_longer_live_are_closed(client):
    gone, alive = Member("gone"), Member("alive")
    try:
        for member in (gone, alive):
            assert (await client.request([member.server.address], lambda a: request(attempt=a)))[0] is not None
        assert set(client.peers) == {gone.server.address, alive.server.address}
        await client.retain({alive.server.address})
        assert set(client.peers) == {alive.server.address}
        delivery, _ = await client.request([alive.server.address], lambda a: request(attempt=a))
        assert delivery is not None and delivery.result.instance == "alive"
    finally:
        await gone.stop()
        await alive.stop()


def test_frames_are_rebuilt_from_reads_of_any_size_and_a_bad_length_is_refused():
    messages = [[b"id-1", b"request", b"", b"x" * 300], [b"ping"], [b"", b"abort", b"s", b"\x00\x01"], []]
    stream = b"".join(Frames.pack(m) for m in messages)
    for size in (1, 7, len(stream)):
        frames, received = Frames(), []
        for at in range(0, len(stream), size):
            received += frames.feed(stream[at:at + size])
        assert received == messages
    with pytest.raises(FrameError):
        Frames().feed(b"\xff\xff\xff\xff\x01")  # 4 GiB announced
    with pytest.raises(FrameError):
        Frames().feed(b"\x00\x00\x00\x05\x01\x00\x00\x00\x09")  # a part longer than its frame


async def test_a_member_that_falls_silent_counts_as_gone_after_three_heartbeats():
    """A member that accepts the connection and then answers nothing (a stopped process: its kernel
    still keeps the connection) is dropped after three heartbeats; the turn goes to the other member."""
    async def accept_and_say_nothing(reader, writer):
        await asyncio.sleep(60)

    silent = await asyncio.start_server(accept_and_say_nothing, "127.0.0.1", 0)
    silent_address = f"tcp://127.0.0.1:{silent.sockets[0].getsockname()[1]}"
    alive = Member("alive")
    client = DirectClient(timeout_s=10.0, heartbeat_ms=100)
    addresses = [silent_address, alive.server.address]
    traj = next(f"g0-t{i}" for i in range(50) if sorted(addresses)[crc32(f"g0-t{i}".encode()) % 2] == silent_address)
    try:
        started = time.monotonic()
        delivery, next_attempt = await wait_for(
            client.request(addresses, lambda attempt: request(traj, attempt)), 5.0)
        assert delivery is not None and delivery.result.instance == "alive" and next_attempt == 2
        assert 0.25 < time.monotonic() - started < 3.0  # three 100 ms heartbeats, not the 10 s timeout
        assert not client.peers[silent_address].up.is_set()
    finally:
        await client.close()
        await alive.stop()
        silent.close()


async def test_a_request_that_arrives_after_stop_is_handed_back_and_asked_elsewhere(client):
    stopping, alive = Member("stopping", behaviour="hang"), Member("alive")
    addresses = [stopping.server.address, alive.server.address]
    mine = [f"g0-t{i}" for i in range(50)
            if sorted(addresses)[crc32(f"g0-t{i}".encode()) % 2] == stopping.server.address][:2]
    try:
        held = asyncio.create_task(client.request(addresses, lambda a: request(mine[0], a)))
        for _ in range(200):
            if stopping.served:
                break
            await asyncio.sleep(0.01)
        stopping.server.stop()  # still answering the one it holds
        delivery, next_attempt = await wait_for(
            client.request(addresses, lambda a: request(mine[1], a)), 5.0)
        assert delivery is not None and delivery.result.instance == "alive" and next_attempt == 2
        assert [r.traj_id for r in stopping.served] == [mine[0]]
        stopping.release.set()
        delivery, _ = await wait_for(held, 5.0)
        assert delivery is not None and delivery.result.instance == "stopping"
    finally:
        await stopping.stop()
        await alive.stop()


async def test_a_member_served_here_is_called_as_a_function_whatever_the_hash(client):
    here, there = Member("here"), Member("there")
    client.serve_here(here.server)
    addresses = [here.server.address, there.server.address]
    before = DIRECT_TURNS.labels("test", "here", "ok")._value.get()
    try:
        built = [request(f"g0-t{i}") for i in range(8)]
        for req in built:
            delivery, next_attempt = await client.request(addresses, lambda attempt, req=req: req)
            assert delivery is not None and delivery.result.instance == "here" and next_attempt == 1
        assert all(a is b for a, b in zip(here.served, built)), "the request was encoded and decoded: a copy"
        assert there.served == [] and client.peers == {}, "no socket, not even to the other member"
        assert DIRECT_TURNS.labels("test", "here", "ok")._value.get() == before + 8
        # a trajectory of a pool it does not serve goes to that pool's member over its socket
        delivery, _ = await client.request([there.server.address], lambda attempt: request("g9-t0", attempt))
        assert delivery is not None and delivery.result.instance == "there" and list(client.peers) == addresses[1:]
    finally:
        await here.stop()
        await there.stop()


async def test_a_member_served_here_hands_back_errors_aborts_and_its_stop_as_a_remote_one_does(client):
    failing, aborting, other = Member("failing", behaviour="fail"), Member("aborting", behaviour="aborted"), Member("o")
    try:
        client.serve_here(failing.server)
        result, next_attempt = await client.request([failing.server.address], lambda a: request(attempt=a))
        assert result is None and next_attempt == 1  # the bus sends attempt 1 and dead-letters it if it fails again
        client.serve_here(aborting.server)
        delivery, next_attempt = await client.request([aborting.server.address, other.server.address],
                                                      lambda a: request(attempt=a))
        assert delivery is not None and delivery.result.instance == "o" and delivery.result.attempt == 1
        aborting.server.stop()  # stopped: takes no more calls, and the turn is asked elsewhere
        delivery, _ = await client.request([aborting.server.address, other.server.address],
                                           lambda a: request("g1-t0", attempt=a))
        assert delivery is not None and delivery.result.instance == "o" and len(aborting.served) == 1
    finally:
        for member in (failing, aborting, other):
            await member.stop()


async def test_a_timed_out_call_here_cancels_the_handler(client):
    member = Member("m0", behaviour="hang")
    client.serve_here(member.server)
    client.timeout_s = 0.3
    try:
        with pytest.raises(asyncio.TimeoutError):
            await client.request([member.server.address], lambda attempt: request(attempt=attempt))
        assert [(a.traj_id, a.turn) for a in member.cancelled] == [("g0-t0", 0)]
        assert member.server.slots._value == 8, "the cancelled call still holds a slot"
    finally:
        await member.stop()
