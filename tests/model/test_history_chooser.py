"""A replica that meets a history it did not capture rebuilds its index from the chunk records in the store, the
same as the one built at capture; a replaced history's records are deleted."""

import pytest
import torch

from benchmarks.history_selection import Captured, per_head
from deployments.history_mode import HOST_PARTS, HistoryChooser
from kvcore.history import fixed_spans
from kvcore.history_index import HISTORY_CHUNK, chunk_record_id
from kvcore.record import EncodingParams, FactKV
from kvcore.store import LocalFactStore
from tests.conversations import MAYA

pytestmark = pytest.mark.model


def _chunk_records(loaded, tenant: str, history_id: str) -> list[FactKV]:
    """The history's chunks as records, K and V from one transformers prefill (as the engine's capture keeps them)."""
    ids = loaded.tokenizer.encode("".join(t.render() for t in MAYA), add_special_tokens=False)
    captured = Captured(loaded.model)
    try:
        with torch.inference_mode():
            out = loaded.model(torch.tensor([ids]), use_cache=True)
    finally:
        for hook in captured._hooks:
            hook.remove()
    keys = torch.stack([per_head(k, loaded.model.config.num_key_value_heads) for k in captured.keys])
    values = torch.stack([held.values[0] for held in out.past_key_values.layers])
    params = EncodingParams(window=0, model_fingerprint=loaded.spec.fingerprint, rope=loaded.spec.rope, dtype="float32")
    return [
        FactKV(
            tenant,
            chunk_record_id(history_id, c),
            tuple(ids[s:e]),
            keys[:, :, s:e].clone(),
            values[:, :, s:e].clone(),
            params,
        )
        for c, (s, e) in enumerate(fixed_spans(len(ids), HISTORY_CHUNK))
    ]


def test_an_index_rebuilt_from_the_store_equals_the_captured_one_and_a_dropped_history_is_gone(loaded, tmp_path):
    store = LocalFactStore(tmp_path)
    records = _chunk_records(loaded, "t1", "history-a")
    store.put_many(records)
    built = HistoryChooser(loaded.path, store, loaded.tokenizer).index_records("t1", "history-a", records)
    rebuilt = HistoryChooser(loaded.path, store, loaded.tokenizer).index("t1", "history-a")  # another replica
    assert rebuilt.record_ids == built.record_ids and rebuilt.spans == built.spans and len(built.spans) > 3
    assert rebuilt.turns == built.turns and len(built.turns) == len(MAYA)
    assert torch.allclose(rebuilt.turn_vectors, built.turn_vectors, atol=1e-6)
    assert torch.equal(rebuilt.summaries.high, built.summaries.high)

    chooser = HistoryChooser(loaded.path, store, loaded.tokenizer)
    choice = chooser.choose("t1", "history-a", "What is the name of Maya's cat?", budget=48)
    items = choice.items
    assert sum(len(i.token_ids) for i in items) <= 48 and choice.question_ms > 0 and choice.bounds_ms > 0
    assert tuple(choice.host_ms) == HOST_PARTS and all(ms >= 0 for ms in choice.host_ms.values())
    assert choice.host_ms["order"] > 0 and sum(choice.host_ms.values()) <= choice.wall_ms  # inside the wall
    cat_turn = next(i for i, t in enumerate(MAYA) if "Pixel" in t.text)
    start, end = built.turns[cat_turn]
    assert any(s < end and start < e for s, e in (built.spans[built.record_ids.index(i.record_id)] for i in items))
    index = chooser.index("t1", "history-a")  # each item is its chunk's tokens and record, built once per index
    for item in items:
        chunk = index.record_ids.index(item.record_id)
        assert item.fact_id == item.record_id and item.token_ids == index.chunk_tokens(chunk)
    again = chooser.choose("t1", "history-a", "What is the name of Maya's cat?", budget=48).items
    assert again == items and all(a is b for a, b in zip(again, items))
    assert chooser.drop("t1", "history-a") == len(records) and store.record_ids("t1") == []
    assert not chooser._items and not chooser._retrievals  # a dropped history's items go with its index
    with pytest.raises(ValueError, match="no chunks"):
        chooser.index("t1", "history-a")


def test_a_chooser_scoring_with_the_first_layer_only_keeps_one_layer_of_summaries_and_scores_with_its_queries(
    loaded, tmp_path
):
    """`llm.history_scoring_layers = 1`: the index keeps layer 0's summaries only (a quarter of four layers'), the
    question's pass stops at layer 0's queries (the model's own, as the four-layer pass's first), and the chunks'
    order is the order of layer 0's masses."""
    from kvcore.history import chunk_mass

    store = LocalFactStore(tmp_path)
    records = _chunk_records(loaded, "t1", "history-a")
    store.put_many(records)
    one = HistoryChooser(loaded.path, store, loaded.tokenizer, scoring_layers=1)
    four = HistoryChooser(loaded.path, store, loaded.tokenizer, scoring_layers=4)
    small, large = (c.index_records("t1", "history-a", records) for c in (one, four))
    assert small.scoring_layers == 1 and small.summaries.high.shape[1] == 1 and large.summaries.high.shape[1] == 4
    assert torch.equal(small.summaries.high[:, 0], large.summaries.high[:, 0])
    ids = loaded.tokenizer.encode("What is the name of Maya's cat?", add_special_tokens=False)
    queries = one.question_pass(ids)
    assert queries.shape[0] == 1 and torch.allclose(queries[0], four.question_pass(ids)[0], atol=1e-6)
    group = queries.shape[1] // small.summaries.norms.shape[2]
    mass = chunk_mass(small.summaries, queries, len(small.token_ids), small.rope, group, small.bounds).mean(0)
    assert torch.equal(small.mass_order(queries), mass.argsort(descending=True, stable=True))
    choice = one.choose("t1", "history-a", "What is the name of Maya's cat?", budget=48)
    assert 0 < sum(len(i.token_ids) for i in choice.items) <= 48
    with pytest.raises(ValueError, match="at least one layer"):
        HistoryChooser(loaded.path, store, loaded.tokenizer, scoring_layers=0)


def test_kept_indexes_are_bounded_by_their_bytes_and_an_evicted_one_is_rebuilt(loaded, tmp_path):
    store = LocalFactStore(tmp_path)
    records = {h: _chunk_records(loaded, "t1", h) for h in ("history-a", "history-b")}
    for found in records.values():
        store.put_many(found)
    chooser = HistoryChooser(loaded.path, store, loaded.tokenizer, cached_bytes=1)  # room for the newest only
    first = chooser.index_records("t1", "history-a", records["history-a"])
    chooser.index_records("t1", "history-b", records["history-b"])
    assert list(chooser._indexes) == [("t1", "history-b")] and first.nbytes > 1
    assert list(chooser._items) == [("t1", "history-b")]  # an index let go takes its items along
    assert list(chooser._retrievals) == [("t1", "history-b")] and chooser._retrievals[("t1", "history-b")][1] is None
    again = chooser.index("t1", "history-a")
    assert again is not first and torch.equal(again.summaries.high, first.summaries.high)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_a_gpu_replica_scores_chunks_as_the_cpu_one_and_keeps_the_evidence_turn(loaded, tmp_path):
    """On CUDA the chooser scores chunks with the fused bounds kernel (float32 sums plus their margin: bounds at most
    ~1e-4 of the largest above the float64 ones, each mass within a few 1e-4 of the CPU's): the same question's
    float32 queries give the CPU index's chunk masses; its own choice (bf16 pass, steps timed by events) keeps the
    evidence turn."""
    from kvcore.history import chunk_mass

    store = LocalFactStore(tmp_path)
    records = _chunk_records(loaded, "t1", "history-a")
    store.put_many(records)
    question = "What is the name of Maya's cat?"
    choosers = {
        device: HistoryChooser(loaded.path, store, loaded.tokenizer, device=device) for device in ("cpu", "cuda")
    }
    indexes = {device: c.index_records("t1", "history-a", records) for device, c in choosers.items()}
    queries = choosers["cpu"].question_pass(loaded.tokenizer.encode(question, add_special_tokens=False))
    masses = {}
    for device, index in indexes.items():
        group = queries.shape[1] // index.summaries.norms.shape[2]
        asked = queries[: index.scoring_layers].to(device)
        masses[device] = chunk_mass(index.summaries, asked, len(index.token_ids), index.rope, group, index.bounds).cpu()
    assert indexes["cuda"].bounds is not indexes["cpu"].bounds  # the kernel on CUDA, torch on the CPU
    assert torch.allclose(masses["cuda"], masses["cpu"], rtol=2e-3, atol=1e-6)
    assert not torch.equal(masses["cuda"], masses["cpu"])  # the margin is there: not the float64 kernel's bounds

    cuda = choosers["cuda"]
    choice = cuda.choose("t1", "history-a", question, budget=48)
    assert choice.question_ms > 0 and choice.retrieval_ms > 0 and choice.bounds_ms > 0 and choice.retrieval_beside
    steps = choice.timings()  # retrieval ran on its own stream, beside the question's pass: not in the total
    assert steps["total"] == pytest.approx(
        sum(steps[k] for k in ("index", "question", "bounds", "selection")), abs=0.01
    )
    index = indexes["cuda"]
    graph = cuda._retrievals[("t1", "history-a")][1]  # retrieval's order replayed, checked against its eager path:
    vector = cuda.embedder.embed_tensor([question])[0]  # the question's, another's, and all ties (chunk order)
    for probe in (vector, cuda.embedder.embed_tensor(["Where does Maya work?"])[0], torch.zeros_like(vector)):
        assert torch.equal(graph.order(probe), index.by_retrieval(probe))
    ids = loaded.tokenizer.encode(question, add_special_tokens=False)
    one_stream = index.choose(cuda.question_pass(ids), 48, index.by_retrieval(vector))
    assert [item.record_id for item in choice.items] == [index.record_ids[c] for c in one_stream]
    start, end = index.turns[next(i for i, t in enumerate(MAYA) if "Pixel" in t.text)]
    spans = [index.spans[index.record_ids.index(item.record_id)] for item in choice.items]
    assert any(s < end and start < e for s, e in spans)
