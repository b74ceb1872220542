"""Anthropic's Messages API through fastllm serve and Anthropic's own Python
client: replies (whole and streamed) equal to the model's chat reply to the
same conversation, stop sequences, max_tokens, count_tokens, tool loops
(tool_use, tool_result, answer) on the default model and a Qwen-family
one, thinking blocks, errors in Anthropic's shape, and x-api-key."""
import json
import urllib.request

import pytest

anthropic = pytest.importorskip("anthropic")
pytest.importorskip("llguidance")
jsonschema = pytest.importorskip("jsonschema")

from fastllm import SamplingParams  # noqa: E402
from fastllm.serve.anthropic_api import chat_body  # noqa: E402
from fastllm.serve.openai_api import APIError  # noqa: E402
from served_models import model, qwen_server, server  # noqa: E402,F401 (fixtures)
from test_server import running  # noqa: E402

GREEDY = SamplingParams(temperature=0)
# Anthropic's client has no temperature any more: clients that set it send it as an extra field.
T0 = {"temperature": 0}
WEATHER = {"name": "get_weather", "description": "The current weather in a city",
           "input_schema": {"type": "object", "required": ["city"],
                            "properties": {"city": {"enum": ["Paris", "Rome", "Oslo"]}}}}


def client(url, **kw):
    return anthropic.Anthropic(base_url=url.removesuffix("/v1"), api_key=kw.pop("api_key", "none"),
                               max_retries=0, timeout=120, **kw)


CONVERSATION = [{"role": "user", "content": "Name a fruit."},
                {"role": "assistant", "content": [{"type": "text", "text": "An apple."}]},
                {"role": "user", "content": [{"type": "text", "text": "And a"}, {"type": "text", "text": "vegetable?"}]}]
AS_CHAT = [{"role": "system", "content": "Answer in one word."}, {"role": "user", "content": "Name a fruit."},
           {"role": "assistant", "content": "An apple."}, {"role": "user", "content": "And a\nvegetable?"}]


def test_a_reply_whole_and_streamed_is_the_models_chat_reply(model, server):
    c = client(server[0])
    want = model.chat(AS_CHAT, 20, sampling=GREEDY)
    r = c.messages.create(model="smollm2", max_tokens=20, extra_body=T0, system="Answer in one word.",
                          messages=CONVERSATION)
    assert r.type == "message" and r.role == "assistant" and r.model == "smollm2"
    assert r.id.startswith("msg_")
    assert [b.type for b in r.content] == ["text"] and r.content[0].text == want
    assert r.stop_reason in ("end_turn", "max_tokens") and r.stop_sequence is None
    assert r.usage.output_tokens <= 20 and r.usage.input_tokens > 10
    with c.messages.stream(model="smollm2", max_tokens=20, extra_body=T0,
                           system=[{"type": "text", "text": "Answer in one word."}], messages=CONVERSATION) as s:
        pieces = list(s.text_stream)
        final = s.get_final_message()
    assert "".join(pieces) == want == final.content[0].text
    assert final.stop_reason == r.stop_reason and final.usage.output_tokens == r.usage.output_tokens


def test_the_stream_is_anthropics_sequence_of_events(server):
    # read raw: the client leaves out the ping
    body = {"model": "m", "max_tokens": 8, "temperature": 0, "stream": True,
            "messages": [{"role": "user", "content": "Hi"}]}
    request = urllib.request.Request(server[0] + "/messages", json.dumps(body).encode(),
                                     {"content-type": "application/json"})
    with urllib.request.urlopen(request, timeout=60) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        raw = r.read().decode()
    events = []
    for block in raw.split("\n\n")[:-1]:
        kind, data = block.split("\n")
        assert kind.startswith("event: ") and data.startswith("data: ")
        events.append(json.loads(data[6:]))
        assert events[-1]["type"] == kind[7:]
    kinds = [e["type"] for e in events]
    assert kinds[:3] == ["message_start", "ping", "content_block_start"]
    assert kinds[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    assert set(kinds[3:-3]) == {"content_block_delta"}
    assert events[0]["message"]["content"] == [] and events[0]["message"]["usage"]["input_tokens"] > 0
    assert events[-2]["delta"]["stop_reason"] == "max_tokens" and events[-2]["usage"]["output_tokens"] == 8


def test_stop_sequences_and_max_tokens(model, server):
    c = client(server[0])
    messages = [{"role": "user", "content": "Count from one to ten in words, separated by commas."}]
    full = model.chat([{"role": "user", "content": messages[0]["content"]}], 30, sampling=GREEDY)
    stop = full.split(",")[1] if "," in full else full[3:6]
    r = c.messages.create(model="m", max_tokens=30, extra_body=T0, messages=messages, stop_sequences=[stop])
    assert r.stop_reason == "stop_sequence" and r.stop_sequence == stop
    assert r.content[0].text == full[:full.index(stop)]
    r = c.messages.create(model="m", max_tokens=3, extra_body=T0, messages=messages)
    assert r.stop_reason == "max_tokens" and r.usage.output_tokens == 3


def test_count_tokens_is_the_rendered_prompts_length(model, server):
    c = client(server[0])
    got = c.messages.count_tokens(model="m", system="Answer in one word.", messages=CONVERSATION)
    prompt = model.tokenizer.apply_chat_template(AS_CHAT, add_generation_prompt=True)
    assert got.input_tokens == len(model.tokenizer.encode(prompt, add_special_tokens=False))
    with_tools = c.messages.count_tokens(model="m", messages=CONVERSATION, tools=[WEATHER])
    assert with_tools.input_tokens > got.input_tokens


def tool_loop(url, choice, **kw):
    """tool_use, tool_result, answer: returns (the first reply, the last)."""
    c = client(url)
    messages = [{"role": "user", "content": "What is the weather in Paris?"}]
    first = c.messages.create(model="m", max_tokens=60, extra_body=T0, messages=messages, tools=[WEATHER],
                              tool_choice=choice, **kw)
    assert first.stop_reason == "tool_use"
    call = [b for b in first.content if b.type == "tool_use"][0]
    assert call.name == "get_weather" and call.id.startswith("toolu_")
    jsonschema.validate(call.input, WEATHER["input_schema"])
    messages += [{"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in first.content]},
                 {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call.id,
                                               "content": f"{call.input['city']}: sunny, 21 C"}]}]
    last = c.messages.create(model="m", max_tokens=30, extra_body=T0, messages=messages, tools=[WEATHER],
                             tool_choice={"type": "none"}, **kw)
    assert last.stop_reason in ("end_turn", "max_tokens")
    assert [b.type for b in last.content] == ["text"] and last.content[0].text
    return first, last


@pytest.mark.parametrize("choice", [{"type": "any", "disable_parallel_tool_use": True},
                                    {"type": "tool", "name": "get_weather", "disable_parallel_tool_use": True}])
def test_a_tool_loop_on_the_default_model(server, choice):
    tool_loop(server[0], choice)


def test_a_streamed_tool_call_is_the_whole_ones(server):
    c = client(server[0])
    kw = dict(model="m", max_tokens=60, extra_body=T0, tools=[WEATHER],
              tool_choice={"type": "any", "disable_parallel_tool_use": True},
              messages=[{"role": "user", "content": "Weather in Rome?"}])
    whole = c.messages.create(**kw)
    with c.messages.stream(**kw) as s:
        kinds = [e.type for e in s]
        final = s.get_final_message()
    assert "content_block_start" in kinds and final.stop_reason == whole.stop_reason == "tool_use"
    assert [(b.name, b.input) for b in final.content if b.type == "tool_use"] == \
        [(b.name, b.input) for b in whole.content if b.type == "tool_use"]


@pytest.mark.slow
def test_a_tool_loop_and_thinking_on_a_qwen_model(qwen_server, tiny_qwen):
    # the Qwen3.5 template renders the tools, the tool_use and the tool_result itself
    first, _ = tool_loop(qwen_server[0], {"type": "any"}, thinking={"type": "disabled"})
    assert [b.type for b in first.content if b.type != "tool_use"] == []
    c = client(qwen_server[0])
    kw = dict(model="m", max_tokens=12, extra_body=T0, thinking={"type": "enabled", "budget_tokens": 1024},
              messages=[{"role": "user", "content": "hi"}])
    r = c.messages.create(**kw)
    # the prompt opened <think>: the (random) model's reply is all thinking, never closed
    model = tiny_qwen("qwen3.5")
    want = model.chat([{"role": "user", "content": "hi"}], 12, sampling=GREEDY,
                      template_kwargs={"enable_thinking": True})
    assert r.content[0].type == "thinking" and r.content[0].thinking == want.lstrip("\n")
    with c.messages.stream(**kw) as s:
        final = s.get_final_message()
    assert final.content[0].thinking == r.content[0].thinking
    # thinking blocks of earlier turns reach the template as reasoning_content
    body = chat_body({"max_tokens": 5, "messages": [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": [{"type": "thinking", "thinking": "Hmm.", "signature": ""},
                                          {"type": "text", "text": "Hello."}]},
        {"role": "user", "content": "bye"}]})
    assert body["messages"][1] == {"role": "assistant", "content": "Hello.", "reasoning_content": "Hmm."}


@pytest.mark.parametrize("body, message", [
    ({"messages": [{"role": "user", "content": "hi"}]}, "'max_tokens' is required"),
    ({"max_tokens": 5, "messages": []}, "'messages' must be a non-empty array"),
    ({"max_tokens": 5, "messages": [{"role": "system", "content": "x"}]}, "role 'user' or 'assistant'"),
    ({"max_tokens": 5, "temperature": 1.5, "messages": [{"role": "user", "content": "x"}]},
     "'temperature' must be a number from 0 to 1"),
    ({"max_tokens": 5, "messages": [{"role": "user", "content": [
        {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AAAA"}}]}]},
     "this model reads text only"),
    ({"max_tokens": 5, "tools": [{"type": "web_search_20250305", "name": "web_search"}],
      "messages": [{"role": "user", "content": "x"}]}, "server tool"),
    ({"max_tokens": 5, "tool_choice": {"type": "tool", "name": "nope"}, "tools": [WEATHER],
      "messages": [{"role": "user", "content": "x"}]}, "not among the tools"),
    ({"max_tokens": 5, "stop_sequences": [""], "messages": [{"role": "user", "content": "x"}]},
     "'stop_sequences' strings must have"),
    ({"max_tokens": 5, "messages": [{"role": "assistant", "content": [{"type": "tool_use", "id": 5}]}]},
     "tool_use block"),
])
def test_bad_requests_are_400s_in_anthropics_shape(server, body, message):
    c = client(server[0])
    with pytest.raises(anthropic.BadRequestError) as e:
        c.post("/v1/messages", body={"model": "m", **body}, cast_to=object)
    assert e.value.status_code == 400 and e.value.body["type"] == "error"
    assert e.value.body["error"]["type"] == "invalid_request_error" and message in e.value.body["error"]["message"]


def test_x_api_key_and_a_bearer_token_are_both_keys(model):
    with running(model, parallel=1, api_key="sekret") as (url, _):
        ask = dict(model="m", max_tokens=2, messages=[{"role": "user", "content": "hi"}])
        assert client(url, api_key="sekret").messages.create(**ask).content
        assert client(url, api_key=None, auth_token="sekret").messages.create(**ask).content
        with pytest.raises(anthropic.AuthenticationError) as e:
            client(url, api_key="wrong").messages.create(**ask)
        assert e.value.body["error"]["type"] == "authentication_error"


def test_the_chat_body_a_tool_result_turn_makes():
    body = chat_body({"max_tokens": 5, "messages": [
        {"role": "assistant", "content": [{"type": "text", "text": "Let me look."},
                                          {"type": "tool_use", "id": "t1", "name": "f", "input": {"a": 1}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "is_error": True,
                                      "content": [{"type": "text", "text": "no such file"}]},
                                     {"type": "text", "text": "Try again."}]}],
        "tool_choice": {"type": "auto", "disable_parallel_tool_use": True}})
    assert body["messages"] == [
        {"role": "assistant", "content": "Let me look.",
         "tool_calls": [{"id": "t1", "type": "function", "function": {"name": "f", "arguments": {"a": 1}}}]},
        {"role": "tool", "tool_call_id": "t1", "content": "Error: no such file"},
        {"role": "user", "content": "Try again."}]
    assert body["tool_choice"] == "auto" and body["parallel_tool_calls"] is False
    with pytest.raises(APIError, match="thinking"):
        chat_body({"max_tokens": 5, "thinking": {"type": "sometimes"}, "messages": [{"role": "user", "content": "x"}]})
    assert json.dumps(body)   # plain JSON, as openai_api.parse_request takes
