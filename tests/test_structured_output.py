"""Structured output in the engine: valid by construction, and still a pure function of the request.

The grammar masks every row a token is chosen from (plain steps and every verify row), cuts drafts
at the first refused token, and proposes its forced tokens as drafts. These tests hold the promise
under all of that: constrained output is token-for-token the same alone and plain as in a busy batch
with speculation on, K switched every step, every proposer and the grammar's own drafts, greedy and
seeded, fp32 and bf16; plain constrained sampling follows the target's masked distribution
(chi-square); a resumed stream continues under its grammar; bad grammars are refused by name.
"""

from __future__ import annotations

import json
import random

import jsonschema
import pytest
import torch

from tests.test_fidelity import neighbours
from tests.test_spec_engine import KINDS, MAX_LEN, Switcher, make_proposer
from workers.config import EngineConfig, StructuredOutputsConfig
from workers.engine import LLMEngine
from workers.errors import InvalidRequestError
from workers.grammar import GrammarRuntime
from workers.proposers.ngram import NgramProposer
from workers.sampler import process_logits
from workers.sampling_params import StructuredOutput

pytestmark = pytest.mark.usefixtures("one_thread")

# Bounded strings and arrays: a random tiny model must still finish its object within max_tokens.
SCHEMAS = [
    {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 6},
            "age": {"type": "integer", "minimum": 0, "maximum": 120},
            "color": {"enum": ["red", "green", "blue"]},
        },
        "required": ["name", "age", "color"],
        "additionalProperties": False,
    },
    {
        "type": "object",
        "properties": {
            "items": {
                "type": "array",
                "maxItems": 2,
                "items": {
                    "type": "object",
                    "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 99}, "ok": {"type": "boolean"}},
                    "required": ["id", "ok"],
                    "additionalProperties": False,
                },
            }
        },
        "required": ["items"],
        "additionalProperties": False,
    },
    {
        "type": "object",
        "properties": {
            "code": {"type": "string", "pattern": "^[A-Z]{2}-[0-9]{3}$"},
            "note": {"type": "string", "maxLength": 4},
            "score": {"type": "number", "minimum": 0, "maximum": 1},
        },
        "required": ["code"],
        "additionalProperties": False,
    },
]
GREEDY = {"max_tokens": 64}
SEEDED = {"max_tokens": 64, "temperature": 1.3, "top_p": 0.95, "seed": 77}


def json_spec(schema: dict) -> dict:
    return {"kind": "json", "value": json.dumps(schema), "param": "response_format"}


def prompts(n: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 49152) for _ in range(rng.randint(3, 12))] for _ in range(n)]


def alone(loaded, dtype: str, reqs: list[tuple[list[int], dict]]) -> list[list[int]]:
    """Each request decoded alone and plainly: the reference."""
    eng = LLMEngine(EngineConfig(dtype=dtype, max_num_seqs=1, max_model_len=MAX_LEN, proposers=[]), loaded)
    return [eng.generate([p], sp)[0] for p, sp in reqs]


def text_of(loaded, ids: list[int]) -> str:
    return loaded.tokenizer.decode(ids, skip_special_tokens=True)


@pytest.fixture(scope="module")
def draft_loaded(tiny_draft_dir):
    from workers.model_loader import load_model

    return load_model(tiny_draft_dir)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("params", [GREEDY, SEEDED], ids=["greedy", "seeded"])
def test_constrained_output_is_identical_on_every_path(tiny_loaded, draft_loaded, dtype, params):
    reqs = [(p, {**params, "structured": json_spec(SCHEMAS[i % len(SCHEMAS)])}) for i, p in enumerate(prompts(6, 3))]
    ref = alone(tiny_loaded, dtype, reqs)
    for ids, (_, sp) in zip(ref, reqs):  # valid by construction: every object completes and validates
        jsonschema.validate(json.loads(text_of(tiny_loaded, ids)), json.loads(sp["structured"]["value"]))
    extra, extra_params = neighbours(8, seed=9)  # unconstrained neighbours of mixed sampling params
    for kind in KINDS:
        for decide in ("policy", "switch"):  # the grammar's drafts always taken / K switched 0..8 every step
            name, prop = make_proposer(kind, tiny_loaded, draft_loaded, num_slots=16)
            eng = LLMEngine(
                EngineConfig(
                    dtype=dtype,
                    max_num_seqs=16,
                    max_model_len=MAX_LEN,
                    num_speculative_tokens=8,
                    proposers=[{"name": name}],
                ),
                tiny_loaded,
                proposers={name: prop},
                decide=Switcher() if decide == "switch" else None,
            )
            for j, (p, sp) in enumerate(zip(extra, extra_params)):
                eng.add_request(f"n{j}", p, sp, speculation="on", proposer=name)
            for i, (p, sp) in enumerate(reqs):
                eng.add_request(f"r{i}", p, sp, speculation="on", proposer=name)
            tokens: dict[str, list[int]] = {}
            while eng.has_work():
                for o in eng.step():
                    tokens.setdefault(o.request_id, []).extend(o.token_ids)
            assert [tokens[f"r{i}"] for i in range(len(reqs))] == ref, f"{kind}/{decide}: output changed"
            if decide == "policy":  # the grammar proposed its forced tokens, and they were accepted
                g = eng.stats["grammar"]
                assert g.num_draft_tokens > 20 and g.acceptance_rate > 0.9, g.as_dict()


def test_speculation_off_auto_and_on_write_the_same_constrained_tokens(tiny_loaded):
    reqs = [(p, {**SEEDED, "structured": json_spec(SCHEMAS[0])}) for p in prompts(4, 5)]
    outs = {}
    for mode in ("off", "auto", "on"):
        eng = LLMEngine(
            EngineConfig(dtype="float32", max_num_seqs=4, max_model_len=MAX_LEN),
            tiny_loaded,
            proposers={"ngram": NgramProposer()},
        )
        outs[mode] = eng.generate([p for p, _ in reqs], reqs[0][1], speculation=mode)
        if mode == "off":  # held plain: not even the grammar's free drafts
            assert "grammar" not in eng.stats
        else:
            assert eng.stats["grammar"].num_accepted_tokens > 0
    assert outs["off"] == outs["auto"] == outs["on"]


def test_grammar_drafts_need_no_proposer(tiny_loaded):
    """An engine without proposers still drafts what the grammar forces; the output is unchanged."""
    sp = {**GREEDY, "structured": json_spec(SCHEMAS[1])}
    ps = prompts(3, 8)
    eng = LLMEngine(EngineConfig(dtype="float32", max_num_seqs=4, max_model_len=MAX_LEN, proposers=[]), tiny_loaded)
    out = eng.generate(ps, sp)
    assert eng.stats["grammar"].num_draft_tokens > 0
    cfg = EngineConfig(
        dtype="float32",
        max_num_seqs=4,
        max_model_len=MAX_LEN,
        proposers=[],
        structured_outputs=StructuredOutputsConfig(max_forced_tokens=0),
    )
    eng0 = LLMEngine(cfg, tiny_loaded)
    assert eng0.generate(ps, sp) == out
    assert "grammar" not in eng0.stats  # max_forced_tokens 0: the knob turns grammar drafts off


def test_drafts_are_cut_at_the_first_refused_token(tiny_loaded):
    """A proposer that guesses tokens the grammar refuses: they are cut before the verify, so no
    refused token is ever verified, and the output is unchanged."""

    class Wrong(NgramProposer):
        def propose(self, requests):
            from workers.proposers.base import Proposals

            return Proposals([[5000 + i for i in range(r.k)] for r in requests], [None] * len(requests))

    sp = {**GREEDY, "structured": json_spec(SCHEMAS[0])}
    ps = prompts(3, 11)
    ref = alone(tiny_loaded, "float32", [(p, sp) for p in ps])
    eng = LLMEngine(
        EngineConfig(
            dtype="float32",
            max_num_seqs=4,
            max_model_len=MAX_LEN,
            structured_outputs=StructuredOutputsConfig(max_forced_tokens=0),
        ),
        tiny_loaded,
        proposers={"ngram": Wrong()},
    )
    assert eng.generate(ps, sp, speculation="on") == ref
    assert eng.stats["ngram"].num_draft_tokens == 0  # all cut: nothing refused reached the verify


def test_masks_along_drafts_equal_the_masks_of_plain_steps(tiny_loaded):
    """Verify row j's mask (computed along the drafts in one call) is the mask a plain step at that
    position computes after committing drafts[:j]: the mask depends only on the tokens before it."""
    eng = LLMEngine(EngineConfig(dtype="float32", max_num_seqs=1, max_model_len=MAX_LEN), tiny_loaded)
    spec = StructuredOutput(**json_spec(SCHEMAS[1]))
    tok = tiny_loaded.tokenizer
    text = '{"items": [{"id": 7, "ok": true}, {"id": 42, "ok": false}]}'
    ids = tok.encode(text, add_special_tokens=False)
    g = eng.grammars.compile(spec)
    assert g.valid_prefix(ids) == len(ids)
    along = eng.grammars.fill_masks([(g, 0, ids)], len(ids) + 1)  # [len + 1, W]
    step = eng.grammars.compile(spec)
    for j in range(len(ids) + 1):
        one = eng.grammars.fill_masks([(step, 0, [])], 1)
        assert torch.equal(one[0], along[j]), j
        if j < len(ids):
            step.consume([ids[j]])
    assert g.valid_prefix(ids) == len(ids)  # the call rolled the matcher back


def test_constrained_sampling_follows_the_masked_distribution(tiny_loaded):
    """Over many seeds the first token of a choice-constrained request follows softmax(logits / T)
    renormalized over the tokens the grammar allows (chi-square at 99.9%). With the identity of
    output under speculation (tests above), speculative constrained sampling follows it too."""
    prompt = prompts(1, 21)[0]
    choices = ("alpha", "beta", "gamma", "delta", "epsilon", "zeta")
    spec = {"kind": "choice", "value": choices, "param": "structured_outputs.choice"}
    temp, n = 3.0, 1200
    eng = LLMEngine(EngineConfig(dtype="float32", max_num_seqs=32, max_model_len=MAX_LEN), tiny_loaded)
    firsts: list[int] = []
    for base in range(0, n, 32):
        for i in range(base, min(n, base + 32)):
            eng.add_request(f"s{i}", prompt, {"max_tokens": 1, "temperature": temp, "seed": i, "structured": spec})
        while eng.has_work():
            firsts += [o.token_ids[0] for o in eng.step() if o.token_ids]
    with torch.no_grad():
        logits = tiny_loaded.model(torch.tensor([prompt])).logits[0, -1].float()  # [V]
    g = eng.grammars.compile(StructuredOutput(**spec))
    bitmask = eng.grammars.fill_masks([(g, 0, [])], 1)
    masked = eng.grammars.apply_masks(logits.unsqueeze(0), bitmask, [0])
    p = process_logits(masked, torch.tensor([temp]), torch.tensor([0]), torch.tensor([1.0]))[0]  # [V]
    allowed = (p > 0).nonzero().squeeze(1).tolist()
    assert 4 <= len(allowed) <= 40 and set(firsts) <= set(allowed)
    counts = torch.tensor([firsts.count(t) for t in allowed], dtype=torch.float64)
    expected = p[allowed].double() * n
    keep = expected >= 5  # chi-square needs expected counts of 5 or more: pool the rare tokens
    obs = torch.cat([counts[keep], counts[~keep].sum().view(1)])
    exp = torch.cat([expected[keep], expected[~keep].sum().view(1)])
    if exp[-1] < 5:
        obs, exp = obs[:-1], exp[:-1]
    chi2 = float(((obs - exp) ** 2 / exp).sum())
    from scipy.stats import chi2 as chi2_dist

    assert len(exp) >= 3, exp
    assert chi2 < chi2_dist.ppf(0.999, len(exp) - 1), (chi2, obs.tolist(), exp.tolist())


@pytest.mark.parametrize("params", [GREEDY, SEEDED], ids=["greedy", "seeded"])
def test_a_resumed_constrained_stream_continues_identically(tiny_loaded, params):
    sp = {**params, "structured": json_spec(SCHEMAS[1])}
    p = prompts(1, 13)[0]
    eng = LLMEngine(
        EngineConfig(dtype="float32", max_num_seqs=2, max_model_len=MAX_LEN),
        tiny_loaded,
        proposers={"ngram": NgramProposer()},
    )
    full = eng.generate([p], sp)[0]
    assert len(full) > 6
    # past the grammar's end, ignore_eos writes EOS after EOS: a resume there continues too
    eos_run = eng.generate([p], {**sp, "ignore_eos": True, "max_tokens": len(full) + 6})[0]
    assert eos_run[: len(full)] == full and len(eos_run) == len(full) + 6
    for cut in (1, len(full) + 2):
        eng.add_request(
            "eos", p, {**sp, "ignore_eos": True, "max_tokens": len(full) + 6}, resume_output_ids=eos_run[:cut]
        )
        rest_eos: list[int] = []
        while eng.has_work():
            for o in eng.step():
                rest_eos += o.token_ids
        assert eos_run[:cut] + rest_eos == eos_run, cut
    for cut in (1, 5, len(full) - 2):
        eng.add_request("again", p, sp, speculation="on", resume_output_ids=full[:cut])
        rest: list[int] = []
        while eng.has_work():
            for o in eng.step():
                rest += o.token_ids
        assert full[:cut] + rest == full, cut
    bad = tiny_loaded.tokenizer.encode("nope", add_special_tokens=False)
    with pytest.raises(InvalidRequestError) as e:
        eng.add_request("bad", p, sp, resume_output_ids=bad)
    assert e.value.param == "resume_output_ids"


def test_hitting_max_tokens_finishes_with_length(tiny_loaded):
    eng = LLMEngine(EngineConfig(dtype="float32", max_num_seqs=1, max_model_len=MAX_LEN), tiny_loaded)
    eng.add_request("r", prompts(1, 4)[0], {"max_tokens": 3, "structured": json_spec(SCHEMAS[0])})
    reasons = []
    while eng.has_work():
        reasons += [o.finish_reason for o in eng.step()]
    assert reasons[-1] == "length"


@pytest.mark.parametrize(
    "spec,needle",
    [
        ({"kind": "regex", "value": "([a-z", "param": "structured_outputs.regex"}, "structured_outputs.regex"),
        (
            {
                "kind": "json",
                "value": '{"type": "object", "properties": {"a": {"type": "strin"}}}',
                "param": "response_format",
            },
            "response_format",
        ),
        ({"kind": "json", "value": "{not json", "param": "response_format"}, "response_format"),
        (
            {"kind": "grammar", "value": "start: undefined_rule", "param": "structured_outputs.grammar"},
            "structured_outputs.grammar",
        ),
    ],
)
def test_bad_grammars_are_refused_by_name_and_others_go_on(tiny_loaded, spec, needle):
    eng = LLMEngine(EngineConfig(dtype="float32", max_num_seqs=2, max_model_len=MAX_LEN), tiny_loaded)
    eng.add_request("ok", prompts(1, 1)[0], {"max_tokens": 8, "structured": json_spec(SCHEMAS[0])})
    with pytest.raises(InvalidRequestError) as e:
        eng.add_request("bad", prompts(1, 2)[0], {"max_tokens": 8, "structured": spec})
    assert e.value.param == needle and needle in e.value.message
    out = []
    while eng.has_work():
        out += eng.step()
    assert out[-1].request_id == "ok" and out[-1].finished


def test_size_and_time_bounds(tiny_loaded):
    tok = tiny_loaded.tokenizer
    big = {
        "type": "object",
        "properties": {f"k{i}": {"type": "string", "pattern": "^[a-z]{1,30}[0-9]+$"} for i in range(400)},
    }
    rt = GrammarRuntime(tok, 49152, [tok.eos_token_id], StructuredOutputsConfig(max_spec_bytes=1000))
    with pytest.raises(InvalidRequestError, match="above this server's limit"):
        rt.compile(StructuredOutput(**json_spec(big)))
    slow = GrammarRuntime(tok, 49152, [tok.eos_token_id], StructuredOutputsConfig(compile_timeout_s=1e-4))
    with pytest.raises(InvalidRequestError, match="did not compile within"):
        slow.compile(StructuredOutput(**json_spec(big)))


def test_hostile_constraints_are_bounded(tiny_loaded):
    """Catastrophic-backtracking regexes compile and mask at once (llguidance's lexer is derivative-based,
    it never backtracks); schemas nested past llguidance's or Python's recursion limits are a 400."""
    tok = tiny_loaded.tokenizer
    rt = GrammarRuntime(tok, 49152, [tok.eos_token_id])
    for rx in ("(a+)+$", "(a|aa)*b{1000}", "([a-z]+)*[0-9]"):
        g = rt.compile(StructuredOutput(kind="regex", value=rx, param="structured_outputs.regex"))
        assert rt.fill_masks([(g, 0, [])], 1).any()
    for depth in (200, 900):
        schema: dict = {"type": "string"}
        for _ in range(depth):
            schema = {"type": "object", "properties": {"a": schema}}
        text = (
            json.dumps(schema)
            if depth < 400
            else "{" + '"type":"object","properties":{"a":{' * depth + "}" * (2 * depth + 1)
        )
        with pytest.raises(InvalidRequestError, match="response_format"):
            rt.compile(StructuredOutput(kind="json", value=text, param="response_format"))


def test_compiled_grammars_are_cached_by_source(tiny_loaded):
    eng = LLMEngine(EngineConfig(dtype="float32", max_num_seqs=2, max_model_len=MAX_LEN), tiny_loaded)
    spec = StructuredOutput(**json_spec(SCHEMAS[2]))
    a, b = eng.grammars.compile(spec), eng.grammars.compile(spec)
    assert eng.grammars.compiles == 1 and a.matcher is not b.matcher  # one build, one matcher per request
    a.consume(tiny_loaded.tokenizer.encode('{"code": "', add_special_tokens=False))
    assert b.valid_prefix(tiny_loaded.tokenizer.encode("{", add_special_tokens=False)) == 1  # b is untouched


def test_objects_are_closed_unless_the_schema_opens_them():
    from workers.json_schema import close_objects

    schema = {
        "type": "object",
        "properties": {
            "a": {"type": "object", "properties": {"b": {"type": "integer"}}},
            "properties": {"type": "string"},
        },
        "$defs": {"d": {"properties": {"x": {}}, "patternProperties": {"^y": {}}}},
        "anyOf": [{"properties": {"z": {}}}],
        "allOf": [{"properties": {"w": {}}}],
    }
    closed = close_objects(schema)
    assert closed["additionalProperties"] is False
    assert closed["properties"]["a"]["additionalProperties"] is False
    assert "additionalProperties" not in closed["properties"]["properties"]  # a property's name, not a keyword
    assert "additionalProperties" not in closed["$defs"]["d"]  # patternProperties opens it
    assert closed["anyOf"][0]["additionalProperties"] is False
    assert "additionalProperties" not in closed["allOf"][0]  # closed allOf parts would exclude each other
    assert close_objects({"type": "object"}) == {"type": "object"}  # any object stays any object
    assert "additionalProperties" not in schema  # the input is not changed


def test_closed_objects_knob_lets_extra_keys_in(tiny_loaded):
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    tok = tiny_loaded.tokenizer
    extra = tok.encode('{"a": 1, "b": 2}', add_special_tokens=False)
    for closed, allowed in ((True, False), (False, True)):
        rt = GrammarRuntime(tok, 49152, [tok.eos_token_id], StructuredOutputsConfig(json_closed_objects=closed))
        g = rt.compile(StructuredOutput(**json_spec(schema)))
        assert (g.valid_prefix(extra) == len(extra)) is allowed


@pytest.mark.slow
@pytest.mark.parametrize(
    "dtype,sampling",
    [("float32", {}), ("bfloat16", {"temperature": 0.7, "seed": 5})],
    ids=["float32-greedy", "bfloat16-seeded"],
)
def test_smollm2_schema_suite_is_valid_and_identical_on_every_path(smollm2_loaded, dtype, sampling):
    """The real model on the shared schema suite (benchmarks/structured/schema_suite.py): every output that ends by
    itself validates (greedy in fp32, T=0.7 in bf16), and speculation (grammar drafts + n-gram) leaves every token as
    plain decoding writes it. The 135M model loops inside some unbounded arrays and strings until
    max_tokens (the grammar allows it, and changing the distribution to stop it is not ours to do):
    those end with "length", as with OpenAI, and most of the suite must still end by itself."""
    from benchmarks.structured.schema_suite import SCHEMAS, chat_messages

    eng = LLMEngine(
        EngineConfig(dtype=dtype, max_num_seqs=len(SCHEMAS), max_model_len=1024),
        smollm2_loaded,
        proposers={"ngram": NgramProposer()},
    )
    prompts = [eng.tokenize_chat(chat_messages(c)) for c in SCHEMAS]
    outs = {}
    for mode in ("off", "on"):
        reqs = [
            (p, {"max_tokens": 320, **sampling, "structured": json_spec(c.schema)}) for p, c in zip(prompts, SCHEMAS)
        ]
        for i, (p, sp) in enumerate(reqs):
            eng.add_request(f"{mode}{i}", p, sp, speculation=mode, proposer="ngram")
        tokens: dict[str, list[int]] = {}
        reasons: dict[str, str | None] = {}
        while eng.has_work():
            for o in eng.step():
                tokens.setdefault(o.request_id, []).extend(o.token_ids)
                reasons[o.request_id] = o.finish_reason
        outs[mode] = [tokens[f"{mode}{i}"] for i in range(len(SCHEMAS))]
        ended = [reasons[f"{mode}{i}"] == "stop" for i in range(len(SCHEMAS))]
        assert set(reasons.values()) <= {"stop", "length"} and sum(ended) >= len(SCHEMAS) - 3, reasons
    assert outs["on"] == outs["off"]
    for ids, case, done in zip(outs["on"], SCHEMAS, ended):
        if done:
            jsonschema.validate(json.loads(text_of(smollm2_loaded, ids)), case.schema)
    assert eng.stats["grammar"].acceptance_rate > 0.9


def test_apply_masks_matches_the_bits_token_by_token(tiny_loaded):
    tok = tiny_loaded.tokenizer
    rt = GrammarRuntime(tok, 49152, [tok.eos_token_id])
    gen = torch.Generator().manual_seed(3)
    bitmask = torch.randint(-(2**31), 2**31 - 1, (5, 1536), dtype=torch.int32, generator=gen)
    bitmask[4] = 0  # an empty row: EOS only
    logits = torch.randn(5, 49152, generator=gen)
    ref_allowed = torch.tensor(
        [[(int(bitmask[r, t // 32]) >> (t % 32)) & 1 for t in range(49152)] for r in range(5)], dtype=torch.bool
    )
    ref_allowed[4, tok.eos_token_id] = True
    for rows in ([0, 1, 2, 3, 4], [1, 3, 4]):  # every row constrained (one pass) / some (the others untouched)
        out = rt.apply_masks(logits, bitmask, rows)
        for r in range(5):
            want = torch.where(ref_allowed[r], logits[r], float("-inf")) if r in rows else logits[r]
            assert torch.equal(out[r], want), (rows, r)
