"""History mode's choice on a GPU as CUDA graph replays: the question's pass, then the chunks' order.

A history question's choice at four scoring layers is ~300 small device operations: the question's pass (~100), then
its rows in float64, the bounds kernel, the float32 margin, the masses and their order (~180). Launched one by one
from Python they cost the host ~2.4 ms on the H200 (2026-12-05) for ~1 ms of device work. Captured, each part is one
launch:
- `QuestionPass`: one graph per question-length bucket, the question padded at its end (the pass is causal: its
  own tokens' queries stay exact).
- `RetrievalGraph`: one graph per kept history for its chunks in retrieval order (its turns' vectors are fixed with
  its index: the question's vector is the only input).
- `OrderGraphs`: one graph per (chunk bucket, question bucket) for the order, fed by the pass's output. A graph's
  shapes are fixed, so a history's summaries are copied, laid along chunks, into buffers of its chunk bucket (a
  multiple of `CHUNK_STEP`), and the chunks past its own are masked out of the softmax and sorted last; the
  question's padding repeats its last token's query at that token's position (each chunk's bound is a maximum
  over the queries, which a repeat leaves unchanged); the question's tokens, the history's length, chunk count
  and extent reach the device as one copy. `padded_order` is the graphs' body, checked eagerly against
  `HistoryIndex.mass_order` (tests/kernels/order_check.py).
The eager path stays for questions past the largest bucket, partial rotary, and a capture the driver refuses.
"""

from __future__ import annotations

import logging
import math
import threading
import weakref
from dataclasses import dataclass
from typing import Any, Callable

import torch

from kvcore.history_index import HistoryIndex
from kvcore.query_pass import EarlyLayers, queries_of, question_queries
from kvcore.rope import RopeConfig, device_inverse_frequencies

log = logging.getLogger(__name__)

QUESTION_BUCKETS = (16, 32, 64, 128)  # question lengths the GPU pass is captured at; longer ones run eagerly
CHUNK_STEP = 512  # a chunk bucket's multiple: a 2,049-chunk history is scored as 2,560 (a power of two: 4,096)
BOUNDS_ACCUMULATE = "float32"  # how history mode sums the bounds, eager or graphed (margin kept: sound)
_HEADER = 4  # after a question's tokens: its last token's index, the history's chunk count, length and extent


def bucket_of(tokens: int) -> int | None:
    """The smallest question bucket that holds `tokens` (None past the largest)."""
    return next((b for b in QUESTION_BUCKETS if b >= tokens), None)


class QuestionPass:
    """The question's pass through the first layers: eager on the CPU; on CUDA one graph per length bucket, so its
    ~100 small kernels cost one launch (6.1 ms a question eagerly at the 8B shape on the H200, 2026-12-04)."""

    def __init__(self, weights: EarlyLayers) -> None:
        self.weights = weights
        self._graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor, torch.Tensor]] | None = (
            {} if weights.embed_tokens.device.type == "cuda" else None
        )
        self.lock = threading.Lock()  # one replay at a time: a graph's input and output buffers are shared

    @property
    def graphed(self) -> bool:
        return self._graphs is not None

    @torch.inference_mode()  # the graphs' buffers are inference tensors: only written to in inference mode
    def __call__(self, token_ids: list[int]) -> torch.Tensor:
        """Pre-RoPE queries `[L, H, Q, D]` of the question's tokens."""
        bucket = bucket_of(len(token_ids))
        if self._graphs is None or bucket is None or not token_ids:
            return question_queries(self.weights, token_ids)
        with self.lock:
            out = self.replay(bucket, token_ids=token_ids)
            return question_queries(self.weights, token_ids) if out is None else out[:, :, : len(token_ids)].clone()

    @torch.inference_mode()
    def replay(
        self, bucket: int, token_ids: list[int] | None = None, ids: torch.Tensor | None = None
    ) -> torch.Tensor | None:
        """With `lock` held: the bucket's graph replayed for `token_ids` (or ids already on the device, `[bucket]`,
        zero padded); its output `[L, H, bucket, D]`, valid until the next replay. None where no graph serves (a
        capture the driver refused: eager passes from then on)."""
        if self._graphs is None:
            return None
        if bucket not in self._graphs:
            try:
                self._graphs[bucket] = self._capture(bucket)
            except torch.OutOfMemoryError:  # a full device, for now: this question fails (503), the next retries
                raise
            except RuntimeError as exc:
                log.warning("CUDA graph capture failed for the question pass (%s); running it eagerly", exc)
                self._graphs = None
                return None
        graph, static_ids, out = self._graphs[bucket]
        if ids is not None:
            static_ids.copy_(ids)
        else:
            static_ids.zero_()
            static_ids[: len(token_ids or ())].copy_(torch.tensor(token_ids or [], dtype=torch.long))
        graph.replay()
        return out

    @torch.inference_mode()
    def _capture(self, bucket: int) -> tuple[torch.cuda.CUDAGraph, torch.Tensor, torch.Tensor]:
        device = self.weights.embed_tokens.device
        ids = torch.zeros(bucket, dtype=torch.long, device=device)
        graph, out = capture(lambda: queries_of(self.weights, ids), device)
        return graph, ids, out


class RetrievalGraph:
    """A history's chunks by retrieval (`HistoryIndex.by_retrieval`: the turns' similarities to the question's
    vector, each chunk's best, sorted) as one replay instead of five launches (0.52 ms of a choice's host time on an
    H100, 2026-12-06). Its own memory pool: it replays on the chooser's second stream, beside the order's graphs."""

    @torch.inference_mode()
    def __init__(self, index: HistoryIndex) -> None:
        vectors = index.turn_vectors
        self._vector = torch.zeros(vectors.shape[1], dtype=torch.float32, device=vectors.device)
        self._graph, self._out = capture(lambda: index.by_retrieval(self._vector), vectors.device)
        self._lock = threading.Lock()  # one replay at a time: the input and output buffers are shared

    @torch.inference_mode()
    def order(self, vector: torch.Tensor) -> torch.Tensor:
        """`by_retrieval(vector)` on the current stream (a copy: the next replay rewrites the graph's output)."""
        with self._lock:
            self._vector.copy_(vector)
            self._graph.replay()
            return self._out.clone()

    @staticmethod
    def for_index(index: HistoryIndex) -> "RetrievalGraph | None":
        """The graph of a GPU index with turns; None where the eager path serves (a CPU index, no turns, or a
        capture the driver refuses)."""
        if index.turn_vectors is None or not index.turns or index.turn_vectors.device.type != "cuda":
            return None
        try:
            return RetrievalGraph(index)
        except torch.OutOfMemoryError:
            raise
        except Exception:  # noqa: BLE001 - a capture the driver refuses: this history's retrieval stays eager
            log.warning("CUDA graph capture failed for a history's retrieval order; ordering eagerly", exc_info=True)
            return None


def capture(
    body: Callable[[], torch.Tensor], device: torch.device, pool: Any = None
) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
    """`body` captured as a CUDA graph, after two warm-up runs on a side stream (lazy tables, Triton's compile and
    cuBLAS's workspaces are made outside the capture); the graph and its output. `pool`: a memory pool shared with
    other graphs, for graphs that never run at the same time and whose outputs are copied out at once after each
    replay (another graph's replay may reuse what was this one's)."""
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        for _ in range(2):
            body()
    torch.cuda.current_stream(device).wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool, capture_error_mode="thread_local"):  # other threads keep using the GPU
        out = body()
    return graph, out


@dataclass
class LaidSummaries:
    """A chunk bucket's summaries laid along chunks (`[L*KVH, X, chunks]`, the bounds kernel's layout), and which
    history's they hold now."""

    high: torch.Tensor
    low: torch.Tensor
    norms: torch.Tensor
    layers: int
    kv_heads: int
    holds: Any = None  # a weak reference to the summaries copied in last

    @classmethod
    def empty(cls, like: HistoryIndex, chunks: int) -> "LaidSummaries":
        summaries = like.summaries
        layers, kv_heads = summaries.low.shape[1:3]

        def zeros(t: torch.Tensor) -> torch.Tensor:
            return t.new_zeros(layers * kv_heads, t.shape[-1], chunks)

        return cls(zeros(summaries.high), zeros(summaries.low), zeros(summaries.norms), layers, kv_heads)

    def fits(self, index: HistoryIndex) -> bool:
        """Whether `index`'s summaries have these buffers' layers, KV heads, widths and dtypes."""
        mine = self.high, self.low, self.norms
        theirs = index.summaries.high, index.summaries.low, index.summaries.norms
        return all(
            a.dtype == b.dtype and b.shape[1:] == (self.layers, self.kv_heads, a.shape[1]) for a, b in zip(mine, theirs)
        )

    def hold(self, index: HistoryIndex, along_chunks: Callable[[torch.Tensor], torch.Tensor]) -> None:
        """Copy `index`'s summaries in, laid along chunks (three copies, skipped while it is the one held)."""
        if self.holds is not None and self.holds() is index.summaries:
            return
        count = len(index.spans)
        for mine, theirs in zip(
            (self.high, self.low, self.norms), (index.summaries.high, index.summaries.low, index.summaries.norms)
        ):
            mine[:, :, :count].copy_(along_chunks(theirs))
        self.holds = weakref.ref(index.summaries)


def padded_order(
    queries: torch.Tensor,
    header: torch.Tensor,
    laid: LaidSummaries,
    rope: RopeConfig,
    kv_heads: int,
    bounds_inputs: Any,
) -> torch.Tensor:
    """The chunks of a chunk bucket by estimated attention mass, highest first, the bucket's padding last: what
    `HistoryIndex.mass_order` gives for the history held in `laid`, from fixed shapes only (a graph's body).

    `queries` `[L, H, B, D]`: the question's pass over its bucket of B tokens; `header` int64 `[B + 4]`: the tokens,
    then the question's last token's index, the history's chunk count, its length (the question's first position)
    and the summaries' extent. `bounds_inputs`: the Triton adapter's `BoundsInputs`."""
    layers, heads, bucket, dim = queries.shape
    last, count, first, extent = header[bucket : bucket + _HEADER]
    group = heads // kv_heads
    pick = torch.minimum(torch.arange(bucket, device=queries.device), last)  # the padding repeats the last token
    chosen = queries.index_select(2, pick)
    grouped = (
        chosen.view(layers, kv_heads, group, bucket, dim).permute(3, 2, 0, 1, 4).reshape(-1, layers, kv_heads, dim)
    )
    positions = (first + pick).repeat_interleave(group)
    inputs = bounds_inputs.laid_out(grouped, positions, 0, extent, rope, laid.high, laid.low, laid.norms)
    chunks = laid.high.shape[-1]
    best = inputs.best(accumulate=BOUNDS_ACCUMULATE).T.reshape(chunks, layers, kv_heads).float()
    padding = torch.arange(chunks, device=queries.device) >= count
    best = best.masked_fill(padding[:, None, None], float("-inf"))
    mass = torch.softmax(best / math.sqrt(dim), dim=0).mean(-1).mean(-1)  # over KV heads, then layers
    return mass.masked_fill(padding, -1.0).argsort(descending=True, stable=True)  # as `mass_order` sorts


class OrderGraphs:
    """History questions' chunk orders as graph replays (module docstring), for one replica's GPU."""

    def __init__(
        self,
        question_pass: QuestionPass,
        rope: RopeConfig,
        scoring_layers: int,
        bounds_inputs: Any,
        along_chunks: Callable[[torch.Tensor], torch.Tensor],
    ) -> None:
        """`bounds_inputs`, `along_chunks`: the Triton adapter's (`deployments/triton_adapter/chunk_bounds.py`)."""
        self._pass, self._rope, self._layers = question_pass, rope, scoring_layers
        self._bounds_inputs, self._along_chunks = bounds_inputs, along_chunks
        self._device = question_pass.weights.embed_tokens.device
        self._laid: dict[int, LaidSummaries] = {}
        # (chunk bucket, question bucket) -> (graph, its output, what it reads: kept alive while it may replay)
        self._graphs: dict[tuple[int, int], tuple[torch.cuda.CUDAGraph, torch.Tensor, tuple]] = {}
        self._headers: dict[int, tuple[torch.Tensor, torch.Tensor, list]] = {}  # pinned, device, [copy event]
        self._lock = threading.Lock()
        self._broken = False
        self._pool: Any = None  # one memory pool for every order graph (their replays are serialized)

    @torch.inference_mode()
    def order(self, index: HistoryIndex, token_ids: list[int], mark: Callable[[], None]) -> torch.Tensor | None:
        """`index.mass_order` of the question's tokens by two replays (`mark` called after the pass, and after the
        order: the choice's step times); None where the graphs do not serve (the caller's eager path)."""
        bucket = bucket_of(len(token_ids))
        if self._broken or bucket is None or not token_ids or not self._pass.graphed:
            return None
        if not self._serves(index):
            return None
        chunks = -(-len(index.spans) // CHUNK_STEP) * CHUNK_STEP
        with self._lock, self._pass.lock:
            laid = self._laid.get(chunks)
            if laid is None or not laid.fits(index):  # new buffers: the graphs that read the old ones go with them
                self._graphs = {key: graph for key, graph in self._graphs.items() if key[0] != chunks}
                laid = self._laid[chunks] = LaidSummaries.empty(index, chunks)
            header = self._stage(bucket, token_ids, index)
            queries = self._pass.replay(bucket, ids=header[:bucket])
            if queries is None:
                return None
            laid.hold(index, self._along_chunks)
            graph = self._graphs.get((chunks, bucket))
            if graph is None:  # captured with this question's inputs in place (its warm-up computes with them)
                try:
                    graph = self._graphs[(chunks, bucket)] = self._capture(queries, header, laid)
                except torch.OutOfMemoryError:
                    raise
                except Exception:  # noqa: BLE001 - a capture the driver refuses, or anything else: eager from now on
                    log.warning("CUDA graph capture failed for the chunk order; ordering eagerly", exc_info=True)
                    self._broken = True
                    return None
            mark()  # the pass (and the summaries' copy): from here on nothing falls back
            graph[0].replay()
            order = graph[1][: len(index.spans)].clone()  # the next question's replay rewrites the graph's output
            mark()
            return order

    def _serves(self, index: HistoryIndex) -> bool:
        """Whether the graphs can order this history: its summaries where the graphs run, in a dtype the kernel
        widens exactly, full rotary (else the kernel's torch path), the pass's layers and rotary, some chunks."""
        summaries = index.summaries
        return (
            len(index.spans) > 0
            and index.rope == self._rope
            and index.scoring_layers == self._layers
            and self._rope.dim == summaries.low.shape[-1]
            and all(
                t.device == self._device and t.dtype in (torch.bfloat16, torch.float16, torch.float32)
                for t in (summaries.high, summaries.low, summaries.norms)
            )
        )

    def _stage(self, bucket: int, token_ids: list[int], index: HistoryIndex) -> torch.Tensor:
        """The question's tokens (zero padded) and the header's scalars on the device, in one copy from pinned
        memory; the pinned buffer is rewritten only once its last copy has left."""
        if bucket not in self._headers:
            pinned = torch.zeros(bucket + _HEADER, dtype=torch.long).pin_memory()
            self._headers[bucket] = (pinned, torch.zeros(bucket + _HEADER, dtype=torch.long, device=self._device), [])
        pinned, on_device, copied = self._headers[bucket]
        if copied:
            copied.pop().synchronize()
        values = [*token_ids, *[0] * (bucket - len(token_ids))]
        values += [len(token_ids) - 1, len(index.spans), len(index.token_ids), index.summaries.span_end]
        pinned.copy_(torch.tensor(values, dtype=torch.long))
        on_device.copy_(pinned, non_blocking=True)
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(self._device))
        copied.append(event)
        return on_device

    def _capture(
        self, queries: torch.Tensor, header: torch.Tensor, laid: LaidSummaries
    ) -> tuple[torch.cuda.CUDAGraph, torch.Tensor, tuple]:
        layers = queries[: self._layers]

        def body() -> torch.Tensor:
            return padded_order(layers, header, laid, self._rope, laid.kv_heads, self._bounds_inputs)

        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        graph, out = capture(body, self._device, self._pool)
        frequencies = device_inverse_frequencies(self._rope, self._device)  # read by the graph: kept while it is
        return graph, out, (queries, header, laid, frequencies)
