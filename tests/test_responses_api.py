"""OpenAI's Responses API through fastllm serve and OpenAI's own client
(client.responses): replies (whole and streamed) equal to the model's chat
reply to the same conversation, the stream's events, a function-calling
loop, previous_response_id (equal to sending the whole conversation), its
bounded store, structured output by text.format, and errors."""
import json
import urllib.request

import pytest

openai = pytest.importorskip("openai")
pytest.importorskip("llguidance")
jsonschema = pytest.importorskip("jsonschema")

from fastllm import SamplingParams  # noqa: E402
from fastllm.serve.openai_api import APIError  # noqa: E402
from fastllm.serve.responses_api import ResponseStore, input_messages  # noqa: E402
from served_models import model, qwen_server, server  # noqa: E402,F401 (fixtures)
from test_server import client  # noqa: E402

GREEDY = SamplingParams(temperature=0)
WEATHER = {"type": "function", "name": "get_weather", "description": "The current weather in a city",
           "parameters": {"type": "object", "required": ["city"], "additionalProperties": False,
                          "properties": {"city": {"enum": ["Paris", "Rome", "Oslo"]}}}}


def test_a_reply_whole_and_streamed_is_the_models_chat_reply(model, server):
    c = client(server[0])
    chat = [{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": "Name a fruit."}]
    want = model.chat(chat, 16, sampling=GREEDY)
    r = c.responses.create(model="smollm2", instructions="Answer briefly.", input="Name a fruit.",
                           max_output_tokens=16, temperature=0)
    assert r.id.startswith("resp_") and r.object == "response" and r.model == "smollm2"
    assert r.output_text == want and r.output[0].type == "message" and r.output[0].id.startswith("msg_")
    assert r.status in ("completed", "incomplete") and r.usage.output_tokens <= 16
    assert r.usage.input_tokens == len(model.tokenizer.encode(
        model.tokenizer.apply_chat_template(chat, add_generation_prompt=True), add_special_tokens=False))
    events = list(c.responses.create(model="smollm2", instructions="Answer briefly.", input=[
        {"role": "user", "content": [{"type": "input_text", "text": "Name a fruit."}]}],
        max_output_tokens=16, temperature=0, stream=True))
    kinds = [e.type for e in events]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert kinds[-4:-1] == ["response.output_text.done", "response.content_part.done", "response.output_item.done"]
    assert kinds[-1] == "response.completed" if r.status == "completed" else "response.incomplete"
    assert [e.sequence_number for e in events] == list(range(len(events)))
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == want == events[-1].response.output_text
    item_id = events[2].item.id
    assert all(e.item_id == item_id for e in events if hasattr(e, "item_id"))


@pytest.mark.slow
def test_a_function_calling_loop(model, server):
    c = client(server[0])
    first = c.responses.create(model="m", input="What is the weather in Paris?", tools=[WEATHER],
                               tool_choice="required", parallel_tool_calls=False, temperature=0,
                               max_output_tokens=60)
    calls = [o for o in first.output if o.type == "function_call"]
    assert len(calls) == 1 and calls[0].name == "get_weather" and calls[0].call_id.startswith("call_")
    args = json.loads(calls[0].arguments)
    jsonschema.validate(args, WEATHER["parameters"])
    # the loop as a client without a server-side store writes it: all items sent again
    again = [{"role": "user", "content": "What is the weather in Paris?"}, calls[0].model_dump(exclude_none=True),
             {"type": "function_call_output", "call_id": calls[0].call_id, "output": f"{args['city']}: sunny"}]
    last = c.responses.create(model="m", input=again, tools=[WEATHER], tool_choice="none", temperature=0,
                              max_output_tokens=20)
    assert [o.type for o in last.output] == ["message"] and last.output_text
    # and with previous_response_id: the same reply
    chained = c.responses.create(model="m", previous_response_id=first.id, input=again[2:], tools=[WEATHER],
                                 tool_choice="none", temperature=0, max_output_tokens=20)
    assert chained.output_text == last.output_text and chained.previous_response_id == first.id
    streamed = list(c.responses.create(model="m", input="Weather in Oslo?", tools=[WEATHER], tool_choice="required",
                                       parallel_tool_calls=False, temperature=0, max_output_tokens=60, stream=True))
    done = [e for e in streamed if e.type == "response.function_call_arguments.done"]
    deltas = "".join(e.delta for e in streamed if e.type == "response.function_call_arguments.delta")
    assert len(done) == 1 and done[0].arguments == deltas and done[0].name == "get_weather"
    assert streamed[-1].response.output[-1].arguments == deltas


def test_previous_response_id_continues_the_conversation(model, server):
    c = client(server[0])
    first = c.responses.create(model="m", instructions="Be brief.", input="Name a fruit.", max_output_tokens=12,
                               temperature=0)
    second = c.responses.create(model="m", previous_response_id=first.id, input="And a vegetable?",
                                max_output_tokens=12, temperature=0)
    # instructions do not carry over, the earlier turns do
    chat = [{"role": "user", "content": "Name a fruit."}, {"role": "assistant", "content": first.output_text},
            {"role": "user", "content": "And a vegetable?"}]
    assert second.output_text == model.chat(chat, 12, sampling=GREEDY)
    assert c.responses.retrieve(second.id).output_text == second.output_text
    assert c.responses.delete(second.id) is None
    for rid in (second.id, "resp_nothing"):
        with pytest.raises(openai.BadRequestError) as e:
            c.responses.create(model="m", previous_response_id=rid, input="x", max_output_tokens=2)
        assert e.value.body["code"] == "previous_response_not_found"
        assert e.value.body["param"] == "previous_response_id"
    with pytest.raises(openai.NotFoundError):
        c.responses.retrieve(second.id)
    unkept = c.responses.create(model="m", input="hi", max_output_tokens=2, store=False)
    with pytest.raises(openai.BadRequestError):
        c.responses.create(model="m", previous_response_id=unkept.id, input="x", max_output_tokens=2)


def test_the_store_is_bounded_least_recently_used_first():
    store = ResponseStore(max_items=3, max_chars=2000)
    for i in range(4):
        store.put(f"r{i}", [{"role": "user", "content": str(i)}], {"id": f"r{i}"})
    with pytest.raises(APIError, match="not found"):
        store.messages("r0")
    store.messages("r1")                          # r1 used: r2 goes next
    store.put("r4", [], {"id": "r4"})
    assert len(store) == 3 and store.get("r1")["id"] == "r1"
    with pytest.raises(APIError):
        store.get("r2")
    store.put("big", [{"role": "user", "content": "x" * 1900}], {"id": "big"})   # the others make room
    assert store.messages("big") and len(store) < 3 and store._chars <= store.max_chars
    with pytest.raises(APIError):
        store.get("r3")                           # the least recently used went first
    store.put("huge", [{"role": "user", "content": "x" * 5000}], {"id": "huge"})   # larger than the bound
    with pytest.raises(APIError):
        store.messages("huge")


def test_text_format_gives_json_that_follows_the_schema(server):
    c = client(server[0])
    schema = {"type": "object", "additionalProperties": False, "required": ["city", "country"],
              "properties": {"city": {"type": "string", "maxLength": 20}, "country": {"type": "string",
                                                                                     "maxLength": 20}}}
    r = c.responses.create(model="m", input="Paris as JSON with city and country.", temperature=0,
                           max_output_tokens=80,
                           text={"format": {"type": "json_schema", "name": "place", "schema": schema, "strict": True}})
    assert r.status == "completed"
    jsonschema.validate(json.loads(r.output_text), schema)
    assert r.text.format.type == "json_schema"


def test_input_items_become_the_conversation():
    assert input_messages([
        {"role": "user", "content": "q"},
        {"type": "reasoning", "id": "rs_1", "summary": [], "content": [{"type": "reasoning_text", "text": "Hmm."}]},
        {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},
        {"type": "function_call", "call_id": "c2", "name": "g", "arguments": "{\"a\": 1}"},
        {"type": "function_call_output", "call_id": "c1", "output": "one"},
        {"type": "function_call_output", "call_id": "c2", "output": [{"type": "input_text", "text": "two"}]},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Done."}]}]) == [
        {"role": "user", "content": "q"},
        {"role": "assistant", "content": "", "reasoning_content": "Hmm.", "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}},
            {"id": "c2", "type": "function", "function": {"name": "g", "arguments": "{\"a\": 1}"}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "one"},
        {"role": "tool", "tool_call_id": "c2", "content": "two"},
        {"role": "assistant", "content": "Done."}]


@pytest.mark.parametrize("body, param, message", [
    ({"input": []}, "input", "non-empty array"),
    ({"input": [{"type": "web_search_call", "id": "x"}]}, "input", "input items may be"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "data:"}]}]}, "input",
     "reads text only"),
    ({"input": "x", "tools": [{"type": "web_search"}]}, "tools", "only function tools"),
    ({"input": "x", "text": {"format": {"type": "yaml"}}}, "text", "'text.format' must be"),
    ({"input": "x", "background": True}, "background", "not supported"),
    ({"input": "x", "max_output_tokens": 0}, "max_output_tokens", "must be an integer >= 1"),
    ({"input": "x", "previous_response_id": 7}, "previous_response_id", "must be a string"),
])
def test_bad_requests_are_400s_that_name_the_field(server, body, param, message):
    request = urllib.request.Request(server[0] + "/responses", json.dumps({"model": "m", **body}).encode(),
                                     {"content-type": "application/json"})
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(request, timeout=60)
    assert e.value.code == 400
    error = json.loads(e.value.read())["error"]
    assert error["param"] == param and message in error["message"]


@pytest.mark.slow
def test_a_function_calling_loop_and_reasoning_on_a_qwen_model(qwen_server, tiny_qwen):
    c = client(qwen_server[0])
    # reasoning.effort "none" closes the think block in the prompt; the
    # Qwen3.5 template renders the tools, the call and its output itself
    kw = dict(model="m", tools=[WEATHER], temperature=0, reasoning={"effort": "none"})
    first = c.responses.create(input="Weather in Oslo?", tool_choice="required", parallel_tool_calls=False,
                               max_output_tokens=40, **kw)
    assert [o.type for o in first.output] == ["function_call"]
    call = first.output[0]
    jsonschema.validate(json.loads(call.arguments), WEATHER["parameters"])
    last = c.responses.create(previous_response_id=first.id, tool_choice="none", max_output_tokens=12, input=[
        {"type": "function_call_output", "call_id": call.call_id, "output": "sunny"}], **kw)
    assert [o.type for o in last.output] == ["message"]
    # thinking on (any other effort): the prompt opened <think>, and the (random) model's reply is all reasoning
    model = tiny_qwen("qwen3.5")
    want = model.chat([{"role": "user", "content": "hi"}], 10, sampling=GREEDY,
                      template_kwargs={"enable_thinking": True})
    r = c.responses.create(model="m", input="hi", max_output_tokens=10, temperature=0, reasoning={"effort": "high"})
    assert r.output[0].type == "reasoning" and r.output[0].content[0].text == want.lstrip("\n")
    events = list(c.responses.create(model="m", input="hi", max_output_tokens=10, temperature=0, stream=True,
                                     reasoning={"effort": "high"}))
    streamed = "".join(e.delta for e in events if e.type == "response.reasoning_text.delta")
    assert streamed == r.output[0].content[0].text
