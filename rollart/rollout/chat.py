"""Token-in/token-out chat contexts: a multi-turn context is built by appending, never re-tokenized.

The first prompt comes from the tokenizer's chat template (system + first observation + the
assistant header). After each LLM turn the generated ids are appended exactly as generated, then
the env's next observation is appended as a user message and a fresh assistant header. Re-encoding
the whole conversation could merge or split tokens differently from what the model generated, which
would make the trainer's logprobs refer to tokens the policy never produced.
"""

from __future__ import annotations

import json
from functools import cached_property, lru_cache
from pathlib import Path

# Tokenizer classes that are a tokenizer.json and nothing model-specific (the tiny models' class,
# and many exports'): they load without AutoTokenizer.
GENERIC_TOKENIZERS = frozenset({"TokenizersBackend", "PreTrainedTokenizerFast"})
CACHED_TEXTS = 4096  # distinct prompts and observations whose tokens a ChatFormat keeps


def load_tokenizer(path: str | Path):
    """The model's tokenizer. AutoTokenizer's imports pull in torch and much of transformers (5.3 s
    of CPU here, against 1.2 s for the generic fast tokenizer alone): on a small machine every stage
    process that only tokenizes (env, reward) pays that at start, beside the engine loading. A generic
    class loads directly; any other goes through AutoTokenizer."""
    config = Path(path) / "tokenizer_config.json"
    name = json.loads(config.read_text()).get("tokenizer_class") if config.is_file() else None
    if name in GENERIC_TOKENIZERS:
        from transformers import PreTrainedTokenizerFast

        return PreTrainedTokenizerFast.from_pretrained(str(path))
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(path))


class ChatFormat:
    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        # Per turn, encode and decode go to the Rust tokenizer a transformers fast tokenizer wraps: its
        # Python wrapper costs more than the encoding of a short observation (a profile of the per-turn
        # path). Only where the wrapper adds nothing to the result (no clean-up of spaces on decode).
        backend = getattr(tokenizer, "backend_tokenizer", None)
        self._fast = backend if backend is not None and not getattr(tokenizer, "clean_up_tokenization_spaces",
                                                                    False) else None
        # Envs repeat their observations (a fixed map's start, the same cell again): the chat template's
        # rendering (Jinja, then the encoding: ~0.1 ms a trajectory here) is done once per distinct text.
        self._initial = lru_cache(maxsize=CACHED_TEXTS)(self._render_initial)
        self._encode = lru_cache(maxsize=CACHED_TEXTS)(self._encode_text)

    @classmethod
    def from_pretrained(cls, path: str | Path) -> "ChatFormat":
        return cls(load_tokenizer(path))

    @cached_property
    def end_of_turn_id(self) -> int:
        return self.tokenizer.convert_tokens_to_ids("<|im_end|>")

    @cached_property
    def stop_token_ids(self) -> tuple[int, ...]:
        return (self.end_of_turn_id,)

    def initial(self, system: str, observation: str) -> list[int]:
        return list(self._initial(system, observation))

    def continuation(self, observation: str, generated: list[int] | tuple[int, ...]) -> list[int]:
        """Tokens that close the assistant turn (if the model did not) and open the next one."""
        closing = [] if generated and generated[-1] == self.end_of_turn_id else [self.end_of_turn_id]
        return closing + list(self._encode(f"\n<|im_start|>user\n{observation}<|im_end|>\n<|im_start|>assistant\n"))

    def _render_initial(self, system: str, observation: str) -> tuple[int, ...]:
        messages = [{"role": "user", "content": observation}]
        if system:
            messages.insert(0, {"role": "system", "content": system})
        return tuple(self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                                        return_dict=False))

    def _encode_text(self, text: str) -> tuple[int, ...]:
        if self._fast is not None:
            return tuple(self._fast.encode(text, add_special_tokens=False).ids)
        return tuple(self.tokenizer.encode(text, add_special_tokens=False))

    def decode_action(self, token_ids) -> str:
        return self._decode(list(token_ids), skip_special_tokens=True).strip()

    def decode(self, token_ids) -> str:
        return self._decode(list(token_ids), skip_special_tokens=False)

    def _decode(self, ids: list[int], *, skip_special_tokens: bool) -> str:
        if self._fast is not None:
            return self._fast.decode(ids, skip_special_tokens=skip_special_tokens)
        return self.tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)
