"""Constrained decoding in the engine (offline LLM on the embedded model, fp32): outputs always match
their constraint, grammar state is freed whatever ends a sequence, a compiled grammar is reused, and
unconstrained neighbours in the same batch get exactly the tokens they get alone."""
from __future__ import annotations

import json
import re

import jsonschema
import pytest
import torch
from hypothesis import given, settings, strategies as st

from nanoserve import LLM, SamplingParams
from nanoserve.layers.sampler import banned_tokens
from nanoserve.sampling_params import InvalidRequest
from nanoserve.structured import StructuredSpec, json_spec

SCHEMAS = {
    "nested": {"type": "object", "properties": {
        "name": {"type": "string", "maxLength": 24},
        "address": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 16},
                                                     "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
                    "required": ["city", "zip"], "additionalProperties": False}},
        "required": ["name", "address"], "additionalProperties": False},
    "array_enum": {"type": "object", "properties": {
        "colors": {"type": "array", "items": {"enum": ["red", "green", "blue"]}, "minItems": 1,
                   "maxItems": 3},
        "count": {"type": "integer", "minimum": 0, "maximum": 99}},
        "required": ["colors", "count"], "additionalProperties": False},
    "list_of_objects": {"type": "array", "minItems": 1, "maxItems": 2, "items": {
        "type": "object", "properties": {"id": {"type": "integer"}, "ok": {"type": "boolean"}},
        "required": ["id", "ok"], "additionalProperties": False}},
}
MSGS = [{"role": "user", "content": "Give me an example as JSON."}]


@pytest.fixture(scope="module")
def llm():
    return LLM(dtype="float32", kv_cache_gb=0.25)


@settings(max_examples=50, deadline=None)
@given(st.lists(st.sets(st.integers(0, 99)), min_size=1, max_size=4))
def test_bitmask_unpacks_to_exactly_the_allowed_tokens(allowed):
    vocab = 100
    words = torch.zeros(len(allowed), (vocab + 31) // 32, dtype=torch.int64)
    for r, toks in enumerate(allowed):
        for t in toks:
            words[r, t // 32] |= 1 << (t % 32)
    words = torch.where(words >= 1 << 31, words - (1 << 32), words).to(torch.int32)  # as int32 bit patterns
    banned = banned_tokens(words, vocab)
    assert banned.shape == (len(allowed), vocab)
    for r, toks in enumerate(allowed):
        assert set(torch.nonzero(~banned[r]).flatten().tolist()) == toks


def test_json_schema_outputs_validate(llm):
    """Every schema, greedy and sampled with n=2, all in one batch."""
    specs = [json_spec(schema, "response_format") for schema in SCHEMAS.values()]
    params = [p for spec in specs for p in (SamplingParams(temperature=0, max_tokens=100, structured=spec),
                                            SamplingParams(temperature=1.0, seed=11, n=2, max_tokens=100,
                                                           structured=spec))]
    outs = llm.chat([MSGS] * len(params), params)
    for out, schema in zip(outs, [s for s in SCHEMAS.values() for _ in (0, 1)]):
        for c in out.outputs:
            assert c.finish_reason == "stop", c
            jsonschema.validate(json.loads(c.text), schema)
    assert len(llm.engine.grammars) == 0  # every matcher freed at finish


def test_regex_and_choice(llm):
    outs = llm.generate(["My phone number is", "The best color is"], [
        SamplingParams(temperature=0.8, seed=1, max_tokens=20,
                       structured=StructuredSpec("regex", r"\d{3}-\d{4}")),
        SamplingParams(temperature=0, max_tokens=20,
                       structured=StructuredSpec("choice", '["red", "green"]'))])
    assert re.fullmatch(r"\d{3}-\d{4}", outs[0].outputs[0].text)
    assert outs[1].outputs[0].text in ("red", "green") and outs[1].outputs[0].finish_reason == "stop"


def test_unconstrained_neighbours_are_unaffected(llm):
    """fp32: a greedy unconstrained request gets the same tokens alone and batched with constrained ones
    (the mask touches only the constrained rows)."""
    free = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    alone = llm.generate(["The capital of France is"], free)[0].outputs[0].token_ids
    spec = json_spec(SCHEMAS["array_enum"], "response_format")
    batch = llm.generate(["Colors:", "The capital of France is", "Numbers:"], [
        SamplingParams(temperature=0, max_tokens=40, structured=spec), free,
        SamplingParams(temperature=1.0, seed=2, max_tokens=40, structured=spec)])
    assert batch[1].outputs[0].token_ids == alone
    for i in (0, 2):
        jsonschema.validate(json.loads(batch[i].outputs[0].text), SCHEMAS["array_enum"])


def test_grammar_compiled_once_and_freed_on_abort(llm):
    eng = llm.engine
    spec = json_spec({"type": "object", "properties": {"k": {"type": "string"}}, "required": ["k"]},
                     "guided_json")
    before = len(eng.grammars._templates)
    for rid in ("a1", "a2"):
        eng.add_request(rid, "Some JSON:", SamplingParams(max_tokens=50, n=2, structured=spec))
    assert len(eng.grammars._templates) == before + 1  # one compiled grammar for both requests
    assert len(eng.grammars) == 4
    eng.step()
    for rid in ("a1", "a2"):
        eng.abort(rid)
    assert len(eng.grammars) == 0 and not eng.has_unfinished()


def test_uncompilable_grammar_is_refused_naming_the_field(llm):
    bad = StructuredSpec("json", json.dumps({"type": "object", "properties": {"a": {"$ref": "#/nope"}}}),
                         "guided_json")
    with pytest.raises(InvalidRequest) as ei:
        bad.validate()
    assert ei.value.param == "guided_json"
    with pytest.raises(InvalidRequest) as ei:  # the engine checks too: it trusts no sender
        llm.engine.add_request("bad", "x", SamplingParams(structured=bad))
    assert ei.value.param == "guided_json" and not llm.engine.has_unfinished()


def test_preempted_constrained_sequences_resume_their_grammar():
    """A KV cache too small for the batch preempts sequences; each keeps its matcher and its output
    still validates."""
    small = LLM(dtype="float32", block_size=4, num_kv_blocks=16)
    schema = {"type": "array", "items": {"type": "integer", "minimum": 10, "maximum": 99}, "minItems": 12,
              "maxItems": 12}  # >= 25 tokens each: 4 x 28+ tokens do not fit 16 blocks of 4
    spec = json_spec(schema, "response_format")
    outs = small.generate([f"Record {i}:" for i in range(4)],
                          SamplingParams(temperature=1.0, seed=5, max_tokens=60, structured=spec))
    assert small.engine.scheduler.num_preemptions > 0
    for o in outs:
        assert o.outputs[0].finish_reason == "stop"
        jsonschema.validate(json.loads(o.outputs[0].text), schema)
    assert len(small.engine.grammars) == 0


def test_grammar_compiles_off_the_step_and_a_slow_one_is_refused(llm):
    """The engine core admits a request once its grammar is compiled on the grammar thread: while the
    thread is busy the compile is pending (the step goes on without it), then ready and cached; a compile
    that outlasts the bound fails its request with a 400-type error naming the field."""
    import threading
    from nanoserve.engine.grammar import GrammarMatchers
    g = GrammarMatchers(lambda: llm.engine.tokenizer, llm.engine.model.vocab_size, compile_timeout=60)
    g.start().result()  # the vocabulary first: a compile's clock starts once it is there
    busy = threading.Event()
    g._pool.submit(busy.wait, 60)  # the grammar thread is occupied: nothing compiles until it is set
    spec = json_spec(SCHEMAS["array_enum"], "response_format")
    pending = g.prepare(spec)
    assert not g.ready(pending) and g.prepare(spec) is pending  # one compile per distinct grammar
    g.compile_timeout = 0
    with pytest.raises(InvalidRequest) as e:
        g.ready(pending)
    assert e.value.param == "response_format" and "took longer" in str(e.value)
    g.compile_timeout = 60
    busy.set()
    pending.future.result(timeout=60)
    assert g.ready(pending)
    bad = g.prepare(StructuredSpec("grammar", "start: nothing_defined", "guided_grammar"))
    with pytest.raises(InvalidRequest):
        bad.future.result(timeout=60)
    g.close()


def test_a_tokenizer_llguidance_cannot_read_refuses_constrained_requests_only(caplog):
    """The vocabulary is built by the first constrained request: when that fails (here the tokenizer does not
    load), it is logged once and every constrained request is refused naming its field, with the reason."""
    import time
    from nanoserve.engine.grammar import GrammarMatchers
    loads = []

    def broken():
        loads.append(1)
        raise OSError("no tokenizer here")
    g = GrammarMatchers(broken, 1000, compile_timeout=60)
    for spec in (json_spec(SCHEMAS["array_enum"], "response_format"),
                 StructuredSpec("regex", r"\d+", "structured_outputs")):
        c = g.prepare(spec)
        deadline = time.monotonic() + 60
        while not c.future.done() and time.monotonic() < deadline:
            time.sleep(0.01)
        with pytest.raises(InvalidRequest) as e:
            g.ready(c)
        assert e.value.param == spec.param and "cannot read its tokenizer" in str(e.value) and \
            "no tokenizer here" in str(e.value)
    assert len(loads) == 1 and \
        sum("structured outputs are unavailable" in r.message for r in caplog.records) == 1
    g.close()


def test_a_compile_is_timed_from_when_the_vocabulary_is_there(llm):
    """The first constrained request loads the vocabulary before its compile runs: the compile's bound counts
    from then, and the vocabulary has a bound of its own."""
    import threading
    import time
    from nanoserve.engine.grammar import GrammarMatchers
    spec = json_spec(SCHEMAS["array_enum"], "response_format")
    loaded, hold = threading.Event(), threading.Event()

    def slow_load():
        loaded.wait(60)
        return llm.engine.tokenizer
    g = GrammarMatchers(slow_load, llm.engine.model.vocab_size, compile_timeout=0, vocab_timeout=60)
    g.start()
    g._pool.submit(hold.wait, 60)  # after the vocabulary, before the compile: it stays pending
    c = g.prepare(spec)
    time.sleep(0.05)
    assert not g.ready(c)  # a 0 s bound, but the vocabulary is still loading
    loaded.set()
    g.start().result(timeout=60)
    with pytest.raises(InvalidRequest, match="took longer than 0s to compile"):
        g.ready(c)
    hold.set()
    g.close()
    stuck = threading.Event()
    g = GrammarMatchers(lambda: stuck.wait(60), llm.engine.model.vocab_size, vocab_timeout=0)
    c = g.prepare(spec)
    with pytest.raises(InvalidRequest, match="reading this model's vocabulary took longer than 0s") as e:
        g.ready(c)
    assert e.value.param == "response_format"
    stuck.set()
    g.close()
