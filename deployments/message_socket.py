"""Length-prefixed messages over a stream socket between an event loop and a child process.

multiprocessing's `Connection` reads a message with blocking reads. An event loop that watches the socket may make
it non-blocking (uvloop does, and Ray runs every replica on uvloop): a message read while its rest is still on the
way then fails with `BlockingIOError`, which looks like the peer's death. Here the loop's side reads whatever has
arrived into a buffer and takes whole messages out of it, and keeps what it writes until the socket takes it; the
child's side blocks.
"""

from __future__ import annotations

import socket
import struct
import time

_LENGTH = struct.Struct("<Q")
_READ = 1 << 20


def _framed(payload: bytes) -> bytes:
    return _LENGTH.pack(len(payload)) + payload


class LoopSide:
    """The event loop's end: never blocks. `read` when readable, `write` and then `flush` when writable."""

    def __init__(self, sock: socket.socket) -> None:
        sock.setblocking(False)
        self._sock = sock
        self._in = bytearray()
        self._out = bytearray()
        self._peer_closed = False

    def fileno(self) -> int:
        return self._sock.fileno()

    @property
    def closed(self) -> bool:
        return self._sock.fileno() < 0

    def read(self) -> list[bytes]:
        """The whole messages that have arrived (maybe none); `EOFError` once the peer has closed and every message
        it sent has been returned."""
        while not self._peer_closed:
            try:
                chunk = self._sock.recv(_READ)
            except (BlockingIOError, InterruptedError):
                break
            except ConnectionError:
                chunk = b""
            if not chunk:
                self._peer_closed = True
            self._in += chunk
        messages = []
        while len(self._in) >= _LENGTH.size:
            (size,) = _LENGTH.unpack_from(self._in)
            if len(self._in) < _LENGTH.size + size:
                break
            messages.append(bytes(self._in[_LENGTH.size : _LENGTH.size + size]))
            del self._in[: _LENGTH.size + size]
        if not messages and self._peer_closed:
            raise EOFError("the peer closed its end")
        return messages

    def write(self, payload: bytes) -> bool:
        """Queue one message and send what the socket takes now; False: the rest waits for `flush`.
        `BrokenPipeError` (an `OSError`) if the peer is gone."""
        self._out += _framed(payload)
        return self.flush()

    def flush(self) -> bool:
        """Send what is queued; True once nothing is left."""
        while self._out:
            try:
                sent = self._sock.send(self._out)
            except (BlockingIOError, InterruptedError):
                return False
            del self._out[:sent]
        return True

    def close(self) -> None:
        self._sock.close()


class BlockingSide:
    """The child's end: each call waits until its message is sent or has arrived whole."""

    def __init__(self, sock: socket.socket) -> None:
        sock.setblocking(True)
        self._sock = sock

    def send(self, payload: bytes) -> None:
        self._sock.sendall(_framed(payload))

    def arrived_within(self, seconds: float) -> bool:
        """Whether a message (or the peer's close) arrives within `seconds`, polled without sleeping: a process
        that spins takes it at once, where one asleep in `recv` first waits for the scheduler to wake it."""
        deadline = time.perf_counter() + seconds
        while True:
            try:
                self._sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT)
                return True  # a byte, or b"": the peer closed (`recv` raises it)
            except (BlockingIOError, InterruptedError):
                if time.perf_counter() >= deadline:
                    return False
            except OSError:  # the peer reset the connection: `recv` reports it
                return True

    def recv(self) -> bytes:
        """The next message; `EOFError` once the peer has closed."""
        (size,) = _LENGTH.unpack(self._exactly(_LENGTH.size))
        return self._exactly(size)

    def _exactly(self, size: int) -> bytes:
        buffer = bytearray(size)
        view, got = memoryview(buffer), 0
        while got < size:
            n = self._sock.recv_into(view[got:])
            if n == 0:
                raise EOFError("the peer closed its end")
            got += n
        return bytes(buffer)

    def close(self) -> None:
        self._sock.close()


def socket_pair() -> tuple[socket.socket, socket.socket]:
    """A connected pair of stream sockets: one end for each side (pass the child's to the process it starts)."""
    return socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
