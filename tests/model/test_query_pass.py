"""The question's own pass through the first layers, from the checkpoint's tensors, equals the model's forward."""

import json

import pytest
import torch

from kvcore.query_pass import EarlyLayers, question_queries
from models.early_layers import load_early_layers

pytestmark = pytest.mark.model


def _model_queries(model, ids: list[int], layers: int) -> torch.Tensor:
    """Pre-RoPE queries `[L, H, Q, D]` caught at the model's own q projections in a plain forward."""
    caught = {}
    hooks = [
        model.model.layers[i].self_attn.q_proj.register_forward_hook(
            lambda _m, _i, out, i=i: caught.__setitem__(i, out.detach()[0])
        )
        for i in range(layers)
    ]
    try:
        with torch.inference_mode():
            model(torch.tensor([ids]))
    finally:
        for hook in hooks:
            hook.remove()
    heads = model.config.num_attention_heads
    return torch.stack([caught[i].view(len(ids), heads, -1).transpose(0, 1) for i in range(layers)])


def test_the_first_four_layers_queries_equal_the_models_own(loaded):
    ids = loaded.tokenizer.encode("Question: Where did Maya move after the wedding?\nAnswer:", add_special_tokens=False)
    weights = load_early_layers(loaded.path, 4)
    ours = question_queries(weights, ids)
    theirs = _model_queries(loaded.model, ids, 4)
    assert ours.shape == theirs.shape == (4, 9, len(ids), 64)
    assert (ours - theirs).abs().max() < 1e-4 * theirs.abs().max()
    # a wrong layer would not pass: layer 3's queries differ from layer 2's by far more than the tolerance
    assert (theirs[3] - theirs[2]).abs().max() > 100 * (ours - theirs).abs().max()


def test_one_layer_needs_no_attention_and_a_question_must_have_tokens(loaded):
    weights = load_early_layers(loaded.path, 1)
    ids = loaded.tokenizer.encode("Hello there", add_special_tokens=False)
    assert torch.allclose(question_queries(weights, ids), _model_queries(loaded.model, ids, 1), atol=1e-5)
    with pytest.raises(ValueError, match="no tokens"):
        question_queries(weights, [])


def test_bad_layer_counts_and_foreign_checkpoints_are_refused(loaded, tmp_path):
    total = json.loads((loaded.path / "config.json").read_text())["num_hidden_layers"]
    with pytest.raises(ValueError, match=f"has {total} layers"):
        load_early_layers(loaded.path, total + 1)
    with pytest.raises(ValueError, match="first 0"):
        load_early_layers(loaded.path, 0)
    (tmp_path / "config.json").write_text((loaded.path / "config.json").read_text())
    with pytest.raises(FileNotFoundError, match="no safetensors"):
        load_early_layers(tmp_path, 2)
    with pytest.raises(ValueError, match="share"):
        weights = load_early_layers(loaded.path, 1)
        EarlyLayers(weights.embed_tokens, weights.layers, 9, 2, 64, weights.eps, weights.rope)


def test_a_question_padded_at_its_end_keeps_its_own_queries(loaded):
    """What the GPU's graphed pass relies on: the pass is causal, so padding after the question (a graph's fixed
    length) leaves the question's own queries as they were."""
    from kvcore.query_pass import queries_of

    early = load_early_layers(loaded.path, 4)
    ids = loaded.tokenizer.encode("What is the name of Maya's cat?", add_special_tokens=False)
    padded = torch.tensor(ids + [0] * (16 - len(ids)))
    assert torch.allclose(queries_of(early, padded)[:, :, : len(ids)], question_queries(early, ids), atol=1e-5)


@pytest.mark.gpu
def test_the_graphed_question_pass_equals_the_eager_one_on_cuda(loaded):
    from deployments.choice_graphs import QuestionPass

    early = load_early_layers(loaded.path, 4, torch.bfloat16, "cuda")
    graphed = QuestionPass(early)
    for text in ("Where does Maya work?", "a " * 40, "What is the name of Maya's cat, and who gave it to her?"):
        ids = loaded.tokenizer.encode(text, add_special_tokens=False)
        got, want = graphed(ids), question_queries(early, ids)
        assert got.shape == want.shape and torch.allclose(got.float(), want.float(), atol=2e-2, rtol=2e-2)
    assert graphed._graphs  # captured, not fallen back to eager
