"""Reading OpenAI requests and shaping responses, without HTTP: every field
checked before anything runs, with messages that name the field; the
messages clients send; the model's generation_config.json as fallback."""
import json
from types import SimpleNamespace

import pytest

from fastllm.serve import openai_api as api
from fastllm.serve.openai_api import APIError
from fastllm.tokenizer import Tokenizer


class FakeModel:
    """What parse_request reads of a Model, with the default model's real
    tokenizer; records what the chat template is given."""

    def __init__(self, tokenizer, n_ctx=256, defaults=None, max_new_tokens=None):
        self.n_ctx = n_ctx
        self.activations = "int8"
        self.config = SimpleNamespace(vocab_size=49152)
        self.generation_defaults = dict(defaults or {})
        self._max_new = max_new_tokens
        self.template_calls = []
        self.encoded = []
        real = tokenizer
        model = self

        class Recording:
            max_chars_per_token = real.max_chars_per_token
            chat_template = real.chat_template

            def apply_chat_template(self, messages, **kw):
                model.template_calls.append((messages, kw))
                kw = {k: v for k, v in kw.items() if k != "enable_thinking"}
                return real.apply_chat_template(messages, **kw)

            def encode(self, text, add_special_tokens=True):
                model.encoded.append(len(text))
                return real.encode(text, add_special_tokens=add_special_tokens)

            def decode(self, ids):
                return real.decode(ids)
        self.tokenizer = Recording()

    def default_max_new_tokens(self, n_prompt, fallback=128):
        return fallback if self._max_new is None else self._max_new


@pytest.fixture(scope="module")
def tokenizer(smollm2_dir):
    return Tokenizer.from_pretrained(smollm2_dir)


@pytest.fixture
def model(tokenizer):
    return FakeModel(tokenizer)


def chat(**fields):
    return {"messages": [{"role": "user", "content": "Hi"}], **fields}


def refused(body, model, chat_endpoint=True, match=None, param=None):
    with pytest.raises(APIError) as e:
        api.parse_request(body, chat_endpoint, model)
    assert e.value.status == 400
    if match is not None:
        assert match in str(e.value), str(e.value)
    if param is not None:
        assert e.value.param == param
    return e.value


@pytest.mark.parametrize("body, match, param", [
    (chat(max_tokens=-5), "'max_tokens' must be an integer >= 1, got -5", "max_tokens"),
    (chat(max_tokens=0), "'max_tokens' must be an integer >= 1, got 0", "max_tokens"),
    (chat(max_tokens=2.5), "'max_tokens' must be an integer", "max_tokens"),
    (chat(temperature="hot"), "'temperature' must be a number from 0 to 2", "temperature"),
    (chat(repetition_penalty=1e308), "repetition_penalty must be a number > 0 and <= 100", None),
    (chat(frequency_penalty=3), "'frequency_penalty' must be a number from -2 to 2", "frequency_penalty"),
    (chat(presence_penalty=-2.5), "'presence_penalty'", "presence_penalty"),
    (chat(seed=-2), "'seed' must be an integer from -1", "seed"),
    (chat(seed=2**64), "'seed'", "seed"),
    (chat(top_p=0), "top_p must be a number in (0, 1]", None),
    (chat(stop=""), "'stop' strings must have 1 to", "stop"),
    (chat(stop=["a", ""]), "'stop' strings", "stop"),
    (chat(stop=["x"] * 17), "'stop' must be a string or an array of at most 16", "stop"),
    (chat(stop="x" * 201), "'stop' strings must have 1 to 200", "stop"),
    (chat(stream="yes"), "'stream' must be true or false", "stream"),
    (chat(stream=True, stream_options=[]), "'stream_options' must be an object", "stream_options"),
    (chat(stream=True, stream_options={"include_usage": 1}), "'include_usage'", "include_usage"),
    (chat(n=0), "'n' must be an integer from 1 to 16", "n"),
    (chat(n=17), "'n'", "n"),
    (chat(logprobs=True, top_logprobs=21), "'top_logprobs'", "top_logprobs"),
    (chat(logit_bias={"abc": 1}), "'logit_bias' keys must be token ids", "logit_bias"),
    (chat(logit_bias={"99999999": 1}), "'logit_bias' keys", "logit_bias"),
    (chat(logit_bias={"5": 101}), "'logit_bias' values must be numbers from -100 to 100", "logit_bias"),
    (chat(logit_bias=[1]), "'logit_bias' must be an object", "logit_bias"),
    (chat(ignore_eos="no"), "'ignore_eos'", "ignore_eos"),
    (chat(model=3), "'model' must be a string", "model"),
    (chat(chat_template_kwargs={"tokenize": True}), "may not set 'tokenize'", "chat_template_kwargs"),
    ({"messages": []}, "'messages' must be a non-empty array", "messages"),
    ({"messages": [{"role": "wizard", "content": "x"}]}, "'messages[0].role' must be one of", "messages"),
    ({"messages": [{"role": "user", "content": None}]}, "'messages[0].content'", "messages"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
     "type 'image_url': this model reads text only", "messages"),
    ({"messages": [{"role": "user", "content": [{"type": "text"}]}]}, "must be a text part", "messages"),
    ({"messages": [{"role": "user", "content": "x", "name": 5}]}, "'messages[0].name'", "messages"),
])
def test_bad_chat_fields_are_refused_naming_the_field(model, body, match, param):
    refused(body, model, match=match, param=param)
    assert not model.encoded   # refused before anything was tokenized


@pytest.mark.parametrize("body, match", [
    ({"prompt": "x", "max_tokens": 0}, "'max_tokens' must be an integer >= 1"),
    ({"prompt": "x", "logprobs": 6}, "'logprobs' must be an integer from 0 to 5"),
    ({"prompt": "x", "echo": "yes"}, "'echo' must be true or false"),
    ({"prompt": [1, True]}, "'prompt' must be a string, an array of strings, a non-empty array of token ids"),
    ({"prompt": [1, -3]}, "'prompt' token id -3 is outside the vocabulary"),
    ({"prompt": [[1, 2], [3, 49152]]}, "'prompt[1]' token id 49152 is outside the vocabulary (0..49151)"),
    ({"prompt": ["a", [1]]}, None),
    ({"prompt": ["a", 5]}, "'prompt' must be"),
    ({"prompt": [[1], []]}, "'prompt' must be"),
    ({"prompt": []}, "'prompt' must be"),
    ({"prompt": ["x"] * 65}, "'prompt' gives 65 prompts: this server takes at most 64 per request"),
    ({"prompt": [[1]] * 100_000}, "'prompt' gives 100000 prompts"),
    ({"prompt": "x", "max_tokens": 0, "echo": False}, "'max_tokens' must be an integer >= 1"),
    ({"prompt": "x", "max_tokens": -1, "echo": True}, "'max_tokens' must be an integer >= 0"),

])
def test_bad_completion_fields_are_refused(model, body, match):
    if match is None:   # a list of several prompts in one shape: mixed are fine, as in OpenAI's API
        assert len(api.parse_request(body, False, model).prompts) == 2
        return
    refused(body, model, chat_endpoint=False, match=match)


def test_the_body_must_be_a_json_object_of_bounded_nesting():
    for raw, match in ((b"{", "not valid JSON"), (b"[1]", "must be a JSON object"),
                       (b'{"a": NaN}', "not valid JSON"), (b'{"t": Infinity}', "not valid JSON"),
                       (b"\xff\xfe", "not valid JSON"),
                       (b"[" * 100000 + b"]" * 100000, "deeper than 64 levels"),
                       (b'{"a":' * 65 + b"1" + b"}" * 65, "deeper than 64 levels")):
        with pytest.raises(APIError, match=match) as e:
            api.parse_json(raw)
        assert e.value.status == 400
    # brackets inside strings do not count
    tricky = {"a": "[[[[" * 100 + '\\"{'}   # a backslash and a quote inside the string
    assert api.parse_json(json.dumps(tricky).encode()) == tricky


def test_a_prompt_too_long_for_the_context_is_refused_before_tokenizing(model):
    huge = "word " * 1_000_000
    e = refused({"prompt": huge}, model, chat_endpoint=False)
    assert e.code == "context_length_exceeded" and not model.encoded
    e = refused({"messages": [{"role": "user", "content": huge}]}, model)
    assert e.code == "context_length_exceeded" and not model.encoded
    e = refused({"prompt": "word " * 300}, model, chat_endpoint=False)   # fits by characters, not tokens
    assert e.code == "context_length_exceeded" and model.encoded
    e = refused({"prompt": [1] * 256}, model, chat_endpoint=False)
    assert e.code == "context_length_exceeded"


def test_sampling_fields_and_choices(model):
    g = api.parse_request(chat(temperature=0.5, top_k=-1, top_p=0.9, min_p=0.1, seed=5, n=3,
                               frequency_penalty=0.5, presence_penalty=-0.25,
                               logit_bias={"7": -100, "3": 2.5}, ignore_eos=True, max_tokens=9), True, model)
    assert [p.seed for p in g.samplings] == [5, 6, 7]
    p = g.samplings[0]
    assert (p.temperature, p.top_k, p.top_p, p.min_p) == (0.5, 0, 0.9, 0.1)
    assert (p.frequency_penalty, p.presence_penalty) == (0.5, -0.25)
    assert p.logit_bias == ((3, 2.5), (7, -100.0))
    assert g.stop_ids == set() and g.max_tokens == 9
    # seed -1 is a random seed, as in llama.cpp; none: OpenAI's defaults
    g = api.parse_request(chat(seed=-1, n=2), True, model)
    assert [p.seed for p in g.samplings] == [None, None]
    g = api.parse_request(chat(), True, model)
    assert g.samplings[0].temperature == 1.0 and g.stop_ids is None and g.top_logprobs is None
    # a chat reply may fill the context; a completion has OpenAI's 16 tokens
    assert g.max_tokens == model.n_ctx - len(g.prompt_ids)
    assert api.parse_request({"prompt": "Hi"}, False, model).max_tokens == 16
    # max_tokens past the context is capped to what it holds
    assert api.parse_request(chat(max_tokens=10**9), True, model).max_tokens == g.max_tokens


def test_the_models_generation_config_fills_what_a_request_leaves_out(tokenizer):
    model = FakeModel(tokenizer, defaults={"temperature": 0.3, "top_k": 20, "repetition_penalty": 1.2,
                                           "max_new_tokens": 7}, max_new_tokens=7)
    g = api.parse_request(chat(), True, model)
    p = g.samplings[0]
    assert (p.temperature, p.top_k, p.repetition_penalty, g.max_tokens) == (0.3, 20, 1.2, 7)
    g = api.parse_request(chat(temperature=0, top_k=3, max_tokens=2), True, model)
    p = g.samplings[0]
    assert (p.temperature, p.top_k, p.repetition_penalty, g.max_tokens) == (0.0, 3, 1.2, 2)
    assert api.parse_request({"prompt": "Hi"}, False, model).max_tokens == 7


def test_messages_as_clients_send_them(model, tokenizer):
    body = {"messages": [
        {"role": "system", "content": [{"type": "text", "text": "Be brief."}]},
        {"role": "user", "content": [{"type": "text", "text": "Weather in"}, {"type": "text", "text": "Paris?"}],
         "name": "ann"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function",
             "function": {"name": "weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
    ], "chat_template_kwargs": {"enable_thinking": False}}
    g = api.parse_request(body, True, model)
    messages, kwargs = model.template_calls[-1]
    assert messages[0] == {"role": "system", "content": "Be brief."}
    assert messages[1] == {"role": "user", "content": "Weather in\nParis?", "name": "ann"}
    assert messages[2]["content"] == "" and messages[2]["tool_calls"] == [
        {"type": "function", "id": "call_1", "function": {"name": "weather", "arguments": {"city": "Paris"}}}]
    assert messages[3] == {"role": "tool", "content": "sunny", "tool_call_id": "call_1"}
    assert kwargs["enable_thinking"] is False and kwargs["add_generation_prompt"] is True
    text = tokenizer.decode(g.prompt_ids)
    assert "Weather in\nParis?" in text and "sunny" in text


def test_response_shapes():
    g = api.Generation(True, [1, 2, 3], 5, [None], [], None, None)
    assert api.choice(g, 0, "hi", "stop", None) == {
        "index": 0, "finish_reason": "stop", "logprobs": None,
        "message": {"role": "assistant", "content": "hi"}}
    assert api.chunk_choice(g, 1, role=True)["delta"] == {"role": "assistant", "content": ""}
    assert api.chunk_choice(g, 1, "x")["delta"] == {"content": "x"}
    assert api.chunk_choice(g, 1, reason="length")["delta"] == {}
    r = api.response(g, "id", 0, "m", [], 4, cached_tokens=2)
    assert r["object"] == "chat.completion" and r["usage"] == {
        "prompt_tokens": 3, "completion_tokens": 4, "total_tokens": 7,
        "prompt_tokens_details": {"cached_tokens": 2}}
    assert "system_fingerprint" in r
    text = api.chunk(g, "id", 0, "m", [])
    assert text.startswith("data: ") and json.loads(text[6:])["object"] == "chat.completion.chunk"
    c = api.Generation(False, [1], 5, [None], [], None, None)
    assert api.chunk_choice(c, 0, reason="stop") == {"index": 0, "logprobs": None,
                                                      "finish_reason": "stop", "text": ""}
    assert json.loads(api.error_event(APIError(500, "boom", type="server_error"))[6:]) == {
        "error": {"message": "boom", "type": "server_error", "param": None, "code": None}}
    assert [api.finish_reason(r) for r in ("stop", "cancelled", "length", "context")] == \
        ["stop", "stop", "length", "length"]


def test_completions_take_prompt_lists_and_echo(model, tokenizer):
    ids = tokenizer.encode("The sea")
    g = api.parse_request({"prompt": ["The sea", [5, 6, 7], "Hi"], "n": 2, "max_tokens": 3}, False, model)
    assert g.prompts == [ids, [5, 6, 7], tokenizer.encode("Hi")] and g.prompt_ids == ids
    assert g.prompt_tokens == len(ids) + 3 + len(tokenizer.encode("Hi")) and g.echo is None
    # a list of one prompt is that prompt; token ids too
    assert api.parse_request({"prompt": [[5, 6]]}, False, model).prompts == [[5, 6]]
    assert api.parse_request({"prompt": [5, 6]}, False, model).prompts == [[5, 6]]
    # echo: a string prompt as it was sent, token ids as their text; max_tokens 0 scores only
    g = api.parse_request({"prompt": ["The sea", [5, 6]], "echo": True, "max_tokens": 0, "logprobs": 2},
                          False, model)
    assert g.echo == ["The sea", tokenizer.decode([5, 6])] and g.max_tokens == 0 and g.top_logprobs == 2
    # a completion's room is the longest prompt's
    g = api.parse_request({"prompt": [[5] * 200, [6]], "max_tokens": 100}, False, model)
    assert g.max_tokens == model.n_ctx - 200
    assert api.system_fingerprint(model).startswith("fastllm-") and model.activations in g.fingerprint
    # the tokens one request may have scored are bounded, before any runs
    big = FakeModel(tokenizer, n_ctx=1024)
    e = refused({"prompt": [[5] * 1000] * 17, "echo": True, "logprobs": 0}, big, chat_endpoint=False)
    assert "at most 16384 prompt tokens per request; these prompts have 17000" in str(e)
    assert len(api.parse_request({"prompt": [[5] * 1000] * 17, "echo": True}, False, big).prompts) == 17


def test_echoed_logprobs_start_with_a_null():
    class Tok:
        def decode(self, ids):
            return "".join(chr(96 + i) for i in ids)
    entries = [(1, None), (2, (-0.5, [(2, -0.5), (3, -1.0)])), (3, (-2.0, []))]
    assert api.completion_logprobs(Tok(), entries, 0) == {
        "tokens": ["a", "b", "c"], "token_logprobs": [None, -0.5, -2.0],
        "top_logprobs": [None, {"b": -0.5, "c": -1.0}, {}], "text_offset": [0, 1, 2]}


def test_text_that_is_not_unicode_is_the_callers_fault(model):
    e = refused({"prompt": "\ud800", "max_tokens": 1}, model, chat_endpoint=False, param="prompt")
    assert "lone surrogate" in str(e)
    e = refused({"messages": [{"role": "user", "content": "hi \udfff"}]}, model, param="messages")
    assert "lone surrogate" in str(e)


def test_chat_replies_shaped_with_tool_calls_and_reasoning():
    from fastllm.generate.toolcalls import QWEN
    g = api.Generation(True, [1], 5, [None], [], None, None,
                       reply={"reasoning": "open", "tools": ["now"], "fmt": QWEN})
    text = 'Time matters.\n</think>\n\n<tool_call>\n{"name": "now", "arguments": {}}\n</tool_call>'
    c = api.choice(g, 0, text, "stop", None)
    assert c["finish_reason"] == "tool_calls"
    message = c["message"]
    assert message["content"] is None and message["reasoning_content"] == "Time matters.\n"
    assert [(t["type"], t["function"]) for t in message["tool_calls"]] == [
        ("function", {"name": "now", "arguments": "{}"})]
    # cut short by max_tokens: "length" stays, text without calls stays content
    assert api.choice(g, 0, "Hm.</think>Hello", "length", None)["message"] == {
        "role": "assistant", "content": "Hello", "reasoning_content": "Hm."}
    assert api.finish_with_calls("length", True) == "length"
    # streamed: one chunk choice per delta, the logprobs on the first
    stream = api.reply_stream(g)
    chunks = api.delta_choices(g, 2, stream.feed(text), logprobs={"content": []})
    assert [c["delta"].keys() for c in chunks] == [{"reasoning_content"}, {"tool_calls"}, {"tool_calls"}]
    assert chunks[2]["delta"]["tool_calls"] == [{"index": 0, "function": {"arguments": "{}"}}]
    assert chunks[0]["logprobs"] == {"content": []} and chunks[1]["logprobs"] is None
    assert chunks[1]["delta"]["tool_calls"][0]["index"] == 0 and stream.called
    # text held back still carries its logprobs
    assert api.delta_choices(g, 0, [], logprobs={"content": []})[0]["delta"] == {"content": ""}
    assert api.reply_stream(api.Generation(False, [1], 5, [None], [], None, None)) is None
