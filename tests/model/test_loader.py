"""The model loader: converted once, reused, offline, fingerprinted, model-agnostic."""

import os
import types

import pytest
import torch

from kvcore.errors import UnsupportedModelError
from kvcore.fingerprint import model_fingerprint
from models import loader

pytestmark = pytest.mark.model


def test_conversion_is_cached_and_complete(loaded, settings, monkeypatch):
    def must_not_convert(*_args):
        raise AssertionError("converted again although the cache is complete")

    monkeypatch.setattr(loader, "_convert_gguf", must_not_convert)
    for dtype in ("float32", "bfloat16"):
        path = loader.ensure_bundled_model(settings.model.cache_dir, dtype)
        assert (path / "config.json").exists() and (path / "model.safetensors").exists()
        assert (path / "tokenizer.json").exists() or (path / "tokenizer_config.json").exists()
        assert not (path / "config.json").read_text().count("quantization_config")
    assert os.environ["HF_HUB_OFFLINE"] == "1" and os.environ["TRANSFORMERS_OFFLINE"] == "1"


def test_spec_of_smollm2(loaded):
    spec = loaded.spec
    assert (spec.num_layers, spec.num_kv_heads, spec.head_dim) == (30, 3, 64)
    assert (spec.rope.theta, spec.rope.rope_type, spec.rope.style) == (100000.0, "default", "neox")
    assert len(spec.fingerprint) == 24


def test_fingerprint_ignores_dtype_but_not_weights(loaded, settings):
    bf16 = loader.load_model(settings.model.model_copy(update={"dtype": "bfloat16"}))
    assert bf16.dtype == torch.bfloat16
    assert bf16.spec.fingerprint == loaded.spec.fingerprint
    config = loaded.model.config.to_dict()
    params = [(name, p.detach().clone()) for name, p in loaded.model.named_parameters()]
    params[5][1].view(-1)[0] += 1.0
    assert model_fingerprint(config, params) != loaded.spec.fingerprint
    assert (
        model_fingerprint({**config, "num_hidden_layers": 29}, loaded.model.named_parameters())
        != loaded.spec.fingerprint
    )


def test_local_directory_loads_like_the_bundled_one(loaded, settings):
    other = loader.load_model(settings.model.model_copy(update={"path": loaded.path}))
    assert other.spec == loaded.spec


def test_bad_sources_fail_clearly(tmp_path, settings):
    with pytest.raises(FileNotFoundError, match="no config.json"):
        loader.load_model(settings.model.model_copy(update={"path": tmp_path}))
    fake = types.SimpleNamespace(config=types.SimpleNamespace(to_dict=lambda: {"model_type": "gpt2"}))
    with pytest.raises(UnsupportedModelError, match="gpt2"):
        loader.model_spec(fake)


def test_a_lone_question_tokenizes_as_the_chat_template_does(loaded, settings):
    """The serving path tokenizes only the question inside the known frame; it must equal the full template."""
    from models.chat import build_frame, split_chat

    frame = build_frame(loaded.tokenizer, settings.system_prompt)
    for question in ("Where does Maya work?", "  spaced  question \n", "Ünïcödé & <tags>?", "a"):
        head, tail = split_chat(loaded.tokenizer, settings.system_prompt, [{"role": "user", "content": question}])
        assert tuple(head) == frame.prefix_ids
        assert frame.query_ids(loaded.tokenizer, question) == tail, question
