"""History mode's chunk order from fixed shapes (`deployments.choice_graphs.padded_order`, a CUDA graph's body)
against the eager `HistoryIndex.mass_order` (`python -m tests.kernels.order_check DEVICE STYLE [graphs]`).

A history of 75 chunks is scored in a bucket of 96 whose tail holds another history's stale summaries; a question
of 5 tokens is padded to 8 with garbage queries past its end. With `graphs` (CUDA) the chooser's own `OrderGraphs`
replays are compared too, over two histories and two questions each. Prints the orders' agreement as JSON."""

from __future__ import annotations

import functools
import json
import sys
import tempfile
from pathlib import Path

import torch

from kvcore.history_index import HistoryIndex
from kvcore.rope import RopeConfig
from tests.core.test_history import _chunk_records

LAYERS, KV_HEADS, GROUP, DIM, CHUNK = 2, 2, 3, 16, 16


def _index(device: str, rope: RopeConfig, tokens: int, seed: int, bounds) -> HistoryIndex:
    gen = torch.Generator().manual_seed(seed)
    keys = torch.randn(LAYERS, KV_HEADS, tokens, DIM, generator=gen) * torch.rand(DIM, generator=gen) * 3
    return HistoryIndex.of_records(_chunk_records(keys, CHUNK), rope, LAYERS, device, bounds)


def main(device: str, style: str, graphs: str = "") -> None:
    from deployments.choice_graphs import BOUNDS_ACCUMULATE, LaidSummaries, padded_order
    from deployments.triton_adapter import chunk_bounds

    rope = RopeConfig(head_dim=DIM, theta=10000.0, style=style)
    bounds = functools.partial(chunk_bounds.fused_max_upper_bounds, accumulate=BOUNDS_ACCUMULATE)
    index = _index(device, rope, 75 * CHUNK - 5, 1, bounds)
    stale = _index(device, rope, 96 * CHUNK, 2, bounds)
    gen = torch.Generator().manual_seed(3)
    tokens, bucket = 5, 8
    queries = torch.randn(LAYERS, KV_HEADS * GROUP, bucket, DIM, generator=gen).to(device)  # past 5: garbage
    want = index.mass_order(queries[:, :, :tokens]).cpu()

    laid = LaidSummaries.empty(index, 96)
    laid.hold(stale, chunk_bounds.along_chunks)
    laid.hold(index, chunk_bounds.along_chunks)
    chunks = len(index.spans)
    header = torch.tensor([0] * bucket + [tokens - 1, chunks, len(index.token_ids), index.summaries.span_end])
    got = padded_order(queries, header.to(device), laid, rope, KV_HEADS, chunk_bounds.BoundsInputs).cpu()
    report = {
        "chunks": chunks,
        "same_order": got[:chunks].tolist() == want.tolist(),
        "padding_last": sorted(got[chunks:].tolist()) == list(range(chunks, 96)),
    }
    if graphs:
        report["graphs_agree"] = _graphs_agree(device, rope, bounds)
    print(json.dumps(report))


def _graphs_agree(device: str, rope: RopeConfig, bounds) -> list[bool]:
    """`OrderGraphs.order` against `mass_order` of the same pass, for two histories (two chunk buckets) and two
    questions of different lengths each (two question buckets), each asked twice (the second a replay)."""
    from benchmarks._cluster import write_early_layers
    from deployments.choice_graphs import OrderGraphs, QuestionPass
    from deployments.triton_adapter import chunk_bounds
    from models.early_layers import load_early_layers

    config = {
        "architectures": ["LlamaForCausalLM"],
        "hidden_act": "silu",
        "max_position_embeddings": 16384,
        "hidden_size": KV_HEADS * GROUP * DIM,
        "num_attention_heads": KV_HEADS * GROUP,
        "num_key_value_heads": KV_HEADS,
        "head_dim": DIM,
        "intermediate_size": 64,
        "num_hidden_layers": LAYERS,
        "rms_norm_eps": 1e-5,
        "rope_theta": rope.theta,
        "vocab_size": 97,
        "model_type": "llama",
    }
    folder = Path(tempfile.mkdtemp())
    write_early_layers(config, folder / "model.safetensors", layers=LAYERS)
    (folder / "config.json").write_text(json.dumps(config))
    early = load_early_layers(folder, LAYERS, torch.float32, device)
    question_pass = QuestionPass(early)
    order_graphs = OrderGraphs(question_pass, early.rope, LAYERS, chunk_bounds.BoundsInputs, chunk_bounds.along_chunks)
    agree = []
    for seed, length in ((4, 75 * CHUNK - 5), (5, 600 * CHUNK)):
        index = _index(device, early.rope, length, seed, bounds)
        for ids in ([5, 17, 33, 2, 8], list(range(1, 21))):
            for _ in range(2):
                got = order_graphs.order(index, ids, lambda: None)
                want = index.mass_order(question_pass(ids))  # the same graphed pass: the same queries bit for bit
                agree.append(got is not None and got.tolist() == want.tolist())
    return agree


if __name__ == "__main__":
    main(*sys.argv[1:])
