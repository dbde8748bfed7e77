"""Queries that arrive together are embedded in one forward pass, in a thread or in a process of its own.

Each chat needs its question embedded before retrieval. One forward per request would queue requests
behind each other's launches; here, a request that finds the embedder idle starts a forward at once,
and the requests that arrive while it runs are embedded together by the next one (up to `max_batch`).
Nothing waits for a batch to fill, so a lone request pays no delay.

Under load the event loop is busy with other requests. Every pass through its ready queue serves their callbacks
first, so a forward is handed over from the caller's own step and comes back in one callback that resolves its
callers and starts the next batch. And a forward in a thread of the serving process takes the GIL back after every
torch call while the loop holds it in long pieces (on a CPU, with the loop 60 % busy in 1 ms pieces, MiniLM's
forward went from 8.9 to 16.3 ms: `benchmarks/retrieval.py`). `ProcessForwarder` runs the forward in a child
process, whose interpreter nothing else uses; the loop sees only a pipe becoming readable. `Embedded` reports
each query's legs and the forward's CPU time.
"""

from __future__ import annotations

import asyncio
import logging
import multiprocessing
import struct
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Callable, Protocol, Sequence

import numpy as np
import torch

log = logging.getLogger(__name__)
_HEADER = struct.Struct("<?dddI")  # a reply from the embedder's process: ok, started, ended, cpu s, rows; vectors
# (vectors or failure, started, ended, the forward's CPU time in its thread, s)
Done = Callable[["torch.Tensor | BaseException", float, float, float], None]


class TensorEmbedder(Protocol):
    """An embedder that returns its vectors as one tensor (on its device)."""

    def embed_tensor(self, texts: Sequence[str]) -> torch.Tensor: ...


class Forwarder(Protocol):
    """Runs one forward off the event loop and calls `done` on the loop with its outcome, its clock
    (`time.perf_counter`, which is the system's monotonic clock in every process) and its thread's CPU time."""

    def submit(self, loop: asyncio.AbstractEventLoop, texts: list[str], done: Done) -> None: ...

    def close(self) -> None: ...


@dataclass(frozen=True)
class Embedded:
    """A query's vector and where the time to it went (ms): waiting for the forwarder (a forward of earlier
    queries running), the forward itself (tokenizer, model, the device's answer), and the way back to the
    caller through the event loop; and how much of the forward was CPU time of its thread."""

    vector: torch.Tensor
    wait_ms: float
    forward_ms: float
    resume_ms: float
    forward_cpu_ms: float = 0.0  # of forward_ms, the forward thread's own CPU time (the rest: waiting)

    @property
    def total_ms(self) -> float:
        return self.wait_ms + self.forward_ms + self.resume_ms


def _vectors(embedder: TensorEmbedder, texts: list[str], device: torch.device | None = None) -> torch.Tensor:
    vectors = embedder.embed_tensor(texts)
    if device is not None:
        vectors = vectors.to(device)
    if vectors.is_cuda:  # wait for the device here, off the event loop, not in the search that follows on it
        torch.cuda.current_stream(vectors.device).synchronize()
    return vectors


class ThreadForwarder:
    """The forward in one thread of this process (its Python steps share this process's GIL)."""

    def __init__(self, embedder: TensorEmbedder, device: torch.device | None = None) -> None:
        self._embedder, self._device = embedder, device
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="query-embed")

    def submit(self, loop: asyncio.AbstractEventLoop, texts: list[str], done: Done) -> None:
        self._pool.submit(self._run, loop, texts, done)

    def _run(self, loop: asyncio.AbstractEventLoop, texts: list[str], done: Done) -> None:
        started, cpu = time.perf_counter(), time.thread_time()
        try:
            outcome: torch.Tensor | BaseException = _vectors(self._embedder, texts, self._device)
        except Exception as exc:  # noqa: BLE001 - every waiting request gets the failure
            outcome = exc
        loop.call_soon_threadsafe(done, outcome, started, time.perf_counter(), time.thread_time() - cpu)

    def close(self) -> None:
        self._pool.shutdown(wait=False)


class EmbedderProcessError(RuntimeError):
    """The query embedder's process failed to start or exited."""


class ProcessForwarder:
    """The forward in a child process (spawned, so it holds its own CUDA context), fed over a pipe.

    `factory` (picklable: a module-level function or a partial of one) builds the embedder in the child. The
    child exits when the pipe closes; if it dies, the batch in flight and every later one fail with
    `EmbedderProcessError` and `alive` turns false (the replica's health check reports it)."""

    def __init__(self, factory: Callable[[], TensorEmbedder], start_timeout_s: float = 300.0) -> None:
        """Spawns the process and returns: its start (loading the model, capturing graphs) overlaps the caller's
        own; `wait_ready` (or the first forward) waits for it."""
        context = multiprocessing.get_context("spawn")
        self._done: Done | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._ready, self._start_timeout_s = False, start_timeout_s
        self._failed: EmbedderProcessError | None = None  # why it did not start (raised again to every caller)
        self._conn, child = context.Pipe()
        self._process = context.Process(target=_serve, args=(child, factory), name="query-embed", daemon=True)
        self._process.start()
        child.close()

    def wait_ready(self) -> None:
        """Block until the process has built its embedder; `EmbedderProcessError` with the cause if it failed."""
        if self._ready:
            return
        if self._failed is None:
            self._failed = self._start_failure()
            if self._failed is None:
                self._ready = True
                return
            self.close()
        raise self._failed

    def _start_failure(self) -> EmbedderProcessError | None:
        if not self._conn.poll(self._start_timeout_s):
            return EmbedderProcessError(
                f"the query embedder's process did not start within {self._start_timeout_s:g} s"
            )
        try:
            kind, detail = self._conn.recv()
        except EOFError:
            kind, detail = "error", f"exited with code {self._process.join(5) or self._process.exitcode}"
        if kind != "ready":
            return EmbedderProcessError(f"the query embedder's process failed to start: {detail}")
        return None

    @property
    def alive(self) -> bool:
        return self._process.is_alive()

    def submit(self, loop: asyncio.AbstractEventLoop, texts: list[str], done: Done) -> None:
        now = time.perf_counter()
        if not self._ready:
            try:
                self.wait_ready()
            except EmbedderProcessError as exc:
                loop.call_soon(done, exc, now, now, 0.0)
                return
        if not self.alive:
            loop.call_soon(done, self._exited(), now, now, 0.0)
            return
        if self._loop is not loop:
            if self._loop is not None:
                self._loop.remove_reader(self._conn.fileno())
            loop.add_reader(self._conn.fileno(), self._on_readable)
            self._loop = loop
        self._done = done
        self._conn.send(texts)

    def _on_readable(self) -> None:
        done, self._done = self._done, None
        try:
            message = self._conn.recv_bytes()
        except (EOFError, OSError):
            assert self._loop is not None
            self._loop.remove_reader(self._conn.fileno())
            self._process.join(0.1)  # the pipe closed as it exited: its code, without holding the event loop
            log.error("the query embedder's process exited (code %s)", self._process.exitcode)
            if done is not None:
                now = time.perf_counter()
                done(self._exited(), now, now, 0.0)
            return
        ok, started, ended, cpu, rows = _HEADER.unpack_from(message)
        body = memoryview(message)[_HEADER.size :]
        if done is not None:
            vectors = torch.frombuffer(bytearray(body), dtype=torch.float32).view(rows, -1) if ok else None
            done(vectors if vectors is not None else RuntimeError(bytes(body).decode()), started, ended, cpu)

    def _exited(self) -> EmbedderProcessError:
        return EmbedderProcessError(f"the query embedder's process exited ({self._process.exitcode})")

    def close(self) -> None:
        """Close the pipe (the process exits on it) and reap the process; safe to call twice."""
        if self._loop is not None and not self._loop.is_closed() and not self._conn.closed:
            self._loop.remove_reader(self._conn.fileno())
        self._loop = None
        self._conn.close()
        self._process.join(5)
        if self._process.is_alive():
            self._process.kill()


def _serve(conn: Connection, factory: Callable[[], TensorEmbedder]) -> None:
    """The child: build the embedder, then answer each list of texts with their vectors (float32, host)."""
    try:
        embedder = factory()
    except Exception as exc:  # noqa: BLE001 - the parent raises it
        conn.send(("error", repr(exc)))
        return
    conn.send(("ready", ""))
    while True:
        try:
            texts = conn.recv()
        except (EOFError, OSError):  # the parent closed the pipe or exited
            return
        started, cpu = time.perf_counter(), time.thread_time()
        try:
            vectors = np.ascontiguousarray(_vectors(embedder, texts).float().cpu().numpy())
            header = _HEADER.pack(True, started, time.perf_counter(), time.thread_time() - cpu, len(vectors))
            conn.send_bytes(header + vectors.tobytes())
        except Exception as exc:  # noqa: BLE001 - the callers get it
            failed = _HEADER.pack(False, started, time.perf_counter(), time.thread_time() - cpu, 0)
            conn.send_bytes(failed + repr(exc).encode())


@dataclass
class _Waiting:
    text: str
    future: asyncio.Future
    since: float  # perf_counter at the call


class QueryBatcher:
    """`await embed(text)` -> the text's vector on `device` (the search's; None: where the forward left it),
    batched with concurrent callers, with its timing. `forwarder`: a `TensorEmbedder` runs in a thread."""

    def __init__(
        self,
        forwarder: Forwarder | TensorEmbedder,
        max_batch: int = 32,
        device: str | torch.device | None = None,
    ) -> None:
        self._device = torch.device(device) if device is not None else None
        if not hasattr(forwarder, "submit"):
            forwarder = ThreadForwarder(forwarder, self._device)  # type: ignore[arg-type]
        self._forwarder: Forwarder = forwarder  # type: ignore[assignment]
        self.max_batch = max_batch
        self._pending: list[_Waiting] = []
        self._running = False
        self.batches = 0  # forwards run so far (tests and metrics read it)

    @property
    def alive(self) -> bool:
        """False once the forwarder can no longer embed (its process died)."""
        return getattr(self._forwarder, "alive", True)

    async def embed(self, text: str) -> Embedded:
        loop = asyncio.get_running_loop()
        waiting = _Waiting(text, loop.create_future(), time.perf_counter())
        self._pending.append(waiting)
        if not self._running:
            self._start_next(loop)
        vector, started, ended, cpu = await waiting.future
        resumed = time.perf_counter()
        return Embedded(
            vector, (started - waiting.since) * 1000, (ended - started) * 1000, (resumed - ended) * 1000, cpu * 1000
        )

    def close(self) -> None:
        self._forwarder.close()

    def _start_next(self, loop: asyncio.AbstractEventLoop) -> None:
        """On the loop: hand the next batch to the forwarder, or mark the embedder idle."""
        if not self._pending:
            self._running = False
            return
        self._running = True
        batch, self._pending = self._pending[: self.max_batch], self._pending[self.max_batch :]
        self.batches += 1
        self._forwarder.submit(
            loop,
            [w.text for w in batch],
            lambda outcome, started, ended, cpu: self._finish(loop, batch, outcome, started, ended, cpu),
        )

    def _finish(
        self,
        loop: asyncio.AbstractEventLoop,
        batch: list[_Waiting],
        outcome: torch.Tensor | BaseException,
        started: float,
        ended: float,
        cpu: float,
    ) -> None:
        """On the loop: resolve the batch's callers, then start the batch that gathered meanwhile."""
        if isinstance(outcome, torch.Tensor) and self._device is not None and outcome.device != self._device:
            outcome = outcome.to(self._device)  # a process's vectors arrive on the host
        for i, waiting in enumerate(batch):
            if waiting.future.done():  # the caller gave up (its request was cancelled)
                continue
            if isinstance(outcome, BaseException):
                waiting.future.set_exception(outcome)
            else:
                waiting.future.set_result((outcome[i], started, ended, cpu))
        self._start_next(loop)
