"""Planning and batching of context-window encoding, on a deterministic fake model."""

import pytest
import torch

from kvcore.conversation import Fact, FactLimits, Turn
from kvcore.encoding import EncodingJob, encode_jobs, plan_fact_jobs
from kvcore.errors import InvalidFactError
from tests.core.factories import SPEC, CausalSumForward


class CharTokens:
    """One token per character: token counts are easy to reason about."""

    def encode_text(self, text):
        return [ord(c) for c in text]


TURNS = [Turn("A", "one"), Turn("B", "two"), Turn("A", "three"), Turn("B", "four")]


def test_window_takes_the_turns_just_before_the_anchor():
    facts = [Fact("f0", "x", 0), Fact("f3", "y", 3), Fact("f4", "z", 4)]
    jobs = plan_fact_jobs(TURNS, facts, window=2, prefix_ids=[7, 7], tokenizer=CharTokens())
    render = CharTokens().encode_text
    assert jobs[0].context_ids == (7, 7)
    assert jobs[1].context_ids == tuple([7, 7] + render(TURNS[1].render()) + render(TURNS[2].render()))
    assert jobs[2].context_ids == tuple([7, 7] + render(TURNS[2].render()) + render(TURNS[3].render()))
    assert jobs[2].target_ids == tuple(render("z\n"))
    no_window = plan_fact_jobs(TURNS, facts, window=0, prefix_ids=[7], tokenizer=CharTokens())
    assert all(job.context_ids == (7,) for job in no_window)


@pytest.mark.parametrize(
    ("fact", "message"),
    [
        (Fact("f", "   ", 0), "empty"),
        (Fact("f", "", 0), "empty"),
        (Fact("f", "x" * 3000, 0), "3000 characters"),
        (Fact("f", "x", 5), "anchored after turn 5"),
        (Fact("f", "x", -1), "anchored"),
        (Fact("bad id!", "x", 0), "fact id"),
    ],
)
def test_bad_facts_are_refused_before_any_work(fact, message):
    with pytest.raises(InvalidFactError, match=message):
        plan_fact_jobs(TURNS, [Fact("ok", "fine", 1), fact], window=1, prefix_ids=[], tokenizer=CharTokens())


def test_too_many_tokens_and_duplicates_are_refused():
    with pytest.raises(InvalidFactError, match="tokens"):
        plan_fact_jobs(
            TURNS,
            [Fact("f", "x" * 50, 0)],
            window=0,
            prefix_ids=[],
            tokenizer=CharTokens(),
            limits=FactLimits(max_tokens=10),
        )
    with pytest.raises(InvalidFactError, match="twice"):
        plan_fact_jobs(TURNS, [Fact("f", "a", 0), Fact("f", "b", 1)], window=0, prefix_ids=[], tokenizer=CharTokens())
    with pytest.raises(InvalidFactError, match="window"):
        plan_fact_jobs(TURNS, [Fact("f", "a", 0)], window=-1, prefix_ids=[], tokenizer=CharTokens())


def _jobs():
    return [EncodingJob(f"j{i}", tuple(range(1, 1 + 3 * i)), tuple(range(50, 50 + i + 1))) for i in range(6)]


def test_batched_equals_one_by_one_and_keeps_order():
    jobs = _jobs()
    batched = encode_jobs(
        jobs, CausalSumForward(), SPEC, tenant_id="t", window=3, dtype=torch.float32, max_batch_tokens=10_000
    )
    for job, rec in zip(jobs, batched):
        alone = encode_jobs([job], CausalSumForward(), SPEC, tenant_id="t", window=3, dtype=torch.float32)[0]
        assert rec.fact_id == job.fact_id and rec.token_ids == job.target_ids
        assert torch.equal(rec.k, alone.k) and torch.equal(rec.v, alone.v)
        expected_first = sum(job.context_ids) + job.target_ids[0]  # cumsum at the first target token, layer 0
        assert rec.k[0, 0, 0, 0].item() == expected_first


def test_token_budget_splits_batches():
    forward = CausalSumForward()
    encode_jobs(_jobs(), forward, SPEC, tenant_id="t", window=0, dtype=torch.float32, max_batch_tokens=30)
    assert len(forward.calls) > 1
    assert all(rows * width <= 30 or rows == 1 for rows, width in forward.calls)


def test_records_carry_params_and_requested_dtype():
    rec = encode_jobs(_jobs()[2:3], CausalSumForward(), SPEC, tenant_id="t", window=4, dtype=torch.bfloat16)[0]
    assert rec.k.dtype == torch.bfloat16 and rec.params.dtype == "bfloat16"
    assert (rec.params.window, rec.params.model_fingerprint, rec.params.rope) == (4, SPEC.fingerprint, SPEC.rope)
    assert rec.k.shape == (3, 2, 3, 8)


def test_neighbours_sit_after_the_window_and_before_the_fact():
    facts = [Fact("f3", "y", 3), Fact("f4", "z", 4)]
    jobs = plan_fact_jobs(
        TURNS, facts, window=1, prefix_ids=[7], tokenizer=CharTokens(), neighbours={"f3": ["far", "near"]}
    )
    render = CharTokens().encode_text
    assert jobs[0].context_ids == tuple([7] + render(TURNS[2].render()) + render("far\n") + render("near\n"))
    assert jobs[0].meta == {"anchor": "3", "neighbours": "2"}
    assert jobs[1].context_ids == tuple([7] + render(TURNS[3].render())) and "neighbours" not in jobs[1].meta
