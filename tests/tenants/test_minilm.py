"""Retrieval with the real embedding model (the packaged all-MiniLM-L6-v2)."""

import numpy as np
import pytest

from models.minilm import MiniLMEmbedder


@pytest.fixture(scope="module")
def minilm():
    return MiniLMEmbedder()


def test_semantic_search_finds_the_paraphrase(make_service, minilm):
    service = make_service(embedder=minilm)
    tenant = service.authenticate(service.create_tenant(service.ensure_admin_key(), "alice")[1])
    tenant.add_facts(
        [
            "I am allergic to peanuts.",
            "My sister lives in Lisbon.",
            "I drive a red Volvo.",
            "My favourite composer is Bach.",
            "I work night shifts at the hospital.",
        ]
    )
    (best, score), *_ = tenant.search("Which nuts should I avoid eating?", k=3)
    assert best.text == "I am allergic to peanuts." and score > 0.3
    vectors = minilm.embed(["a", "b b"])
    assert vectors.shape == (2, 384) and abs(float((vectors[0] ** 2).sum()) - 1) < 1e-5


def test_the_forward_matches_transformers_bert(minilm):
    """The hand-written forward equals sentence-transformers' recipe over transformers' own BertModel."""
    import torch
    from transformers import AutoModel, AutoTokenizer

    from models.minilm import minilm_path

    texts = ["Where does Maya work?", "a", "My sister lives in Lisbon and visits every second summer, usually in June."]
    tokenizer, model = AutoTokenizer.from_pretrained(minilm_path()), AutoModel.from_pretrained(minilm_path()).eval()
    batch = tokenizer(texts, padding=True, return_tensors="pt")
    with torch.inference_mode():
        hidden = model(**batch).last_hidden_state
    mask = batch["attention_mask"].unsqueeze(-1).float()
    reference = torch.nn.functional.normalize((hidden * mask).sum(1) / mask.sum(1), dim=-1)
    ours = minilm.embed_tensor(texts)
    assert ours.shape == (3, 384)
    assert torch.allclose(ours, reference, atol=2e-5), (ours - reference).abs().max()
    # a query embedded alone equals the same query embedded in a padded batch
    assert torch.allclose(minilm.embed_tensor(texts[:1])[0], ours[0], atol=2e-5)


@pytest.mark.gpu
def test_cuda_graph_buckets_equal_the_eager_forward():
    """On CUDA each (batch, length) bucket is a captured graph; its answers must equal the eager forward's, for
    batches and lengths that pad into a bucket and for a bucket replayed with other inputs."""
    import torch

    graphed, eager = MiniLMEmbedder(device="cuda"), MiniLMEmbedder(device="cuda", cuda_graphs=False)
    for texts in (["Where does Maya work?"], ["a", "b b b"], ["What does box 17 hold?"] * 3 + ["x " * 40]):
        got, want = graphed.embed_tensor(texts), eager.embed_tensor(texts)
        assert got.shape == (len(texts), 384) and torch.allclose(got, want, atol=1e-5), (got - want).abs().max()
    assert graphed._graphs, "no graph was captured"


def test_without_graphs_the_captured_only_forward_is_the_plain_one(minilm):
    texts = ["Where does Maya work?", "x " * 60]
    assert np.allclose(minilm.embed_tensor_captured(texts).numpy(), minilm.embed_tensor(texts).numpy())
    # the same from token ids (the inline launch tokenizes apart, to time the two), over more than one batch
    many = [f"What does box {i} hold?" for i in range(70)]
    from_ids = minilm.embed_ids_captured(minilm.token_ids(many)).numpy()
    assert from_ids.shape == (70, 384) and np.allclose(from_ids, minilm.embed_tensor(many).numpy(), atol=1e-6)


@pytest.mark.gpu
def test_the_captured_only_forward_refuses_a_bucket_not_captured_before_any_device_work():
    """Buckets prepared at start replay; a longer question's bucket is refused (`GraphNotCaptured`) until a plain
    forward has captured it, and then gives the plain forward's answer."""
    import torch

    from models.minilm import GraphNotCaptured

    embedder = MiniLMEmbedder(device="cuda")
    embedder.prepare(4)  # batches up to 4, lengths up to 32 tokens
    short, long = ["Where does Maya work?"], ["where " * 50]
    captured = dict(embedder._graphs)
    assert torch.allclose(embedder.embed_tensor_captured(short), embedder.embed_tensor(short), atol=1e-6)
    with pytest.raises(GraphNotCaptured):
        embedder.embed_tensor_captured(long)
    with pytest.raises(GraphNotCaptured):
        embedder.embed_ids_captured(embedder.token_ids(long))
    assert embedder._graphs == captured  # nothing captured by the refusal
    plain = embedder.embed_tensor(long)
    assert torch.allclose(embedder.embed_tensor_captured(long), plain, atol=1e-6)


@pytest.mark.gpu
def test_a_bucket_replayed_on_two_streams_keeps_each_calls_answer():
    """A history's turns are embedded on one stream while a question is embedded on another (the chooser's second
    stream): calls one at a time, but their replays of one bucket's graph may overlap on the device unless each
    waits for the last one's output. Alternating streams, with a large product queued on one to delay it, every
    answer equals the same text's answer alone."""
    import torch

    graphed = MiniLMEmbedder(device="cuda")
    texts = [f"question number {i} about box {i * 7}" for i in range(12)]
    alone = [graphed.embed_tensor([t])[0].clone() for t in texts]
    streams = [torch.cuda.Stream(), torch.cuda.Stream()]
    busy = torch.randn(4096, 4096, device="cuda")
    got = []
    for i, text in enumerate(texts):
        with torch.cuda.stream(streams[i % 2]):
            if i % 2 == 0:
                busy @ busy  # the even stream lags: without the wait the odd one's replay would overtake it
            got.append(graphed.embed_tensor([text])[0])
    torch.cuda.synchronize()
    assert all(torch.allclose(g, a, atol=1e-5) for g, a in zip(got, alone))


@pytest.mark.gpu
def test_search_on_the_device_matches_the_cpu():
    import numpy as np

    from tenants.vector_index import ExactIndex

    rng = np.random.default_rng(1)
    vectors = rng.standard_normal((3000, 384)).astype(np.float32)
    ids = np.arange(3000) * 3
    on_gpu, on_cpu = ExactIndex(384, "cuda"), ExactIndex(384)
    for index in (on_gpu, on_cpu):
        index.upsert(ids, vectors)
        index.remove(ids[::7])
    query = rng.standard_normal(384).astype(np.float32)
    assert on_gpu.search(query, 50)[1].tolist() == on_cpu.search(query, 50)[1].tolist()


def test_the_rust_tokenizer_gives_transformers_ids_and_padding_keeps_every_row_finite(minilm):
    """Questions are tokenized by the Rust tokenizer directly; its ids must be transformers' (special tokens,
    truncation at MAX_TOKENS, accents), and a bucket's padding rows attend to their first token."""
    from models.minilm import MAX_TOKENS, ONE_BY_ONE, padded

    texts = ["Where does Maya work?", "Café déjà vu — naïve résumé!", "word " * 400, ""]
    reference = minilm._tokenizer(texts, truncation=True, max_length=MAX_TOKENS)["input_ids"]
    assert minilm.token_ids(texts) == reference and len(reference[2]) == MAX_TOKENS
    assert len(texts) <= ONE_BY_ONE < len(texts) * 3
    many = texts * 3  # more than ONE_BY_ONE: through the tokenizer's pool, the same ids
    assert minilm.token_ids(many) == reference * 3
    out = padded([[101, 7, 102], [101, 102]], np.full((2, 4, 5), 9, dtype=np.int64))
    assert out[0].tolist() == [[101, 7, 102, 0, 0], [101, 102, 0, 0, 0], [0] * 5, [0] * 5]
    assert out[1].tolist() == [[1, 1, 1, 0, 0], [1, 1, 0, 0, 0], [1, 0, 0, 0, 0], [1, 0, 0, 0, 0]]
