"""The incremental detokenizer's text is the tokenizer's own ``decode``, whichever way it is called."""

from __future__ import annotations

import copy
import random
from typing import Any

import pytest

from workers.detokenizer import IncrementalDetokenizer, text_decoder


@pytest.fixture(scope="module")
def tokenizer(smollm2_loaded: Any) -> Any:
    return smollm2_loaded.tokenizer


def hf_decode(tok: Any, ids: list[int]) -> str:
    return tok.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)


def sequences(tok: Any) -> list[list[int]]:
    """Text with multi-byte characters split across tokens, special tokens inside it, and random ids."""
    rng = random.Random(0)
    text = "Héllo wörld 🐉🐲 dragons — naïve café 日本語のテキスト\n\tcode(x) {return x**2;}  "
    ids = tok.encode(text, add_special_tokens=False)
    specials = list(tok.all_special_ids)
    out = [ids, ids[:1], [], specials + ids + specials]
    for _ in range(200):
        n = rng.randint(1, 12)
        out.append([rng.randrange(len(tok)) for _ in range(n)] + rng.sample(specials, 1))
    return out


def test_the_text_decoder_gives_the_tokenizers_own_decode(tokenizer: Any) -> None:
    dec = text_decoder(tokenizer)
    for ids in sequences(tokenizer):
        for cut in range(len(ids) + 1):  # every prefix, as the incremental windows are
            assert dec(ids[:cut]) == hf_decode(tokenizer, ids[:cut])


def test_a_tokenizer_that_decodes_its_own_way_keeps_its_decode(tokenizer: Any) -> None:
    class Shouting(type(tokenizer)):  # type: ignore[misc]
        def _decode(self, token_ids: Any, **kwargs: Any) -> str:
            return str(super()._decode(token_ids, **kwargs)).upper()

    shouting = copy.copy(tokenizer)
    shouting.__class__ = Shouting
    ids = tokenizer.encode("quiet words", add_special_tokens=False)
    assert text_decoder(shouting)(ids) == "QUIET WORDS" == hf_decode(shouting, ids)


@pytest.mark.parametrize("stop", [(), ("dragons",), ("🐲",)])
def test_streamed_text_is_the_decode_of_the_whole_output(tokenizer: Any, stop: tuple[str, ...]) -> None:
    prompt = tokenizer.encode("Tell me:", add_special_tokens=False)
    out = tokenizer.encode(" Héllo 🐉🐲 dragons naïve 日本語 end", add_special_tokens=False)
    for decode in (text_decoder(tokenizer), None):
        d = IncrementalDetokenizer(tokenizer, prompt, stop, decode)
        chunks = []
        for t in out:
            stopped = d.add(t)
            chunks.append(d.take(stopped))
            if stopped:
                break
        chunks.append(d.take(True))
        full = hf_decode(tokenizer, prompt[-5:] + out)[len(hf_decode(tokenizer, prompt[-5:])) :]
        want = full[: min((full.index(s) for s in stop), default=len(full))]
        assert "".join(chunks) == want
        assert "\ufffd" not in "".join(chunks)
