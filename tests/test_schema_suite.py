"""The shared schema suite holds together: every valid instance passes its schema and every refused one
fails it (jsonschema), and llguidance, the engine's grammar library, agrees token by token on
SmolLM2's vocabulary through the benchmark's own walk."""

from __future__ import annotations

import json

import pytest

from benchmarks.structured.schema_suite import SCHEMAS, by_name, chat_messages, instance_text


def test_names_unique_and_lookup():
    names = [c.name for c in SCHEMAS]
    assert len(names) == len(set(names)) >= 10
    assert by_name("server_config").name == "server_config"
    with pytest.raises(KeyError):
        by_name("nope")


def test_instances_follow_their_schemas():
    jsonschema = pytest.importorskip("jsonschema")
    for case in SCHEMAS:
        validator = jsonschema.Draft202012Validator(case.schema)
        validator.check_schema(case.schema)
        assert validator.is_valid(case.example), case.name
        for bad in case.invalid:
            assert not validator.is_valid(bad), (case.name, bad)
        # keys in properties order: the libraries emit properties in that order
        assert list(case.example) == [k for k in case.schema["properties"] if k in case.example], case.name


def test_chat_messages_carry_the_schema():
    msgs = chat_messages(by_name("person"))
    assert [m["role"] for m in msgs] == ["system", "user"]
    assert json.dumps(by_name("person").schema) in msgs[0]["content"]
    assert instance_text({"a": 1, "b": [True]}) == '{"a": 1, "b": [true]}'


def test_llguidance_accepts_every_instance_and_refuses_every_bad_one():
    pytest.importorskip("llguidance")
    import torch

    from benchmarks.structured.grammar_libs import MASK_WORDS, LLGuidance, load_smollm2_tokenizer, walk

    tok = load_smollm2_tokenizer()
    lib = LLGuidance()
    lib.setup(tok)
    bitmask = torch.zeros(1, MASK_WORDS, dtype=torch.int32)  # [1, 1536] packed bits
    for case in SCHEMAS:
        compiled = lib.compile(json.dumps(case.schema))
        tokens = tok.encode(instance_text(case.example), add_special_tokens=False) + [tok.eos_token_id]
        assert walk(lib, lib.matcher(compiled, len(tokens)), tokens, bitmask, count_forced=True).refused_at is None, (
            case.name
        )
        for bad in case.invalid:
            bad_tokens = tok.encode(instance_text(bad), add_special_tokens=False) + [tok.eos_token_id]
            assert (
                walk(lib, lib.matcher(compiled, len(bad_tokens)), bad_tokens, bitmask, False).refused_at is not None
            ), (case.name, bad)
