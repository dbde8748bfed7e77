"""The order of a chat's facts in its prompt (`memory.order`), on made-up retrieval hits."""

import pytest

from deployments.gateway import order_facts
from deployments.schemas import ChatRequest
from tenants.facts import Fact


def _fact(fact_id: str, turn: int | None, created: float) -> Fact:
    return Fact(fact_id, f"text of {fact_id}", 1, None, None, turn, created, created)


HITS = [
    (_fact("said-late", 7, 10.0), 0.9),
    (_fact("api-old", None, 1.0), 0.8),
    (_fact("said-early", 2, 30.0), 0.7),
    (_fact("api-new", None, 50.0), 0.6),
]


@pytest.mark.parametrize(
    "order, expected",
    [
        ("best_first", ["said-late", "api-old", "said-early", "api-new"]),  # retrieval's order
        ("best_last", ["api-new", "said-early", "api-old", "said-late"]),  # the best next to the question
        ("time", ["said-early", "said-late", "api-old", "api-new"]),  # by turn, then facts without one by time
    ],
)
def test_orders(order, expected):
    ordered = order_facts(HITS, order)
    assert [fact.id for fact, _ in ordered] == expected
    assert sorted(score for _, score in ordered) == [0.6, 0.7, 0.8, 0.9]  # scores travel with their facts


def test_an_unknown_order_is_refused():
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
    assert ChatRequest(**body, memory={"order": "time"}).memory.order == "time"
    assert ChatRequest(**body).memory.order is None  # the server's default applies
    with pytest.raises(ValueError, match="best_first"):
        ChatRequest(**body, memory={"order": "random"})
