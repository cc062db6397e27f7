"""Incremental detokenization with stop strings.

Decoding the whole output every step is O(n) per token; instead we decode a short
window (the prefix/read offsets of vLLM's ``detokenize_incrementally``) and hold back
a trailing U+FFFD so a multi-byte character split across tokens is never emitted
half-way. Stop strings are searched only in the newly grown tail, and text that
could still become the start of a stop string is held back until it cannot.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable, Sequence, cast

if TYPE_CHECKING:  # the Router and the ingress import the engine's types; they never need transformers
    from transformers import PreTrainedTokenizerBase

_PROMPT_CONTEXT = 5  # prompt tokens used as decoding context, so the first output token gets its leading space


def text_decoder(tokenizer: PreTrainedTokenizerBase) -> Callable[[list[int]], str]:
    """``ids -> tokenizer.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)``.

    Why not that call itself: a fast tokenizer's ``decode`` is a Python wrapper (argument conversion, batch
    detection, clean-up options) around its Rust tokenizer's ``decode``, and costs several times the decode it
    makes, twice a token. Where the tokenizer overrides neither of the wrapper's two steps, the Rust call is the
    whole of what it would return; any other tokenizer keeps its own ``decode``."""
    from transformers.tokenization_utils_base import PreTrainedTokenizerBase
    from transformers.tokenization_utils_tokenizers import TokenizersBackend

    cls, backend = type(tokenizer), getattr(tokenizer, "backend_tokenizer", None)
    if (
        isinstance(tokenizer, TokenizersBackend)
        and backend is not None
        and cls.decode is PreTrainedTokenizerBase.decode
        and cls._decode is TokenizersBackend._decode
    ):
        return lambda ids: cast(str, backend.decode(ids, skip_special_tokens=True))
    return lambda ids: cast(str, tokenizer.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False))


class IncrementalDetokenizer:
    def __init__(
        self,
        tokenizer: PreTrainedTokenizerBase,
        prompt_ids: Sequence[int],
        stop: Sequence[str] = (),
        decode: Callable[[list[int]], str] | None = None,  # text_decoder(tokenizer), made once per tokenizer
    ) -> None:
        self._decode = decode if decode is not None else text_decoder(tokenizer)
        ctx = list(prompt_ids[-_PROMPT_CONTEXT:])
        self._ids: list[int] = ctx  # context + output tokens
        self._prefix = 0
        self._read = len(ctx)
        self.stop = tuple(stop)
        self._hold = max((len(s) for s in self.stop), default=1) - 1
        self.text = ""  # output text so far, cut before a matched stop string
        self._emitted = 0
        self.stopped = False

    def add(self, token_id: int) -> bool:
        """Append one output token; True when it completed a stop string (the caller stops there)."""
        if self.stopped:
            return True
        self._ids.append(token_id)
        prefix_text = self._decode(self._ids[self._prefix : self._read])
        new_text = self._decode(self._ids[self._prefix :])
        if len(new_text) <= len(prefix_text) or new_text.endswith("\ufffd"):
            return False  # an incomplete multi-byte character: wait for the next token
        delta = new_text[len(prefix_text) :]
        self._prefix, self._read = self._read, len(self._ids)
        start = max(0, len(self.text) - self._hold)
        self.text += delta
        if self.stop:
            hits = [i for i in (self.text.find(s, start) for s in self.stop) if i >= 0]
            if hits:
                self.text = self.text[: min(hits)]
                self.stopped = True
        return self.stopped

    def take(self, final: bool) -> str:
        """Text not yet handed out; while not final, hold back what may still begin a stop string."""
        end = len(self.text) if (final or self.stopped) else max(self._emitted, len(self.text) - self._hold)
        out = self.text[self._emitted : end]
        self._emitted = end
        return out
