"""History mode's layout on the real model: chosen history tokens' K/V, keys re-rotated to contiguous positions,
serve a question as the plain prefill does when every token is kept (the benchmark's answers rest on it)."""

import pytest
import torch

from benchmarks.history_selection import Captured, compact_cache, per_head

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
    return ids, keys, out.past_key_values


def _next_logits(model, cache, question: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        return model(torch.tensor([question]), past_key_values=cache).logits[0, -1]


def test_keeping_every_token_gives_the_plain_prefills_next_token_logits(loaded):
    history = "[May 1]\nAnna: I moved to Lisbon last spring.\nBen: Nice! Do you still paint?\nAnna: Every weekend.\n"
    ids, keys, cache = _prefill(loaded, history)
    question = loaded.tokenizer.encode("Question: Where does Anna live?\nAnswer:", add_special_tokens=False)
    full = _next_logits(loaded.model, _copy(cache), question)
    kept = compact_cache(keys, cache, torch.arange(len(ids)), loaded.spec.rope)
    assert (_next_logits(loaded.model, kept, question) - full).abs().max() < 1e-3 * full.abs().max()


def test_dropping_tokens_changes_what_the_question_sees(loaded):
    ids, keys, cache = _prefill(loaded, "Anna: My sister's name is Clara.\nBen: And your dog?\nAnna: Rex.\n")
    question = loaded.tokenizer.encode("Question: What is the dog's name?\nAnswer:", add_special_tokens=False)
    full = _next_logits(loaded.model, _copy(cache), question)
    first_half = compact_cache(keys, cache, torch.arange(len(ids) // 2), loaded.spec.rope)
    assert (_next_logits(loaded.model, first_half, question) - full).abs().max() > 0.1  # the test can tell


def _copy(cache):
    import copy

    return copy.deepcopy(cache)
