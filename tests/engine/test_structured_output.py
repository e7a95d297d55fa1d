"""Structured output in the engine (engine/structured.py): outputs that finish with "stop" are
valid JSON for their schema; a request waits for its grammar without holding up the batch;
the grammar state survives swap, recompute, migration and resubmission (output token for token
as undisturbed, greedy and seeded)."""

from __future__ import annotations

import dataclasses
import json
import pickle
import threading
from types import SimpleNamespace

import jsonschema
import pytest

from fairbatch.deployments.cluster.replica import Replica
from fairbatch.deployments.cluster.wire import RequestMeta
from fairbatch.engine import LLM, SamplingParams
from fairbatch.engine.structured import GrammarSpec, schema_error

OBJ = "object"
SCHEMAS = [
    {"type": OBJ, "properties": {"a": {"type": "integer"}}, "required": ["a"]},
    {"type": "integer", "minimum": 0, "maximum": 100},
    {"type": "number", "minimum": -1.5, "maximum": 2.5},
    {"type": "string", "enum": ["red", "green", "blue"]},
    {"type": "boolean"},
    {"type": "null"},
    {"type": "array", "items": {"type": "integer"}, "minItems": 1, "maxItems": 3},
    {"type": "array", "items": {"enum": ["x", "y", "z"]}, "maxItems": 4},
    {"type": "string", "maxLength": 5},
    {"type": "string", "pattern": "^[a-z]{1,4}$"},
    {"const": "fixed"},
    {"anyOf": [{"type": "integer"}, {"type": "boolean"}]},
    {"enum": [1, "two", None, False]},
    {
        "type": OBJ,
        "properties": {"name": {"type": "string", "maxLength": 6}, "age": {"type": "integer"}},
        "required": ["name"],
    },
    {
        "type": OBJ,
        "properties": {
            "id": {"type": "integer", "minimum": 1, "maximum": 9},
            "tags": {"type": "array", "items": {"type": "string", "maxLength": 3}, "maxItems": 2},
            "ok": {"type": "boolean"},
        },
        "required": ["id", "ok"],
        "additionalProperties": False,
    },
    {
        "type": OBJ,
        "properties": {
            "point": {
                "type": OBJ,
                "properties": {"x": {"type": "number"}, "y": {"type": "number"}},
                "required": ["x", "y"],
            }
        },
        "required": ["point"],
    },
    {
        "type": OBJ,
        "properties": {
            "a": {
                "type": OBJ,
                "properties": {
                    "b": {
                        "type": OBJ,
                        "properties": {"c": {"enum": [1, 2, 3]}},
                        "required": ["c"],
                    }
                },
                "required": ["b"],
            }
        },
        "required": ["a"],
    },
    {
        "type": "array",
        "items": {
            "type": OBJ,
            "properties": {"k": {"type": "string", "maxLength": 4}, "v": {"type": "integer"}},
            "required": ["k", "v"],
        },
        "maxItems": 2,
    },
    {
        "type": OBJ,
        "properties": {"score": {"type": "number", "exclusiveMinimum": 0, "maximum": 1}},
        "required": ["score"],
    },
    {
        "$defs": {"unit": {"enum": ["kg", "g"]}},
        "type": OBJ,
        "properties": {
            "amount": {"type": "integer", "minimum": 0},
            "unit": {"$ref": "#/$defs/unit"},
        },
        "required": ["amount", "unit"],
    },
    {
        "type": OBJ,
        "properties": {"opt1": {"type": "integer"}, "opt2": {"type": "string", "maxLength": 3}},
    },
    {
        "type": OBJ,
        "properties": {
            "level": {"type": "string", "enum": ["low", "high"]},
            "count": {"type": "integer", "minimum": -5, "maximum": 5},
            "ratio": {"type": "number", "minimum": 0, "maximum": 10},
        },
        "required": ["level", "count", "ratio"],
    },
    {"type": "array", "items": {"type": "boolean"}, "minItems": 2, "maxItems": 2},
    {"type": OBJ, "properties": {"list": {"type": "array", "items": {"type": "null"}}}},
]
PROMPTS = ["Answer in JSON:", "The scheduler decides", "Tenants share", "A block"]
# output long enough to be preempted and moved mid-way
LONG = {
    "type": OBJ,
    "properties": {"notes": {"type": "array", "items": {"type": "string"}, "minItems": 12}},
    "required": ["notes"],
}


@pytest.fixture(scope="module")
def llm():
    return LLM("tiny")


def params(schema, *, seed=None, temperature=0.0, max_tokens=96, **kw) -> SamplingParams:
    spec = GrammarSpec.from_schema(schema) if schema is not None else GrammarSpec.json_object()
    return SamplingParams(
        temperature=temperature, seed=seed, max_tokens=max_tokens, structured_output=spec, **kw
    )


def test_outputs_that_stop_are_valid_json_of_their_schema(llm):
    assert len(SCHEMAS) >= 20
    jobs = []
    for k, schema in enumerate(SCHEMAS):
        jobs.append((schema, PROMPTS[k % 4], params(schema)))
        for s in range(3):  # seeded random samples
            jobs.append((schema, PROMPTS[s], params(schema, seed=100 * k + s, temperature=1.0)))
    outs = llm.generate([p for _, p, _ in jobs], [sp for *_, sp in jobs], use_tqdm=False)
    stopped = 0
    for (schema, _, _), out in zip(jobs, outs):
        assert out.finish_reason in ("stop", "length")
        if out.finish_reason == "stop":
            stopped += 1
            jsonschema.validate(json.loads(out.text), schema)
    assert stopped >= 0.75 * len(jobs), f"only {stopped} of {len(jobs)} finished"


def test_json_object_mode_gives_objects(llm):
    outs = llm.generate(
        PROMPTS, [params(None, seed=i, temperature=1.0, max_tokens=64) for i in range(4)],
        use_tqdm=False,
    )  # fmt: skip
    for out in outs:
        if out.finish_reason == "stop":
            assert isinstance(json.loads(out.text), dict)


def test_the_request_ends_when_the_grammar_allows_nothing_more(llm):
    # ignore_eos: EOS is no stop token, yet the request ends at the closing brace
    schema = SCHEMAS[0]
    out = llm.generate(PROMPTS[:1], params(schema, ignore_eos=True), use_tqdm=False)[0]
    assert out.finish_reason == "stop" and out.text.endswith("}")
    assert json.loads(out.text) == json.loads(out.text.strip())
    assert llm.tokenizer.decode(out.token_ids) == out.text  # no token past the object


def test_a_grammar_completed_by_the_last_allowed_token_is_a_stop(llm):
    # Each output that stopped, run again with max_tokens = its length: the same tokens, and
    # still "stop" (its JSON is complete), not "length"; one token fewer is cut short.
    jobs = [(schema, params(schema, seed=k, temperature=1.0)) for k, schema in enumerate(SCHEMAS)]
    outs = llm.generate(["Answer in JSON:"] * len(jobs), [p for _, p in jobs], use_tqdm=False)
    again, short = [], []
    for (_, p), out in zip(jobs, outs):
        if out.finish_reason == "stop" and len(out.token_ids) > 1:
            n = len(out.token_ids)
            again.append((out, dataclasses.replace(p, max_tokens=n)))
            short.append((out, dataclasses.replace(p, max_tokens=n - 1)))
    eos = set(llm.engine.eos_token_ids)
    assert sum(out.token_ids[-1] not in eos for out, _ in again) >= 5  # ended by the grammar
    rerun = llm.generate(["Answer in JSON:"] * len(again), [p for _, p in again], use_tqdm=False)
    for (out, _), got in zip(again, rerun):
        assert (got.token_ids, got.finish_reason) == (out.token_ids, "stop")
    cut = llm.generate(["Answer in JSON:"] * len(short), [p for _, p in short], use_tqdm=False)
    for (out, _), got in zip(short, cut):
        assert (got.token_ids, got.finish_reason) == (out.token_ids[:-1], "length")


def test_n_samples_each_follow_the_grammar(llm):
    p = params(SCHEMAS[13], seed=7, temperature=1.0, n=3)
    out = llm.generate(PROMPTS[:1], p, use_tqdm=False)[0]
    assert len(out.samples) == 3
    for s in out.samples:
        if s.finish_reason == "stop":
            jsonschema.validate(json.loads(s.text), SCHEMAS[13])


def test_a_schema_xgrammar_cannot_compile_ends_the_request_with_an_error(llm):
    bad = {"type": OBJ, "properties": {"a": {"type": "nope"}}}
    assert "nope" in schema_error(GrammarSpec.from_schema(bad).json_schema)
    core = llm.engine
    core.add_request("x", params(bad), request_id="bad")  # held while it compiles
    deltas = []
    while core.has_unfinished():
        deltas.extend(core.step())
    assert [(d.request_id, d.finished, d.finish_reason) for d in deltas] == [("bad", True, "error")]
    with pytest.raises(ValueError, match="cannot be compiled"):  # compiled (failed) already
        core.add_request("x", params(bad), request_id="bad2")
    assert "bad2" not in core.scheduler.requests


def test_a_compiling_grammar_does_not_hold_up_the_batch(llm, monkeypatch):
    core = llm.engine
    structured = core._structured()
    gate = threading.Event()
    real = structured._compile
    monkeypatch.setattr(structured, "_compile", lambda schema: (gate.wait(10), real(schema))[1])
    free = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)
    core.add_request("The scheduler decides", free, request_id="free")
    schema = {"type": OBJ, "properties": {"slow": {"type": "integer"}}, "required": ["slow"]}
    core.add_request("Tenants share", params(schema), request_id="slow")
    assert "slow" in structured.held and "slow" not in core.scheduler.requests
    done = {}
    for _ in range(5):  # the free request runs to its end while the grammar compiles
        for d in core.step():
            done.setdefault(d.request_id, []).append(d)
    assert done["free"][-1].finish_reason == "length" and "slow" not in done
    assert core.has_unfinished()  # the held request keeps the loop alive
    gate.set()
    while core.has_unfinished():
        for d in core.step():
            done.setdefault(d.request_id, []).append(d)
    text = "".join(d.text for d in done["slow"])
    assert done["slow"][-1].finish_reason == "stop" and "slow" in json.loads(text)


def test_aborting_a_held_request(llm, monkeypatch):
    core = llm.engine
    structured = core._structured()
    gate = threading.Event()
    real = structured._compile
    monkeypatch.setattr(structured, "_compile", lambda schema: (gate.wait(10), real(schema))[1])
    schema = {"type": OBJ, "properties": {"gone": {"type": "integer"}}}
    core.add_request("x", params(schema), request_id="held")
    assert core.abort("held") and not core.has_unfinished()
    gate.set()
    assert core.step() == []


def test_the_grammar_cache_is_bounded(llm):
    structured = llm.engine._structured()
    size = structured._cache_size
    structured._cache_size = 2
    try:
        for i in range(4):
            structured.compiled(GrammarSpec.from_schema({"const": i})).result()
        assert len(structured._cache) == 2
        assert list(structured._cache) == [
            GrammarSpec.from_schema({"const": i}).json_schema for i in (2, 3)
        ]
    finally:
        structured._cache_size = size


# ---- exact across the scheduler's moves -----------------------------------------------------


def long_jobs():
    prompts = [
        f"{PROMPTS[i % 4]} request {i} with a longer prompt to fill blocks" for i in range(8)
    ]
    plist = [params(LONG, max_tokens=80)] * 4 + [
        params(LONG, seed=i, temperature=1.0, max_tokens=80) for i in range(4)
    ]
    return prompts, plist


@pytest.fixture(scope="module")
def reference(llm):
    prompts, plist = long_jobs()
    return [o.token_ids for o in llm.generate(prompts, plist, use_tqdm=False)]


@pytest.mark.parametrize("mode", ["swap", "recompute"])
def test_preempted_requests_give_the_undisturbed_tokens(reference, mode):
    small = LLM("tiny", num_gpu_blocks=14, preemption_mode=mode)
    prompts, plist = long_jobs()
    outs = small.generate(prompts, plist, use_tqdm=False)
    assert sum(small.engine.stats()["preemptions"].values()) > 0
    assert [o.token_ids for o in outs] == reference


def run_to_end(core, deltas=None):
    deltas = {} if deltas is None else deltas
    while core.has_unfinished():
        for d in core.step():
            deltas.setdefault(d.request_id, []).extend(d.token_ids)
    return deltas


def test_a_migrated_request_rebuilds_its_matcher_and_gives_the_same_tokens(llm, reference):
    prompts, plist = long_jobs()
    src, dst = llm.engine, LLM("tiny").engine  # dst: a cold grammar cache, so it is held
    for k in (0, 5):  # greedy and seeded
        src.add_request(prompts[k], plist[k], request_id=f"m{k}")
        got: dict = {}
        for _ in range(20):
            for d in src.step():
                got.setdefault(d.request_id, []).extend(d.token_ids)
        assert src.preempt(f"m{k}", "swap")
        migrated = pickle.loads(pickle.dumps(src.export_request(f"m{k}")))
        assert migrated.kv_blocks is not None and f"m{k}" not in src.structured.matchers
        dst.import_request(migrated)
        run_to_end(dst, got)
        assert got[f"m{k}"] == reference[k]
        assert not dst.structured.matchers and not dst.structured.held


def test_a_resubmitted_request_replays_its_delivered_tokens(llm, reference):
    prompts, plist = long_jobs()
    tok = llm.tokenizer
    for k in (1, 6):
        delivered = reference[k][:15]
        meta = RequestMeta(f"r{k}", tok.encode(prompts[k]), plist[k], output_ids=delivered)
        core = LLM("tiny").engine
        core.import_request(Replica._resubmitted(SimpleNamespace(core=core), meta))
        got = run_to_end(core)
        assert delivered + got[f"r{k}"] == reference[k]
