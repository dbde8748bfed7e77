"""History mode's layout on the real model: chosen history tokens' K/V, keys re-rotated to contiguous positions,
serve a question as the plain prefill does when every token is kept (the benchmark's answers rest on it)."""

import pytest
import torch

from benchmarks.history_selection import Captured, compact_cache, int8_round_trip, per_head
from kvcore.history import fixed_spans

pytestmark = pytest.mark.model


def _prefill(loaded, text: str):
    model = loaded.model
    captured = Captured(model)
    ids = loaded.tokenizer.encode(text, add_special_tokens=False)
    with torch.inference_mode():
        out = model(torch.tensor([ids]), use_cache=True)
    kv_heads = model.config.num_key_value_heads
    keys = torch.stack([per_head(k, kv_heads) for k in captured.keys])  # [L, KVH, T, D], before RoPE
    for hook in captured._hooks:
        hook.remove()
    values = torch.stack([held.values[0] for held in out.past_key_values.layers])  # [L, KVH, T, D]
    return ids, keys, values, out.past_key_values


def _next_logits(model, cache, question: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        return model(torch.tensor([question]), past_key_values=cache).logits[0, -1]


def test_keeping_every_token_gives_the_plain_prefills_next_token_logits(loaded):
    history = "[May 1]\nAnna: I moved to Lisbon last spring.\nBen: Nice! Do you still paint?\nAnna: Every weekend.\n"
    ids, keys, values, cache = _prefill(loaded, history)
    question = loaded.tokenizer.encode("Question: Where does Anna live?\nAnswer:", add_special_tokens=False)
    full = _next_logits(loaded.model, _copy(cache), question)
    kept = compact_cache(keys, values, torch.arange(len(ids)), loaded.spec.rope)
    assert (_next_logits(loaded.model, kept, question) - full).abs().max() < 1e-3 * full.abs().max()


def test_dropping_tokens_changes_what_the_question_sees(loaded):
    ids, keys, values, cache = _prefill(loaded, "Anna: My sister's name is Clara.\nBen: And your dog?\nAnna: Rex.\n")
    question = loaded.tokenizer.encode("Question: What is the dog's name?\nAnswer:", add_special_tokens=False)
    full = _next_logits(loaded.model, _copy(cache), question)
    first_half = compact_cache(keys, values, torch.arange(len(ids) // 2), loaded.spec.rope)
    assert (_next_logits(loaded.model, first_half, question) - full).abs().max() > 0.1  # the test can tell


def test_chunks_through_int8_move_the_logits_a_little_and_only_where_they_are(loaded):
    history = "[May 1]\nAnna: I moved to Lisbon last spring.\nBen: Nice! Do you still paint?\nAnna: Every weekend.\n"
    ids, keys, values, cache = _prefill(loaded, history)
    question = loaded.tokenizer.encode("Question: Where does Anna live?\nAnswer:", add_special_tokens=False)
    full = _next_logits(loaded.model, _copy(cache), question)
    spans = fixed_spans(len(ids), 8)
    int8_keys, int8_values = int8_round_trip(keys, values, list(range(1, len(spans))), spans)
    assert torch.equal(int8_keys[:, :, :8], keys[:, :, :8]) and torch.equal(int8_values[:, :, :8], values[:, :, :8])
    assert not torch.equal(int8_keys[:, :, 8:], keys[:, :, 8:])
    rounded = _next_logits(
        loaded.model, compact_cache(int8_keys, int8_values, torch.arange(len(ids)), loaded.spec.rope), question
    )
    error = (rounded - full).abs().max() / full.abs().max()
    assert 0 < error < 0.05, error  # int8 with per-chunk scales: close, not equal
    assert rounded.argmax() == full.argmax()


def _copy(cache):
    import copy

    return copy.deepcopy(cache)
