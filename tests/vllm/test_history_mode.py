"""History mode on the real engine: a conversation history prefilled once and kept as 16-token chunk records by
the engine's own capture; all chunks injected reproduce the plain prefill; a chosen subset injected at contiguous
positions (each chunk's keys rotated to where it lands) answers as the reference layout does in transformers
(the same chunks' K/V from a full prefill, keys re-rotated, values as prefilled)."""

from __future__ import annotations

import torch

from benchmarks.history_selection import Captured, compact_cache, per_head
from deployments.vllm_adapter.engine import capture_request
from kvcore.conversation import Turn
from kvcore.history_index import HistoryIndex, capture_spans, chunk_record_id
from kvcore.plan import CapturePlan, CaptureSpan, MemoryPlan
from kvcore.query_pass import question_queries
from models.early_layers import load_early_layers
from tests.conversations import MAYA
from tests.vllm.conftest import GREEDY, ask

CHUNK = 16
TENANT = "history-maya"
FILLER = [
    Turn("Maya", "The weather in Porto was grey all week, so I mostly stayed in and read."),
    Turn("Assistant", "Reading sounds like a good way to spend grey days. Any good books?"),
    Turn("Maya", "A long novel about sailors, and a guide to growing tomatoes on a balcony."),
    Turn("Assistant", "Balcony tomatoes can do well with enough sun and a deep pot."),
]


def _history(loaded) -> list[int]:
    turns = MAYA + FILLER * 3  # the facts first, then a long stretch that does not hold them
    return loaded.tokenizer.encode("".join(t.render() for t in turns), add_special_tokens=False)


def _captured(llm, loaded, frame, store) -> tuple[list[int], HistoryIndex]:
    history = _history(loaded)
    start = len(frame.prefix_ids)
    spans = (CaptureSpan("frame", 0, start), *capture_spans("h1", start, len(history), CHUNK))
    memory = [*frame.prefix_ids, *history]
    llm.generate(*map(list, zip(capture_request(memory, CapturePlan(TENANT, spans, window=0)))), use_tqdm=False)
    records = [store.get(TENANT, s.fact_id) for s in spans[1:]]
    return history, HistoryIndex.of_records(records, loaded.spec.rope, scoring_layers=4)


def _reference(loaded, memory: list[int], kept: torch.Tensor, query: list[int]) -> tuple[list[int], list[float]]:
    """Greedy tokens and their log-probs from transformers over the kept tokens' K/V of a prefill of `memory`."""
    model = loaded.model
    captured = Captured(model)
    try:
        with torch.inference_mode():
            out = model(torch.tensor([memory]), use_cache=True)
            keys = torch.stack([per_head(k, model.config.num_key_value_heads) for k in captured.keys])
            values = torch.stack([held.values[0] for held in out.past_key_values.layers])
            cache = compact_cache(keys, values, kept, loaded.spec.rope)
            tokens, logprobs, feed = [], [], query
            for _ in range(GREEDY.max_tokens):
                logits = model(torch.tensor([feed]), past_key_values=cache).logits[0, -1].float()
                token = int(logits.argmax())
                tokens.append(token)
                logprobs.append(float(torch.log_softmax(logits, -1)[token]))
                feed = [token]
    finally:
        for hook in captured._hooks:
            hook.remove()
    return tokens, logprobs


def test_a_history_in_chunks_answers_as_prefilled_and_a_chosen_part_as_the_reference_layout(llm, loaded, frame, store):
    history, index = _captured(llm, loaded, frame, store)
    chunks = len(index.spans)
    assert chunks == -(-len(history) // CHUNK) and index.token_ids == tuple(history)
    assert index.record_ids[3] == chunk_record_id("h1", 3)

    question = "What is the name of Maya's cat?"
    query = frame.query_ids(loaded.tokenizer, question)
    memory = [*frame.prefix_ids, *history]
    every = MemoryPlan(TENANT, ("frame", *index.record_ids), store.version(TENANT))
    plain = ask(llm, [(memory + query, None)])[0]
    injected = ask(llm, [(memory + query, every)])[0]
    assert injected[3]["injected_tokens"] > 0 and injected[3]["fallback"] is None
    assert injected[0] == plain[0] and max(abs(a - b) for a, b in zip(injected[1], plain[1])) < 1e-5

    early = load_early_layers(loaded.path, 4)
    queries = question_queries(early, loaded.tokenizer.encode(question, add_special_tokens=False))
    budget = len(history) // 4
    chosen = index.choose(queries, budget)
    assert chosen == sorted(chosen) and chosen[0] == 0 and chosen[-1] == chunks - 1
    assert sum(index.spans[c][1] - index.spans[c][0] for c in chosen) <= budget < len(history)

    region = [*frame.prefix_ids, *(t for c in chosen for t in index.chunk_tokens(c))]
    part = MemoryPlan(TENANT, ("frame", *(index.record_ids[c] for c in chosen)), store.version(TENANT))
    tokens, logprobs, _, report = ask(llm, [(region + query, part)])[0]
    assert report["fallback"] is None and report["records"] == len(chosen) + 1
    start = len(frame.prefix_ids)
    kept = torch.cat([torch.arange(start), *(start + torch.arange(*index.spans[c]) for c in chosen)])
    ref_tokens, ref_logprobs = _reference(loaded, memory, kept, query)
    assert tokens == ref_tokens
    assert max(abs(a - b) for a, b in zip(logprobs, ref_logprobs)) < 2e-3
    assert max(abs(a - b) for a, b in zip(logprobs, plain[1])) > 1e-3  # the part is not the whole: the test tells
