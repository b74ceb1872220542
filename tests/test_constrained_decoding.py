"""Constrained decoding through llguidance (fastllm.generate.constrain): the token
bytes it is built on, JSON and JSON Schema replies that parse and
validate, tool calls that must come out, clear errors, and constrained
requests batched beside others that equal them alone."""
import json
import sys

import numpy as np
import pytest

pytest.importorskip("llguidance")
jsonschema = pytest.importorskip("jsonschema")

from fastllm import Model, SamplingParams  # noqa: E402
from fastllm.generate.constrain import reply_grammar, token_bytes  # noqa: E402
from fastllm.serve.serving import BatchEngine  # noqa: E402
from fastllm.generate.toolcalls import (LLAMA3_JSON, QWEN, check_tools, parse_reply, reasoning_mode,
                                        tool_format)

PERSON = {"type": "object", "additionalProperties": False, "required": ["name", "age", "pets"],
          "properties": {"name": {"type": "string", "maxLength": 20},
                         "age": {"type": "integer", "minimum": 0, "maximum": 150},
                         "pets": {"type": "array", "maxItems": 3,
                                  "items": {"enum": ["cat", "dog", "fish"]}},
                         "admin": {"type": "boolean"}}}
PERSON_FORMAT = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}
WEATHER = [{"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "required": ["city"],
                   "properties": {"city": {"type": "string", "maxLength": 30},
                                  "unit": {"enum": ["celsius", "fahrenheit"]}}}}},
    {"type": "function", "function": {"name": "get_time", "parameters": {
        "type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}}, "required": ["zone"]}}}]
TEXTS = ["Hello, world!", " {\"a\": [1, 2.5e-3, null]}\n\n", "naïve café – 日本語 🙂", "<|im_end|>",
         "<tool_call>\n{\"name\": \"f\"}\n</tool_call>", "<think>\nhm\n</think>\n\n"]


@pytest.fixture(scope="module")
def model(fastllm_home):
    """The default model, as the server runs it: its Q4_1 file, int8 activations."""
    return Model.from_pretrained(n_ctx=1024, threads=2)


def ask(text):
    return [{"role": "user", "content": text}]


def test_token_bytes_add_up_to_the_text(model):
    tok = model.tokenizer
    for text in TEXTS:
        ids = tok.encode(text, add_special_tokens=False)
        assert b"".join(token_bytes(tok, i) for i in ids) == text.encode()


def test_json_object_reply_parses(model):
    out = model.chat(ask("Reply with a JSON object with keys city and country for Paris."), 150,
                     response_format={"type": "json_object"}, temperature=0)
    assert model.last_stats.finish_reason == "stop"
    assert isinstance(json.loads(out), dict)


@pytest.mark.slow
def test_json_schema_replies_validate_greedy_and_sampled(model):
    prompt = ask("Give me a person as JSON.")
    for seed in [None, 1, 2, 3]:
        temperature = 0 if seed is None else 1.0
        out = model.chat(prompt, 200, response_format=PERSON_FORMAT, temperature=temperature, seed=seed)
        assert model.last_stats.finish_reason == "stop", out
        jsonschema.validate(json.loads(out), PERSON)
    # the same through generate, on a plain prompt
    out = model.generate("A person:", 200, response_format=PERSON_FORMAT, temperature=0)
    jsonschema.validate(json.loads(out), PERSON)


def test_text_response_format_constrains_nothing(model):
    prompt = ask("Say hi.")
    assert model.chat(prompt, 12, response_format={"type": "text"}, temperature=0) == \
        model.chat(prompt, 12, temperature=0)


@pytest.mark.parametrize("response_format, message", [
    ({"type": "xml"}, "must be 'text', 'json_object' or 'json_schema'"),
    ("json", "must be an object with a 'type'"),
    ({"type": "json_schema"}, "json_schema must be an object"),
    ({"type": "json_schema", "json_schema": {"name": "x", "schema": []}}, "schema must be a JSON Schema"),
    ({"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "foo"}}}, "Invalid type: foo"),
    ({"type": "json_schema", "json_schema": {"name": "x", "schema": {"$ref": "#/defs/none"}}},
     "does not exist"),
    ({"type": "json_schema", "json_schema": {"name": "x", "strict": "yes", "schema": {}}}, "strict must be"),
    ({"type": "json_schema", "json_schema": {"schema": {"type": "string", "pattern": "(unclosed"}}},
     "response_format: .*unclosed"),
])
def test_bad_response_formats_are_refused_by_name(model, response_format, message):
    with pytest.raises(ValueError, match=message):
        model.chat(ask("hi"), 5, response_format=response_format)


def test_a_missing_llguidance_is_named(model, monkeypatch):
    monkeypatch.setitem(sys.modules, "llguidance", None)
    with pytest.raises(ImportError, match=r"pip install 'fastllm-engine\[structured\]'"):
        model.chat(ask("hi"), 5, response_format={"type": "json_object"})


def chat_prompt(model, messages, tools=None, **template_kwargs):
    from fastllm.generate.toolcalls import messages_for_template
    template = model.tokenizer.chat_template
    messages, tools = messages_for_template(messages, tools, template)
    text = model.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tools=tools,
                                               **template_kwargs)
    return text, model.tokenizer.encode(text, add_special_tokens=False)


@pytest.mark.parametrize("choice", ["required", "get_time"])
def test_required_and_named_tool_choice_give_a_valid_call(model, choice):
    tools = check_tools(WEATHER)
    text, ids = chat_prompt(model, ask("What is the weather in Paris?"), WEATHER)
    fmt = tool_format(model.tokenizer.chat_template)
    grammar = reply_grammar(model, tools=tools, tool_choice=choice, fmt=fmt)
    out = model.generate_tokens(ids, 120, SamplingParams(), constraint=grammar.start())
    reply = parse_reply(model.tokenizer.decode(list(out), skip_special_tokens=True), tools=tools, fmt=fmt)
    assert model.last_stats.finish_reason == "stop"
    assert reply.tool_calls and reply.content == ""
    for call in reply.tool_calls:
        name = call["function"]["name"]
        assert name == choice or choice == "required"
        jsonschema.validate(json.loads(call["function"]["arguments"]), tools[name])


def test_auto_tool_choice_with_a_schema_gives_a_call_or_the_json(model):
    tools = check_tools(WEATHER)
    _, ids = chat_prompt(model, ask("Give me a person as JSON."), WEATHER)
    grammar = reply_grammar(model, response_format=PERSON_FORMAT, tools=tools, tool_choice="auto")
    out = model.tokenizer.decode(list(model.generate_tokens(ids, 200, constraint=grammar.start())),
                                 skip_special_tokens=True)
    reply = parse_reply(out, tools=tools)
    if not reply.tool_calls:
        jsonschema.validate(json.loads(reply.content), PERSON)
    # without a schema or a forced call there is nothing to constrain
    assert reply_grammar(model, tools=tools, tool_choice="auto") is None
    assert reply_grammar(model, tools=tools, tool_choice="none") is None


def follows(grammar, model, text):
    """How many tokens of text the grammar lets through, and whether it is then done."""
    constraint = grammar.start()
    ids = model.tokenizer.encode(text, add_special_tokens=False)
    for n, token in enumerate(ids):
        if constraint.mask(np.zeros(model.config.vocab_size, np.float32))[token] == -np.inf:
            return n, False
        constraint.accept(token)
    return len(ids), constraint.done


def test_llama3_json_calls_and_the_grammar_agree(model):
    tools = check_tools(WEATHER)
    grammar = reply_grammar(model, tools=tools, tool_choice="get_weather", fmt=LLAMA3_JSON)
    good = '{"name": "get_weather", "parameters": {"city": "Oslo", "unit": "celsius"}}'
    n, done = follows(grammar, model, good)
    assert done and n == len(model.tokenizer.encode(good, add_special_tokens=False))
    assert parse_reply(good, tools=tools, fmt=LLAMA3_JSON).tool_calls[0]["function"]["name"] == "get_weather"
    assert not follows(grammar, model, '{"name": "get_time", "parameters": {}}')[1]


@pytest.mark.slow
def test_qwen_token_bytes_add_up_to_the_text(tiny_qwen):
    tok = tiny_qwen("qwen3").tokenizer
    for text in TEXTS:
        ids = tok.encode(text, add_special_tokens=False)
        assert b"".join(token_bytes(tok, i) for i in ids) == text.encode()


@pytest.mark.slow
@pytest.mark.parametrize("kind, thinking, reply", [
    ("qwen3", None, "<think>\nParis, so weather.\n</think>\n\n<tool_call>\n"
                    '{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'),
    ("qwen3", False, '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'),
    ("qwen3.5", True, "Paris, so weather.\n</think>\n\n<tool_call>\n"
                      '{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'),
])
def test_qwen_tool_calls_after_reasoning(tiny_qwen, kind, thinking, reply):
    model = tiny_qwen(kind)
    tools = check_tools(WEATHER)
    kwargs = {} if thinking is None else {"enable_thinking": thinking}
    text, ids = chat_prompt(model, ask("Weather in Paris?"), WEATHER, **kwargs)
    template = model.tokenizer.chat_template
    mode = reasoning_mode(template, text)
    assert tool_format(template) is QWEN
    grammar = reply_grammar(model, tools=tools, tool_choice="required", reasoning=mode)
    n, _ = follows(grammar, model, reply)
    assert n == len(model.tokenizer.encode(reply, add_special_tokens=False))
    parsed = parse_reply(reply, tools=tools, reasoning=mode)
    assert parsed.reasoning == (None if mode is None else "Paris, so weather.\n")
    assert [c["function"]["arguments"] for c in parsed.tool_calls] == ['{"city": "Paris"}']
    # and the model itself, constrained, calls a tool (its reasoning bounded by max tokens)
    if mode is None:
        out = model.generate_tokens(ids, 60, constraint=grammar.start())
        got = parse_reply(model.tokenizer.decode(list(out), skip_special_tokens=True), tools=tools)
        assert model.last_stats.finish_reason == "stop" and got.tool_calls


@pytest.mark.slow
def test_constrained_requests_batched_equal_alone(model):
    prompts = [chat_prompt(model, ask(q))[1] for q in
               ("Give me a person as JSON.", "Name a sea animal.", "A person, please, in JSON.", "Hi!")]
    grammar = reply_grammar(model, response_format=PERSON_FORMAT)
    settings = [SamplingParams(), SamplingParams(temperature=0.9, seed=7)]
    for params in settings:
        alone = [list(model.generate_tokens(p, 60, params, constraint=grammar.start() if i % 2 == 0 else None))
                 for i, p in enumerate(prompts)]
        engine = BatchEngine(model, parallel=4, max_queue=8, prefill_chunk=16)
        try:
            requests = [engine.submit(p, 60, params, constraint=grammar.start() if i % 2 == 0 else None)
                        for i, p in enumerate(prompts)]
            assert [list(r) for r in requests] == alone
        finally:
            engine.close()
        for i in (0, 2):
            jsonschema.validate(json.loads(model.tokenizer.decode(alone[i], skip_special_tokens=True)), PERSON)
