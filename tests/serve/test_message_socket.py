"""Messages cross the embedder's socket whole however the bytes arrive, and a closed peer is told apart from a
message still on the way."""

import threading

import pytest

from deployments.message_socket import BlockingSide, LoopSide, socket_pair


def test_a_message_read_in_pieces_comes_out_whole_and_only_once_complete():
    ours, theirs = socket_pair()
    loop_side = LoopSide(ours)
    framed = (5).to_bytes(8, "little") + b"hello" + (3).to_bytes(8, "little") + b"abc"
    assert loop_side.read() == []  # nothing yet: no message, and not a closed peer
    theirs.sendall(framed[:4])  # half the first length
    assert loop_side.read() == []
    theirs.sendall(framed[4:10])  # the length and part of the body
    assert loop_side.read() == []
    theirs.sendall(framed[10:])  # the rest, and the whole second message
    assert loop_side.read() == [b"hello", b"abc"]
    theirs.close()
    with pytest.raises(EOFError):
        loop_side.read()


def test_messages_sent_before_the_peer_closed_are_read_before_its_close():
    ours, theirs = socket_pair()
    loop_side = LoopSide(ours)
    BlockingSide(theirs).send(b"last words")
    theirs.close()
    assert loop_side.read() == [b"last words"]
    with pytest.raises(EOFError):
        loop_side.read()


def test_a_write_larger_than_the_socket_takes_is_kept_until_flushed():
    ours, theirs = socket_pair()
    loop_side, child = LoopSide(ours), BlockingSide(theirs)
    big = bytes(range(256)) * 16384  # 4 MiB: more than a socket's buffer
    assert loop_side.write(big) is False  # the rest waits
    received = []

    reader = threading.Thread(target=lambda: received.append(child.recv()))
    reader.start()
    while not loop_side.flush():
        pass
    reader.join(10)
    assert received == [big]


def test_the_blocking_side_reports_a_closed_peer():
    ours, theirs = socket_pair()
    child = BlockingSide(theirs)
    ours.close()
    with pytest.raises(EOFError):
        child.recv()


def test_the_blocking_side_polls_for_a_message_without_sleeping_until_its_deadline():
    import time

    ours, child = socket_pair()
    loop_side, blocking = LoopSide(ours), BlockingSide(child)
    started = time.perf_counter()
    assert not blocking.arrived_within(0.02)  # nothing came: it gave up at the deadline, not before
    assert time.perf_counter() - started >= 0.02
    loop_side.write(b"question")
    assert blocking.arrived_within(0.02) and blocking.recv() == b"question"  # polled, not taken
    loop_side.close()
    assert blocking.arrived_within(5)  # a closed peer ends the poll at once, and the read reports it
    with pytest.raises(EOFError):
        blocking.recv()
