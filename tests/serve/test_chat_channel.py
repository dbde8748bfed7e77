"""The chat channel carries many chats on one connection, each with its own events in order; it refuses a peer
without the token, cancels a chat its reader left, and ends every chat of a broken connection with `ChannelClosed`."""

import asyncio
import dataclasses
import struct
from types import SimpleNamespace

import pytest

from deployments import loop_spin
from deployments.chat_channel import (
    AHEAD,
    HELLO,
    MAX_FRAME,
    TASK,
    ChannelAddress,
    ChannelClosed,
    ChannelPool,
    ChannelServer,
    _frame,
)
from deployments.chat_task import ChatTask


def _task(tenant: str, question: str) -> ChatTask:
    return ChatTask(tenant, 1, (("user", question),))


async def _echo(task: ChatTask):
    """Three events that name their chat, with a yield to the loop between them (so chats interleave)."""
    for i in range(3):
        await asyncio.sleep(0.001)
        yield {"delta": f"{task.question()}-{i}"}
    yield {"done": True, "tenant": task.tenant_id}


async def _collect(events) -> list[dict]:
    return [event async for event in events]


def _tracking(server: ChannelServer) -> list:
    """The replica's end of each connection the server takes from now on, in order (to break one, to count them)."""
    connections, serve = [], server._serve

    async def tracked(reader, writer):
        connections.append(writer)
        await serve(reader, writer)

    server._serve = tracked  # type: ignore[method-assign]
    return connections


def test_concurrent_chats_share_one_connection_and_keep_their_own_events():
    async def main():
        server = ChannelServer(_echo, "127.0.0.1")
        address = await server.start()
        pool = ChannelPool()
        client = pool.client(address)
        got = await asyncio.gather(*(_collect(client.chat(_task(f"t{i}", f"q{i}"))) for i in range(20)))
        same = pool.client(address) is client
        pool.close()
        server.close()
        return got, same, server.ongoing

    got, same, ongoing = asyncio.run(main())
    for i, events in enumerate(got):
        assert events == [
            {"delta": f"q{i}-0"},
            {"delta": f"q{i}-1"},
            {"delta": f"q{i}-2"},
            {"done": True, "tenant": f"t{i}"},
        ]
    assert same and ongoing == 0


def test_a_peer_without_the_token_is_closed_before_anything_is_unpickled():
    ran = []

    async def handler(task):
        ran.append(task)
        yield {"done": True}

    async def main():
        server = ChannelServer(handler, "127.0.0.1")
        address = await server.start()
        wrong = ChannelAddress(address.host, address.port, b"x" * 32)
        with pytest.raises(ChannelClosed):
            await _collect(ChannelPool().client(wrong).chat(_task("t", "q")))
        server.close()

    asyncio.run(main())
    assert ran == []


def test_a_chat_whose_reader_leaves_is_cancelled_on_the_replica():
    async def main():
        seen = asyncio.Event()

        async def slow(task):
            yield {"delta": "first"}
            try:
                await asyncio.sleep(60 if task.question() == "q" else 0)
            except asyncio.CancelledError:
                seen.set()
                raise
            yield {"done": True}

        server = ChannelServer(slow, "127.0.0.1")
        client = ChannelPool().client(await server.start())
        events = client.chat(_task("t", "q"))
        first = await events.__anext__()
        await events.aclose()  # the HTTP client left
        await asyncio.wait_for(seen.wait(), 5)
        after = await _collect(client.chat(_task("t", "again")))  # the connection still serves
        server.close()
        return first, server.ongoing, after

    first, ongoing, after = asyncio.run(main())
    assert first == {"delta": "first"} and ongoing == 0
    assert after == [{"delta": "first"}, {"done": True}]


def test_a_broken_connection_ends_its_chats_with_channel_closed_and_the_pool_reconnects():
    async def main():
        async def hang(task):
            yield {"delta": "started"}
            await asyncio.sleep(60)

        server = ChannelServer(hang, "127.0.0.1")
        connections = _tracking(server)
        address = await server.start()
        pool = ChannelPool()
        events = pool.client(address).chat(_task("t", "q"))
        assert await events.__anext__() == {"delta": "started"}
        connections[0].transport.abort()  # the replica's end dies
        with pytest.raises(ChannelClosed):
            await events.__anext__()
        fresh = pool.client(address)
        first = await fresh.chat(_task("t", "q")).__anext__()
        server.close()
        return first, len(connections)

    first, connections = asyncio.run(main())
    assert first == {"delta": "started"} and connections == 2


def test_a_failing_chat_ends_with_an_error_event_and_the_next_one_is_served():
    async def flaky(task):
        if task.question() == "boom":
            raise RuntimeError("engine fault")
        yield {"done": True}

    async def main():
        server = ChannelServer(flaky, "127.0.0.1")
        client = ChannelPool().client(await server.start())
        failed = await _collect(client.chat(_task("t", "boom")))
        served = await _collect(client.chat(_task("t", "fine")))
        server.close()
        return failed, served

    failed, served = asyncio.run(main())
    assert failed == [{"error": {"status": 500, "message": "the model replica failed this request"}}]
    assert served == [{"done": True}]


def test_a_frame_over_the_limit_closes_the_connection():
    async def main():
        server = ChannelServer(_echo, "127.0.0.1")
        address = await server.start()
        reader, writer = await asyncio.open_connection(address.host, address.port)
        writer.write(struct.pack("<IQB", len(address.token), 0, HELLO) + address.token)
        writer.write(struct.pack("<IQB", MAX_FRAME + 1, 1, TASK))
        closed = await asyncio.wait_for(reader.read(), 5)  # b"" once the server closed its end
        server.close()
        return closed

    assert asyncio.run(main()) == b""


def test_the_replica_runs_at_most_its_share_of_chats_at_once_and_queues_the_rest():
    async def main():
        peak, running = [0], [0]

        async def counted(task):
            running[0] += 1
            peak[0] = max(peak[0], running[0])
            await asyncio.sleep(0.01)
            running[0] -= 1
            yield {"done": True}

        server = ChannelServer(counted, "127.0.0.1", max_ongoing=2)
        client = ChannelPool().client(await server.start())
        done = await asyncio.gather(*(_collect(client.chat(_task("t", f"q{i}"))) for i in range(7)))
        server.close()
        return peak[0], done

    peak, done = asyncio.run(main())
    assert peak == 2 and done == [[{"done": True}]] * 7


class _ChannelHandle:
    """A deployment handle whose `channel.remote(tenant_id=...)` names a live channel server, and counts asks."""

    handle_options = SimpleNamespace(_by_reference=False)

    def __init__(self, address):
        self.address, self.asked, self.channel = address, [], self

    def options(self, stream=False, **transport):
        return self

    def remote(self, tenant_id):
        self.asked.append(tenant_id)

        async def answer():
            return self.address

        return answer()


def test_the_ingress_asks_serve_once_for_a_tenants_replica_and_again_after_its_connection_broke():
    from deployments.ray_serve.ingress import ServeLLMBackend

    async def main():
        server = ChannelServer(_echo, "127.0.0.1")
        connections = _tracking(server)
        handle = _ChannelHandle(await server.start())
        backend = ServeLLMBackend(handle, channel_ttl_s=60.0)
        first = [e async for e in backend.chat(_task("t1", "a"))]
        again = [e async for e in backend.chat(_task("t1", "b"))]
        asked_before = list(handle.asked)
        broken = backend.chat(_task("t1", "c"))
        assert await broken.__anext__() == {"delta": "c-0"}
        connections[0].transport.abort()
        ended = [e async for e in broken]
        after = [e async for e in backend.chat(_task("t1", "d"))]
        server.close()
        return first, again, asked_before, ended, after, handle.asked, backend.transports

    first, again, asked_before, ended, after, asked, transports = asyncio.run(main())
    assert first[-1] == again[-1] == {"done": True, "tenant": "t1"} and asked_before == ["t1"]
    assert ended[-1]["error"]["status"] == 503 and "retry" in ended[-1]["error"]["message"]
    assert after[-1] == {"done": True, "tenant": "t1"} and asked == ["t1", "t1"]  # asked again after the break
    assert "channel" in transports


def test_a_tenants_route_past_its_time_is_used_while_a_new_one_is_asked_for_beside_the_chat():
    from deployments.ray_serve.ingress import ChannelRoutes

    class SlowHandle(_ChannelHandle):
        def remote(self, tenant_id):
            self.asked.append(tenant_id)

            async def answer():
                await asyncio.sleep(0.3)  # Serve answers slowly: no chat after the first may wait for it
                return self.address

            return answer()

    async def main():
        server = ChannelServer(_echo, "127.0.0.1")
        routes = ChannelRoutes(SlowHandle(await server.start()), ttl_s=0.2)
        first = await routes.address("t")  # fresh for 0.2 s from the answer
        await asyncio.sleep(0.3)  # the route is now past its time
        started = asyncio.get_running_loop().time()
        again = await routes.address("t")
        waited = asyncio.get_running_loop().time() - started
        await asyncio.sleep(0.35)  # the new answer arrives beside (0.3 s), fresh for 0.2 s
        third = await routes.address("t")  # fresh again: no new question
        server.close()
        return first == again == third, waited, routes._handle.asked

    same, waited, asked = asyncio.run(main())
    assert same and waited < 0.05 and asked == ["t", "t"]


def test_a_hello_longer_than_a_token_is_closed_before_its_body_is_read():
    async def main():
        server = ChannelServer(_echo, "127.0.0.1")
        address = await server.start()
        reader, writer = await asyncio.open_connection(address.host, address.port)
        writer.write(struct.pack("<IQB", 1 << 30, 0, HELLO))  # "a 1 GiB token": refused on its header
        closed = await asyncio.wait_for(reader.read(), 5)
        server.close()
        return closed

    assert asyncio.run(main()) == b""


def test_a_stopping_replica_finishes_its_chats_refuses_new_ones_and_closes():
    async def main():
        release = asyncio.Event()

        async def held(task):
            yield {"delta": "started"}
            await release.wait()
            yield {"done": True}

        server = ChannelServer(held, "127.0.0.1")
        client = ChannelPool().client(await server.start())
        running = client.chat(_task("t", "running"))
        assert await running.__anext__() == {"delta": "started"}
        draining = asyncio.ensure_future(server.drain(timeout_s=5))
        await asyncio.sleep(0.05)
        with pytest.raises(ChannelClosed, match="stopping"):
            await _collect(client.chat(_task("t", "new")))  # refused at once, not after the drain
        release.set()
        rest = await _collect(running)
        await draining
        await asyncio.sleep(0.05)
        return rest, client.closed, server.in_flight

    rest, closed, in_flight = asyncio.run(main())
    assert rest == [{"done": True}] and closed and in_flight == 0


def test_both_ends_keep_the_connection_alive_so_a_silent_peer_is_noticed():
    import socket

    async def main():
        server = ChannelServer(_echo, "127.0.0.1")
        client = ChannelPool().client(await server.start())
        await _collect(client.chat(_task("t", "q")))
        sock = client._writer.get_extra_info("socket")
        on = sock.getsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE)
        idle = sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE) if hasattr(socket, "TCP_KEEPIDLE") else 10
        server.close()
        return on, idle

    on, idle = asyncio.run(main())
    assert on and idle == 10


def test_a_chat_waiting_for_serve_to_name_a_replica_is_a_503_after_the_first_event_timeout():
    from deployments.ray_serve.ingress import ServeLLMBackend

    class NoReplica(_ChannelHandle):
        def remote(self, tenant_id):
            self.asked.append(tenant_id)
            return asyncio.sleep(60)  # no replica runs: Serve holds the call

    async def main():
        backend = ServeLLMBackend(NoReplica(None), first_event_timeout_s=0.2, channel_ttl_s=5.0)
        started = asyncio.get_running_loop().time()
        events = [e async for e in backend.chat(_task("t", "q"))]
        return events, asyncio.get_running_loop().time() - started

    events, waited = asyncio.run(main())
    assert len(events) == 1 and events[0]["error"]["status"] == 503 and waited < 2


def test_a_note_ahead_reaches_the_replica_with_whether_it_is_idle_and_a_failing_one_harms_nothing():
    """Nothing is sent ahead before the connection is open; once it is, each note reaches the replica's `ahead`
    with whether a chat runs there; a note whose preparation fails leaves the connection serving."""
    notes: list[tuple[object, bool]] = []
    release = asyncio.Event()

    def ahead(note, idle):
        if note == "boom":
            raise RuntimeError("cannot prepare")
        notes.append((note, idle))

    async def held(task):
        await release.wait()
        yield {"done": True, "tenant": task.tenant_id}

    async def main():
        server = ChannelServer(held, "127.0.0.1", ahead=ahead)
        client = ChannelPool().client(await server.start())
        client.ahead("before any chat")  # no connection yet: dropped, none is opened for it
        first = asyncio.ensure_future(_collect(client.chat(_task("t", "q"))))
        await asyncio.sleep(0.05)
        client.ahead("while a chat runs")
        client.ahead("boom")
        client._writer.write(_frame(0, AHEAD, b"not a pickle"))  # a note that does not unpickle: dropped too
        await asyncio.sleep(0.05)
        release.set()
        await first
        client.ahead("idle again")
        await asyncio.sleep(0.05)
        after = await _collect(client.chat(_task("t", "q")))
        client.close()
        server.close()
        return after

    assert asyncio.run(main()) == [{"done": True, "tenant": "t"}]
    assert notes == [("while a chat runs", False), ("idle again", True)]


def test_after_a_note_the_replicas_loop_polls_until_its_chat_arrives_or_the_spin_ends():
    """With `ahead_spin_s`, a note keeps the replica's loop from sleeping: the spin stops as the chat arrives, and,
    when no chat follows, at the spin's end; without it the loop spins not at all."""

    def spun(spin_s: float, chat_after_s: float | None) -> list[float]:
        times: list[float] = []

        async def main():
            server = ChannelServer(_echo, "127.0.0.1", ahead=lambda note, idle: None, ahead_spin_s=spin_s)
            client = ChannelPool().client(await server.start())
            await _collect(client.chat(_task("t", "open the connection")))
            client.ahead("note")
            if chat_after_s is not None:
                await asyncio.sleep(chat_after_s)
                await _collect(client.chat(_task("t", "q")))
            await asyncio.sleep(0.1)
            count = len(times)
            await asyncio.sleep(0.05)
            assert len(times) == count, "the loop went on spinning"
            client.close()
            server.close()

        keep_awake = loop_spin.keep_awake

        def counted(loop, until, waiting):
            times.append(loop.time())
            keep_awake(loop, until, waiting)

        loop_spin.keep_awake = counted  # each pass of the spin, the first and every one it schedules
        try:
            asyncio.run(main())
        finally:
            loop_spin.keep_awake = keep_awake
        return times

    unanswered = spun(0.02, None)  # no chat: it spins to the end of its 20 ms (not the 100 ms the test waits)
    assert len(unanswered) > 10 and 0.015 < unanswered[-1] - unanswered[0] < 0.08
    answered = spun(0.5, 0.01)  # the chat 10 ms after the note ends a 500 ms spin
    assert len(answered) > 10 and answered[-1] - answered[0] < 0.2
    assert spun(0.0, 0.01) == []


def test_sent_is_called_once_the_task_is_written_and_before_any_event_comes_back():
    """The ingress starts its usage lookups on `sent`, beside the engine's work and not beside the send (a thread
    that took the GIL while the loop pickled the task slowed the send by 0.06 ms on a 2-core CPU)."""
    order: list[str] = []

    async def replica(task: ChatTask):
        order.append("replica got the task")
        yield {"delta": "a"}
        yield {"done": True}

    async def main():
        server = ChannelServer(replica, "127.0.0.1")
        pool = ChannelPool()
        try:
            events = pool.client(await server.start()).chat(_task("t", "q"), lambda: order.append("sent"))
            async for event in events:
                order.append(f"event {sorted(event)[0]}")
        finally:
            pool.close()
            await server.drain(1.0)

    asyncio.run(main())
    assert order == ["sent", "replica got the task", "event delta", "event done"]


@dataclasses.dataclass(frozen=True)
class _Tagged(ChatTask):
    """A task with a field of its own: it must come back as itself."""

    tag: str = ""


def test_a_task_crosses_by_pickle_whole_with_its_facts_as_columns():
    """`ChatTask` pickles its facts as four columns: the task read back equals the one sent, facts without a record
    and a task without facts included, and is smaller than ~50 pickled objects."""
    import pickle

    from deployments.chat_task import RetrievedFact

    facts = tuple(RetrievedFact(f"f{i}", f"fact {i}", f"r{i}" if i % 2 else None, i / 10) for i in range(50))
    task = ChatTask("t", 3, (("user", "q"),), facts, "prompt", 9, 0.5, stop=("x",), history_id=None, recompute=2)
    for sent in (task, _task("t", "q")):
        got = pickle.loads(pickle.dumps(sent, protocol=5))
        assert got == sent and all(type(f) is RetrievedFact for f in got.facts)
    assert got.facts == ()
    assert b"RetrievedFact" not in pickle.dumps(task, protocol=5)  # columns of plain values, no fact objects

    tagged = _Tagged("t", 3, (("user", "q"),), facts[:2], tag="x")
    assert pickle.loads(pickle.dumps(tagged, protocol=5)) == tagged
