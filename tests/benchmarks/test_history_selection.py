"""The history-selection benchmark's own pieces: the history's turn spans and its judge of recall (the choice of
chunks is the core's, tests/core/test_history.py)."""

import pytest
import torch

from benchmarks.history_selection import build_history, judge, mask_of
from benchmarks.quality.devset import conversation


class Chars:
    """A tokenizer of one id per character (enough to check spans)."""

    def encode(self, text, add_special_tokens=False):
        return [ord(c) for c in text]


def test_each_turn_keeps_its_token_span_and_questions_name_their_conversation():
    samples = [conversation(0, 7), conversation(1, 7)]
    history = build_history(Chars(), samples)
    turn = samples[1]["conversation"]["session_2"][0]
    start, end = history.turns[f"1:{turn['dia_id']}"]
    assert "".join(map(chr, history.ids[start:end])) == f"{turn['speaker']}: {turn['text']}\n"
    assert all(e.split(":", 1)[0] in ("0", "1") for q in history.questions for e in q["evidence"])


def test_the_judge_counts_top_tokens_mass_and_evidence_inside_the_mask():
    importance = torch.tensor([[5.0, 0, 0, 0, 0, 0, 0, 0, 0, 5.0]]) + torch.tensor([0.1] + [0.0] * 9)  # top: 0
    mask = mask_of({0}, [(0, 2), (2, 10)], 10)
    row = judge(mask, importance, evidence=[(1, 3)])
    assert row["recall"] == [1.0] and row["mass"] == [pytest.approx(5.1 / 10.1)] and row["evidence"]
    assert not judge(mask, importance, evidence=[(4, 6)])["evidence"]


def test_turn_chunks_follow_the_turns_and_split_the_long_ones():
    from benchmarks.history_selection import turn_spans

    turns = {"a": (3, 10), "b": (10, 150), "c": (152, 160)}  # 0-3 a header, 150-152 one between b and c
    spans = turn_spans(turns, 165, longest=64)
    assert spans[0] == (0, 3) and spans[-1] == (152, 165)  # the header alone; the tail joins the last turn
    assert all(a[1] == b[0] for a, b in zip(spans, spans[1:]))  # contiguous, the whole history
    assert {s for s, _ in spans} >= {3, 10, 152}  # every turn starts a chunk
    assert [e - s for s, e in spans if 10 <= s < 152] == [47, 47, 48]  # b and its gap (142 tokens) in 3 even parts


def test_the_few_layer_summaries_are_those_layers_of_the_whole():
    from benchmarks.history_selection import layers_of
    from kvcore.rope import RopeConfig
    from kvcore.summaries import summarize

    rope = RopeConfig(head_dim=16, theta=10000.0)
    keys = torch.randn(6, 2, 40, 16)
    whole = summarize(keys, [(0, 20), (20, 40)], rope)
    some = layers_of(whole, torch.tensor([1, 4]))
    assert torch.equal(some.high, whole.high[:, [1, 4]]) and torch.equal(some.norms, whole.norms[:, [1, 4]])
    assert torch.equal(some.high, summarize(keys[[1, 4]], [(0, 20), (20, 40)], rope).high)
    assert some.nbytes < whole.nbytes / 2
