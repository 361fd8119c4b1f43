"""Structured outputs in the engine (backend/structured/), on the random-weight default model: its
unconstrained text is noise, so every constrained output that parses and validates was made so by
the grammar. JSON schema, regex, choice, EBNF; finish reasons; n > 1, min_tokens, stop strings,
penalties, logprobs; every batching mode and both capacity policies; errors at arrival."""
from __future__ import annotations

import json
import re

import jsonschema
import pytest

from backend import LLM, SamplingParams

SCHEMA = {"type": "object",
          "properties": {"name": {"type": "string", "maxLength": 6},
                         "size": {"type": "integer", "minimum": 0, "maximum": 99},
                         "kind": {"enum": ["cat", "dog"]},
                         "tags": {"type": "array", "items": {"type": "string", "maxLength": 3}, "maxItems": 2},
                         "home": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 5}},
                                  "required": ["city"]}},
          "required": ["name", "size", "kind", "home"]}
# No free whitespace: random weights would otherwise spend max_tokens on it.
JSON_SPEC = {"json": SCHEMA, "disable_any_whitespace": True}
PROMPTS = ["The weather today", "Once upon a time", "A list of numbers:", "Hello"]


@pytest.fixture(scope="module")
def llm(default_model_dir):
    return LLM(str(default_model_dir), max_num_seqs=16, max_model_len=512)


def sampled(seed, **kw):
    return SamplingParams(max_tokens=150, temperature=1.0, seed=seed, **kw)


def test_json_schema_outputs_validate_and_unconstrained_ones_do_not(llm):
    outs = llm.generate(PROMPTS, [sampled(i, structured_outputs=JSON_SPEC) for i in range(len(PROMPTS))])
    for o in outs:
        assert o.finish_reason == "stop", o.text
        jsonschema.validate(json.loads(o.text), SCHEMA)
    assert len({o.text for o in outs}) > 1  # sampled, not one fixed answer
    free = llm.generate(PROMPTS, [sampled(i) for i in range(len(PROMPTS))])
    assert not any(_valid(o.text) for o in free)
    assert llm.stats()["kv_blocks_used"] == 0


def _valid(text):
    try:
        jsonschema.validate(json.loads(text), SCHEMA)
        return True
    except (ValueError, jsonschema.ValidationError):
        return False


def test_regex_choice_grammar_and_json_object(llm):
    regex = r"[a-z]{2,4}-\d{3}"
    for seed in range(3):
        out = llm.generate("x", sampled(seed, structured_outputs={"regex": regex}))[0]
        assert re.fullmatch(regex, out.text) and out.finish_reason == "stop", out.text
    choices = ["yes", "no", "say \"maybe\"\n"]
    got = {llm.generate("x", sampled(seed, structured_outputs={"choice": choices}))[0].text for seed in range(8)}
    assert got <= set(choices) and len(got) > 1
    ebnf = 'root ::= "(" digit+ ")"\ndigit ::= [0-9]'
    out = llm.generate("x", sampled(0, structured_outputs={"grammar": ebnf}))[0]
    assert re.fullmatch(r"\(\d+\)", out.text), out.text
    out = llm.generate("x", SamplingParams(max_tokens=300, temperature=0.0, structured_outputs={
        "json_object": True, "disable_any_whitespace": True}))[0]
    assert isinstance(json.loads(out.text), dict) and out.finish_reason == "stop", out.text


def test_legacy_keys_and_the_vllm_backends_json_string_mean_the_same():
    a = SamplingParams.from_dict({"guided_choice": ["a", "b"]}).structured_outputs
    b = SamplingParams.from_dict({"structured_outputs": json.dumps({"choice": ["a", "b"]})}).structured_outputs
    c = SamplingParams.from_dict({"guided_decoding": {"choice": ["a", "b"]}}).structured_outputs
    assert a.cache_key == b.cache_key == c.cache_key == ("choice", '["a", "b"]', False, False)
    with pytest.raises(ValueError, match="one constraint per request"):
        SamplingParams.from_dict({"guided_regex": "a", "structured_outputs": {"choice": ["b"]}})


def test_a_constraint_that_cannot_finish_in_max_tokens_ends_with_length(llm):
    out = llm.generate("x", SamplingParams(max_tokens=3, temperature=0.0, structured_outputs={"regex": "a{10}"}))[0]
    assert out.finish_reason == "length" and out.text == "a" * len(out.text) and len(out.token_ids) == 3


def test_constrained_and_unconstrained_rows_share_steps_unchanged(llm):
    free = SamplingParams(max_tokens=12, temperature=0.0)
    alone = llm.generate(PROMPTS, free)
    mixed = llm.generate(PROMPTS * 2, [free] * len(PROMPTS) + [sampled(i, structured_outputs=JSON_SPEC)
                                                                 for i in range(len(PROMPTS))])
    assert [o.token_ids for o in mixed[:len(PROMPTS)]] == [o.token_ids for o in alone]
    assert all(_valid(o.text) for o in mixed[len(PROMPTS):])


def test_n_completions_each_follow_the_grammar(llm):
    out = llm.generate("x", sampled(5, n=4, structured_outputs=JSON_SPEC))[0]
    assert len(out.samples) == 4 and len({s.text for s in out.samples}) > 1
    assert all(_valid(s.text) for s in out.samples)


def test_min_tokens_stop_strings_and_penalties(llm):
    # min_tokens keeps EOS away while the grammar could end ("a+" ends after any a)
    out = llm.generate("x", SamplingParams(max_tokens=20, temperature=0.0, min_tokens=6,
                                           structured_outputs={"regex": "a+"}))[0]
    assert len(out.token_ids) >= 6 and re.fullmatch("a+", out.text)
    # a stop string cuts the constrained text, as it cuts any text
    out = llm.generate("x", SamplingParams(max_tokens=20, temperature=0.0, stop=["-"],
                                           structured_outputs={"choice": ["abc-def"]}))[0]
    assert out.text == "abc" and out.finish_reason == "stop"
    # a grammar that can only end ends the request then, min_tokens or not, with no EOS token sampled
    out = llm.generate("x", SamplingParams(max_tokens=20, temperature=0.0, min_tokens=8, ignore_eos=True,
                                           structured_outputs={"choice": ["yes"]}))[0]
    assert (out.text, out.finish_reason) == ("yes", "stop")
    assert not set(out.token_ids) & set(llm.engine.model_config.eos_token_ids)
    out = llm.generate("x", sampled(1, repetition_penalty=1.8, frequency_penalty=1.5, structured_outputs=JSON_SPEC))[0]
    assert _valid(out.text)


def test_logprobs_are_those_of_the_raw_logits(llm):
    free = llm.generate("x", SamplingParams(max_tokens=1, temperature=0.0, logprobs=5))[0]
    kept = llm.generate("x", SamplingParams(max_tokens=4, temperature=0.0, logprobs=5,
                                            structured_outputs={"regex": "zzzz"}))[0]
    first_free, first_kept = free.logprobs[0], kept.logprobs[0]
    # the first token's distribution is the model's, masked or not: same top 5, same numbers
    top = lambda lp: sorted((t, round(v.logprob, 5)) for t, v in lp.items() if v.rank <= 5)
    assert top(first_free) == top(first_kept)
    sampled_token = kept.token_ids[0]
    assert first_kept[sampled_token].rank > 1 and first_kept[sampled_token].logprob < 0


@pytest.mark.parametrize("mode", ["inflight", "dynamic", "static", "none"])
def test_every_batching_mode_gives_the_same_constrained_outputs(default_model_dir, llm, mode):
    params = [sampled(i, structured_outputs=JSON_SPEC) if i % 2 else SamplingParams(max_tokens=8, temperature=0.0)
              for i in range(len(PROMPTS))]
    expected = [o.token_ids for o in llm.generate(PROMPTS, params)]
    other = LLM(str(default_model_dir), batching_mode=mode, max_num_seqs=4, max_queue_delay_microseconds=1000,
                executor_static_batch_size=4 if mode == "static" else -1, max_model_len=512)
    assert [o.token_ids for o in other.generate(PROMPTS, params)] == expected
    assert other.stats()["kv_blocks_used"] == 0


def test_preemption_recomputes_to_the_same_constrained_outputs(default_model_dir, llm):
    params = [sampled(i, structured_outputs=JSON_SPEC) for i in range(8)]
    prompts = [p + " and more" * (i + 3) for i, p in enumerate(PROMPTS * 2)]
    expected = [o.text for o in llm.generate(prompts, params)]
    tight = LLM(str(default_model_dir), batch_scheduler_policy="max_utilization", kv_block_size=16,
                max_tokens_in_paged_kv_cache=400, max_model_len=512,
                inter_token_target_ms=0)  # unpaced: preemptions that do not follow step times (test_engine_vs_hf.py)
    got = tight.generate(prompts, params)
    assert tight.stats()["num_preemptions"] > 0, "the tight cache should have forced preemption"
    assert [o.text for o in got] == expected and all(_valid(t) for t in expected)
    assert tight.stats()["kv_blocks_used"] == 0


@pytest.mark.parametrize("spec, field, words", [
    ({"json": {"type": "strin"}}, "structured_outputs.json", "/type must be one of"),
    ({"json": {"type": "string", "minLength": 5, "maxLength": 2}}, "structured_outputs.json", "minLength 5 is greater"),
])
def test_bad_schemas_are_refused_at_arrival(llm, spec, field, words):
    engine = llm.engine
    with pytest.raises(ValueError) as err:
        engine.add_request("bad", "x", SamplingParams(max_tokens=4, structured_outputs=spec))
    assert str(err.value).startswith(field) and words in str(err.value), str(err.value)
    assert not engine.has_work() and engine.stats()["kv_blocks_used"] == 0


@pytest.mark.parametrize("spec, field, words", [
    ({"regex": "(ab"}, "structured_outputs.regex", "cannot be compiled"),
    ({"grammar": 'root ::= "a" b'}, "structured_outputs.grammar", "not defined"),
    ({"grammar": 'root ::= root "a"'}, "structured_outputs.grammar", "tokenizer cannot satisfy"),
    ({"structural_tag": {"type": "structural_tag", "format": {"type": "nope"}}}, "structured_outputs.structural_tag",
     "cannot be compiled"),
])
def test_constraints_xgrammar_refuses_end_their_request_with_the_reason(llm, spec, field, words):
    """Compiling runs off the request path: xgrammar's refusal ends the request (an error output,
    a 400 at the doors: error_kind "invalid"); a second one is refused at arrival (cached)."""
    bad = SamplingParams(max_tokens=4, structured_outputs=spec)
    out = llm.generate("x", bad)[0]
    assert out.finish_reason == "error" and out.error_kind == "invalid", out
    assert out.error.startswith(field) and words in out.error, out.error
    with pytest.raises(ValueError, match=words):
        llm.engine.add_request("again", "x", bad)
    assert not llm.engine.has_work() and llm.stats()["kv_blocks_used"] == 0
    assert llm.generate("x", SamplingParams(max_tokens=2, temperature=0.0))[0].finish_reason  # it serves on


def test_only_empty_output_with_min_tokens_is_refused(llm):
    out = llm.generate("x", SamplingParams(max_tokens=4, min_tokens=2, structured_outputs={"regex": "a{0}"}))[0]
    assert out.finish_reason == "error" and "admits only an empty output, but min_tokens is 2" in out.error


def test_each_distinct_constraint_compiles_once_in_a_bounded_cache(default_model_dir):
    engine = LLM(str(default_model_dir), max_model_len=256).engine
    engine.grammars.cache_size = 2
    specs = [{"regex": "a+"}, {"regex": "b+"}, {"regex": "a+"}, {"regex": "c+"}, {"regex": "b+"}]
    for i, spec in enumerate(specs):
        engine.make_request(f"r{i}", "x", SamplingParams(structured_outputs=spec))
    # a+ miss, b+ miss, a+ hit, c+ miss (evicts b+), b+ miss again
    assert (engine.grammars.hits, engine.grammars.misses) == (1, 4) and len(engine.grammars._cache) == 2


def test_the_constraint_modules_load_without_torch_or_xgrammar():
    """The request, its constraint and the compiler's module load neither torch nor xgrammar: a bad
    constraint is refused by the Triton adapter and the OpenAI server before the heavy libraries."""
    import subprocess
    import sys

    code = ("import sys\nimport backend.core.request, backend.core.structured, backend.engine.structured.compiler\n"
            "import openai_server.constraints, openai_server.tools\n"
            "print(','.join(m for m in ('torch', 'xgrammar', 'transformers') if m in sys.modules))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == ""
