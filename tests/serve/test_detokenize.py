"""The streaming detokenizer primed with the prompt's tail gives the text of one primed with the whole prompt."""

import random

import pytest
import tokenizers.decoders
from tokenizers import Tokenizer

from config import load_settings
from deployments.vllm_adapter import detokenize
from models.loader import model_path

TEXTS = [
    "Maya moved to Zürich in 2019 — 東京へ行った 🎉🎉 and then naïve café crème.",
    "def f(x):\n    return x ** 2  # ≥ ≤ ∑ 😀",
    "  leading spaces\tand\ttabs  ",
    "Ελληνικά και русский текст, 한국어도.",
]


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return Tokenizer.from_file(str(model_path(load_settings().model) / "tokenizer.json"))


def _cases(tokenizer: Tokenizer) -> list[tuple[list[int], list[int]]]:
    """(prompt, continuation): texts cut at every token (multi-byte characters split over tokens among them),
    chat-framed ones, and random ids; only prompts whose text ends on a whole character, as every chat prompt
    does (where it ends inside one, the library's stream repeats the whole prompt's text as its first piece)."""
    special = [tokenizer.token_to_id(t) for t in ("<|im_start|>", "<|im_end|>")]
    cases = []
    for text in TEXTS:
        ids = tokenizer.encode(text * 3).ids
        cases += [(ids[:cut], ids[cut : cut + 8]) for cut in range(1, len(ids) - 1)]
        framed = [special[0], *tokenizer.encode("assistant\n").ids]
        cases.append((ids + [special[1]] + framed, ids[:8]))
    rng = random.Random(7)
    vocab = tokenizer.get_vocab_size()
    for _ in range(1500):
        prompt = [rng.randrange(vocab) for _ in range(rng.randrange(0, 90))]
        cases.append((prompt, [rng.randrange(vocab) for _ in range(10)]))
    return [(p, c) for p, c in cases if not tokenizer.decode(p, skip_special_tokens=False).endswith("\ufffd")]


def _pieces(stream, tokenizer: Tokenizer, continuation: list[int]) -> list[str | None]:
    return [stream.step(tokenizer, t) for t in continuation]


def _differences(tokenizer: Tokenizer, skip_special: bool) -> int:
    whole = detokenize._Original.stream or tokenizers.decoders.DecodeStream
    return sum(
        _pieces(detokenize.prompt_suffix_stream(ids=p, skip_special_tokens=skip_special), tokenizer, c)
        != _pieces(whole(ids=p, skip_special_tokens=skip_special), tokenizer, c)
        for p, c in _cases(tokenizer)
    )


@pytest.mark.parametrize("skip_special", [True, False])
def test_the_prompts_tail_gives_the_same_pieces_as_the_whole_prompt(tokenizer, skip_special):
    assert len(_cases(tokenizer)) > 1000
    assert _differences(tokenizer, skip_special) == 0


def test_one_token_of_context_is_not_enough(tokenizer, monkeypatch):
    """The cases need the prompt's context: primed with its last token alone, some first pieces change."""
    monkeypatch.setattr(detokenize, "PROMPT_CONTEXT", 1)
    assert _differences(tokenizer, True) > 0


def test_install_replaces_the_stream_vllm_looks_up_once(monkeypatch):
    monkeypatch.setattr(detokenize._Original, "stream", None)
    library = detokenize._Original.stream or tokenizers.decoders.DecodeStream  # the library's, installed or not
    monkeypatch.setattr(tokenizers.decoders, "DecodeStream", library)
    detokenize.install_prompt_suffix_detokenizer()
    detokenize.install_prompt_suffix_detokenizer()
    assert tokenizers.decoders.DecodeStream is detokenize.prompt_suffix_stream
    assert detokenize._Original.stream is library  # not the replacement itself: no recursion
    assert detokenize.prompt_suffix_stream(skip_special_tokens=True).step is not None  # no prompt (vLLM's reset)
