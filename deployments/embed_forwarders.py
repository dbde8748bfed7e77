"""Where a batch of questions is embedded: on the event loop, in a thread of this process or in a child process.

A forwarder runs one `EmbedBatch` (the forward, then the search copy's updates and searches on the same device) and
calls back on the loop with its `Answer`. `InlineForwarder` launches it from the loop and polls the device between
other callbacks (no thread's wake-up on either side); `ThreadForwarder` shares this process's GIL;
`ProcessForwarder` runs the forward in a child whose interpreter nothing else uses (under load a forward in a thread
waits for a busy loop's GIL: `query_batcher.py`), fed over a socket the loop watches, answered in raw bytes. The
child is replaced when it dies; one that keeps dying is given up and reported.

A process asleep in a read, and a loop asleep in its poll, each pay a scheduler's wake-up before they run, on a
core that idled. With `spin_s`, neither sleeps around a question: a chat's arrival sends the idle child a wake
message (`wake`), and it polls its socket without sleeping until the batch comes (at most `spin_s`, and as long
again after each answer, for the next batch); the loop does not sleep while a batch is in flight (at most
`spin_s`), so it takes the answer as it lands. The cost is CPU time bounded by each chat request (refused ones
too: the wake goes out before the request is read), never a core held while no chat comes.
"""

from __future__ import annotations

import asyncio
import contextlib
import faulthandler
import json
import logging
import multiprocessing
import multiprocessing.process
import select
import signal
import socket
import struct
import threading
import time
import traceback
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Callable, ContextManager, Protocol, Sequence

import numpy as np
import torch

from deployments import loop_spin
from deployments.message_socket import BlockingSide, LoopSide, socket_pair
from models.minilm import GraphNotCaptured
from tenants.index_mirror import (
    Hits,
    IndexUpdate,
    MirrorIndexes,
    SearchAsk,
    pack_hits,
    pack_updates,
    unpack_hits,
    unpack_updates,
)

log = logging.getLogger(__name__)
_READY = b"R"  # the child's first message once its embedder is built (else b"E" and why)
_WAKE = b""  # to the child: a question is on its way (no answer)
# a reply from the embedder's process: ok, started, ended, cpu s, rows, dim; then vectors and hits (or the failure)
_HEADER = struct.Struct("<?dddII?")  # ... and whether the search copy failed
_LENGTH = struct.Struct("<I")


@dataclass(frozen=True)
class Answer:
    """A batch's vectors (one row a question) and, per question, what the search copy found (None: no search);
    `copy_failed`: the copy could not take its updates or search (the owner starts it over, smaller)."""

    vectors: torch.Tensor
    hits: Hits
    copy_failed: bool = False
    # the launch's host time by piece (ms: tokenize, forward, search, read_back), where it ran in this process
    launch_legs_ms: dict[str, float] = field(default_factory=dict)


# (answer or failure, started, ended, the forward's CPU time in its thread, s)
Done = Callable[["Answer | BaseException", float, float, float], None]


@dataclass(frozen=True)
class EmbedBatch:
    """What the forwarder runs at once: the copy's updates, the questions' texts and their searches."""

    texts: list[str]
    asks: list[SearchAsk | None]
    updates: list[IndexUpdate]

    def to_bytes(self) -> bytes:
        headers, blob = pack_updates(self.updates)
        asks = [None if a is None else [a.tenant_id, a.k] for a in self.asks]
        head = json.dumps({"texts": self.texts, "asks": asks, "updates": headers}).encode()
        return _LENGTH.pack(len(head)) + head + blob

    @classmethod
    def from_bytes(cls, data: bytes) -> "EmbedBatch":
        (size,) = _LENGTH.unpack_from(data)
        head = json.loads(data[_LENGTH.size : _LENGTH.size + size])
        asks = [None if a is None else SearchAsk(a[0], int(a[1])) for a in head["asks"]]
        return cls(head["texts"], asks, unpack_updates(head["updates"], memoryview(data)[_LENGTH.size + size :]))


class TensorEmbedder(Protocol):
    """An embedder that returns its vectors as one tensor (on its device)."""

    def embed_tensor(self, texts: Sequence[str]) -> torch.Tensor: ...


class Forwarder(Protocol):
    """Runs one forward off the event loop and calls `done` on the loop with its outcome, its clock
    (`time.perf_counter`, which is the system's monotonic clock in every process) and its thread's CPU time."""

    def submit(self, loop: asyncio.AbstractEventLoop, batch: EmbedBatch, done: Done) -> None: ...

    def close(self) -> None: ...


class Replaying(Protocol):
    """An embedder whose captured forward leaves a batch's vectors in one buffer (`models/minilm.py`), so the
    copy's searches, captured too, can read them there (`MirrorIndexes.replay_plan`)."""

    def replay_buffer(self, rows: Sequence[Sequence[int]]) -> torch.Tensor | None: ...

    def replayed(self, rows: Sequence[Sequence[int]]) -> ContextManager[None]: ...


def _run_batch(embedder: TensorEmbedder, copy: MirrorIndexes, batch: EmbedBatch) -> Answer:
    """The forward, the copy's updates and searches, the vectors on the host: one device wait, off the loop."""
    if all(hasattr(embedder, name) for name in ("token_ids", "embed_ids", "replayed")):  # MiniLM: ids apart
        forward, tokenize = embedder.embed_ids, embedder.token_ids  # type: ignore[attr-defined]
        answer, _ = _start_batch(forward, copy, batch, tokenize, embedder)  # type: ignore[arg-type]
    else:
        answer, _ = _start_batch(embedder.embed_tensor, copy, batch)
    return answer()


def _start_batch(
    forward: Callable[[Sequence[str]], torch.Tensor],
    copy: MirrorIndexes,
    batch: EmbedBatch,
    tokenize: Callable[[Sequence[str]], Any] | None = None,
    replaying: Replaying | None = None,
    capture_searches: bool = True,
) -> tuple[Callable[[], Answer], torch.cuda.Event | None]:
    """The copy's updates, the forward, the searches, and the read-back of vectors and hits, launched: the call
    returned makes the answer (waiting for the device if it has not finished), and the event (None on the host)
    tells when it has. A failure of the copy (out of device memory for a tenant sent whole) leaves the questions
    their vectors. With `tokenize`, `forward` takes what it returns (token ids) instead of the texts, and the
    answer's `launch_legs_ms` times the two apart. With `replaying` too, a batch whose every question the copy can
    search as a captured graph is the forward's replay and theirs (`MirrorIndexes.replay_plan`): a few host calls.
    Without `capture_searches` (on an event loop) a search graph not captured yet sends the batch the launched way,
    and is left for the copy's `capture_wanted`."""
    marks = [time.perf_counter()]
    inputs = tokenize(batch.texts) if tokenize is not None else batch.texts
    marks.append(time.perf_counter())
    copy_failed, launch = False, None
    try:  # before the forward, which may yet refuse (`GraphNotCaptured`: the batch runs again elsewhere, whole;
        copy.apply(batch.updates)  # every update is idempotent, so the copy takes them twice unharmed)
        if replaying is not None and tokenize is not None:
            launch = copy.replay_plan(replaying.replay_buffer(inputs), batch.asks, capture_searches)
    except Exception:  # noqa: BLE001 - the owner searches these itself
        log.exception("the search copy failed; its questions are searched by the ingress")
        copy.clear()
        copy_failed = True
    marks.append(time.perf_counter())
    if launch is not None:
        with replaying.replayed(inputs):  # type: ignore[union-attr]
            marks.append(time.perf_counter())
            read = launch()
        marks.append(time.perf_counter())
        landed = torch.cuda.Event()
        landed.record(torch.cuda.current_stream(copy.device))
        marks.append(time.perf_counter())
        legs = _launch_legs(marks, tokenize is not None)

        def replayed_answer() -> Answer:
            landed.synchronize()
            vectors, hits = read()
            return Answer(vectors, hits, False, legs)

        return replayed_answer, landed
    vectors = forward(inputs)
    marks.append(time.perf_counter())
    unsearched: Hits = [None] * len(batch.texts)
    hits: Callable[[], Hits] = lambda: unsearched  # noqa: E731
    if not copy_failed:
        try:
            hits = copy.search_started(vectors, batch.asks, caller_waits=True)  # `answer` waits for `landed` first
        except Exception:  # noqa: BLE001 - the owner searches these itself
            log.exception("the search copy failed; its questions are searched by the ingress")
            copy.clear()
            copy_failed = True
    marks.append(time.perf_counter())
    on_host = vectors.device.type == "cpu"
    # each torch call is a cold dispatch on a host whose caches a gap between questions emptied: none spared
    as_float = vectors if vectors.dtype == torch.float32 else vectors.float()
    host_vectors = as_float.to("cpu", non_blocking=not on_host)  # pinned where non-blocking
    landed = None
    if not on_host:
        landed = torch.cuda.Event()
        landed.record(torch.cuda.current_stream(vectors.device))
    marks.append(time.perf_counter())
    legs = _launch_legs(marks, tokenize is not None)

    def answer() -> Answer:
        if landed is not None:
            landed.synchronize()
        return Answer(host_vectors, hits(), copy_failed, legs)

    return answer, landed


def _launch_legs(marks: list[float], tokenized_apart: bool) -> dict[str, float]:
    """The launch's host time by piece (ms) from its marks: started, tokenized, the copy's updates applied (and
    its graphs planned), the forward launched, the searches launched, the read-back launched. Without a tokenizer
    of its own, the forward's leg holds the tokenizer."""
    ms = [(end - begin) * 1000 for begin, end in zip(marks, marks[1:])]
    legs = {"tokenize": ms[0], "forward": ms[2], "search": ms[1] + ms[3], "read_back": ms[4]}
    if not tokenized_apart:
        legs["forward"] += legs.pop("tokenize")
    return {leg: round(value, 4) for leg, value in legs.items()}


def _answer_from_thread(run: Callable[[], Answer], loop: asyncio.AbstractEventLoop, done: Done) -> None:
    """In a worker thread: run a batch whole and hand its outcome, clock and CPU time to `done` on the loop."""
    started, cpu = time.perf_counter(), time.thread_time()
    try:
        outcome: Answer | BaseException = run()
    except Exception as exc:  # noqa: BLE001 - every waiting request gets the failure
        outcome = exc
    loop.call_soon_threadsafe(done, outcome, started, time.perf_counter(), time.thread_time() - cpu)


def _device_of(embedder: TensorEmbedder) -> torch.device:
    return torch.device(getattr(embedder, "device", "cpu"))


class ThreadForwarder:
    """The forward in one thread of this process (its Python steps share this process's GIL)."""

    def __init__(self, embedder: TensorEmbedder, search_graphs: bool = False) -> None:
        self._embedder, self._copy = embedder, MirrorIndexes(_device_of(embedder), search_graphs)
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="query-embed")

    def submit(self, loop: asyncio.AbstractEventLoop, batch: EmbedBatch, done: Done) -> None:
        self._pool.submit(self._run, loop, batch, done)

    def _run(self, loop: asyncio.AbstractEventLoop, batch: EmbedBatch, done: Done) -> None:
        _answer_from_thread(lambda: _run_batch(self._embedder, self._copy, batch), loop, done)

    def close(self) -> None:
        self._pool.shutdown(wait=False)


class InlineForwarder:
    """The forward launched on the event loop itself, its answer taken by the loop as the device finishes.

    A thread or a process answers through a sleeping thread's wake-up on each side (the H200's serving run,
    2026-12-05: 0.22 ms to the child's start, 0.25 from its answer back to the handler, of a 1.16 ms embedding).
    Here the loop that read the request launches the graph's replay, the search and their read-back into pinned
    memory (a few host calls on a core that is awake), then keeps a callback ready that asks the device whether it
    is done, for at most `spin_s` (then every `poll_s`): other requests are served between the asks, and nothing
    sleeps. A caller's own work beside the question (its note to the LLM replica) runs while the device computes.
    On the host (no device) the forward runs on the loop, whole, one callback after the caller's work. Queries get
    a stream of their own, so a fact batch embedded by another thread of this process does not queue them. The loop
    only replays graphs captured already: a batch whose bucket has none yet (a question longer than the buckets
    captured at start) runs once in a thread, which captures it; a batch whose tenant's search has no graph yet
    (its first questions, or its matrix grew) is searched call by call, and the thread captures that graph."""

    def __init__(
        self, embedder: TensorEmbedder, spin_s: float = 0.02, poll_s: float = 0.0002, search_graphs: bool = False
    ) -> None:
        """`search_graphs`: on a CUDA device, each tenant's search in the copy is captured as a CUDA graph and
        replayed after the question's (`tenants/search_graphs.py`)."""
        device = _device_of(embedder)
        self._embedder, self._copy = embedder, MirrorIndexes(device, search_graphs)
        # on the loop only what replays captured graphs: a bucket to capture first (a long question) runs once in
        # a thread of its own, since a capture takes tens of ms that the loop would stall for
        self._on_loop = getattr(embedder, "embed_tensor_captured", embedder.embed_tensor)
        self._tokenize = None  # with an embedder that takes token ids, the launch times its tokenizer apart
        if hasattr(embedder, "token_ids") and hasattr(embedder, "embed_ids_captured"):
            self._tokenize, self._on_loop = embedder.token_ids, embedder.embed_ids_captured
        # with a forward that leaves its vectors in one buffer, the copy's searches replay as captured graphs too
        self._replaying = embedder if self._tokenize is not None and hasattr(embedder, "replayed") else None
        self._pool: ThreadPoolExecutor | None = None
        self._search_capture_queued = False
        self._spin_s, self._poll_s = spin_s, poll_s
        stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self._on_stream = (lambda: torch.cuda.stream(stream)) if stream is not None else contextlib.nullcontext
        self.launch_at_once = stream is not None  # the device computes while the caller's work runs

    def submit(self, loop: asyncio.AbstractEventLoop, batch: EmbedBatch, done: Done) -> None:
        """On a device, launched at once: the caller's own work (its note to the LLM replica) then runs while the
        device computes. On the host the forward is the work itself, so it waits one callback for the caller's."""
        if self.launch_at_once:
            self._launch(loop, batch, done)
        else:
            loop.call_soon(self._launch, loop, batch, done)

    def _launch(self, loop: asyncio.AbstractEventLoop, batch: EmbedBatch, done: Done) -> None:
        started, cpu = time.perf_counter(), time.thread_time()
        try:
            with self._on_stream():
                answer, landed = _start_batch(
                    self._on_loop, self._copy, batch, self._tokenize, self._replaying, capture_searches=False
                )
        except GraphNotCaptured:
            self._capturing().submit(self._in_thread, loop, batch, done)
            return
        except Exception as exc:  # noqa: BLE001 - every waiting request gets the failure
            done(exc, started, time.perf_counter(), time.thread_time() - cpu)
            return
        self._queue_search_captures()
        self._check(loop, answer, landed, done, started, time.thread_time() - cpu, started + self._spin_s)

    def _queue_search_captures(self) -> None:
        """The copy's searches this batch found without a graph, captured in the capture thread: one job takes
        every graph noted until it runs."""
        if not self._copy.wants_captures or self._search_capture_queued:
            return
        try:
            self._capturing().submit(self._capture_searches)
        except RuntimeError:  # closed: nothing more is captured
            return
        self._search_capture_queued = True

    def _capturing(self) -> ThreadPoolExecutor:
        """The one thread where captures run (the embedder's buckets, the copy's searches), made at its first use."""
        if self._pool is None:
            self._pool = ThreadPoolExecutor(1, thread_name_prefix="query-embed-capture")
        return self._pool

    def _capture_searches(self) -> None:
        self._search_capture_queued = False  # graphs noted from here on get a job of their own
        try:
            self._copy.capture_wanted()
        except Exception:  # noqa: BLE001 - a job's failure would otherwise be lost with its future
            log.exception("capturing the copy's searches failed")

    def _in_thread(self, loop: asyncio.AbstractEventLoop, batch: EmbedBatch, done: Done) -> None:
        """A batch whose graph is captured first, whole, off the loop (the next batches of its bucket replay it)."""

        def run() -> Answer:
            with self._on_stream():
                return _run_batch(self._embedder, self._copy, batch)

        _answer_from_thread(run, loop, done)

    def _check(
        self,
        loop: asyncio.AbstractEventLoop,
        answer: Callable[[], Answer],
        landed: torch.cuda.Event | None,
        done: Done,
        started: float,
        cpu: float,
        spin_until: float,
    ) -> None:
        try:
            pending = landed is not None and not landed.query()
        except Exception:  # noqa: BLE001 - a device error: the answer raises it to every waiting request
            pending = False
        if pending:
            args = (loop, answer, landed, done, started, cpu, spin_until)
            if time.perf_counter() < spin_until:
                loop.call_soon(self._check, *args)
            else:
                loop.call_later(self._poll_s, self._check, *args)
            return
        before = time.thread_time()
        try:
            outcome: Answer | BaseException = answer()
        except Exception as exc:  # noqa: BLE001 - every waiting request gets the failure
            outcome = exc
        done(outcome, started, time.perf_counter(), cpu + time.thread_time() - before)

    def close(self) -> None:
        """A batch in flight on the loop ends with its loop; one capturing in the thread is not waited for."""
        if self._pool is not None:
            self._pool.shutdown(wait=False)


class EmbedderProcessError(RuntimeError):
    """The query embedder's process failed to start, exited, or was restarted too often."""


class ProcessForwarder:
    """The forward in a child process (spawned, so it holds its own CUDA context), fed over a socket.

    `factory` (picklable: a module-level function or a partial of one) builds the embedder in the child. The
    child exits when the socket closes. If it dies, the batch in flight fails with `EmbedderProcessError` (the
    HTTP layer answers 503) and a new process is started at once; later batches wait for its start. After
    `max_restarts` deaths with no batch served in between, it gives up: every caller fails and `alive` turns
    false (the replica's health check reports it, so Serve replaces the replica). The child writes a dying
    traceback (Python's and, for a crash, faulthandler's) to its stderr, which is the replica's log. Messages go
    through `message_socket`, which reads a reply that arrives in pieces whole on any event loop."""

    def __init__(
        self,
        factory: Callable[[], TensorEmbedder],
        start_timeout_s: float = 300.0,
        max_restarts: int = 3,
        spin_s: float = 0.0,
        search_graphs: bool = False,
    ) -> None:
        """Spawns the process and returns: its start (loading the model, capturing graphs) overlaps the caller's
        own; `wait_ready` (or the first forward) waits for it. `spin_s`: how long the child and the loop poll
        instead of sleeping around a question (module docstring); 0: they sleep. `search_graphs`: as
        `InlineForwarder`'s."""
        self._factory, self._start_timeout_s, self._max_restarts = factory, start_timeout_s, max_restarts
        self._spin_s, self._search_graphs = spin_s, search_graphs
        self._woken = float("-inf")  # when the last wake message was sent
        self._context = multiprocessing.get_context("spawn")
        self._done: Done | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._failed: EmbedderProcessError | None = None  # given up: raised to every caller
        self._deaths = 0  # since the last batch served
        self.restarts = 0  # processes started after the first (metrics and tests read it)
        self._spawn()

    def _spawn(self) -> None:
        self._ready = False
        ours, child = socket_pair()
        try:
            self._process = self._context.Process(
                target=_serve,
                args=(child, self._factory, self._spin_s, self._search_graphs),
                name="query-embed",
                daemon=True,
            )
            self._process.start()
        except BaseException:
            ours.close()
            raise
        finally:
            child.close()
        self._side = LoopSide(ours)
        self._early: list[bytes] = []  # replies that came with the start message (`wait_ready` reads both)

    def wait_ready(self) -> None:
        """Block until the process has built its embedder; `EmbedderProcessError` with the cause if it failed."""
        if self._ready:
            return
        if self._failed is None:
            self._failed = self._wait_start()
            if self._failed is None:
                return
            self.close()
        raise self._failed

    def _wait_start(self) -> EmbedderProcessError | None:
        deadline = time.monotonic() + self._start_timeout_s
        while True:
            try:
                messages = self._side.read()
            except (EOFError, OSError):
                self._process.join(5)
                return EmbedderProcessError(
                    f"the query embedder's process exited with code {self._process.exitcode} as it started"
                )
            if messages:
                self._early = messages[1:]  # answered once a loop watches (`_watch`)
                return self._started(messages[0])
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return EmbedderProcessError(
                    f"the query embedder's process did not start within {self._start_timeout_s:g} s"
                )
            poller = select.poll()  # not select.select: Ray's workers may hold descriptors numbered past 1024
            poller.register(self._side.fileno(), select.POLLIN)
            poller.poll(remaining * 1000)

    def _started(self, message: bytes) -> EmbedderProcessError | None:
        """The child's first message: ready, or why its embedder could not be built."""
        if message == _READY:
            self._ready = True
            return None
        return EmbedderProcessError(f"the query embedder's process failed to start: {message[1:].decode()}")

    @property
    def alive(self) -> bool:
        """False once it has given up (a failed start, or too many deaths in a row)."""
        return self._failed is None

    def submit(self, loop: asyncio.AbstractEventLoop, batch: EmbedBatch, done: Done) -> None:
        """`QueryBatcher` has called `watch` first: a process that died while idle is already replaced."""
        if self._failed is not None:
            now = time.perf_counter()
            loop.call_soon(done, self._failed, now, now, 0.0)
            return
        self._watch(loop)
        self._done = done
        try:  # before the process is ready it waits in the socket
            if not self._side.write(batch.to_bytes()):
                loop.add_writer(self._side.fileno(), self._flush)
        except OSError:
            self._died(loop, in_flight=self._take_done())
            return
        if self._spin_s > 0:  # awake while this batch is out
            loop_spin.keep_awake(loop, time.perf_counter() + self._spin_s, lambda: self._done is done)

    def wake(self, loop: asyncio.AbstractEventLoop) -> None:
        """On the loop, as a chat arrives: with `spin_s`, tell the idle child that a question is on its way, so
        that it is awake and polling when the batch comes. Nothing while a batch runs (the child is awake) or
        while an earlier wake still holds it."""
        now = time.perf_counter()
        if self._spin_s <= 0 or not self._ready or self._failed is not None or self._done is not None:
            return
        if self._side.closed:  # closed (the replica is stopping): nothing to wake
            return
        if now - self._woken < self._spin_s / 2:
            return
        self._woken = now
        self._watch(loop)
        try:
            if not self._side.write(_WAKE):
                loop.add_writer(self._side.fileno(), self._flush)
        except OSError:
            pass  # the process is gone: the next batch finds it out and starts another

    def watch(self, loop: asyncio.AbstractEventLoop) -> None:
        """On the loop: follow the process from now on, so that its death is answered at once (a new process
        started) even while no question comes. The replica's health check calls it."""
        if self._failed is not None:
            return
        if self._done is None and not self._process.is_alive():  # died while idle: start another now
            self._died(loop, in_flight=None)
            return
        self._watch(loop)

    def _flush(self) -> None:
        assert self._loop is not None
        try:
            if self._side.flush():
                self._loop.remove_writer(self._side.fileno())
        except OSError:
            self._died(self._loop, in_flight=self._take_done())

    def _watch(self, loop: asyncio.AbstractEventLoop) -> None:
        if self._loop is loop:
            return
        self._unwatch()
        loop.add_reader(self._side.fileno(), self._on_readable)
        self._loop = loop
        early, self._early = self._early, []
        for message in early:
            loop.call_soon(self._received, message)

    def _unwatch(self) -> None:
        if self._loop is not None and not self._loop.is_closed() and not self._side.closed:
            self._loop.remove_reader(self._side.fileno())
            self._loop.remove_writer(self._side.fileno())
        self._loop = None

    def _take_done(self) -> Done | None:
        done, self._done = self._done, None
        return done

    def _on_readable(self) -> None:
        assert self._loop is not None
        try:
            messages = self._side.read()
        except (EOFError, OSError):
            self._died(self._loop, in_flight=self._take_done())
            return
        for message in messages:
            self._received(message)

    def _received(self, message: bytes) -> None:
        if not self._ready:
            self._failed = self._started(message)
            if self._failed is not None:  # given up: its socket is closed, no new process is started
                log.error("%s", self._failed)
                self._unwatch()
                self._side.close()
                self._fail(self._take_done(), self._failed)
            return
        done = self._take_done()
        ok, started, ended, cpu, rows, dim, copy_failed = _HEADER.unpack_from(message)
        body = memoryview(message)[_HEADER.size :]
        if ok:
            self._deaths = 0
        if done is None:
            return
        outcome: Answer | BaseException
        try:
            if not ok:
                raise RuntimeError(bytes(body).decode())
            size = rows * dim * 4
            vectors = torch.frombuffer(bytearray(body[:size]), dtype=torch.float32).view(rows, dim)
            outcome = Answer(vectors, unpack_hits(body[size:], rows), copy_failed)
        except Exception as exc:  # noqa: BLE001 - its callers get it, not the loop
            outcome = exc
        done(outcome, started, ended, cpu)

    def _died(self, loop: asyncio.AbstractEventLoop, in_flight: Done | None) -> None:
        """On the loop: the process is gone. Fail the batch it held, log its exit code once it is known (off
        the loop), and start another unless too many died in a row."""
        process = self._process
        self._unwatch()
        self._side.close()
        threading.Thread(target=_log_exit, args=(process,), name="query-embed-reaper", daemon=True).start()
        self._deaths += 1
        if self._deaths > self._max_restarts:
            self._failed = EmbedderProcessError(
                f"the query embedder's process exited {self._deaths} times in a row; not restarted again"
            )
        else:
            try:
                self._spawn()
            except Exception as exc:  # noqa: BLE001 - no process (out of descriptors, memory): give up
                self._failed = EmbedderProcessError(f"the query embedder's process could not be restarted: {exc}")
            else:
                self.restarts += 1
                self._watch(loop)
                loop.call_later(self._start_timeout_s, self._overdue, self._process)
        self._fail(
            in_flight, self._failed or EmbedderProcessError("the query embedder's process exited; restarting it")
        )

    def _overdue(self, process: multiprocessing.process.BaseProcess) -> None:
        if process is self._process and not self._ready and process.is_alive():
            log.error("the query embedder's process did not start within %g s; killing it", self._start_timeout_s)
            process.kill()  # its socket closes: the loop sees a death

    @staticmethod
    def _fail(done: Done | None, error: EmbedderProcessError) -> None:
        if done is not None:
            now = time.perf_counter()
            done(error, now, now, 0.0)

    def close(self) -> None:
        """Close the socket (the process exits on it) and reap the process; safe to call twice."""
        self._unwatch()
        self._side.close()
        self._process.join(5)
        if self._process.is_alive():
            self._process.kill()


def _log_exit(process: multiprocessing.process.BaseProcess) -> None:
    process.join(60)
    code = process.exitcode
    how = f"signal {signal.Signals(-code).name}" if code is not None and code < 0 else f"code {code}"
    log.error(
        "the query embedder's process (pid %s) exited with %s; its stderr is in this replica's log", process.pid, how
    )


def _serve(
    sock: socket.socket, factory: Callable[[], TensorEmbedder], spin_s: float = 0.0, search_graphs: bool = False
) -> None:
    """The child: build the embedder, then answer each list of texts with their vectors (float32, host)."""
    faulthandler.enable()  # a crash in native code leaves its Python stack in the replica's log
    side = BlockingSide(sock)
    try:
        embedder = factory()
    except Exception as exc:  # noqa: BLE001 - the parent raises it
        side.send(b"E" + repr(exc).encode())
        return
    side.send(_READY)
    try:
        _answer(side, embedder, spin_s, search_graphs)
    except BaseException:
        traceback.print_exc()  # whatever ends the process besides its socket closing
        raise


def _answer(side: BlockingSide, embedder: TensorEmbedder, spin_s: float, search_graphs: bool) -> None:
    copy = MirrorIndexes(_device_of(embedder), search_graphs)
    while True:
        try:
            message = side.recv()
        except (EOFError, OSError):  # the parent closed its end or exited
            return
        if message == _WAKE:  # the batch follows: poll for it rather than sleep
            side.arrived_within(spin_s)
            continue
        started, cpu = time.perf_counter(), time.thread_time()
        try:
            answer = _run_batch(embedder, copy, EmbedBatch.from_bytes(message))
            vectors = np.ascontiguousarray(answer.vectors.numpy())
            rows, dim = vectors.shape
            header = _HEADER.pack(
                True, started, time.perf_counter(), time.thread_time() - cpu, rows, dim, answer.copy_failed
            )
            side.send(header + vectors.tobytes() + pack_hits(answer.hits))
        except Exception as exc:  # noqa: BLE001 - the callers get it
            failed = _HEADER.pack(False, started, time.perf_counter(), time.thread_time() - cpu, 0, 0, False)
            side.send(failed + repr(exc).encode())
        if spin_s > 0:  # under load the next batch follows at once
            side.arrived_within(spin_s)
