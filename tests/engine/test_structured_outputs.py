"""Structured outputs on the real model, offline: JSON schemas, regex, choice and EBNF grammars give output
of their language (greedy and sampled, n > 1, under preemption), batched unconstrained requests keep their
greedy tokens, requests wait in the queue while their grammar compiles, and bad constraints raise."""

import json
import re
import sys
import threading
from concurrent.futures import Future

import jsonschema
import numpy as np
import pytest
import torch

from engine import SamplingParams, StructuredOutputsConfig, StructuredOutputsParams
from engine.sample.bitmask import apply_token_bitmask
from tests.conftest import assert_greedy_matches, make_llm
from tests.structured_schemas import random_schemas

SCHEMAS = random_schemas(50)
PERSON = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
    "required": ["name", "age"],
}
SHORT_PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
    },
    "required": ["name", "age"],
}
PHONE = r"\(\d{3}\) \d{3}-\d{4}"
CHOICES = ["positive", "negative", "neutral"]
# a small arithmetic language: sums and products of 1-3 digit numbers, optionally parenthesized
EBNF = r'''root ::= expr
expr ::= term (("+" | "-") term)*
term ::= factor (("*" | "/") factor)*
factor ::= [0-9] [0-9]? [0-9]? | "(" expr ")"'''


def chat(llm, text: str) -> list[int]:
    tok = llm.tokenizer
    return tok.encode(
        tok.apply_chat_template([{"role": "user", "content": text}], tokenize=False, add_generation_prompt=True),
        add_special_tokens=False,
    )


def in_ebnf_language(text: str) -> bool:
    # the grammar above as a regex check: balanced parentheses around well-formed sums/products
    while re.search(r"\([^()]*\)", text):
        inner = re.search(r"\(([^()]*)\)", text)
        if not re.fullmatch(r"\d{1,3}([-+*/]\d{1,3})*", inner.group(1)):
            return False
        text = text[: inner.start()] + "1" + text[inner.end() :]
    return re.fullmatch(r"\d{1,3}([-+*/]\d{1,3})*", text) is not None


@pytest.mark.slow
def test_fifty_json_schemas_greedy_and_sampled_validate(llm):
    """Every output of 50 schemas, at temperature 0 and 1, parses and validates; all in one batch. The
    output is compact JSON (disable_any_whitespace): with free whitespace the 135M model in bfloat16
    can put newlines after "{" until max_tokens, greedy or sampled (valid JSON so far, but never closed)."""
    prompt = chat(llm, "Reply with a short JSON object.")  # one prompt: its KV comes from the prefix cache
    params = [
        SamplingParams(
            temperature=t,
            seed=i,
            max_tokens=400,
            structured_outputs=StructuredOutputsParams(json=s, disable_any_whitespace=True),
        )
        for t in (0.0, 1.0)
        for i, s in enumerate(SCHEMAS)
    ]
    outs = llm.generate([prompt] * len(params), params, use_tqdm=False)
    for out, p in zip(outs, params):
        c = out.outputs[0]
        assert c.finish_reason == "stop", (c.finish_reason, c.text)
        jsonschema.validate(json.loads(c.text), p.structured_outputs.json)


@pytest.mark.slow
def test_regex_choice_grammar_and_json_object_with_n4_beside_unconstrained(llm, prompts, hf_reference):
    """Constrained requests (n = 4, sampled) in the same batches as the eight unconstrained greedy
    prompts, which still match transformers."""
    S = StructuredOutputsParams
    constrained = [
        (chat(llm, "What is your phone number?"), S(regex=PHONE), lambda t: re.fullmatch(PHONE, t)),
        (chat(llm, "Is 'I love this film' positive, negative or neutral?"), S(choice=CHOICES), lambda t: t in CHOICES),
        (chat(llm, "Write an arithmetic expression."), S(grammar=EBNF), in_ebnf_language),
        (
            chat(llm, "Give me a person as compact JSON."),
            S(json=SHORT_PERSON, disable_any_whitespace=True),
            lambda t: jsonschema.validate(json.loads(t), SHORT_PERSON) is None and "\n" not in t,
        ),
        # greedy: any object is allowed, and sampled ones at temperature 1 grow past any max_tokens
        # (a prompt that names the keys: on open-ended ones the 135M model lists keys past max_tokens)
        (
            chat(llm, "Describe a cat as a JSON object with a name and an age."),
            S(json_object=True),
            lambda t: isinstance(json.loads(t), dict),
        ),
    ]
    params = [SamplingParams(temperature=0, max_tokens=32)] * len(prompts) + [
        SamplingParams(
            n=4, temperature=1.0 if spec.kind != "json_object" else 0.0, seed=7, max_tokens=200, structured_outputs=spec
        )
        for _, spec, _ in constrained
    ]
    outs = llm.generate(prompts + [p for p, _, _ in constrained], params, use_tqdm=False)
    for out, ref in zip(outs, hf_reference):
        assert_greedy_matches(out.outputs[0].token_ids, ref)
    for out, (_, spec, check) in zip(outs[len(prompts) :], constrained):
        assert len(out.outputs) == 4
        for c in out.outputs:
            assert c.finish_reason == "stop" and check(c.text), (spec.kind, c.finish_reason, c.text)


@pytest.mark.slow
def test_preemption_keeps_grammar_state():
    """Recompute preemption keeps the generated tokens, so each matcher's state stays right."""
    llm = make_llm(kv_cache_memory=12 * 16 * 2 * 30 * 3 * 64 * 4, max_model_len=192)  # 12 blocks of 16
    prompt = chat(llm, "Give me a list of people as JSON.")
    schema = {"type": "array", "items": PERSON, "minItems": 3, "maxItems": 3}
    spec = StructuredOutputsParams(json=schema, disable_any_whitespace=True)
    outs = llm.generate(
        [prompt] * 4,
        [SamplingParams(temperature=1.0, seed=i, max_tokens=100, structured_outputs=spec) for i in range(4)],
        use_tqdm=False,
    )
    assert llm.engine.engine_core.scheduler.num_preemptions > 0
    for out in outs:
        c = out.outputs[0]
        assert c.finish_reason == "stop", c.text
        jsonschema.validate(json.loads(c.text), schema)


def test_length_mid_structure_and_stop_string(llm):
    prompt = chat(llm, "Give me a person as JSON.")
    spec = StructuredOutputsParams(json=PERSON)
    cut, stopped = llm.generate(
        [prompt, prompt],
        [
            SamplingParams(temperature=0, max_tokens=4, structured_outputs=spec),
            SamplingParams(temperature=0, max_tokens=50, stop=['"age"'], structured_outputs=spec),
        ],
        use_tqdm=False,
    )
    assert cut.outputs[0].finish_reason == "length" and len(cut.outputs[0].token_ids) == 4
    with pytest.raises(ValueError):
        json.loads(cut.outputs[0].text)
    assert stopped.outputs[0].finish_reason == "stop" and stopped.outputs[0].stop_reason == '"age"'


def test_add_request_waits_for_its_grammar_and_refuses_a_failed_compile(llm, monkeypatch):
    """LLMEngine.add_request compiles (or finds) the grammar before queueing: a constraint whose compile
    fails raises ValueError and queues nothing; one still compiling is waited for."""
    engine = llm.engine
    spec = StructuredOutputsParams(choice=["yes", "no"])
    compiled = engine.structured.compile(spec).result()
    failing, pending = Future(), Future()
    futures = iter([failing, pending])
    monkeypatch.setattr(engine.structured, "compile", lambda _: next(futures))
    prompt = chat(llm, "Yes or no?")
    failing.set_exception(ValueError("invalid grammar: test"))
    with pytest.raises(ValueError, match="invalid grammar: test"):
        engine.add_request("bad", prompt, SamplingParams(temperature=0, max_tokens=8, structured_outputs=spec))
    assert "bad" not in engine.request_ids() and not engine.has_unfinished_requests()
    threading.Timer(0.2, pending.set_result, [compiled]).start()
    engine.add_request("slow", prompt, SamplingParams(temperature=0, max_tokens=8, structured_outputs=spec))
    finals = {}
    while engine.has_unfinished_requests():
        finals.update({o.request_id: o for o in engine.step() if o.finished})
    assert finals["slow"].outputs[0].text in ("yes", "no")


def test_bad_constraints_raise_before_any_request_is_queued(llm):
    S = StructuredOutputsParams
    for kwargs in [{}, {"regex": "a", "choice": ["a"]}, {"choice": []}, {"choice": ["a", 1]}]:
        with pytest.raises(ValueError, match="structured outputs need exactly one|choice must be"):
            S(**kwargs)
    for spec, message in [
        (S(json={"type": "objekt"}), "invalid JSON schema: Unsupported type"),
        (S(json="{not json"), "invalid JSON schema"),
        (S(regex="(ab"), "invalid regex: .*parenthesis"),
        (S(grammar="root ::= missing"), "invalid grammar: .*not defined"),
    ]:
        with pytest.raises(ValueError, match=message):
            llm.generate(
                ["Hi", "Hello"],
                [SamplingParams(max_tokens=2), SamplingParams(max_tokens=2, structured_outputs=spec)],
                use_tqdm=False,
            )
        assert not llm.engine.request_ids()


def test_compile_timeout_and_missing_xgrammar(llm, monkeypatch):
    structured = llm.engine.structured
    monkeypatch.setattr(structured.config, "compile_timeout", 1e-4)
    slow = {"type": "object", "properties": {"text": {"type": "string", "minLength": 3, "maxLength": 40}}}
    with pytest.raises(ValueError, match="did not compile within"):
        llm.generate(
            "Hi", SamplingParams(max_tokens=2, structured_outputs=StructuredOutputsParams(json=slow)), use_tqdm=False
        )
    monkeypatch.setitem(sys.modules, "xgrammar", None)  # as if not installed
    with pytest.raises(ValueError, match="pip install --no-deps xgrammar==0.2.8 apache-tvm-ffi"):
        llm.generate(
            "Hi", SamplingParams(max_tokens=2, structured_outputs=StructuredOutputsParams(regex="a+")), use_tqdm=False
        )
    assert llm.generate("Hi", SamplingParams(max_tokens=2), use_tqdm=False)[0].outputs[0].token_ids


def test_matcher_api_for_speculative_decoding(llm):
    """accept_tokens stops at the first token the grammar rejects; rollback undoes accepted tokens
    (also the stop token); the special tokens other than EOS are never allowed."""
    from engine.structured.matcher import RequestGrammar

    structured = llm.engine.structured
    grammar = RequestGrammar(
        structured.compile(StructuredOutputsParams(json=PERSON, disable_any_whitespace=True)).result()
    )
    good = llm.tokenizer.encode('{"name": "Ann", "age": 7}', add_special_tokens=False)
    eos = 2
    bad = llm.tokenizer.encode("hello", add_special_tokens=False)
    assert grammar.accept_tokens(good[:3] + bad) == 3
    grammar.rollback(3)
    assert grammar.accept_tokens(good + [eos]) == len(good) + 1 and grammar.is_terminated
    grammar.rollback(2)
    assert not grammar.is_terminated
    bitmask = np.zeros((1, 49152 // 32), dtype=np.int32)
    grammar.fill_bitmask(bitmask, 0)
    allowed = {i for i in range(49152) if bitmask[0, i // 32] >> (i % 32) & 1}
    assert good[-1] in allowed and eos not in allowed and not allowed & {0, 1}
    grammar.accept_tokens(good[-1:])
    grammar.fill_bitmask(bitmask, 0)
    assert bitmask[0, 0] & 0b111 == 0b100  # only EOS (id 2) of the special tokens ends it


def test_bitmask_apply_equals_xgrammar_kernel(llm):
    """The NumPy unpack + masked_fill equals xgrammar's own CPU kernel on random masks, for a subset of rows."""
    import xgrammar as xgr

    gen = np.random.default_rng(0)
    words = gen.integers(-(2**31), 2**31, size=(5, 1536), dtype=np.int64).astype(np.int32)
    words[[1, 4]] = -1  # rows without a grammar: every token allowed
    rows = [0, 2, 3]
    logits = torch.randn(5, 49152)
    expected = logits.clone()
    xgr.apply_token_bitmask_inplace(expected, torch.from_numpy(words))
    apply_token_bitmask(logits, words[rows], rows)
    assert torch.equal(logits, expected)


def test_structured_outputs_config_rejects_unknown_keys_and_bad_json():
    """The flag's JSON and the dict given to LLM(...) go through one parser (engine/config/parse.py)."""
    from engine import EngineConfig, StructuredOutputsConfig

    assert StructuredOutputsConfig.from_json('{"compile_timeout": 5}').compile_timeout == 5
    assert EngineConfig(structured_outputs_config={"compile_timeout": 5}).structured_outputs_config.compile_timeout == 5
    with pytest.raises(ValueError, match=r"unknown structured_outputs_config key\(s\): timeout"):
        EngineConfig(structured_outputs_config={"timeout": 5})
    with pytest.raises(ValueError, match="--structured-outputs-config is not valid JSON"):
        StructuredOutputsConfig.from_json("{")
    with pytest.raises(ValueError, match="must be a JSON object"):
        StructuredOutputsConfig.from_json("[1]")


def test_json_whitespace_runs_are_bounded(llm):
    """JSON grammars allow at most max_whitespace_cnt (16) whitespace characters in a row, so a model
    cannot fill max_tokens with newlines; with the bound off (null) they allow any run."""
    from engine.structured.manager import StructuredOutputManager
    from engine.structured.matcher import RequestGrammar

    newline = llm.tokenizer.encode("\n", add_special_tokens=False)
    brace = llm.tokenizer.encode("{", add_special_tokens=False)
    assert len(newline) == len(brace) == 1
    spec = StructuredOutputsParams(json_object=True)
    for bound, accepted in [(16, 16), (None, 40)]:
        engine = llm.engine
        manager = StructuredOutputManager(
            llm.tokenizer, engine.vocab_size, engine.eos_token_ids, StructuredOutputsConfig(max_whitespace_cnt=bound)
        )
        grammar = RequestGrammar(manager.compile(spec).result())
        assert grammar.accept_tokens(brace + newline * 40) == 1 + accepted
        manager.shutdown()
