"""Composition of records into one memory region with chunked RoPE."""

import pytest
import torch

from kvcore.compose import compose
from kvcore.errors import IncompatibleRecordsError
from kvcore.rope import rotate
from tests.core.factories import ROPE, make_record


def test_order_positions_and_rotation():
    prefix, a, b = make_record("p", 3, seed=0), make_record("a", 4, seed=1), make_record("b", 2, seed=2)
    mem = compose([b, a], prefix, start=10)
    assert mem.token_ids == prefix.token_ids + b.token_ids + a.token_ids
    assert [(s.fact_id, s.begin, s.end) for s in mem.spans] == [("p", 0, 3), ("b", 3, 5), ("a", 5, 9)]
    assert (mem.start, mem.end, mem.k.shape) == (10, 19, (3, 2, 9, 8))
    # fact `a` lands at positions 15..18 whatever position it was encoded at
    assert torch.allclose(mem.k[:, :, 5:9], rotate(a.k, torch.arange(15, 19), ROPE), atol=1e-6)
    assert torch.equal(mem.v[:, :, 5:9], a.v)


def test_without_rotation_keys_are_left_pre_rope():
    a = make_record("a", 4)
    assert torch.equal(compose([a], rotate=False, start=7).k, a.k)
    assert not torch.allclose(compose([a], start=7).k, a.k, atol=1e-3)


def test_incompatible_records_are_refused():
    with pytest.raises(IncompatibleRecordsError, match="another model"):
        compose([make_record("a"), make_record("b", fingerprint="e" * 24)])
    with pytest.raises(IncompatibleRecordsError, match="layout"):
        compose([make_record("a"), make_record("b", layers=2)])
    with pytest.raises(IncompatibleRecordsError, match="nothing"):
        compose([])
    with pytest.raises(ValueError, match="start"):
        compose([make_record("a")], start=-1)


def test_output_dtype_follows_request():
    mem = compose([make_record("a", dtype=torch.bfloat16)], dtype=torch.float32)
    assert mem.k.dtype == torch.float32 and mem.v.dtype == torch.float32
