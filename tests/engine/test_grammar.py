"""Constrained decoding: on a tiny random model, whose unconstrained output is noise, every reply
constrained by a JSON schema, JSON object, regex, choice or EBNF grammar matches it, in both step
modes, and ends with reason "stop"; a bad grammar is refused at the door with nothing queued; a
row its grammar fails fails alone; compiled grammars are cached by text, within a bound.
Jump-forward: forced text is computed in fewer steps, re-tokenized with the sampled token, the
same in both step modes, streamed, and cut at max_tokens."""

from __future__ import annotations

import json
import re
from dataclasses import replace

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from schema_strategies import SCHEMAS
from tiny_llama import build_char_tokenizer, build_model, random_prompts

from radixkv import LLM, SamplingParams
from radixkv.engine.sampling.grammar import GrammarCompiler, GrammarError, json_schema_for_xgrammar

jsonschema = pytest.importorskip("jsonschema")  # test extras: absent on the GPU machine
pytest.importorskip("xgrammar")

STEP_MODES = (False, True)  # async_scheduling
PROMPTS = random_prompts(3, 4, min_len=3, max_len=12)


@pytest.fixture(scope="module")
def engines() -> dict[bool, LLM]:
    model, tokenizer = build_model("gqa"), build_char_tokenizer()
    settings_ = dict(block_size=8, num_blocks=256, max_num_seqs=8)
    return {
        on: LLM(model, tokenizer=tokenizer, async_scheduling=on, **settings_) for on in STEP_MODES
    }


def _run(
    llm: LLM,
    params: list[SamplingParams],
    prompts: list[list[int]] = PROMPTS,
    seen: dict[str, list] | None = None,
) -> list:
    """The finished outputs, stepping with integrity checks after each step; `seen` gets every
    update with tokens, by request (index in `params`)."""
    ids = [llm.add_request(prompts[i % len(prompts)], p) for i, p in enumerate(params)]
    outputs = {}
    while llm.has_unfinished_requests():
        for u in llm.step():
            if u.output is not None:
                outputs[u.request_id] = u
            if seen is not None and u.new_token_ids:
                seen.setdefault(ids.index(u.request_id), []).append(u)
        llm.check_integrity()
    assert llm.cache.stats().num_in_use_blocks == 0
    return [outputs[rid] for rid in ids]


def _sampled(i: int, **constraint) -> SamplingParams:
    """Greedy for even i, seeded sampling for odd i: both must obey the grammar."""
    if i % 2 == 0:
        return SamplingParams(max_tokens=300, **constraint)
    return SamplingParams(max_tokens=300, temperature=1.0, seed=i, **constraint)


@pytest.mark.parametrize("async_scheduling", STEP_MODES)
def test_each_kind_of_constraint_is_obeyed_and_ends_with_stop(engines, async_scheduling):
    llm = engines[async_scheduling]
    cases = [
        (dict(regex=r"[a-c]{2,4}-[0-9]{3}"), lambda t: re.fullmatch(r"[a-c]{2,4}-[0-9]{3}", t)),
        (dict(choice=("yes", "no", 'say "maybe"')), lambda t: t in ("yes", "no", 'say "maybe"')),
        (dict(grammar='root ::= "(" [xy]+ ")" | "no"'), lambda t: re.fullmatch(r"\([xy]+\)|no", t)),
    ]
    params = [_sampled(i, **c) for i in range(4) for c, _ in cases]
    checks = [check for _ in range(4) for _, check in cases]
    for update, check in zip(_run(llm, params), checks, strict=True):
        out = update.output
        assert out.finish_reason == "stop", out
        assert check(out.text), out.text


@pytest.mark.parametrize("async_scheduling", STEP_MODES)
def test_the_mask_comes_before_logit_bias(engines, async_scheduling):
    """A bias of +100 on tokens the grammar forbids does not bring them in. (A JSON object is
    unbounded: noise alone may never close one, so the bias also steers it to an end.)"""
    llm = engines[async_scheduling]
    vocab = llm.tokenizer.get_vocab()
    close, quote, z = vocab["}"], vocab['"'], vocab["z"]
    bias = {quote: 100.0, close: 90.0, z: 100.0}
    obj = SamplingParams(max_tokens=50, json_object=True, logit_bias=bias)
    letters = SamplingParams(max_tokens=50, regex="[ab]{1,9}", logit_bias={z: 100.0})
    first, second = (u.output for u in _run(llm, [obj, letters]))
    assert first.finish_reason == "stop" and isinstance(json.loads(first.text), dict)
    assert second.finish_reason == "stop" and re.fullmatch("[ab]{1,9}", second.text)


@pytest.mark.parametrize("async_scheduling", STEP_MODES)
def test_vllm_extensions_keep_to_the_grammar_and_min_tokens_lets_it_end(engines, async_scheduling):
    """min_tokens longer than any reply the grammar allows: the grammar still ends it (its
    end is the only token left), greedy and sampled; a repetition penalty and min_p stay
    within the mask."""
    llm = engines[async_scheduling]
    choice = dict(choice=("yes", "no"), min_tokens=40, max_tokens=60)
    params = [
        SamplingParams(**choice),
        SamplingParams(temperature=1.0, seed=3, **choice),
        SamplingParams(max_tokens=60, regex="[ab]{2,9}", repetition_penalty=1.5),
        SamplingParams(max_tokens=60, regex="[ab]{2,9}", temperature=1.0, seed=4, min_p=0.2),
    ]
    outs = [u.output for u in _run(llm, params)]
    assert all(out.finish_reason == "stop" for out in outs), outs
    assert outs[0].text in ("yes", "no") and outs[1].text in ("yes", "no")
    assert all(re.fullmatch("[ab]{2,9}", out.text) for out in outs[2:]), outs


# ------------------------------------------------------------------ JSON schemas, generated


@settings(
    max_examples=12,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(schemas=st.lists(SCHEMAS, min_size=1, max_size=4))
def test_generated_json_schemas_are_obeyed_in_both_step_modes(engines, schemas):
    for schema in schemas:
        jsonschema.Draft202012Validator.check_schema(schema)
    params = [_sampled(i, json_schema=s) for i, s in enumerate(schemas)]
    for async_scheduling in STEP_MODES:
        for update, schema in zip(_run(engines[async_scheduling], params), schemas, strict=True):
            out = update.output
            assert out.finish_reason == "stop", (schema, out)
            jsonschema.validate(json.loads(out.text), schema)


def test_string_lengths_reach_xgrammar_as_patterns():
    schema = {"type": "object", "properties": {"s": {"type": "string", "maxLength": 3}}}
    converted = json.loads(json_schema_for_xgrammar(json.dumps(schema)))
    assert converted["properties"]["s"] == {"type": "string", "pattern": "^.{0,3}$"}
    enum = {"enum": [{"type": "string", "maxLength": 2}]}  # a value, not a subschema: kept
    assert json.loads(json_schema_for_xgrammar(json.dumps(enum))) == enum


# ------------------------------------------------------------------ the door and faults


@pytest.mark.parametrize(
    ("fields", "error"),
    [
        (dict(json_object=True, regex="a"), ValueError),
        (dict(json_schema="{}", choice=("a",)), ValueError),
        (dict(regex=""), ValueError),
        (dict(regex=3), TypeError),
        (dict(choice="ab"), TypeError),
        (dict(choice=()), ValueError),
        (dict(choice=("a", "")), TypeError),
        (dict(json_object=1), TypeError),
        (dict(grammar="x" * 70_000), ValueError),
        (dict(json_schema={"a": float("nan")}), ValueError),
        (dict(regex="a", jump_forward=1), TypeError),
        (dict(regex="a", jump_forward=True, logprobs=2), ValueError),  # jumped: not sampled
    ],
)
def test_sampling_params_refuse_bad_constraints(fields, error):
    with pytest.raises(error):
        SamplingParams(**fields)


def test_a_schema_dict_is_kept_as_canonical_text():
    a = SamplingParams(json_schema={"type": "object", "required": []})
    b = SamplingParams(json_schema={"required": [], "type": "object"})
    assert a.json_schema == b.json_schema and a.grammar_spec == b.grammar_spec


@pytest.mark.parametrize(
    "fields",
    [
        dict(json_schema="{not json"),
        dict(json_schema='{"type": "no-such-type"}'),
        dict(regex="(unclosed"),
        dict(grammar="root ::= undefined_rule"),
        dict(json_object=True, ignore_eos=True),  # could never end
    ],
)
def test_a_bad_grammar_is_refused_with_nothing_queued(engines, fields):
    llm = engines[False]
    with pytest.raises(ValueError):
        llm.add_request(PROMPTS[0], SamplingParams(**fields))
    assert not llm.has_unfinished_requests()
    llm.check_integrity()


@pytest.mark.parametrize("async_scheduling", STEP_MODES)
def test_a_grammar_the_vocabulary_cannot_spell_fails_its_request_alone(engines, async_scheduling):
    llm = engines[async_scheduling]
    with pytest.raises(ValueError, match="vocabulary"):  # refused before it is queued
        llm.add_request(PROMPTS[0], SamplingParams(max_tokens=20, regex="é+"))
    unspellable = SamplingParams(max_tokens=20, regex="ab?é")  # stuck after "a" or "ab"
    fine = SamplingParams(max_tokens=20, regex="[ab]{3}")
    bad, good = _run(llm, [unspellable, fine])
    assert bad.output.finish_reason == "error" and isinstance(bad.error, GrammarError)
    assert good.output.finish_reason == "stop" and re.fullmatch("[ab]{3}", good.output.text)


def test_compiled_grammars_are_cached_by_text_within_a_byte_budget():
    """The budget counts each grammar's memory_size_bytes; the least recently used go first,
    and one larger than the whole budget is compiled but never kept."""
    probe = GrammarCompiler(build_char_tokenizer(), 256)
    size = {r: probe.compile(("regex", r)).memory_size_bytes for r in ("a+", "c+")}
    budget = size["a+"] + size["c+"]  # a and c fit, a third does not
    compiler = GrammarCompiler(build_char_tokenizer(), 256, cache_bytes=budget)
    a = compiler.compile(("regex", "a+"))
    assert compiler.compile(("regex", "a+")) is a
    b = compiler.compile(("regex", "b+"))
    assert compiler.compile(("regex", "a+")) is a  # a is now the most recent
    compiler.compile(("regex", "c+"))  # evicts b, the least recent
    compiler.check_integrity()
    assert compiler.num_cached == 2 and compiler.cache.num_bytes == budget
    assert compiler.compile(("regex", "a+")) is a
    assert compiler.compile(("regex", "b+")) is not b
    big = compiler.compile(("regex", "." * 300))
    assert big.memory_size_bytes > budget and not compiler.is_cached(("regex", "." * 300))
    compiler.check_integrity()
    assert compiler.num_cached == 2 and compiler.cache.num_bytes <= budget
    with pytest.raises(GrammarError, match="regex"):
        compiler.compile(("regex", "(unclosed"))


def test_a_grammar_cache_holds_its_budget_under_random_traffic():
    """Byte-budget LRU against a plain model: after every put, the entries are the most
    recent puts that fit, newest first, their sizes summing to at most the budget."""
    from hypothesis import given, settings
    from hypothesis import strategies as st

    from radixkv.engine.sampling.grammar import GrammarCache

    class Sized:
        def __init__(self, n: int) -> None:
            self.memory_size_bytes = n

    @settings(max_examples=60, deadline=None)
    @given(st.integers(0, 40), st.lists(st.tuples(st.integers(0, 5), st.integers(0, 30))))
    def run(budget: int, puts: list[tuple[int, int]]) -> None:
        cache = GrammarCache(budget)
        model: list[tuple[tuple[str, str], int]] = []  # most recent last
        for key, size in puts:
            spec = ("regex", str(key))
            kept = cache.put(spec, Sized(size))
            assert kept == (size <= budget)
            if kept:
                model = [(s, n) for s, n in model if s != spec] + [(spec, size)]
                while sum(n for _, n in model) > budget:
                    model.pop(0)
            cache.check_integrity()
            assert cache.num_bytes == sum(n for _, n in model) <= budget
            assert [s for s, _ in model] == [s for s, _ in model if s in cache]
            assert cache.num_cached == len(model)

    run()


@pytest.mark.parametrize("async_scheduling", STEP_MODES)
def test_preempted_grammar_requests_resume_their_matchers(async_scheduling):
    """A pool too small for the batch preempts requests mid-reply (recompute): their matchers
    keep the tokens accepted so far, and every reply still matches; aborts return all."""
    llm = LLM(
        build_model("gqa"),
        tokenizer=build_char_tokenizer(),
        async_scheduling=async_scheduling,
        block_size=4,
        num_blocks=32,
        max_num_seqs=4,
        chunked_prefill_size=8,
    )
    pattern = "[a-z]{40,50}"
    params = [replace(_sampled(i, regex=pattern), max_tokens=60) for i in range(6)]
    prompts = random_prompts(4, 6, min_len=30, max_len=35)
    updates = _run(llm, params, prompts)
    assert llm.scheduler.num_preemptions > 0, "the small pool preempted"
    for u in updates:
        assert u.output.finish_reason == "stop" and re.fullmatch(pattern, u.output.text)
    rid = llm.add_request(PROMPTS[0], SamplingParams(max_tokens=40, regex=pattern))
    llm.step()
    assert llm.abort_request(rid)
    while llm.has_unfinished_requests():
        llm.step()
    llm.check_integrity()
    assert llm.cache.stats().num_in_use_blocks == 0


# ------------------------------------------------------------------ jump-forward

LONG_KEYS = ("customer_full_name", "shipping_street_address", "is_priority_order")
LONG_KEYS_SCHEMA = {
    "type": "object",
    "properties": {k: {"type": "integer"} for k in LONG_KEYS},
    "required": list(LONG_KEYS),
    "additionalProperties": False,
}


def test_jump_forward_is_valid_shorter_and_the_same_in_both_step_modes(engines):
    """Overlapped steps hold a request whose text is forced until its token is read, so both
    modes jump at the same tokens and give the same outputs."""
    params = [_sampled(i, json_schema=LONG_KEYS_SCHEMA) for i in range(4)]
    results = {}
    for async_scheduling in STEP_MODES:
        for jump in (False, True):
            seen: dict[int, list] = {}
            tried = [replace(p, jump_forward=jump) for p in params]
            outs = [u.output for u in _run(engines[async_scheduling], tried, seen=seen)]
            for out in outs:
                assert out.finish_reason == "stop", out
                jsonschema.validate(json.loads(out.text), LONG_KEYS_SCHEMA)
            steps = [len(seen[i]) for i in range(len(params))]
            results[async_scheduling, jump] = ([o.token_ids for o in outs], steps)
    for jump in (False, True):
        assert results[False, jump] == results[True, jump]
    for i in range(len(params)):  # each key's forced text: one step instead of one per token
        assert results[False, True][1][i] <= results[False, False][1][i] - 2 * len(LONG_KEYS)


@pytest.mark.parametrize("async_scheduling", STEP_MODES)
def test_forced_text_is_retokenized_with_the_sampled_token_and_streamed(engines, async_scheduling):
    """One choice: the first token is sampled (any prefix of it the mask allows), the rest is
    forced. The jump re-encodes that token with the rest, so the ids are the tokenizer's own
    for the whole text; the stream carries the text in two updates (prefill, extend)."""
    llm = engines[async_scheduling]
    word = "customer_full_name_and_address"
    params = [_sampled(i, choice=(word,)) for i in range(4)]
    seen: dict[int, list] = {}
    for i, update in enumerate(_run(llm, params, seen=seen)):
        out = update.output
        assert out.text == word and out.finish_reason == "stop"
        assert list(out.token_ids[:-1]) == llm.tokenizer.encode(word, add_special_tokens=False)
        assert len(seen[i]) == 2
        assert "".join(u.new_text for u in seen[i]) == word
        assert sum(len(u.new_token_ids) for u in seen[i]) == len(out.token_ids)


@pytest.mark.parametrize("async_scheduling", STEP_MODES)
def test_a_jump_is_cut_at_max_tokens(engines, async_scheduling):
    llm = engines[async_scheduling]
    word = "customer_full_name_and_address"
    (update,) = _run(llm, [SamplingParams(max_tokens=5, choice=(word,))])
    out = update.output
    assert out.finish_reason == "length" and len(out.token_ids) == 5
    assert word.startswith(out.text)


def test_a_jump_never_rewrites_a_token_with_kv():
    """plan_jump keeps every output token but the last (sampled, not computed): where a merge
    would rewrite an earlier one, the last token alone is encoded with the forced text."""
    from radixkv.engine.sampling.grammar import RequestGrammar
    from radixkv.engine.sampling.jump_forward import plan_jump

    tok = build_char_tokenizer()
    compiler = GrammarCompiler(tok, 256)
    eos = (tok.eos_token_id,)
    enc = lambda text: tok.encode(text, add_special_tokens=False)  # noqa: E731
    compiled = compiler.compile(("regex", '\\{"customer_full_name": 1\\}'))
    brace = enc("{")
    jump = plan_jump(tok, RequestGrammar(compiled, eos), brace, frozenset(eos))
    assert jump is not None and jump.num_kept == 0  # "{" merges with the quote after it
    assert list(jump.token_ids) == enc('{"customer_full_name": 1}')
    sampled = [*enc('{"'), *enc("c")]  # nothing to merge: the jump only appends
    jump = plan_jump(tok, RequestGrammar(compiled, eos), sampled, frozenset(eos))
    assert jump is not None and jump.num_kept == 2
    assert [*sampled, *jump.token_ids] == enc('{"customer_full_name": 1}')
    split = [*enc("{"), *enc('"')]  # merging '{"' would rewrite "{", which has KV: so the
    jump = plan_jump(tok, RequestGrammar(compiled, eos), split, frozenset(eos))  # last alone
    assert jump is not None and jump.num_kept >= 1
    assert [*split[: jump.num_kept], *jump.token_ids] == [
        *enc("{"),
        *enc('"customer_full_name": 1}'),
    ]
