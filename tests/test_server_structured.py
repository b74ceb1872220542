"""Structured output, tool calls and reasoning through fastllm serve and
OpenAI's own client: JSON and JSON Schema replies that parse and validate
(and pydantic's parse), tool-calling loops (call, tool result, answer) on
the default model and a Qwen-family one, streamed tool calls,
reasoning_content, and concurrent clients that each get their reply alone,
with and without a schema, on the default model's Q4_1 file."""
import json
from concurrent.futures import ThreadPoolExecutor

import pytest

openai = pytest.importorskip("openai")
pytest.importorskip("llguidance")
jsonschema = pytest.importorskip("jsonschema")
pydantic = pytest.importorskip("pydantic")

from fastllm import Model  # noqa: E402
from test_server import client, running  # noqa: E402

PERSON = {"type": "object", "additionalProperties": False, "required": ["name", "age", "pets"],
          "properties": {"name": {"type": "string", "maxLength": 20},
                         "age": {"type": "integer", "minimum": 0, "maximum": 150},
                         "pets": {"type": "array", "maxItems": 3, "items": {"enum": ["cat", "dog", "fish"]}}}}
PERSON_FORMAT = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}
TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "The current weather in a city",
    "parameters": {"type": "object", "required": ["city"],
                   "properties": {"city": {"enum": ["Paris", "Rome", "Oslo"]},
                                  "unit": {"enum": ["celsius", "fahrenheit"]}}}}}]


class Person(pydantic.BaseModel):
    name: str = pydantic.Field(max_length=20)
    age: int = pydantic.Field(ge=0, le=150)


@pytest.fixture(scope="module")
def model(fastllm_home):
    """The default model as `fastllm serve` runs it: its Q4_1 file, int8 activations."""
    return Model.from_pretrained(n_ctx=1024, threads=2)


@pytest.fixture(scope="module")
def server(model):
    with running(model, parallel=6) as (url, engine):
        yield url, engine


def ask(text):
    return [{"role": "user", "content": text}]


@pytest.mark.slow
def test_json_object_and_json_schema_replies_parse_and_validate(server):
    c = client(server[0])
    r = c.chat.completions.create(model="m", messages=ask("Reply with a JSON object with keys city and "
                                                         "country for Paris."),
                                  max_tokens=150, temperature=0, response_format={"type": "json_object"})
    assert r.choices[0].finish_reason == "stop"
    assert isinstance(json.loads(r.choices[0].message.content), dict)
    for seed in range(3):
        r = c.chat.completions.create(model="m", messages=ask("Give me a person as JSON."), max_tokens=200,
                                      temperature=1.0, seed=seed, response_format=PERSON_FORMAT)
        assert r.choices[0].finish_reason == "stop"
        jsonschema.validate(json.loads(r.choices[0].message.content), PERSON)
    # streamed: the same text
    pieces = c.chat.completions.create(model="m", messages=ask("Give me a person as JSON."), max_tokens=200,
                                       temperature=1.0, seed=0, response_format=PERSON_FORMAT, stream=True)
    streamed = "".join(p.choices[0].delta.content or "" for p in pieces if p.choices)
    r = c.chat.completions.create(model="m", messages=ask("Give me a person as JSON."), max_tokens=200,
                                  temperature=1.0, seed=0, response_format=PERSON_FORMAT)
    assert streamed == r.choices[0].message.content
    # completions take a response_format too
    r = c.completions.create(model="m", prompt="A person:", max_tokens=200, temperature=0,
                             extra_body={"response_format": PERSON_FORMAT})
    jsonschema.validate(json.loads(r.choices[0].text), PERSON)


def test_parse_with_a_pydantic_model(server):
    c = client(server[0])
    r = c.chat.completions.parse(model="m", messages=ask("Give me a person."), max_tokens=200,
                                 temperature=0, response_format=Person)
    person = r.choices[0].message.parsed
    assert isinstance(person, Person) and 0 <= person.age <= 150


@pytest.mark.parametrize("response_format, tools, tool_choice, param, message", [
    ({"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "foo"}}}, None, None,
     "response_format", "Invalid type: foo"),
    ({"type": "yaml"}, None, None, "response_format", "must be 'text', 'json_object' or 'json_schema'"),
    (None, TOOLS, {"type": "function", "function": {"name": "launch"}}, "tool_choice", "not among the tools"),
    (None, [{"type": "function", "function": {"name": "bad name"}}], None, "tools", "function.name"),
    (None, None, "required", "tool_choice", "needs 'tools'"),
])
def test_bad_formats_and_tools_are_400s_that_name_the_field(server, response_format, tools, tool_choice,
                                                            param, message):
    c = client(server[0])
    extra = {k: v for k, v in [("response_format", response_format), ("tools", tools),
                               ("tool_choice", tool_choice)] if v is not None}
    with pytest.raises(openai.BadRequestError) as e:
        c.chat.completions.create(model="m", messages=ask("hi"), max_tokens=5, extra_body=extra)
    assert e.value.body["param"] == param and message in e.value.body["message"]


def tool_loop(url, question, first_choice, **kw):
    """Call, tool result, final answer: returns (the first reply, the last)."""
    c = client(url)
    messages = ask(question)
    first = c.chat.completions.create(model="m", messages=messages, tools=TOOLS, tool_choice=first_choice,
                                      temperature=0, **kw)
    message = first.choices[0].message
    assert first.choices[0].finish_reason == "tool_calls"
    assert message.content is None and message.tool_calls
    call = message.tool_calls[0]
    assert call.type == "function" and call.id.startswith("call_") and call.function.name == "get_weather"
    args = json.loads(call.function.arguments)
    jsonschema.validate(args, TOOLS[0]["function"]["parameters"])
    messages += [message.model_dump(exclude_none=True),
                 {"role": "tool", "tool_call_id": call.id, "content": f"{args['city']}: sunny, 21 C"}]
    last = c.chat.completions.create(model="m", messages=messages, tools=TOOLS, tool_choice="none",
                                     temperature=0, **kw)
    assert last.choices[0].message.tool_calls is None
    assert isinstance(last.choices[0].message.content, str) and last.choices[0].message.content
    return first, last


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "get_weather"}}])
def test_a_tool_calling_loop_on_the_default_model(server, choice):
    # one call: with parallel calls allowed this small model calls again and again
    tool_loop(server[0], "What is the weather in Paris?", choice, max_tokens=60, parallel_tool_calls=False)


def test_streamed_tool_calls_equal_the_whole_reply(server):
    c = client(server[0])
    kw = dict(model="m", messages=ask("Weather in Rome and in Oslo?"), tools=TOOLS, tool_choice="required",
              temperature=0, max_tokens=80)
    whole = c.chat.completions.create(**kw).choices[0]
    calls, reasons, content = {}, [], ""
    for chunk in c.chat.completions.create(stream=True, **kw):
        for ch in chunk.choices:
            reasons.append(ch.finish_reason)
            content += ch.delta.content or ""
            for d in ch.delta.tool_calls or []:
                entry = calls.setdefault(d.index, {"id": d.id, "name": "", "arguments": ""})
                entry["name"] += d.function.name or ""
                entry["arguments"] += d.function.arguments or ""
    assert reasons[-1] == whole.finish_reason == "tool_calls" and content == ""
    assert [(v["name"], v["arguments"]) for _, v in sorted(calls.items())] == \
        [(t.function.name, t.function.arguments) for t in whole.message.tool_calls]


@pytest.fixture(scope="module")
def qwen_server(tiny_qwen):
    with running(tiny_qwen("qwen3.5"), parallel=2) as (url, engine):
        yield url, engine


@pytest.mark.slow
def test_a_tool_calling_loop_on_a_qwen_model(qwen_server):
    # the Qwen3.5 template renders the tools, the call and the tool result
    # itself; enable_thinking false closes the think block in the prompt
    first, last = tool_loop(qwen_server[0], "Weather in Oslo?", "required", max_tokens=40,
                            parallel_tool_calls=False, extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    assert first.choices[0].message.model_extra.get("reasoning_content") is None


@pytest.mark.slow
def test_reasoning_content_follows_chat_template_kwargs(qwen_server):
    c = client(qwen_server[0])
    kw = dict(model="m", messages=ask("hi"), max_tokens=12, temperature=0)
    thinking = c.chat.completions.create(extra_body={"chat_template_kwargs": {"enable_thinking": True}}, **kw)
    plain = c.chat.completions.create(extra_body={"chat_template_kwargs": {"enable_thinking": False}}, **kw)
    # the prompt opened <think>: the (random) model's reply is all reasoning, never closed
    reasoning = thinking.choices[0].message.model_extra["reasoning_content"]
    assert reasoning and thinking.choices[0].message.content == ""
    assert "reasoning_content" not in plain.choices[0].message.model_extra
    assert plain.choices[0].message.content
    streamed = "".join(getattr(ch.choices[0].delta, "reasoning_content", None) or "" for ch in c.chat.completions.create(
        stream=True, extra_body={"chat_template_kwargs": {"enable_thinking": True}}, **kw) if ch.choices)
    assert streamed == reasoning


@pytest.mark.slow
def test_concurrent_clients_each_get_their_reply_alone(model, server):
    """N clients at once, greedy and seeded, with and without a schema: each
    reply is exactly what the model gives that request alone."""
    prompts = [ask(q) for q in ("Give me a person as JSON.", "Name three sea animals.",
                                "A person, in JSON, please.", "What is the capital of France?",
                                "Describe a person as JSON.", "Say something kind.")]
    settings = [dict(temperature=0), dict(temperature=0.8, seed=11)]
    jobs = [(p, s, PERSON_FORMAT if i % 2 == 0 else None) for s in settings for i, p in enumerate(prompts)]
    c = client(server[0])

    def one(job):
        messages, sampling, fmt = job
        extra = {} if fmt is None else {"response_format": fmt}
        r = c.chat.completions.create(model="m", messages=messages, max_tokens=40, top_p=1, **sampling, **extra)
        return r.choices[0].message.content

    with ThreadPoolExecutor(len(prompts)) as pool:
        replies = list(pool.map(one, jobs))
    for (messages, sampling, fmt), reply in zip(jobs, replies):
        alone = model.chat(messages, 40, response_format=fmt, top_p=1, **sampling)
        assert reply == alone


@pytest.fixture(scope="module")
def mistral_server(tmp_path_factory):
    from oracles.tiny_chat_models import make_tiny_mistral_chat_model
    folder = make_tiny_mistral_chat_model(tmp_path_factory.mktemp("mistral_chat"))
    with running(Model.from_pretrained(folder, n_ctx=512, threads=2), parallel=2) as (url, engine):
        yield url, engine


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "get_weather"}}])
def test_a_tool_calling_loop_in_mistrals_format(mistral_server, choice):
    # The template renders [AVAILABLE_TOOLS], the [TOOL_CALLS]name[ARGS]
    # call and [TOOL_RESULTS] itself; the reply's markers are special tokens,
    # which the grammar asks for by id and the reply is decoded with.
    first, last = tool_loop(mistral_server[0], "Weather in Oslo?", choice, max_tokens=40,
                            parallel_tool_calls=False)
    assert last.choices[0].finish_reason in ("stop", "length")


def test_streamed_mistral_tool_calls_equal_the_whole_reply(mistral_server):
    c = client(mistral_server[0])
    kw = dict(model="m", messages=ask("Weather in Rome and in Oslo?"), tools=TOOLS, tool_choice="required",
              temperature=0, max_tokens=60)
    whole = c.chat.completions.create(**kw).choices[0]
    calls = {}
    for chunk in c.chat.completions.create(stream=True, **kw):
        for ch in chunk.choices:
            assert not ch.delta.content
            for d in ch.delta.tool_calls or []:
                entry = calls.setdefault(d.index, {"name": "", "arguments": ""})
                entry["name"] += d.function.name or ""
                entry["arguments"] += d.function.arguments or ""
    assert whole.finish_reason == "tool_calls" and whole.message.tool_calls
    assert [(v["name"], v["arguments"]) for _, v in sorted(calls.items())] == \
        [(t.function.name, t.function.arguments) for t in whole.message.tool_calls]


def test_mistral_markers_are_decoded_only_for_tool_calls(mistral_server):
    from fastllm.generate.textstream import TextStream
    tok = mistral_server[1].model.tokenizer
    ids = tok.encode('[TOOL_CALLS]get_weather[ARGS]{"city": "Rome"}', add_special_tokens=False)
    assert tok.id_to_token(ids[0]) == "[TOOL_CALLS]"

    def text_of(**kw):
        stream = TextStream(tok, **kw)
        return "".join(stream.feed(t) for t in ids + [None])
    assert text_of() == 'get_weather{"city": "Rome"}'
    assert text_of(keep=("[TOOL_CALLS]", "[ARGS]")) == '[TOOL_CALLS]get_weather[ARGS]{"city": "Rome"}'
