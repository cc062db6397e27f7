"""Grammar-constrained decoding (structured output): compile, mask, and the grammar's forced tokens.

A request with ``SamplingParams.structured`` (a JSON schema, any JSON object, a regex, a choice
or a Lark/GBNF grammar) carries a :class:`Grammar`: an llguidance matcher advanced over the
tokens the request has committed. Three uses, each keeping output a pure function of the request:

* **the mask**: the target's logits at output position t are masked to the tokens the grammar
  allows after the tokens before t, before the position-keyed sample. A verify row j sees the
  committed output plus drafts[:j], exactly what a plain step at that position would see, so the
  masked distribution, and therefore the token, is the same whatever K, proposer or path;
* **the draft cut**: drafts from any proposer are cut at the first token the grammar refuses
  (such a draft could never equal the target's masked sample, so verifying it is wasted rows);
* **the grammar as a proposer**: where the grammar forces the continuation (``{"name": "`` after
  an object opens, an enum's tail), llguidance's fast-forward tokens are proposed as drafts for
  free, and the target accepts them unless it tokenizes the forced text differently.

Why llguidance (benchmarks/structured/grammar_libs.py, docs/grammar_libraries.md): no dependencies beyond
its own wheel, masks computed lazily per step (no per-schema precompilation stall), and the
speculative pieces this file needs in its API: ``validate_tokens`` (the draft cut),
``compute_ff_tokens`` (forced drafts), ``rollback`` and masks along a draft in one call.
"""

from __future__ import annotations

import concurrent.futures
import hashlib
import json
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Sequence

import llguidance
import llguidance.hf
import numpy as np
import torch

from workers.config import StructuredOutputsConfig
from workers.errors import InvalidRequestError
from workers.json_schema import close_objects

if TYPE_CHECKING:
    from llguidance._lib import JsonCompileOptions

_WORD_BITS = 32  # llguidance's bitmask packs 32 tokens per int32 word


@dataclass(frozen=True)
class GrammarSource:
    """A constraint as llguidance takes it, and the request field it came from (named in errors)."""

    grammar: str  # llguidance's grammar text (JSON), from one of LLMatcher.grammar_from_*
    param: str  # e.g. "response_format", "structured_outputs.regex"


def grammar_source(spec: Any, config: StructuredOutputsConfig | None = None) -> GrammarSource:
    """The llguidance grammar of a ``StructuredOutput`` (workers/sampling_params.py). Raises
    ``InvalidRequestError`` for what can be refused without a tokenizer (bad JSON, an empty choice)."""
    config = config or StructuredOutputsConfig()
    options: JsonCompileOptions = (
        {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
        if config.json_whitespace == "compact"
        else {"whitespace_flexible": True}
    )
    kind, value, param = spec.kind, spec.value, spec.param
    try:
        if kind == "json_object":
            return GrammarSource(
                llguidance.LLMatcher.grammar_from_json_schema({"type": "object"}, overrides=options), param
            )
        if kind == "json":
            schema = json.loads(value)
            if not isinstance(schema, dict):
                raise ValueError("a JSON schema must be an object")
            if config.json_closed_objects:
                schema = close_objects(schema)
            return GrammarSource(llguidance.LLMatcher.grammar_from_json_schema(schema, overrides=options), param)
        if kind == "regex":
            return GrammarSource(llguidance.LLMatcher.grammar_from_regex(value), param)
        if kind == "choice":
            lark = "start: " + " | ".join(json.dumps(c) for c in value)
            return GrammarSource(llguidance.LLMatcher.grammar_from_lark(lark), param)
        if kind == "lark":
            return GrammarSource(llguidance.LLMatcher.grammar_from_lark(value), param)
        if kind == "grammar":  # Lark, or GBNF (llama.cpp), which llguidance converts to Lark
            return GrammarSource(llguidance.grammar_from("grammar", value), param)
    except (ValueError, TypeError) as e:
        raise InvalidRequestError(f"{param}: {e}", param=param) from None
    except RecursionError:
        raise InvalidRequestError(f"{param}: nested too deeply", param=param) from None
    raise InvalidRequestError(f"{param}: unknown kind {kind!r}", param=param)


class Grammar:
    """One request's matcher: the grammar state after the tokens it has committed.

    Not thread-safe: only the engine thread touches it once the request is admitted."""

    def __init__(self, matcher: llguidance.LLMatcher, key: str) -> None:
        self.matcher = matcher
        self.key = key  # hash of the source: which compiled grammar this is

    def consume(self, token_ids: Sequence[int]) -> None:
        """Advance over committed tokens. They were sampled under this grammar's mask, so this cannot fail
        unless the engine broke that rule: then it raises rather than constrain from a wrong state. Per token,
        since a request past the grammar's end may still write EOS (ignore_eos), which it does not consume."""
        for t in token_ids:
            if self.matcher.is_stopped():  # complete: what follows is EOS (repeated under ignore_eos)
                return
            if not self.matcher.consume_token(t):
                raise RuntimeError(f"grammar refused committed token {t}: {self.matcher.get_error()}")

    def resume(self, token_ids: Sequence[int], eos_token_ids: frozenset[int]) -> bool:
        """Advance over output written elsewhere (a resumed stream); False if the grammar refuses it. Past the
        grammar's end only EOS can have been written (repeated under ignore_eos)."""
        for t in token_ids:
            if self.matcher.is_stopped():
                if t not in eos_token_ids:
                    return False
            elif not self.matcher.consume_token(t):
                return False
        return True

    def valid_prefix(self, token_ids: Sequence[int]) -> int:
        """How many leading ``token_ids`` the grammar allows from the current state (the draft cut)."""
        return self.matcher.validate_tokens(list(token_ids)) if token_ids else 0

    def forced(self, limit: int) -> list[int]:
        """Up to ``limit`` tokens the grammar forces next (none once it can stop, where EOS competes)."""
        if limit <= 0 or self.matcher.is_stopped():
            return []
        return self.matcher.compute_ff_tokens()[:limit]

    @property
    def done(self) -> bool:
        """The grammar is complete and admits nothing but EOS."""
        return self.matcher.is_stopped()


class GrammarRuntime:
    """Compiles and caches grammars for one tokenizer, and masks logits for a batch of matchers.

    ``compile`` may be called from any thread (it holds a lock around the cache and drops the GIL
    while llguidance builds); the masking methods run on the engine thread."""

    def __init__(
        self,
        hf_tokenizer: Any,
        vocab_size: int,
        eos_token_ids: Sequence[int],
        config: StructuredOutputsConfig | None = None,
    ) -> None:
        self.config = config or StructuredOutputsConfig()
        self.vocab_size = vocab_size
        self._hf_tokenizer = hf_tokenizer
        self._eos = sorted(eos_token_ids)
        self._lock = threading.Lock()
        self._tokenizer: llguidance.LLTokenizer | None = None
        self._cache: OrderedDict[str, llguidance.LLMatcher] = OrderedDict()  # key -> matcher at the start state
        self._pool: concurrent.futures.ThreadPoolExecutor | None = None
        self._executor: llguidance.LLExecutor | None = None
        self.compiles = 0  # grammars built (cache misses), for stats and tests
        self.seconds = 0.0  # engine-thread time in grammar work (masks, forced tokens, draft cuts, advancing)

    # ------------------------------------------------------------------ compile (any thread)

    def tokenizer(self) -> llguidance.LLTokenizer:
        """llguidance's view of the vocabulary (built once, ~1 s): EOS is every id the engine stops on."""
        with self._lock:
            if self._tokenizer is None:
                self._tokenizer = llguidance.hf.from_tokenizer(
                    self._hf_tokenizer, n_vocab=self.vocab_size, eos_token=self._eos
                )
            return self._tokenizer

    def compile(self, spec: Any) -> Grammar:
        """A fresh matcher for ``spec``, from the cache when the same source was compiled before. Raises
        ``InvalidRequestError`` naming the field for a grammar that does not compile, is too large, or
        takes longer than ``compile_timeout_s``. Blocks: call it off the engine's step loop."""
        param = spec.param
        size = (
            len(spec.value.encode()) if isinstance(spec.value, str) else sum(len(c.encode()) for c in spec.value or ())
        )
        if size > self.config.max_spec_bytes:
            raise InvalidRequestError(
                f"{param}: {size} bytes is above this server's limit of {self.config.max_spec_bytes}", param=param
            )
        src = grammar_source(spec, self.config)
        key = hashlib.sha256(src.grammar.encode()).hexdigest()
        with self._lock:
            hit = self._cache.get(key)
            if hit is not None:
                self._cache.move_to_end(key)
                return Grammar(hit.deep_copy(), key)
            if self._pool is None:
                self._pool = concurrent.futures.ThreadPoolExecutor(2, thread_name_prefix="grammar-compile")
            pool = self._pool
        fut = pool.submit(self._build, src)
        try:
            matcher = fut.result(timeout=self.config.compile_timeout_s)
        except concurrent.futures.TimeoutError:
            raise InvalidRequestError(
                f"{param}: the grammar did not compile within {self.config.compile_timeout_s} s", param=param
            ) from None
        with self._lock:
            if self.config.cache_size:
                self._cache[key] = matcher
                while len(self._cache) > self.config.cache_size:
                    self._cache.popitem(last=False)
            self.compiles += 1
        return Grammar(matcher.deep_copy(), key)

    def _build(self, src: GrammarSource) -> llguidance.LLMatcher:
        tok = self.tokenizer()
        is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(src.grammar, tok)
        if is_error:
            raise InvalidRequestError(f"{src.param}: {_short(messages[0])}", param=src.param)
        matcher = llguidance.LLMatcher(tok, src.grammar, log_level=0)
        if matcher.is_error():
            raise InvalidRequestError(f"{src.param}: {_short(matcher.get_error())}", param=src.param)
        return matcher

    # ------------------------------------------------------------------ masks (engine thread)

    def fill_masks(
        self,
        entries: Sequence[tuple[Grammar, int, Sequence[int]]],  # (grammar, first row, drafts validated by it)
        num_rows: int,
    ) -> torch.Tensor:  # [num_rows, ceil(vocab / 32)] int32 bitmask; rows no entry covers allow every token
        """The mask of every verify row of every constrained request: row ``first + j`` is the mask after
        the request's committed tokens and ``drafts[:j]``. One call; llguidance spreads the requests over
        its threads, advances each matcher along its drafts and rolls it back."""
        words = (self.vocab_size + _WORD_BITS - 1) // _WORD_BITS
        bitmask = torch.full((num_rows, words), -1, dtype=torch.int32)  # [R, W] all allowed
        if not entries:
            return bitmask
        if self._executor is None:
            self._executor = llguidance.LLExecutor(num_threads=max(1, torch.get_num_threads()))
        plain = [(g.matcher, row) for g, row, drafts in entries if not drafts]
        along = [(g.matcher, row, list(drafts)) for g, row, drafts in entries if drafts]
        if plain:
            self._executor.unsafe_compute_mask_ptr(plain, bitmask.data_ptr(), words * 4, num_rows)
        if along:
            self._executor.unsafe_compute_mask_ptr_with_draft_token(along, bitmask.data_ptr(), words * 4, num_rows)
        return bitmask

    def apply_masks(
        self,
        logits: torch.Tensor,  # [R, V] float32 rows verify decides from
        bitmask: torch.Tensor,  # [R, W] int32 from fill_masks
        rows: Sequence[int],  # the constrained rows (the others are left as they are)
    ) -> torch.Tensor:  # [R, V] with refused tokens at -inf in ``rows``
        """Refused tokens get -inf, elementwise per row, so batch invariance and the keyed sample are
        untouched. A row the grammar left empty (a matcher in error: never expected) allows EOS only.
        The bits are unpacked by numpy's unpackbits (one pass over the bytes, where torch's shifts take
        several over 32x the data), and a batch whose every row is constrained is masked in one pass."""
        if not rows:
            return logits
        vocab = logits.shape[1]
        idx = torch.tensor(list(rows), dtype=torch.long)  # [m]
        packed = bitmask[idx].numpy().view(np.uint8)  # [m, 4W] little-endian words: bit j of byte i = token 8i + j
        allowed = torch.from_numpy(np.unpackbits(packed, axis=1, count=vocab, bitorder="little")).bool()  # [m, V]
        empty = ~allowed.any(dim=1)  # [m]
        if bool(empty.any()):
            allowed[empty.nonzero().squeeze(1).unsqueeze(1), torch.tensor(self._eos, dtype=torch.long)] = True
        allowed = allowed.to(logits.device)
        refused = torch.tensor(float("-inf"), dtype=logits.dtype, device=logits.device)
        if len(idx) == logits.shape[0] and bool((idx == torch.arange(len(idx))).all()):
            return torch.where(allowed, logits, refused)
        out = logits.clone()
        idx = idx.to(logits.device)
        out[idx] = torch.where(allowed, logits[idx], refused)
        return out


def _short(message: str, limit: int = 400) -> str:
    """llguidance's messages can carry the whole grammar; an error names the problem, not the source."""
    message = message.strip()
    return message if len(message) <= limit else message[:limit] + " ..."
