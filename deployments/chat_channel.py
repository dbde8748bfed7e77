"""A chat's way from the ingress to an LLM replica over a socket of the replica's own: no Serve code on either side.

Ray Serve's streamed handle call (over gRPC in high-throughput mode) costs a chat ~1.3 ms on a 2-core CPU and
~2.5 ms on the H200 host before any work (`benchmarks/serve_hop.py`), and its replica-side handling is ~1 ms of
CPU a chat on the LLM replica's event loop, the loop that bounds the cluster's QPS. Here one connection per
(ingress replica, LLM replica) carries many chats at once: a frame is (length, request id, kind) and a pickle.

- The connection opens with the replica's token (random, handed out through Serve, the trusted path): the replica
  reads nothing but that token's 32 bytes, and unpickles nothing, from a peer that has not shown it. The ingress
  trusts the address Serve gave it, as it trusts Serve.
- A chat the ingress stops reading (its client left) is cancelled on the replica; a connection that breaks, or
  goes silent (TCP keepalive, ~25 s), ends every chat on it with `ChannelClosed` (the ingress answers a retryable
  503, as for a replica that dies).
- A replica that stops (`ChannelServer.drain`) starts no new chat (each is refused at once, so the ingress asks
  Serve for another replica), lets the running ones finish for a while, then closes its connections.
- A note sent ahead of a chat (`ChannelClient.ahead`, kind AHEAD: no answer, no request of its own) reaches the
  replica's `ahead` callback at once, with whether the replica is idle: it prepares what it can while the ingress
  still retrieves. With `ahead_spin_s`, the replica's loop then does not sleep until a chat arrives (at most that
  long), so the chat is read as it lands instead of after a sleeping thread's wake-up.
- Pure asyncio: the Ray adapter (`ray_serve/llm_server.py`, `ray_serve/ingress.py`) says where the server listens
  and which replica a tenant's chats go to.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import itertools
import logging
import pickle
import secrets
import socket
import struct
import time
from dataclasses import dataclass
from typing import Any, AsyncIterator, Callable

from deployments import loop_spin

log = logging.getLogger(__name__)

_HEADER = struct.Struct("<IQB")  # payload length, request id (64 bits: never reused on a connection), kind
HELLO, TASK, CANCEL, EVENT, END, REFUSED, AHEAD = range(7)
MAX_FRAME = 64 << 20  # a chat task carries texts, never K/V
TOKEN_BYTES = 32
HELLO_TIMEOUT_S = 5.0
_KEEPALIVE = (("TCP_KEEPIDLE", 10), ("TCP_KEEPINTVL", 5), ("TCP_KEEPCNT", 3))  # a silent peer is dead after ~25 s
Handler = Callable[[Any], AsyncIterator[dict[str, Any]]]
Ahead = Callable[[Any, bool], None]  # (the note, whether the replica runs no chat now)


class ChannelClosed(ConnectionError):
    """The connection to the replica broke (or it refused the token) before the chat ended."""


@dataclass(frozen=True)
class ChannelAddress:
    """Where a replica's channel listens, and the token that opens it."""

    host: str
    port: int
    token: bytes


def _frame(request_id: int, kind: int, payload: bytes = b"") -> bytes:
    return _HEADER.pack(len(payload), request_id, kind) + payload


async def _read_frame(reader: asyncio.StreamReader, limit: int = MAX_FRAME) -> tuple[int, int, bytes]:
    size, request_id, kind = _HEADER.unpack(await reader.readexactly(_HEADER.size))
    if size > limit:
        raise ChannelClosed(f"a frame of {size} bytes is over the channel's {limit}")
    return request_id, kind, await reader.readexactly(size) if size else b""


def _keep_alive(writer: asyncio.StreamWriter) -> None:
    """TCP keepalive on the connection, so a peer that vanished (a node lost, no FIN) is noticed."""
    sock = writer.get_extra_info("socket")
    if sock is None:
        return
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
        for name, value in _KEEPALIVE:
            if hasattr(socket, name):
                sock.setsockopt(socket.IPPROTO_TCP, getattr(socket, name), value)
    except OSError as exc:  # a platform without these options: the OS's defaults apply
        log.debug("chat channel: keepalive not set (%s)", exc)


class ChannelServer:
    """The replica's end: runs `handler(task)` for each chat that arrives and streams its events back."""

    def __init__(
        self,
        handler: Handler,
        host: str,
        max_ongoing: int = 64,
        ahead: Ahead | None = None,
        ahead_spin_s: float = 0.0,
    ) -> None:
        """`max_ongoing`: chats the handler runs at once; later ones wait here (as Serve queues beyond the
        deployment's `max_ongoing_requests`); `ahead`: called on the loop with each note sent ahead of a chat;
        `ahead_spin_s`: how long the loop polls instead of sleeping after a note, until a chat arrives."""
        self._handler, self._host, self._ahead, self._ahead_spin_s = handler, host, ahead, ahead_spin_s
        self._tasks_seen = 0  # chats arrived, over every connection (a spin after a note ends at the next)
        self._token = secrets.token_bytes(32)
        self._server: asyncio.Server | None = None
        self._slots = asyncio.Semaphore(max_ongoing)
        self._writers: set[asyncio.StreamWriter] = set()
        self._draining = False
        self.ongoing = 0  # chats running now, over every connection
        self.in_flight = 0  # chats running or waiting for a slot: the replica's load as the router reads it

    async def start(self) -> ChannelAddress:
        self._server = await asyncio.start_server(self._serve, self._host, 0)
        return self.address

    @property
    def address(self) -> ChannelAddress:
        if self._server is None:
            raise RuntimeError("the channel server has not started")
        return ChannelAddress(self._host, self._server.sockets[0].getsockname()[1], self._token)

    def close(self) -> None:
        """Take no new connection (those open go on: `drain` ends them)."""
        if self._server is not None:
            self._server.close()

    async def drain(self, timeout_s: float) -> None:
        """Before the replica stops: refuse every new chat (the ingress asks Serve for another replica), give the
        running ones up to `timeout_s` to finish, then close every connection (what is left ends with a 503)."""
        self._draining = True
        self.close()
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while self.in_flight and loop.time() < deadline:
            await asyncio.sleep(0.05)
        for writer in list(self._writers):
            writer.close()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        chats: dict[int, asyncio.Task] = {}
        self._writers.add(writer)
        try:
            _, kind, token = await asyncio.wait_for(_read_frame(reader, TOKEN_BYTES), HELLO_TIMEOUT_S)
            if kind != HELLO or not hmac.compare_digest(token, self._token):
                log.warning("chat channel: a connection without the token was closed")
                return
            _keep_alive(writer)
            while True:
                request_id, kind, payload = await _read_frame(reader)
                if kind == TASK and self._draining:
                    writer.write(_frame(request_id, REFUSED))
                elif kind == TASK and request_id not in chats:
                    self._tasks_seen += 1
                    chat = asyncio.create_task(self._run(request_id, pickle.loads(payload), writer))
                    chats[request_id] = chat
                    chat.add_done_callback(lambda _, rid=request_id: chats.pop(rid, None))
                elif kind == CANCEL and request_id in chats:
                    chats[request_id].cancel()
                elif kind == AHEAD and self._ahead is not None and not self._draining:
                    self._note(payload)
                    if self._ahead_spin_s > 0:  # awake until a chat arrives
                        seen, until = self._tasks_seen, time.perf_counter() + self._ahead_spin_s
                        loop_spin.keep_awake(asyncio.get_running_loop(), until, lambda: self._tasks_seen == seen)
        except (asyncio.IncompleteReadError, asyncio.TimeoutError, ConnectionError):
            pass  # the ingress went away (or never said hello): its chats end below
        except Exception:  # noqa: BLE001 - a frame that does not unpickle: this connection is not ours to serve
            log.warning("chat channel: closing a connection that sent a bad frame", exc_info=True)
        finally:
            self._writers.discard(writer)
            for chat in list(chats.values()):
                chat.cancel()
            writer.close()

    def _note(self, payload: bytes) -> None:
        """A note is an optimisation: one that does not unpickle or whose preparation fails is logged (the chat
        meets the same fault itself), never the connection's end."""
        try:
            self._ahead(pickle.loads(payload), self.ongoing == 0)  # type: ignore[misc]
        except Exception:  # noqa: BLE001
            log.debug("chat channel: preparing for a chat failed", exc_info=True)

    async def _run(self, request_id: int, task: Any, writer: asyncio.StreamWriter) -> None:
        self.in_flight += 1
        try:
            async with self._slots:
                await self._answer(request_id, task, writer)
        finally:
            self.in_flight -= 1

    async def _answer(self, request_id: int, task: Any, writer: asyncio.StreamWriter) -> None:
        self.ongoing += 1
        try:
            try:
                async with contextlib.aclosing(self._handler(task)) as events:  # a chat left early ends at once
                    async for event in events:
                        writer.write(_frame(request_id, EVENT, pickle.dumps(event, protocol=5)))
                        await writer.drain()
            except ConnectionError:
                return  # the ingress went away: no one reads this chat's events
            except Exception:  # noqa: BLE001 - the chat's own fault: it ends with an error event, the rest go on
                log.exception("chat %d over the channel failed", request_id)
                error = {"error": {"status": 500, "message": "the model replica failed this request"}}
                writer.write(_frame(request_id, EVENT, pickle.dumps(error, protocol=5)))
            writer.write(_frame(request_id, END))
        finally:
            self.ongoing -= 1


class _End:
    """Put on a chat's queue when the replica has sent its last event."""


class ChannelClient:
    """The ingress's end of one connection to one replica: `chat(task)` streams that chat's events."""

    def __init__(self, address: ChannelAddress) -> None:
        self.address = address
        self._ids = itertools.count(1)
        self._chats: dict[int, asyncio.Queue] = {}
        self._writer: asyncio.StreamWriter | None = None
        self._reading: asyncio.Task | None = None
        self._connecting = asyncio.Lock()
        self.closed = False

    async def chat(self, task: Any, sent: Callable[[], None] | None = None) -> AsyncIterator[dict[str, Any]]:
        """The chat's events; `ChannelClosed` if the connection breaks first. Closing the iterator early (the
        caller's client left) cancels the chat on the replica. `sent` is called once the task is on its way."""
        writer = await self._connected()
        request_id = next(self._ids)
        queue: asyncio.Queue = asyncio.Queue()
        self._chats[request_id] = queue
        ended = False
        try:
            if self.closed:  # broke while this chat waited for the connection
                raise ChannelClosed(f"the channel to {self.address.host}:{self.address.port} is closed")
            writer.write(_frame(request_id, TASK, pickle.dumps(task, protocol=5)))
            if sent is not None:
                sent()
            while True:
                item = await queue.get()
                if isinstance(item, _End):
                    ended = True
                    return
                if isinstance(item, BaseException):
                    ended = True
                    raise item
                yield item
        finally:
            self._chats.pop(request_id, None)
            if not ended and not self.closed:
                writer.write(_frame(request_id, CANCEL))

    def ahead(self, note: Any) -> None:
        """Send `note` ahead of a chat, on a connection already open (none is opened for it); nothing comes back."""
        if self._writer is not None and not self.closed:
            self._writer.write(_frame(0, AHEAD, pickle.dumps(note, protocol=5)))

    async def _connected(self) -> asyncio.StreamWriter:
        async with self._connecting:
            if self.closed:
                raise ChannelClosed(f"the channel to {self.address.host}:{self.address.port} is closed")
            if self._writer is None:
                try:
                    reader, writer = await asyncio.open_connection(self.address.host, self.address.port)
                except OSError as exc:
                    self.closed = True
                    raise ChannelClosed(f"cannot reach {self.address.host}:{self.address.port}: {exc}") from exc
                writer.write(_frame(0, HELLO, self.address.token))
                _keep_alive(writer)
                self._writer = writer
                self._reading = asyncio.create_task(self._read(reader))
            return self._writer

    async def _read(self, reader: asyncio.StreamReader) -> None:
        where = f"{self.address.host}:{self.address.port}"
        why: BaseException = ChannelClosed(f"the replica at {where} closed")
        try:
            while True:
                request_id, kind, payload = await _read_frame(reader)
                queue = self._chats.get(request_id)
                if queue is None:
                    continue
                if kind == EVENT:
                    queue.put_nowait(pickle.loads(payload))
                elif kind == END:
                    queue.put_nowait(_End())
                elif kind == REFUSED:
                    queue.put_nowait(ChannelClosed(f"the replica at {where} is stopping"))
        except (asyncio.IncompleteReadError, ConnectionError) as exc:
            if isinstance(exc, ChannelClosed):
                why = exc
        except Exception as exc:  # noqa: BLE001 - an event that does not unpickle here: every chat on it ends
            log.exception("chat channel: a bad frame from %s; closing the connection", where)
            why = ChannelClosed(f"a bad frame from the replica at {where}: {exc!r}")
        finally:
            self._close(why)

    def _close(self, why: BaseException) -> None:
        self.closed = True
        for queue in self._chats.values():
            queue.put_nowait(ChannelClosed(str(why)))
        if self._writer is not None:
            self._writer.close()

    def close(self) -> None:
        if self._reading is not None:
            self._reading.cancel()
        self._close(ChannelClosed("closed by the ingress"))


class ChannelPool:
    """One client per replica address, made on first use and replaced once its connection has broken."""

    def __init__(self) -> None:
        self._clients: dict[ChannelAddress, ChannelClient] = {}

    def client(self, address: ChannelAddress) -> ChannelClient:
        client = self._clients.get(address)
        if client is None or client.closed:
            self._clients = {a: c for a, c in self._clients.items() if not c.closed}  # replicas gone stay gone
            client = self._clients[address] = ChannelClient(address)
        return client

    def close(self) -> None:
        for client in self._clients.values():
            client.close()
        self._clients.clear()
