"""The quality cost of int8 K/V on the lower tiers, measured on SmolLM2 against full precision."""

import dataclasses

import pytest

from kvcore.compose import compose
from kvcore.quantize import dequantize, quantize
from tests.conversations import maya_records

pytestmark = pytest.mark.model
QUESTIONS = ["What is the name of Maya's cat?", "Where does Maya work?", "What is Maya allergic to?"]


def test_int8_records_keep_greedy_answers_and_small_logit_deltas(loaded, forward, engine, frame, record_property):
    records = maya_records(loaded, forward, frame)
    full = compose(records[:-1], records[-1])
    lossy = [dataclasses.replace(r, k=dequantize(quantize(r.k)), v=dequantize(quantize(r.v))) for r in records]
    compressed = compose(lossy[:-1], lossy[-1])
    deltas, agree = [], 0
    for question in QUESTIONS:
        query = frame.query_ids(loaded.tokenizer, question)
        exact, approx = engine.injected_logits(full, query), engine.injected_logits(compressed, query)
        deltas.append((exact - approx).abs().max().item())
        agree += engine.generate_injected(full, query, 12) == engine.generate_injected(compressed, query, 12)
    record_property("int8_max_logit_delta", max(deltas))
    record_property("int8_greedy_agreement", f"{agree}/{len(QUESTIONS)}")
    assert agree == len(QUESTIONS) and max(deltas) < 1.0
    assert max(deltas) > 1e-4  # the codes really are lossy: the measurement measures something
