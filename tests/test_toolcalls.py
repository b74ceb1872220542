"""Tool calls and reasoning read from a reply's text (fastllm.generate.toolcalls):
whole, and streamed in pieces, which must add up to the same reply."""
import json
import random

import pytest

from fastllm.tokenizer.chat_template import render_chat
from fastllm.generate.toolcalls import (LLAMA3_JSON, MISTRAL, MISTRAL_LIST, QWEN, ReplyStream,
                                        check_tool_choice, check_tools, gather, messages_for_template,
                                        parse_reply, reasoning_mode, tool_format)
from oracles.qwen_tokenizers import QWEN3_CHAT_TEMPLATE, QWEN35_CHAT_TEMPLATE

TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                            "parameters": {"type": "object",
                                                           "properties": {"city": {"type": "string"}},
                                                           "required": ["city"]}}},
         {"type": "function", "function": {"name": "now"}}]
NAMES = check_tools(TOOLS)
SMOLLM2_TEMPLATE = ("{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
                    "{{ '<|im_start|>system\nYou are a helpful AI assistant<|im_end|>\n' }}{% endif %}"
                    "{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}"
                    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
LLAMA31_SNIPPET = ('{{- "<|start_header_id|>assistant<|end_header_id|>\\n\\n" }}{%- if tools %}'
                   '{{- \'{"name": "\' + tool_call.name + \'", "parameters": \' }}{{- "<|python_tag|>" }}'
                   '{%- endif %}')


def plain(reply):
    """reply without the random call ids."""
    calls = [{k: v for k, v in c.items() if k != "id"} for c in reply.tool_calls]
    return reply.content, reply.reasoning, calls


def streamed(text, pieces, **options):
    """The reply of text fed in pieces cut at random places."""
    rng = random.Random(pieces)
    cuts = sorted(rng.sample(range(1, len(text)), min(pieces, len(text) - 1))) if len(text) > 1 else []
    stream = ReplyStream(**options)
    deltas = []
    for a, b in zip([0] + cuts, cuts + [len(text)]):
        deltas += stream.feed(text[a:b])
    return gather(deltas + stream.close())


def call(name, args):
    return {"type": "function", "function": {"name": name, "arguments": json.dumps(args)}}


QWEN_CASES = [
    # (reply text, content, [calls])
    ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>',
     "", [call("get_weather", {"city": "Paris"})]),
    ('Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
     '<tool_call>\n{"name": "now", "arguments": {}}\n</tool_call>',
     "Let me look.", [call("get_weather", {"city": "Paris"}), call("now", {})]),
    # arguments given as a JSON string are read as JSON
    ('<tool_call>{"name": "get_weather", "arguments": "{\\"city\\": \\"Rome\\"}"}</tool_call>',
     "", [call("get_weather", {"city": "Rome"})]),
    # not a call of a tool, or not JSON: the text stays content
    ('<tool_call>\n{"name": "launch", "arguments": {}}\n</tool_call>',
     '<tool_call>\n{"name": "launch", "arguments": {}}\n</tool_call>', []),
    ("<tool_call>\n{not json}\n</tool_call> ok", "<tool_call>\n{not json}\n</tool_call> ok", []),
    # a call the reply ended before closing is still read
    ('<tool_call>\n{"name": "now", "arguments": {}}', "", [call("now", {})]),
    ("Plain text with a < sign and <tool but no call.", "Plain text with a < sign and <tool but no call.", []),
    ("trailing <tool_c", "trailing <tool_c", []),
    ("", "", []),
]


def test_calls_have_ids_and_indexes_in_order():
    stream = ReplyStream(tools=NAMES)
    deltas = stream.feed('<tool_call>{"name": "now", "arguments": {}}</tool_call>\n'
                         '<tool_call>{"name": "now", "arguments": {}}</tool_call>') + stream.close()
    assert [d.index for d in deltas] == [0, 0, 1, 1]   # each call opened, then its arguments
    ids = [d.call["id"] for d in deltas if "id" in d.call]
    assert len(set(ids)) == 2 and all(i.startswith("call_") for i in ids)


def test_arguments_stream_as_openai_sends_them():
    """A call goes out once its name is read, with empty arguments, and its
    arguments follow in pieces as they come; their pieces add up to them."""
    stream = ReplyStream(tools=NAMES)
    assert stream.feed('<tool_call>\n{"name": "get_wea') == []
    opened = stream.feed('ther", "arguments": {"ci')
    assert opened[0].call["function"] == {"name": "get_weather", "arguments": ""} and opened[0].index == 0
    assert [d.call for d in opened[1:]] == [{"function": {"arguments": '{"ci'}}]
    more = stream.feed('ty": "Paris"}}\n</tool_call>') + stream.close()
    assert [d.call for d in more] == [{"function": {"arguments": 'ty": "Paris"}'}}]
    assert stream.called
    # the same through the server's stream chunks: OpenAI's shape, index first
    from fastllm.serve import openai_api as api
    g = api.Generation(True, [1], 5, [None], [], None, None, reply={"reasoning": None, "tools": NAMES, "fmt": QWEN})
    chunks = api.delta_choices(g, 0, opened + more)
    assert chunks[0]["delta"]["tool_calls"][0]["function"] == {"name": "get_weather", "arguments": ""}
    assert chunks[1]["delta"] == {"tool_calls": [{"index": 0, "function": {"arguments": '{"ci'}}]}


BARE_CASES = [
    # Qwen2.5's bare calls under tool_choice "auto": a JSON object, or one in a ```json fence
    ('{"name": "get_weather", "arguments": {"city": "Istanbul"}}', "", [call("get_weather", {"city": "Istanbul"})]),
    ('```json\n{\n  "name": "get_weather",\n  "arguments": {\n    "city": "Oslo"\n  }\n}\n```', "",
     [{"type": "function", "function": {"name": "get_weather",
                                        "arguments": '{\n    "city": "Oslo"\n  }'}}]),
    ('{"name": "now", "arguments": {}}\n{"name": "get_weather", "arguments": {"city": "Rome"}}', "",
     [call("now", {}), call("get_weather", {"city": "Rome"})]),
    # arguments first: read once the object is whole
    ('{"arguments": {"city": "Rome"}, "name": "get_weather"}', "", [call("get_weather", {"city": "Rome"})]),
    # JSON that is no call, a fence of something else, a call inside text: content
    ('{"answer": 42}', '{"answer": 42}', []),
    ('{"name": "launch", "arguments": {}}', '{"name": "launch", "arguments": {}}', []),
    ("```python\nprint(1)\n```", "```python\nprint(1)\n```", []),
    ('Sure: {"name": "now", "arguments": {}}', 'Sure: {"name": "now", "arguments": {}}', []),
    ("{not json", "{not json", []),
]


XML_TOOLS = check_tools(TOOLS + [{"type": "function", "function": {
    "name": "plot", "parameters": {"type": "object", "properties": {
        "points": {"type": "array"}, "scale": {"type": "number"}, "title": {"type": "string"},
        "log": {"type": "boolean"}}}}}])
XML_CASES = [
    # Qwen3.5's (Qwen3-Coder's) form
    ("<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n</function>\n</tool_call>",
     "", [call("get_weather", {"city": "Paris"})]),
    # values typed by the schema: JSON where it says so, text where it says string
    ("<tool_call>\n<function=plot>\n<parameter=points>\n[1, 2.5]\n</parameter>\n<parameter=scale>\n2\n"
     "</parameter>\n<parameter=title>\n42\n</parameter>\n<parameter=log>\ntrue\n</parameter>\n</function>\n"
     "</tool_call>", "", [call("plot", {"points": [1, 2.5], "scale": 2, "title": "42", "log": True})]),
    ("Checking.\n<tool_call>\n<function=now>\n</function>\n</tool_call>\n<tool_call>\n<function=get_weather>\n"
     "<parameter=city>\nSão Paulo\n</parameter>\n</function>\n</tool_call>",
     "Checking.", [call("now", {}), {"type": "function", "function": {"name": "get_weather",
                                                                       "arguments": '{"city": "São Paulo"}'}}]),
    # a function that is not a tool: content
    ("<tool_call>\n<function=launch>\n</function>\n</tool_call>",
     "<tool_call>\n<function=launch>\n</function>\n</tool_call>", []),
]


@pytest.mark.parametrize("tools, text, content, calls", [(NAMES, *c) for c in QWEN_CASES + BARE_CASES] +
                         [(XML_TOOLS, *c) for c in XML_CASES])
def test_qwen_tool_calls_whole_and_streamed(tools, text, content, calls):
    """<tool_call> with JSON or Qwen3.5's XML inside, and bare calls."""
    want = (content, None, calls)
    assert plain(parse_reply(text, tools=tools)) == want
    for pieces in (1, 3, 17, len(text)):
        assert plain(streamed(text, pieces, tools=tools)) == want, pieces


def test_text_that_may_begin_a_call_is_held_back_and_no_more():
    stream = ReplyStream(tools=NAMES)
    # (the space waits too: whitespace before a call is dropped)
    assert [d.text for d in stream.feed("Hello <tool")] == ["Hello"]
    assert stream.feed("_c") == []
    # it was not a call after all: given out at once
    assert [d.text for d in stream.feed("ar")] == [" <tool_car"]
    assert stream.feed("<tool_call>") == []
    deltas = stream.feed('{"name": "now", "arguments": {}}</tool_call>')
    assert [(d.kind, d.call["function"]) for d in deltas] == [("tool_call", {"name": "now", "arguments": ""}),
                                                               ("tool_call", {"arguments": "{}"})]


def test_without_tools_the_text_is_content_as_it_is():
    text = '<tool_call>\n{"name": "now", "arguments": {}}\n</tool_call>'
    assert plain(parse_reply(text)) == (text, None, [])


LLAMA_CASES = [
    ('{"name": "get_weather", "parameters": {"city": "Paris"}}', "", [call("get_weather", {"city": "Paris"})]),
    (' {"name": "now", "parameters": {}}; {"name": "get_weather", "parameters": {"city": "Oslo"}}',
     "", [call("now", {}), call("get_weather", {"city": "Oslo"})]),
    ("It is sunny.", "It is sunny.", []),
    ('{"answer": 42}', '{"answer": 42}', []),
    # once its name and arguments are read it is a call, and what follows it is content
    ('{"name": "get_weather", "parameters": {"city": "Paris"}} and more',
     " and more", [call("get_weather", {"city": "Paris"})]),
]


@pytest.mark.parametrize("text, content, calls", LLAMA_CASES)
def test_llama3_json_tool_calls_whole_and_streamed(text, content, calls):
    want = (content, None, calls)
    assert plain(parse_reply(text, tools=NAMES, fmt=LLAMA3_JSON)) == want
    for pieces in (1, 4, len(text)):
        assert plain(streamed(text, pieces, tools=NAMES, fmt=LLAMA3_JSON)) == want


def test_llama3_plain_text_streams_at_once():
    stream = ReplyStream(tools=NAMES, fmt=LLAMA3_JSON)
    assert [d.text for d in stream.feed("It is")] == ["It is"]


MISTRAL_CASES = [
    # Ministral 3's: [TOOL_CALLS]name[ARGS]arguments, once per call
    ('[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}', "", [call("get_weather", {"city": "Paris"})]),
    ('Checking.[TOOL_CALLS]get_weather[ARGS]{"city": "Zürich"}[TOOL_CALLS]now[ARGS] {}',
     "Checking.", [{"type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Zürich"}'}},
                   call("now", {})]),
    ('[TOOL_CALLS]now[ARGS]{} and then text', " and then text", [call("now", {})]),
    # not a call of a tool, a name that cannot be one: content
    ('[TOOL_CALLS]launch[ARGS]{}', '[TOOL_CALLS]launch[ARGS]{}', []),
    ('a [TOOL_CALLS]hello world', 'a [TOOL_CALLS]hello world', []),
    # arguments the reply ended in (max_tokens): the call as far as it came, as OpenAI's API gives it
    ('[TOOL_CALLS]get_weather[ARGS]{"city": "Par', "",
     [{"type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Par'}}]),
    ('[TOOL_CALLS]get_weather', '[TOOL_CALLS]get_weather', []),
    ("[TOOL_CALL", "[TOOL_CALL", []),
]
MISTRAL_LIST_CASES = [
    # Mistral 7B v0.3's: [TOOL_CALLS] and a JSON list of calls
    ('[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Rome"}}, {"name": "now", "arguments": {}}]',
     "", [call("get_weather", {"city": "Rome"}), call("now", {})]),
    ('[TOOL_CALLS] [{"name": "launch", "arguments": {}}]', '[TOOL_CALLS] [{"name": "launch", "arguments": {}}]', []),
    ("[TOOL_CALLS] hi", "[TOOL_CALLS] hi", []),
    ("[TOOL_CALLS] []", "[TOOL_CALLS] []", []),
]


@pytest.mark.parametrize("fmt, text, content, calls", [(MISTRAL, *c) for c in MISTRAL_CASES] +
                         [(MISTRAL_LIST, *c) for c in MISTRAL_LIST_CASES])
def test_mistral_tool_calls_whole_and_streamed(fmt, text, content, calls):
    want = (content, None, calls)
    assert plain(parse_reply(text, tools=NAMES, fmt=fmt)) == want
    for pieces in (1, 3, 11, len(text)):
        assert plain(streamed(text, pieces, tools=NAMES, fmt=fmt)) == want, pieces


def test_a_mistral_call_goes_out_as_soon_as_its_arguments_begin():
    stream = ReplyStream(tools=NAMES, fmt=MISTRAL)
    assert stream.feed("[TOOL_CALLS]get_weather[ARGS]") == []
    deltas = stream.feed('{"city": "Oslo"')
    assert [d.call["function"] for d in deltas] == [{"name": "get_weather", "arguments": ""},
                                                    {"arguments": '{"city": "Oslo"'}]
    assert [d.call for d in stream.feed("}")] == [{"function": {"arguments": "}"}}]


REASONING_CASES = [
    # (text, mode, content, reasoning)
    ("<think>\nThe user greets.\n</think>\n\nHello!", "optional", "Hello!", "The user greets.\n"),
    ("Hello!", "optional", "Hello!", None),
    ("  <thi", "optional", "  <thi", None),
    ("The user greets.\n</think>\n\nHello!", "open", "Hello!", "The user greets.\n"),
    ("Still thinking when it stopped", "open", "", "Still thinking when it stopped"),
    ("<think>x</think>y", None, "<think>x</think>y", None),
]


@pytest.mark.parametrize("text, mode, content, reasoning", REASONING_CASES)
def test_reasoning_is_split_from_content(text, mode, content, reasoning):
    want = (content, reasoning, [])
    assert plain(parse_reply(text, reasoning=mode)) == want
    for pieces in (1, 2, 9, len(text)):
        assert plain(streamed(text, pieces, reasoning=mode)) == want


def test_reasoning_streams_before_it_ends_and_then_a_call():
    stream = ReplyStream(reasoning="open", tools=NAMES)
    first = stream.feed("Need the weather. </thi")
    assert [(d.kind, d.text) for d in first] == [("reasoning", "Need the weather. ")]
    rest = stream.feed('nk>\n\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
                       '</tool_call>') + stream.close()
    assert gather(rest).tool_calls[0]["function"] == {"name": "get_weather", "arguments": '{"city": "Paris"}'}


def test_reasoning_mode_comes_from_template_and_prompt():
    chat = [{"role": "user", "content": "hi"}]
    q3 = render_chat(QWEN3_CHAT_TEMPLATE, chat, add_generation_prompt=True)
    q3_off = render_chat(QWEN3_CHAT_TEMPLATE, chat, add_generation_prompt=True, enable_thinking=False)
    q35_on = render_chat(QWEN35_CHAT_TEMPLATE, chat, add_generation_prompt=True, enable_thinking=True)
    assert reasoning_mode(QWEN3_CHAT_TEMPLATE, q3) == "optional"
    assert reasoning_mode(QWEN3_CHAT_TEMPLATE, q3_off) is None
    assert reasoning_mode(QWEN35_CHAT_TEMPLATE, q35_on) == "open"
    assert reasoning_mode(SMOLLM2_TEMPLATE, "<|im_start|>assistant\n") is None


def test_tool_format_follows_the_template():
    assert tool_format(QWEN3_CHAT_TEMPLATE) is QWEN
    assert tool_format(SMOLLM2_TEMPLATE) is QWEN
    assert tool_format(LLAMA31_SNIPPET) is LLAMA3_JSON
    assert tool_format({"default": SMOLLM2_TEMPLATE, "tool_use": LLAMA31_SNIPPET}) is LLAMA3_JSON
    assert tool_format("{{ '[TOOL_CALLS]' + name + '[ARGS]' + arguments }}") is MISTRAL
    assert tool_format('{{ "[TOOL_CALLS] [" }}{{ calls | tojson }}') is MISTRAL_LIST
    assert MISTRAL.markers == ("[TOOL_CALLS]", "[ARGS]") and QWEN.markers == ("<tool_call>", "</tool_call>")
    assert LLAMA3_JSON.markers == ()


@pytest.mark.parametrize("tools, message", [
    ([], "non-empty list"),
    ([{"type": "function"}], r"tools\[0\] must be"),
    ([{"type": "function", "function": {"name": "a b"}}], r"tools\[0\].function.name"),
    ([{"type": "function", "function": {"name": "f"}}] * 2, "given twice"),
    ([{"type": "function", "function": {"name": "f", "parameters": []}}], "parameters must be"),
])
def test_bad_tools_are_refused_by_name(tools, message):
    with pytest.raises(ValueError, match=message):
        check_tools(tools)


def test_tool_choice():
    assert check_tool_choice(None, NAMES) == "auto"
    assert check_tool_choice("required", NAMES) == "required"
    assert check_tool_choice({"type": "function", "function": {"name": "now"}}, NAMES) == "now"
    assert check_tool_choice(None, {}) is None
    with pytest.raises(ValueError, match="not among the tools"):
        check_tool_choice({"type": "function", "function": {"name": "nope"}}, NAMES)
    with pytest.raises(ValueError, match="needs 'tools'"):
        check_tool_choice("required", {})
    with pytest.raises(ValueError, match="must be 'none'"):
        check_tool_choice("always", NAMES)


CONVERSATION = [
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function",
         "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21 C"},
]


def test_a_template_without_tools_gets_them_in_the_system_turn():
    messages, tools = messages_for_template(CONVERSATION, TOOLS, SMOLLM2_TEMPLATE)
    assert tools is None
    text = render_chat(SMOLLM2_TEMPLATE, messages, add_generation_prompt=True)
    assert text.startswith("<|im_start|>system\n# Tools\n")
    assert '"name": "get_weather"' in text.split("<tools>")[2].split("</tools>")[0]
    assert ('<|im_start|>assistant\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
            '</tool_call><|im_end|>') in text
    assert "<|im_start|>user\n<tool_response>\nsunny, 21 C\n</tool_response><|im_end|>" in text
    # a system prompt of the caller's own comes first
    messages, _ = messages_for_template([{"role": "system", "content": "Be brief."}] + CONVERSATION,
                                        TOOLS, SMOLLM2_TEMPLATE)
    assert messages[0]["content"].startswith("Be brief.\n\n# Tools")


def test_a_template_with_tools_gets_them_as_they_are():
    assert messages_for_template(CONVERSATION, TOOLS, QWEN3_CHAT_TEMPLATE) == (CONVERSATION, TOOLS)
    assert messages_for_template(CONVERSATION, None, SMOLLM2_TEMPLATE) == (CONVERSATION, None)
