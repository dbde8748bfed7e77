"""Retrieval with the real embedding model (the packaged all-MiniLM-L6-v2)."""

import pytest

from models.minilm import MiniLMEmbedder


@pytest.fixture(scope="module")
def minilm():
    return MiniLMEmbedder()


def test_semantic_search_finds_the_paraphrase(make_service, minilm):
    service = make_service(embedder=minilm)
    tenant = service.authenticate(service.create_tenant(service.ensure_admin_key(), "alice")[1])
    tenant.add_facts(["I am allergic to peanuts.", "My sister lives in Lisbon.", "I drive a red Volvo.",
                      "My favourite composer is Bach.", "I work night shifts at the hospital."])
    (best, score), *_ = tenant.search("Which nuts should I avoid eating?", k=3)
    assert best.text == "I am allergic to peanuts." and score > 0.3
    vectors = minilm.embed(["a", "b b"])
    assert vectors.shape == (2, 384) and abs(float((vectors[0] ** 2).sum()) - 1) < 1e-5
