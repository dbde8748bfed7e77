"""A tenant's search captured as a CUDA graph answers as the launched search does: for every k, after rows are
written in place (the same graph), after the matrix grew (captured again), for several questions of a batch, each
reading its row of the one query buffer; and on the host there is no plan at all."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tenants.index_mirror import IndexUpdate, MirrorIndexes, SearchAsk
from tenants.vector_index import ExactIndex


def _unit(rng: np.random.Generator, rows: int, dim: int = 384) -> np.ndarray:
    vectors = rng.standard_normal((rows, dim)).astype(np.float32)
    return vectors / np.linalg.norm(vectors, axis=1, keepdims=True)


def _replayed(copy: MirrorIndexes, queries: torch.Tensor, asks: list[SearchAsk]):
    launch = copy.replay_plan(queries, asks)
    assert launch is not None
    read = launch()
    torch.cuda.synchronize()
    return read()


def _graph_count(copy: MirrorIndexes) -> int:
    return sum(len(graphs) for graphs in copy._graphs._by_tenant.values())  # type: ignore[union-attr]


def test_on_the_host_there_is_no_plan():
    copy = MirrorIndexes("cpu", graphs=True)
    copy.apply([IndexUpdate("t", "snapshot", np.arange(3), _unit(np.random.default_rng(0), 3, 8))])
    assert copy.replay_plan(torch.zeros(1, 8), [SearchAsk("t", 2)]) is None


@pytest.mark.gpu
def test_a_captured_search_answers_as_the_launched_one_through_writes_and_growth():
    rng = np.random.default_rng(1)
    owner, copy = ExactIndex(384), MirrorIndexes("cuda", graphs=True)
    owner.upsert(np.arange(100), _unit(rng, 100))
    copy.apply([IndexUpdate("t", "snapshot", *owner.export())])  # built at 100 rows
    queries = torch.zeros((1, 384), device="cuda")  # the buffer the graphs read, as an embedder's output

    def check(k: int) -> None:
        query = _unit(rng, 1)
        queries.copy_(torch.from_numpy(query))  # written after the capture: each replay reads it afresh
        vectors, hits = _replayed(copy, queries, [SearchAsk("t", k)])
        want_scores, want_ids = owner.search(query[0], k)
        assert np.allclose(vectors.numpy(), query, atol=1e-6)
        assert hits[0][1].tolist() == want_ids.tolist() and np.allclose(hits[0][0], want_scores, atol=1e-5)

    for k in (1, 5, 50, 64, 100, 300):  # 300: more than the tenant holds, read as all it holds
        check(k)
    captured = _graph_count(copy)
    assert captured == len({1, 8, 64, 100})  # a top-k size a power of two, at most the rows

    written = _unit(rng, 3)
    for change in (IndexUpdate("t", "upsert", np.array([4, 5, 6]), written), IndexUpdate("t", "remove", np.arange(10))):
        copy.apply([change])
        if change.kind == "upsert":
            owner.upsert(change.ids, change.vectors)
        else:
            owner.remove(change.ids)
        queries.copy_(torch.from_numpy(written[:1]))
        _, hits = _replayed(copy, queries, [SearchAsk("t", 5)])
        assert hits[0][1].tolist() == owner.search(written[0], 5)[1].tolist()
        check(50)
    assert _graph_count(copy) == captured  # written in place: the same graphs

    grown = _unit(rng, 200)
    copy.apply([IndexUpdate("t", "upsert", np.arange(1000, 1200), grown)])
    owner.upsert(np.arange(1000, 1200), grown)
    check(50)
    check(250)
    assert _graph_count(copy) == 2  # the stale ones went with the old matrix


@pytest.mark.gpu
def test_each_question_of_a_batch_reads_its_own_row_and_tenant():
    rng = np.random.default_rng(2)
    owners = {name: ExactIndex(384) for name in ("a", "b")}
    copy = MirrorIndexes("cuda", graphs=True)
    for i, (name, owner) in enumerate(owners.items()):
        owner.upsert(np.arange(50 * (i + 1)), _unit(rng, 50 * (i + 1)))
        copy.apply([IndexUpdate(name, "snapshot", *owner.export())])
    asks = [SearchAsk("a", 10), SearchAsk("b", 20), SearchAsk("a", 3)]
    queries = torch.from_numpy(_unit(rng, 3)).cuda()
    vectors, hits = _replayed(copy, queries, asks)
    assert np.allclose(vectors.numpy(), queries.cpu().numpy(), atol=1e-6)
    for row, ask in enumerate(asks):
        want_scores, want_ids = owners[ask.tenant_id].search(queries[row].cpu(), ask.k)
        assert hits[row][1].tolist() == want_ids.tolist() and np.allclose(hits[row][0], want_scores, atol=1e-5)
    copy.apply([IndexUpdate("a", "drop", np.empty(0, np.int64))])
    assert copy.replay_plan(queries, asks) is None  # a tenant it no longer holds: searched the other way
    assert copy.replay_plan(queries[:1], [None]) is None  # a question with no search


@pytest.mark.gpu
def test_a_plan_that_must_not_capture_notes_its_graphs_and_another_thread_captures_them():
    """An event loop plans without capturing: a missing graph is noted and the plan refused; a thread captures the
    noted graphs, and the loop then replays them. A graph whose tenant's copy was replaced before its capture ended
    is not kept."""
    import threading

    rng = np.random.default_rng(3)
    owners = {name: ExactIndex(384) for name in ("a", "b")}
    copy = MirrorIndexes("cuda", graphs=True)
    for name, owner in owners.items():
        owner.upsert(np.arange(80), _unit(rng, 80))
        copy.apply([IndexUpdate(name, "snapshot", *owner.export())])
    queries = torch.from_numpy(_unit(rng, 2)).cuda()
    asks = [SearchAsk("a", 10), SearchAsk("b", 40)]
    assert copy.replay_plan(queries, asks, capture=False) is None and copy.wants_captures
    assert _graph_count(copy) == 0  # nothing captured on the planner's thread

    worker = threading.Thread(target=copy.capture_wanted)
    worker.start()
    worker.join()
    assert not copy.wants_captures and _graph_count(copy) == 2
    launch = copy.replay_plan(queries, asks, capture=False)
    assert launch is not None
    read = launch()
    torch.cuda.synchronize()
    _, hits = read()
    for row, ask in enumerate(asks):
        want_scores, want_ids = owners[ask.tenant_id].search(queries[row].cpu(), ask.k)
        assert hits[row][1].tolist() == want_ids.tolist() and np.allclose(hits[row][0], want_scores, atol=1e-5)

    # "b" is noted, and replaced (a snapshot) while the thread captures its graph: the graph over the old copy is
    # not kept, though the capture itself went through
    graphs = copy._graphs
    assert graphs is not None and copy.replay_plan(queries[:1], [SearchAsk("b", 3)], capture=False) is None
    capture, captures = graphs._capture, []

    def replaced_meanwhile(index, query, k):
        graph = capture(index, query, k)
        captures.append(k)
        owners["b"].upsert(np.arange(80), _unit(rng, 80))
        copy.apply([IndexUpdate("b", "snapshot", *owners["b"].export())])
        return graph

    graphs._capture = replaced_meanwhile  # type: ignore[method-assign]
    assert graphs.capture_wanted(lambda tenant_id, index: copy._indexes.get(tenant_id) is index) == 0
    assert captures == [4] and "b" not in graphs._by_tenant and not copy.wants_captures
