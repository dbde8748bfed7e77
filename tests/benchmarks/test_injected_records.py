"""`benchmarks/injected_records.py`: each size's pool holds records of that size, as many as two requests' tokens."""

import torch

from benchmarks.injected_records import POOL_TOKENS, fill_pools
from kvcore.store import LocalFactStore

CONFIG = {"num_hidden_layers": 2, "num_key_value_heads": 2, "num_attention_heads": 4, "hidden_size": 32}
CONFIG |= {"vocab_size": 1000, "rope_theta": 10000.0, "max_position_embeddings": 512}


def test_each_pool_holds_records_of_its_size_and_each_request_a_prefix_record_of_its_own(tmp_path):
    store = LocalFactStore(tmp_path)
    ids = fill_pools(store, CONFIG, "f" * 24, torch.bfloat16, [16, 64], tokens=64, prefixes=3)
    heads = [ids[f"prefix-{i}"] for i in range(3)]
    assert all(len(h) == 24 for h in heads) and len({tuple(h) for h in heads}) == 3 and "prefix-3" not in ids
    for size in (16, 64):
        pool = [r for r in ids if r.startswith(f"s{size}-")]
        assert len(pool) == POOL_TOKENS * 64 // size
        record = store.get("bench", pool[-1])
        assert record.k.shape == (2, 2, size, 8) and record.k.dtype == torch.bfloat16
        assert list(record.token_ids) == ids[pool[-1]]
