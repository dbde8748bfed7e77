"""The streaming detokenizer primed with the prompt's tail gives the text of one primed with the whole prompt."""

import random
from types import SimpleNamespace

import pytest
import tokenizers.decoders
from tokenizers import Tokenizer
from vllm import SamplingParams

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


def _differences(tokenizer: Tokenizer, skip_special: bool, context: int = detokenize.PROMPT_CONTEXT) -> int:
    whole = detokenize.library_stream()
    tail = detokenize.prompt_suffix_stream(whole, context)
    return sum(
        _pieces(tail(ids=p, skip_special_tokens=skip_special), tokenizer, c)
        != _pieces(whole(ids=p, skip_special_tokens=skip_special), tokenizer, c)
        for p, c in _cases(tokenizer)
    )


@pytest.mark.parametrize("skip_special", [True, False])
def test_the_prompts_tail_gives_the_same_pieces_as_the_whole_prompt(tokenizer, skip_special):
    assert len(_cases(tokenizer)) > 1000
    assert _differences(tokenizer, skip_special) == 0


def test_one_token_of_context_is_not_enough(tokenizer):
    """The cases need the prompt's context: primed with its last token alone, some first pieces change."""
    assert _differences(tokenizer, True, context=1) > 0


def test_vllms_detokenizer_builds_its_stream_from_the_prompts_tail(monkeypatch):
    """vLLM's own detokenizer, given a 100-token prompt, primes its stream through the replacement with 32 ids."""
    from vllm.tokenizers import get_tokenizer
    from vllm.v1.engine.detokenizer import FastIncrementalDetokenizer, IncrementalDetokenizer

    primed: list[int] = []
    library = detokenize.library_stream()

    def spy(ids=None, **kwargs):
        primed.append(len(ids or ()))
        return library(ids=ids, **kwargs)

    monkeypatch.setattr(tokenizers.decoders, "DecodeStream", spy)
    detokenize.install_prompt_suffix_detokenizer()
    assert detokenize.installed() and tokenizers.decoders.DecodeStream is not spy
    vllm_tokenizer = get_tokenizer(str(model_path(load_settings().model)))
    params = SamplingParams(max_tokens=4, skip_special_tokens=True)
    request = SimpleNamespace(request_id="r", prompt_token_ids=list(range(1000, 1100)), sampling_params=params)
    made = IncrementalDetokenizer.from_new_request(vllm_tokenizer, request)
    assert isinstance(made, FastIncrementalDetokenizer)
    assert primed == [detokenize.PROMPT_CONTEXT]
    detokenize.install_prompt_suffix_detokenizer()  # a second install wraps nothing twice
    made.decode_next(2000)
    assert primed == [detokenize.PROMPT_CONTEXT]


def test_without_a_prompt_the_stream_starts_empty():
    """vLLM's reset after a decoding error builds a stream with no ids."""
    stream = detokenize.prompt_suffix_stream(detokenize.library_stream())(skip_special_tokens=True)
    assert stream.step is not None
