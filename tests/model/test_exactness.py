"""KV injection against a plain full-prompt prefill of the real SmolLM2 (float32, CPU).

Theorem 3: jointly encoded memory injected == prompt injection of the same tokens.
Theorem 6: memory encoded at position 0 and rotated to offset p == the same prompt prefilled at p,
           and the same keys *not* re-rotated are measurably wrong.
Corollary 9: context-window encoding whose window holds all preceding memory is exact; w=0 is not.
"""

import dataclasses

import pytest
import torch

from kvcore.compose import compose
from kvcore.conversation import Fact
from kvcore.encoding import EncodingJob, encode_jobs, plan_fact_jobs
from models.chat import TokenizerEncoder
from tests.conversations import MAYA as TURNS

pytestmark = pytest.mark.model

TOL = 1e-4
QUESTION = "What is the name of Maya's cat?"


def _turn_facts():
    """Each turn as a fact anchored at its own index: the memory is the conversation itself."""
    return [Fact(f"turn{i}", t.render().rstrip("\n"), i) for i, t in enumerate(TURNS)]


def _encode(loaded, forward, jobs, window):
    return encode_jobs(jobs, forward, loaded.spec, tenant_id="maya", window=window, dtype=torch.float32)


def _prefix(loaded, forward, frame):
    return _encode(loaded, forward, [EncodingJob("prefix", (), frame.prefix_ids)], 0)[0]


def _gap(engine, memory, query, start=0):
    plain = engine.prompt_logits(list(memory.token_ids) + query, start=start)[-len(query) :]
    return (plain - engine.injected_logits(memory, query)).abs().max().item()


def test_joint_encoding_injected_equals_prompt_injection(loaded, forward, engine, frame):
    """Theorem 3, with identical greedy continuations."""
    memory_ids = tuple(i for t in TURNS for i in TokenizerEncoder(loaded.tokenizer).encode_text(t.render()))
    joint = _encode(loaded, forward, [EncodingJob("memory", frame.prefix_ids, memory_ids)], 0)[0]
    memory = compose([joint], _prefix(loaded, forward, frame))
    query = frame.query_ids(loaded.tokenizer, QUESTION)
    assert _gap(engine, memory, query) <= TOL
    plain = engine.generate_plain(list(memory.token_ids) + query, 16)
    assert len(plain) >= 3
    assert engine.generate_injected(memory, query, 16) == plain


@pytest.mark.parametrize("offset", [50, 500])
def test_relocation_needs_and_gets_chunked_rope(loaded, forward, engine, frame, offset):
    """Theorem 6: encoded at 0, served at `offset`; without re-rotation it is measurably wrong."""
    jobs = plan_fact_jobs(
        TURNS,
        _turn_facts(),
        window=len(TURNS),
        prefix_ids=frame.prefix_ids,
        tokenizer=TokenizerEncoder(loaded.tokenizer),
    )
    records = _encode(loaded, forward, jobs, len(TURNS))
    prefix = _prefix(loaded, forward, frame)
    query = frame.query_ids(loaded.tokenizer, QUESTION)

    relocated = compose(records, prefix, start=offset)
    assert _gap(engine, relocated, query, start=offset) <= TOL

    stale = dataclasses.replace(compose(records, prefix, start=0), start=offset)  # keys still at 0..M-1
    wrong = _gap(engine, stale, query, start=offset)
    assert wrong > 100 * TOL, f"unrotated keys should change the logits, gap {wrong:.2e}"


def test_full_window_encoding_is_exact_and_w0_is_not(loaded, forward, engine, frame, record_property):
    """Corollary 9, and the measured gap of independent (w=0) encoding."""
    tokens = TokenizerEncoder(loaded.tokenizer)
    prefix = _prefix(loaded, forward, frame)
    query = frame.query_ids(loaded.tokenizer, QUESTION)
    gaps = {}
    for window in (len(TURNS), 2, 0):
        jobs = plan_fact_jobs(TURNS, _turn_facts(), window=window, prefix_ids=frame.prefix_ids, tokenizer=tokens)
        gaps[window] = _gap(engine, compose(_encode(loaded, forward, jobs, window), prefix), query)
    record_property("max_logit_gap_by_window", gaps)
    print(f"max |delta logit| by window: {gaps}")
    assert gaps[len(TURNS)] <= TOL
    assert gaps[0] > 1e-2 and gaps[2] > 1e-2


def test_projection_and_cache_extraction_agree(loaded, forward):
    from models.transformers_adapter import HFKVForward

    ids = torch.tensor([[1, 504, 3120, 28, 1117, 2113, 30, 198, 2]])
    k1, v1 = forward(ids, torch.ones_like(ids))
    k2, v2 = HFKVForward(loaded, method="cache")(ids, torch.ones_like(ids))
    assert k1.shape == (30, 1, 3, 9, 64)
    assert (k1 - k2).abs().max() < 1e-4 and (v1 - v2).abs().max() < 1e-5


def test_batched_encoding_of_real_facts_equals_one_at_a_time(loaded, forward, frame):
    facts = _turn_facts() + [Fact("cat", "Maya has a grey cat called Pixel.", 3)]
    jobs = plan_fact_jobs(
        TURNS, facts, window=2, prefix_ids=frame.prefix_ids, tokenizer=TokenizerEncoder(loaded.tokenizer)
    )
    batched = _encode(loaded, forward, jobs, 2)
    assert len({job.length for job in jobs}) > 1  # rows really are padded
    for job, rec in zip(jobs, batched):
        alone = _encode(loaded, forward, [job], 2)[0]
        assert (rec.k - alone.k).abs().max() < 1e-4 and (rec.v - alone.v).abs().max() < 1e-4


def test_neighbour_context_is_exact_when_it_holds_the_facts_before_it(loaded, forward, engine, frame):
    """Corollary 9 for neighbour contexts: each fact encoded behind the facts laid out before it in the memory
    region (the neighbours, least similar first) is a joint prefill of that region; alone (no neighbours) it is not."""
    texts = ["Maya has a grey cat called Pixel.", "Pixel sleeps on the piano.", "Maya's piano is in the attic."]
    facts = [Fact(f"n{i}", text, 0) for i, text in enumerate(texts)]
    tokens = TokenizerEncoder(loaded.tokenizer)
    prefix = _prefix(loaded, forward, frame)
    query = frame.query_ids(loaded.tokenizer, "Where does Maya's cat sleep?")
    gaps = {}
    for name, near in (("before", {f"n{i}": texts[:i] for i in range(3)}), ("alone", None)):
        jobs = plan_fact_jobs([], facts, window=0, prefix_ids=frame.prefix_ids, tokenizer=tokens, neighbours=near)
        gaps[name] = _gap(engine, compose(_encode(loaded, forward, jobs, 0), prefix), query)
    assert gaps["before"] <= TOL, gaps
    assert gaps["alone"] > 1e-2, gaps
