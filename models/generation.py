"""Plain text generation with the loaded model (greedy, chat template), for jobs that ask the model things."""

from __future__ import annotations

from models.loader import LoadedModel
from models.transformers_adapter import ReferenceEngine


class ChatGenerator:
    """`generate(prompt, max_new_tokens) -> str`: the prompt as one user message, the reply decoded."""

    def __init__(self, loaded: LoadedModel) -> None:
        self._tokenizer = loaded.tokenizer
        self._engine = ReferenceEngine(loaded)

    def __call__(self, prompt: str, max_new_tokens: int) -> str:
        ids = self._tokenizer.apply_chat_template(
            [{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=True, return_dict=False
        )
        if isinstance(ids, dict) or hasattr(ids, "keys"):
            ids = ids["input_ids"]
        return self._tokenizer.decode(self._engine.generate_plain(list(ids), max_new_tokens), skip_special_tokens=True)
