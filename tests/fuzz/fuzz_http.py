"""The HTTP layer: generated requests through the OpenAI-compatible server
in-process - its Starlette app called as ASGI (scope, receive, send), no
sockets - on the tiny model in tests/data, served three times: with its own
chat template and a 128-token context; with Qwen3.5's template (tools,
content parts, thinking), an API key and a 512-token context; and both
behind one app, as "tiny" and "qwen", picked by the request's model.

Each input is a recipe read byte by byte (`Recipe`): the app, method, path
and headers, then a body that is one of
- an OpenAI request of the right shape whose fields take values of every
  JSON type: huge, negative, NaN and Infinity numbers, huge strings,
  content parts, tools, response_format, stream and stream_options, n,
  logit_bias, stop, seed -1, max_tokens 0, unknown fields...;
- the same serialized, then mutated byte by byte;
- malformed JSON: deep nesting, invalid UTF-8, cut short, not an object.
The other APIs get requests of their own shapes, as generated and mutated:
Anthropic's /v1/messages and count_tokens, /v1/responses (previous_response_id
now and then one the server made), /v1/embeddings, /tokenize, /detokenize.
The body comes in one or more chunks, and some clients go away before or
while the answer comes. Valid requests mostly ask for 1 to 3 tokens. An
input that starts with "REQ " is a request written out instead
(`written_request`): the inputs that found bugs are kept that way, readable.

A finding (`Finding`, raised) is:
- an exception out of the app, or any 5xx;
- an error that is not JSON in OpenAI's shape
  ({"error": {"message", "type", "param", "code"}}), or under /v1/messages
  in Anthropic's ({"type": "error", "error": {"type", "message"}});
- a 200 that is not a completion: JSON with choices and usage, or with
  "stream": true server-sent events of chunks that end in [DONE]; output
  that does not parse as JSON although response_format asked for JSON;
  likewise for the other APIs: a Message or its event sequence (blocks
  opened, extended and closed in order), a Response or its events (in
  sequence, the streamed text the final output's), embeddings of one
  length and unit norm, tokens and text;
- a request refused with a 4xx whose generation is still queued or running;
- a request that takes longer than LIMIT seconds; an engine still busy a
  moment after every request ended; a /health that is not ok; RSS that
  grows past MEMORY_GROWTH_MB over what it was after the warm-up.

    python tests/fuzz/fuzz_http.py CORPUS -len_control=0 -max_len=2048 -timeout=30   # coverage-guided
    python tests/fuzz/random_http.py INPUTS [OUT.jsonl]   # random recipes, faster; past findings

FASTLLM_FUZZ_HTTP_BYSTANDER=1 keeps another client streaming from the first
app the whole time, on a thread and event loop of its own, through the same
engine: a gap between its chunks longer than GAP seconds
(FASTLLM_FUZZ_HTTP_GAP, 1) while an input runs is a finding too.

FASTLLM_FUZZ_HTTP_LOG=FILE appends a line every LOG_EVERY inputs: time,
inputs run, inputs/s, RSS, known findings and the count of each status so
far. FASTLLM_FUZZ_HTTP_KNOWN=REGEX: findings that match it (bugs reported
and not fixed yet) are counted, not raised. FASTLLM_FUZZ_HTTP_LIMIT: LIMIT.
"""
import asyncio
import base64
import json
import math
import os
import re
import shutil
import sys
import tempfile
import threading
import time
import traceback

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _target import ROOT, instrumented, main  # noqa: E402

# Only the server's own modules are instrumented: the model, tokenizer and
# templates have targets of their own, and tracing them would slow each
# request several-fold.
from fastllm import Model  # noqa: E402
from fastllm.serve.serving import BatchEngine  # noqa: E402

with instrumented():
    import fastllm.serve.server as server_module  # noqa: E402
    import fastllm.serve.anthropic_api  # noqa: E402,F401
    import fastllm.serve.embeddings_api  # noqa: E402,F401
    import fastllm.serve.responses_api  # noqa: E402,F401
    import fastllm.serve.served  # noqa: E402,F401

HERE = os.path.dirname(os.path.abspath(__file__))
TINY = os.path.join(ROOT, "tests", "data", "tiny-llama")
API_KEY = "fuzz-key"
LIMIT = float(os.environ.get("FASTLLM_FUZZ_HTTP_LIMIT", "8"))   # seconds one request may take
MEMORY_GROWTH_MB = 256      # over the RSS after WARMUP inputs
WARMUP = 20_000
CHECK_EVERY = 250           # inputs between checks that the engines are idle and healthy
LOG_EVERY = 10_000
# Findings already reported and not fixed yet, matched by a regular expression,
# are counted (the log's "known") instead of ending the run.
KNOWN = re.compile(os.environ["FASTLLM_FUZZ_HTTP_KNOWN"]) if os.environ.get("FASTLLM_FUZZ_HTTP_KNOWN") else None
# (the first two are what clients mostly call; the server takes them without /v1 too)
GENERATE_PATHS = ("/v1/chat/completions", "/v1/completions", "/chat/completions", "/completions")
CORS_ORIGINS = "http://localhost:3000,localhost"   # the second app's: web pages that may call it
GAP = float(os.environ.get("FASTLLM_FUZZ_HTTP_GAP", "1"))   # seconds another client's stream may wait
OTHER_PATHS = ("/v1/messages", "/v1/responses", "/v1/embeddings", "/v1/messages/count_tokens", "/tokenize",
               "/detokenize")


class Finding(Exception):
    """Something the server must not do; str() says what, with the request."""


# The server answers its own faults with a 500 in OpenAI's shape; the
# exception being handled then is kept, for the finding to show where.
server_tracebacks = []


def _keeping_tracebacks(server_error):
    def kept(*args, **kwargs):
        if sys.exc_info()[1] is not None:
            server_tracebacks.append(traceback.format_exc(limit=-12))
        return server_error(*args, **kwargs)
    return kept


_api = getattr(server_module, "api", None)
if _api is not None and hasattr(_api, "server_error"):
    _api.server_error = _keeping_tracebacks(_api.server_error)


# ---------------------------------------------------------------- recipes

class Recipe:
    """The input's bytes read as choices; past the end every choice is 0, so
    the first option of each choice is the plain, valid one."""

    def __init__(self, data: bytes):
        self.data, self.pos = data, 0

    def byte(self) -> int:
        if self.pos >= len(self.data):
            return 0
        self.pos += 1
        return self.data[self.pos - 1]

    def below(self, n: int) -> int:
        if n <= 256:
            return self.byte() % n
        return (self.byte() | self.byte() << 8 | self.byte() << 16) % n

    def chance(self, in256: int) -> bool:
        """True with probability in256/256 (for random bytes)."""
        return self.byte() >= 256 - in256

    def pick(self, options):
        return options[self.below(len(options))]

    def rest(self) -> bytes:
        return self.data[self.pos:]


# Raw JSON numbers that json.dumps cannot write: spliced in for their sentinels.
RAW_NUMBERS = ["1e999", "-1e999", "1" * 5000, "-0", "0.0e0", "1.0e-400", "123456789012345678901234567890",
               "1E+2", "4.0", "-1.0"]
RAW = [f"\u2063raw{i}\u2063" for i in range(len(RAW_NUMBERS))]

ATOMS = [None, True, False, 0, 1, -1, 2, 3, 0.5, -0.0, 1.5, 2**31 - 1, 2**31, -2**31, 2**53 + 1, 2**63,
         2**64, -2**63 - 1, 10**30, 1e308, -1e308, 5e-324, math.nan, math.inf, -math.inf,
         "", "a", "0", "1", "-1", "true", "null", "NaN", "auto", "none", "text", "x" * 10_000,
         "\ud800", "\x00", "\u00e9\U0001f642", [], {}, [1], {"a": 1}, [None], [""], *RAW]

FRAGMENTS = ["Hello", " world", "The capital of France is", "\n", " ", "<|im_start|>", "<|im_end|>",
             "</s>", "<s>", "<think>", "</think>", "<tool_call>", '{"name": "f", "arguments": {}}',
             "</tool_call>", "\u00e9", "\U0001f642", "\u4e2d\u6587", "\u200b", "\x00", "\t", "{{ x }}",
             "{% if x %}", "\\", '"', "'", "\ud800", "\udfff", "\ufeff", "\r\n", "a" * 200]


def text(r: Recipe) -> str:
    if r.chance(1):   # now and then a huge one
        return r.pick(["word " * 400, "x" * 100_000, "\U0001f642" * 20_000, "ab " * 100_000])
    n = r.below(5) + (r.byte() == 0)
    return "".join(r.pick(FRAGMENTS) for _ in range(n)) or "Hi"


def value(r: Recipe, depth: int = 2):
    """A JSON value of any type."""
    kind = r.below(8)
    if kind < 5 or depth <= 0:
        return r.pick(ATOMS)
    if kind == 5:
        return text(r)
    if kind == 6:
        return [value(r, depth - 1) for _ in range(r.below(4))]
    return {r.pick(["a", "type", "text", "role", "content", "name", ""]): value(r, depth - 1)
            for _ in range(r.below(4))}


def either(r: Recipe, good, bad=()):
    """Mostly one of good, else one of bad or any JSON value."""
    b = r.byte()
    if b < 176:
        return r.pick(good)
    if bad and b < 232:
        return r.pick(bad)
    return value(r)


# Counts past the context are rarer: where the server takes them as "the
# whole context", each costs a long generation.
BAD_COUNTS = [0, -1, -5, 1.5, 2.0, "3", True, None, [], math.nan, math.inf] * 3 + [2**31, 2**63, 10**30, 1e308]
BAD_FLOATS = [-0.1, -1, 2.0000001, 3, 1e308, -1e308, math.nan, math.inf, -math.inf, "1", True, None, []]
SCHEMAS = [
    {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]},
    {"type": "string", "maxLength": 3},
    {"type": "array", "items": {"type": "number"}, "maxItems": 2},
    {"enum": ["x", "y", 3]},
    {"type": "object", "properties": {"n": {"$ref": "#"}}},
    {"type": "string", "pattern": "(a+)+$"},
    {"type": "string", "pattern": "["},
    {"type": "integer", "minimum": 10, "maximum": 1},
    {"type": "foo"},
    {"$ref": "#/definitions/nothing"},
    {"anyOf": [{"type": "null"}, {"type": "boolean"}]},
    {"type": "string", "minLength": 10**9},
    {"type": "object", "additionalProperties": False, "properties": {}},
    {"enum": list(range(2000))},
    True, False, {},
]
# Schemas llguidance accepts that fail once decoding reaches them: no reply
# at all, or a lexer past its limits at the first byte of a part.
SCHEMA_BOMBS = [
    {"$ref": "#"},
    {"$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}}, "$ref": "#/$defs/a"},
    {"type": "object", "properties": {"self": {"$ref": "#"}}, "required": ["self"]},
    {"type": "string", "pattern": "^a{1000000}$"},
    {"type": "string", "pattern": "^(ab|cd){20000}x{30000}$"},
    {"const": "x" * 1_000_000},
    {"enum": ["y" * 300_000, 1]},
    {"type": "object", "required": ["k"], "properties": {"k": {"type": "string", "pattern": "^b{1000000}$"}}},
    {"type": "object", "required": ["a", "b"], "properties": {"a": {"type": "integer"},
                                                            "b": {"type": "string", "pattern": "^c{500000}$"}}},
    {"anyOf": [{"type": "integer"}, {"const": "z" * 500_000}]},
    {"type": "array", "items": {"type": "string", "pattern": "^d{800000}$"}, "minItems": 1},
]


def schema(r: Recipe):
    if r.chance(32):
        return value(r, 3)
    s = r.pick(SCHEMA_BOMBS) if r.chance(24) else r.pick(SCHEMAS)
    for _ in range(r.below(3) if r.chance(32) else 0):   # nested
        s = {"type": "object", "properties": {"k": s}, "required": ["k"]}
    return s


def response_format(r: Recipe):
    return either(r, [{"type": "text"}, {"type": "json_object"},
                      {"type": "json_schema", "json_schema": {"name": "out", "schema": schema(r)}},
                      {"type": "json_schema", "json_schema": {"name": "out", "schema": schema(r),
                                                              "strict": True}}],
                  [{"type": "json_schema"}, {"type": "json_schema", "json_schema": None},
                   {"type": "json_schema", "json_schema": {"schema": "x"}}, {"type": "xml"}, {}, "json"])


def tool(r: Recipe):
    name = either(r, ["get_weather", "f", "lookup"], ["", "a b", "x" * 300, None, 5])
    params = either(r, [{"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
                        {"type": "object", "properties": {}}], [schema(r)])
    fn = {"name": name, "description": either(r, ["Look it up", ""]), "parameters": params}
    return either(r, [{"type": "function", "function": fn}],
                  [{"type": "function"}, {"type": "code_interpreter"}, {"function": fn}, fn])


def tool_choice(r: Recipe):
    return either(r, ["auto", "none", "required", {"type": "function", "function": {"name": "get_weather"}}],
                  [{"type": "function", "function": {"name": "missing"}}, {"type": "function"},
                   "any", {"type": "function", "function": {"name": 5}}])


def tool_calls(r: Recipe):
    args = either(r, ['{"city": "Paris"}', "{}", "not json"], [{"city": "Paris"}])
    call = {"id": either(r, ["call_1", ""]), "type": "function",
            "function": {"name": either(r, ["get_weather", ""]), "arguments": args}}
    return either(r, [[call], [call, call]], [[], [{"id": "c"}], [{"function": None}], call])


def content(r: Recipe):
    part = lambda: either(r, [{"type": "text", "text": text(r)}],   # noqa: E731
                          [{"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}},
                           {"type": "input_audio", "input_audio": {"data": "", "format": "wav"}},
                           {"type": "text"}, {"type": "text", "text": 5}, {"text": "x"}, {"type": "file"}])
    b = r.byte()
    if b < 150:
        return text(r)
    if b < 215:
        return [part() for _ in range(r.below(4))]
    return either(r, [None, ""], [5, {"type": "text", "text": "x"}, [[]], True])


def message(r: Recipe, first: bool):
    role = either(r, ["user", "user", "assistant", "system", "tool"] if not first else ["user", "system"],
                  ["developer", "function", "", "USER", "bot", None, 3])
    m = {"role": role, "content": content(r)}
    if r.chance(24):
        m["name"] = either(r, ["alice", ""])
    if role == "assistant" and r.chance(64):
        m["tool_calls"] = tool_calls(r)
        if r.chance(128):
            m["content"] = None
    if role == "tool" or r.chance(8):
        m["tool_call_id"] = either(r, ["call_1", ""], [None, 5])
    if role == "assistant" and r.chance(24):
        m["reasoning_content"] = either(r, ["I think so.", ""])
    if r.chance(8):
        del m["content"]
    if r.chance(8):
        m[r.pick(["extra", "audio", "refusal", "weight"])] = value(r)
    return m


def sampling_fields(r: Recipe, chat: bool) -> dict:
    """The fields both endpoints share, each present or not."""
    fields = {
        "temperature": lambda: either(r, [0, 0.0, 0.7, 1, 2], BAD_FLOATS),
        "top_p": lambda: either(r, [1, 0.9, 0.5, 1e-9], [0, -0.5, 1.5] + BAD_FLOATS),
        "top_k": lambda: either(r, [0, 1, 40, -1], [-2, 300, 10**9, 2**63, 1.5, "40"]),
        "min_p": lambda: either(r, [0, 0.05, 1], BAD_FLOATS),
        "repetition_penalty": lambda: either(r, [1, 1.1, 0.9], [0, -1, 1e308] + BAD_FLOATS),
        "frequency_penalty": lambda: either(r, [0, 0.5, -2, 2], [2.5, -3] + BAD_FLOATS),
        "presence_penalty": lambda: either(r, [0, 0.5, -2, 2], [2.5, -3] + BAD_FLOATS),
        "seed": lambda: either(r, [0, 1, 42, -1], [-2, -2**63, 2**63 - 1, 2**64, 2**32, 1.5, "42", True]),
        "n": lambda: either(r, [1, 2, 3], [0, -1, 128, 10**9, 1.5, "2", True]),
        "stop": lambda: either(r, ["\n", ["\n", "."], "e", [], ["Hello"]],
                               ["", [""], [1], [["x"]], ["x"] * 1000, "s" * 10_000, [None]]),
        "stream": lambda: either(r, [False, True], ["true", 1, 0, None]),
        "stream_options": lambda: either(r, [{"include_usage": True}, {"include_usage": False}, None],
                                         [{"include_usage": "x"}, "x", [], {"continuous_usage_stats": True}]),
        "logit_bias": lambda: either(r, [{"5": 100}, {"299": -100}, {}, {"7": 2.5, "8": -2.5}],
                                     [{"abc": 1}, {"-1": 5}, {"100000": 3}, {"5": math.nan}, {"5": "x"},
                                      {"5": 1e308}, {"5": 101}, [], "x", {str(i): 1 for i in range(400)}]),
        "ignore_eos": lambda: either(r, [False, True], ["yes", 1]),
        "user": lambda: either(r, ["u1"], [5]),
        "model": lambda: either(r, ["tiny", "gpt-4o", ""], [None, 5]),
        "max_tokens": lambda: either(r, [1, 2, 3], BAD_COUNTS),
        "suffix": lambda: either(r, [None], ["x"]),
    }
    common = ["model", "max_tokens", "temperature", "seed", "stream", "stop", "top_p", "top_k", "min_p",
              "repetition_penalty", "frequency_penalty", "presence_penalty", "n", "stream_options",
              "logit_bias", "ignore_eos", "user"]
    body = {}
    # max_tokens is there 31 times in 32 (a valid request runs a few tokens, not the whole context)
    body["max_tokens"] = fields["max_tokens"]() if not r.chance(8) else None
    if body["max_tokens"] is None:
        del body["max_tokens"]
    for name in common:
        if name != "max_tokens" and r.chance(48):
            body[name] = fields[name]()
    if not chat and r.chance(16):
        body["suffix"] = fields["suffix"]()
    return body


def chat_body(r: Recipe) -> dict:
    body = {"messages": [message(r, i == 0) for i in range(1 + r.below(4) if not r.chance(8) else 0)]}
    body.update(sampling_fields(r, chat=True))
    if r.chance(24):
        body["max_completion_tokens"] = either(r, [1, 2, 3], BAD_COUNTS)
    if r.chance(24):
        body["logprobs"] = either(r, [True, False], [1, "yes"])
        if r.chance(128):
            body["top_logprobs"] = either(r, [0, 1, 5, 20], [21, -1, 1.5])
    if r.chance(32):
        body["response_format"] = response_format(r)
    if r.chance(32):
        body["tools"] = either(r, [[tool(r)], [tool(r), tool(r)]], [[], {}, "x", [None]])
        if r.chance(128):
            body["tool_choice"] = tool_choice(r)
        if r.chance(32):
            body["parallel_tool_calls"] = either(r, [True, False], ["x"])
    elif r.chance(8):
        body["tool_choice"] = tool_choice(r)
    if r.chance(16):
        body["chat_template_kwargs"] = either(r, [{"enable_thinking": True}, {"enable_thinking": False}],
                                              [{"enable_thinking": "x"}, {"messages": []}, [], "x",
                                               {"add_generation_prompt": False}, {"tools": 5}])
    if r.chance(8):
        body[r.pick(["metadata", "store", "service_tier", "reasoning_effort", "functions", "audio"])] = value(r)
    if r.chance(8):
        del body[r.pick(list(body))]
    return body


def completion_body(r: Recipe) -> dict:
    b = r.byte()
    if b < 150:
        prompt = text(r)
    elif b < 200:
        prompt = either(r, [[5, 6, 7], [text(r)], [1] * 40, [[1, 2]], [text(r), text(r)], [[5, 6], [7], [8, 9]],
                            [text(r), [5, 6, 7]]],
                        [[], [-1], [300], [2**31], [2**63], [1.5], [True], list(range(2000)), [[]], [[1], []],
                         [[1, 300]], [[1, -1]], [[1, 2**40]], [text(r), 5], [[[1]]], [[1] * 200] * 3,
                         [[1]] * 100_000, ["x"] * 100_000, [[5, 6]] * 70, ["Hi"] * 17, [None]])
    else:
        prompt = value(r)
    body = {"prompt": prompt}
    body.update(sampling_fields(r, chat=False))
    if r.chance(48):
        body["logprobs"] = either(r, [0, 1, 5], [6, -1, True, 1.5])
    if r.chance(48):
        body["echo"] = either(r, [False, True], ["x"])
        if body["echo"] is True and r.chance(128):   # scoring without generating
            body["max_tokens"] = 0
    if r.chance(8):
        body[r.pick(["best_of", "response_format", "metadata", "tools"])] = value(r)
    if r.chance(8):
        del body[r.pick(list(body))]
    return body


# ------------------------------------------------ the other APIs' requests

RECENT = []   # ids of responses the server made (kept), for previous_response_id
MODELS = ["tiny", "qwen", "gpt-4o", ""]


def mostly(r: Recipe, good, bad):
    """One of good, now and then one of bad: for the parts of a request
    that come several times, which either() would make bad too often for
    the whole to be valid."""
    return r.pick(bad) if r.chance(12) else r.pick(good)


def anthropic_block(r: Recipe, role: str):
    good = [{"type": "text", "text": text(r)}]
    if role == "assistant":
        good += [{"type": "tool_use", "id": either(r, ["toolu_1", "call_1"]), "name": either(r, ["get_weather", "f"]),
                  "input": either(r, [{"city": "Paris"}, {}], ["x", None, [1]])},
                 {"type": "thinking", "thinking": either(r, ["Hmm.", ""]), "signature": ""},
                 {"type": "redacted_thinking", "data": "xx"}]
    else:
        good += [{"type": "tool_result", "tool_use_id": either(r, ["toolu_1", ""], [None, 5]),
                  "content": either(r, ["sunny", [{"type": "text", "text": "21 C"}], ""],
                                    [[{"type": "image", "source": {}}], 5, [5]]),
                  **({"is_error": either(r, [True, False], ["x"])} if r.chance(32) else {})}]
    return mostly(r, good, [{"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AA"}},
                            {"type": "document"}, {"type": "text"}, {"type": "tool_use"}, {"type": "server_tool_use"},
                            {"text": "x"}, {"type": "tool_result"}, {"type": "thinking", "thinking": 5}, value(r)])


def anthropic_message(r: Recipe, i: int):
    role = mostly(r, ["user", "assistant"] if i else ["user"], ["system", "tool", "", None, 3])
    b = r.byte()
    content = text(r) if b < 120 else [anthropic_block(r, role) for _ in range(r.below(4))] if b < 230 else value(r)
    return {"role": role, "content": content}


def anthropic_body(r: Recipe, count_only: bool = False) -> dict:
    body = {"model": r.pick(MODELS) if not r.chance(16) else either(r, MODELS, [None, 5]),
            "stream": True if r.chance(64) else None,
            "messages": [anthropic_message(r, i) for i in range(1 + r.below(4) if not r.chance(8) else 0)]}
    if not count_only or r.chance(16):
        body["max_tokens"] = either(r, [1, 2, 3], BAD_COUNTS) if not r.chance(4) else None
    extra = {
        "system": lambda: either(r, ["Be brief.", [{"type": "text", "text": "Be brief."}], ""],
                                 [[{"type": "image"}], 5, [{"text": "x"}]]),
        "stop_sequences": lambda: either(r, [["\n"], ["e", "."], []], ["", [""], [1], "x" * 300, ["x"] * 100]),
        "temperature": lambda: either(r, [0, 0.5, 1], BAD_FLOATS + [1.5]),
        "top_p": lambda: either(r, [1, 0.9], BAD_FLOATS),
        "top_k": lambda: either(r, [0, 1, 40], [-1, 1.5, "40"]),
        "stream": lambda: either(r, [False, True], ["true", 1]),
        "tools": lambda: either(r, [[{"name": either(r, ["get_weather", "f"], ["", "a b", None]),
                                      "description": "Look it up",
                                      "input_schema": either(r, [{"type": "object", "properties": {
                                          "city": {"type": "string"}}, "required": ["city"]}], [schema(r)])}]],
                                [[], [{"type": "web_search_20250305", "name": "web_search"}], [{"name": "f"}],
                                 {"name": "f"}, [None]]),
        "tool_choice": lambda: either(r, [{"type": "auto"}, {"type": "any"}, {"type": "none"},
                                          {"type": "tool", "name": "get_weather"},
                                          {"type": "any", "disable_parallel_tool_use": True}],
                                      [{"type": "tool"}, {"type": "tool", "name": "nope"}, "auto",
                                       {"type": "auto", "disable_parallel_tool_use": "x"}]),
        "thinking": lambda: either(r, [{"type": "enabled", "budget_tokens": 1024}, {"type": "disabled"}],
                                   [{"type": "sometimes"}, True, {}]),
        "metadata": lambda: either(r, [{"user_id": "u"}], [5]),
        "output_config": lambda: either(r, [{"format": {"type": "json_schema", "schema": schema(r)}},
                                            {"effort": "low"}], [{"format": {"type": "xml"}}, 5]),
    }
    for name, make in extra.items():
        if r.chance(40):
            body[name] = make()
    if r.chance(8):
        body[r.pick(["n", "service_tier", "container", "mcp_servers", "logprobs"])] = value(r)
    return {k: v for k, v in body.items() if v is not None or r.chance(8)}


def responses_item(r: Recipe):
    good = [{"role": either(r, ["user", "assistant", "system", "developer"]), "content": text(r)},
            {"type": "message", "role": "user", "content": [{"type": "input_text", "text": text(r)}]},
            {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": text(r)}]},
            {"type": "function_call", "call_id": "call_1", "name": either(r, ["get_weather", "f"]),
             "arguments": either(r, ['{"city": "Paris"}', "{}", "not json"])},
            {"type": "function_call_output", "call_id": either(r, ["call_1", ""]), "output": either(r, ["sunny", ""])},
            {"type": "reasoning", "summary": [], "content": [{"type": "reasoning_text", "text": "Hmm."}]}]
    return mostly(r, good, [{"role": "tool", "content": "x"}, {"type": "item_reference", "id": "x"},
                            {"type": "web_search_call"}, {"role": "user", "content": [{"type": "input_image"}]},
                            {"type": "function_call"}, {"type": "function_call_output", "call_id": 5}, "x"])


def responses_body(r: Recipe) -> dict:
    b = r.byte()
    body = {"model": r.pick(MODELS) if not r.chance(16) else either(r, MODELS, [None, 5]),
            "stream": True if r.chance(64) else None,
            "input": text(r) if b < 110 else [responses_item(r) for _ in range(1 + r.below(4))] if b < 235
            else either(r, [""], [[], None, 5, {"role": "user"}])}
    body["max_output_tokens"] = either(r, [1, 2, 3], BAD_COUNTS) if not r.chance(8) else None
    extra = {
        "instructions": lambda: either(r, ["Be brief.", ""], [5, ["x"]]),
        "previous_response_id": lambda: either(r, RECENT[-4:] or ["resp_x"], ["resp_x", "", 5]),
        "store": lambda: either(r, [True, False], ["x"]),
        "stream": lambda: either(r, [False, True], ["true", 1]),
        "temperature": lambda: either(r, [0, 1], BAD_FLOATS),
        "top_p": lambda: either(r, [1, 0.9], BAD_FLOATS),
        "tools": lambda: either(r, [[{"type": "function", "name": either(r, ["get_weather", "f"], ["", None]),
                                      "parameters": either(r, [{"type": "object", "properties": {
                                          "city": {"type": "string"}}}], [schema(r)])}], []],
                                [[{"type": "web_search"}], [{"name": "f"}], "x", [None]]),
        "tool_choice": lambda: either(r, ["auto", "none", "required", {"type": "function", "name": "get_weather"}],
                                      [{"type": "function"}, {"type": "allowed_tools"}, "any"]),
        "parallel_tool_calls": lambda: either(r, [True, False], ["x"]),
        "text": lambda: either(r, [{"format": {"type": "text"}}, {"format": {"type": "json_object"}},
                                   {"format": {"type": "json_schema", "name": "out", "schema": schema(r)}}],
                               [{"format": {"type": "xml"}}, {"format": None}, "x", {"format": 5}]),
        "reasoning": lambda: either(r, [{"effort": "none"}, {"effort": "low"}, {}], [{"effort": "max"}, 5]),
        "metadata": lambda: either(r, [{"a": "b"}], [5]),
        "background": lambda: either(r, [False], [True]),
        "truncation": lambda: either(r, ["disabled", "auto"]),
    }
    for name, make in extra.items():
        if r.chance(40):
            body[name] = make()
    return {k: v for k, v in body.items() if v is not None or r.chance(8)}


def embedding_input(r: Recipe):
    return either(r, [text(r), [5, 6, 7], {"prompt_string": text(r)}, {"content": [{"type": "text", "text": "hi"}]}],
                  [[], [-1], [300], [2**40], [1.5], [True], "", {"content": "x"},
                   {"content": [{"type": "image_url"}]}, None])


def embeddings_body(r: Recipe) -> dict:
    b = r.byte()
    body = {"model": r.pick(MODELS) if not r.chance(16) else either(r, MODELS, [None, 5]),
            "input": embedding_input(r) if b < 120 else [embedding_input(r) for _ in range(r.below(5))]
            if b < 230 else either(r, [[1, "a", 2]], [["a"] * 3000, [[1] * 200] * 3, value(r)])}
    if r.chance(48):
        body["encoding_format"] = either(r, ["float", "base64"], ["int8", 5])
    if r.chance(48):
        body["dimensions"] = either(r, [1, 8, 64], [0, -1, 65, 10**9, 1.5, "8"])
    if r.chance(32):
        body["normalize"] = either(r, [True, False], ["x"])
    return body


def tokenize_body(r: Recipe) -> dict:
    body = {"content": either(r, [text(r), ["a", 5, "b"], [5, 6]], [[-1], [2**40], 5, [None], {}])}
    for name in ("add_special", "with_pieces", "parse_special"):
        if r.chance(64):
            body[name] = either(r, [True, False], ["x", 1])
    return body


def detokenize_body(r: Recipe) -> dict:
    return {"tokens": either(r, [[5, 6, 7], [], list(range(250))], [[-1], [2**40], ["a"], "x", [1.5], [True]])}


def body_for(r: Recipe, path: str) -> dict:
    if path.endswith("chat/completions"):
        return chat_body(r)
    if path == "/v1/completions":
        return completion_body(r)
    return {"/v1/messages": anthropic_body, "/v1/messages/count_tokens": lambda r: anthropic_body(r, True),
            "/v1/responses": responses_body, "/v1/embeddings": embeddings_body, "/tokenize": tokenize_body,
            "/detokenize": detokenize_body}.get(path, completion_body)(r)


# ------------------------------------------------ the other APIs' answers

def sse(data: bytes) -> list:
    """(event name, data) of each server-sent event, the name the data's type."""
    out = []
    blocks = data.decode().split("\n\n")
    assert blocks[-1] == "", blocks[-1:]
    for block in blocks[:-1]:
        name, line = block.split("\n")
        assert name.startswith("event: ") and line.startswith("data: "), block[:100]
        event = json.loads(line[6:])
        assert event["type"] == name[7:], (name, event)
        out.append(event)
    return out


def _stops(intent, key):
    stops = intent.get(key)
    return [s for s in stops if isinstance(s, str) and s] if isinstance(stops, list) else []


def _json_format(intent) -> bool:
    fmt = (intent.get("text") or {}).get("format") if isinstance(intent.get("text"), dict) else None
    return isinstance(fmt, dict) and fmt.get("type") in ("json_object", "json_schema")


def check_message(m: dict, intent: dict):
    assert m["type"] == "message" and m["role"] == "assistant" and isinstance(m["content"], list), m
    assert m["stop_reason"] in ("end_turn", "max_tokens", "stop_sequence", "tool_use"), m["stop_reason"]
    for b in m["content"]:
        assert b["type"] in ("text", "thinking", "tool_use"), b
        if b["type"] == "tool_use":
            assert isinstance(b["input"], dict) and isinstance(b["name"], str), b
        if b["type"] == "text":
            for stop in _stops(intent, "stop_sequences"):
                if stop in b["text"]:
                    raise Finding(f"the text holds the stop sequence {stop!r}: {b['text'][:300]!r}")
    limit = intent.get("max_tokens")
    if type(limit) is int and m["usage"]["output_tokens"] > limit:
        raise Finding(f"{m['usage']['output_tokens']} tokens with max_tokens {limit}")


def check_message_events(events: list, intent: dict):
    assert events[0]["type"] == "message_start", events[0]
    if events[-1]["type"] == "error":   # the caller's fault found late may end a stream; the server's may not
        if events[-1]["error"]["type"] == "api_error":
            raise Finding(f"a server error in the stream: {events[-1]}\n" + "".join(server_tracebacks[-1:]))
        return
    assert [e["type"] for e in events[-2:]] == ["message_delta", "message_stop"], events[-2:]
    blocks, open_index = [], None
    for e in events[1:-2]:
        kind = e["type"]
        if kind == "content_block_start":
            assert open_index is None and e["index"] == len(blocks), e
            open_index = e["index"]
            blocks.append(dict(e["content_block"]))
        elif kind == "content_block_delta":
            assert e["index"] == open_index, e
            delta, block = e["delta"], blocks[open_index]
            field = {"text_delta": "text", "thinking_delta": "thinking", "input_json_delta": "partial_json",
                     "signature_delta": "signature"}[delta["type"]]
            block[field] = block.get(field, "") + delta[field]
        elif kind == "content_block_stop":
            assert e["index"] == open_index, e
            open_index = None
        else:
            assert kind == "ping", e
    assert open_index is None and blocks, "a block left open, or none"
    for b in blocks:
        if b["type"] == "tool_use":
            b["input"] = json.loads(b.pop("partial_json", "") or "{}")
    message = dict(events[0]["message"], content=blocks, **events[-2]["delta"])
    message["usage"] = dict(message["usage"], **events[-2]["usage"])
    check_message(message, intent)


def check_response(resp: dict, intent: dict):
    assert resp["object"] == "response" and isinstance(resp["output"], list), resp
    assert resp["status"] in ("completed", "incomplete"), resp["status"]
    text = ""
    for item in resp["output"]:
        assert item["type"] in ("message", "reasoning", "function_call"), item
        if item["type"] == "message":
            text += "".join(p["text"] for p in item["content"])
        if item["type"] == "function_call":
            assert isinstance(item["arguments"], str) and item["call_id"], item
    if resp["status"] == "completed" and _json_format(intent) and resp["output"][-1]["type"] == "message":
        try:
            json.loads(text)
        except ValueError:
            raise Finding(f"text.format asked for JSON but the output is not: {text[:300]!r}") from None
    u = resp["usage"]
    assert u["total_tokens"] == u["input_tokens"] + u["output_tokens"], u
    if resp.get("store"):
        RECENT.append(resp["id"])
        del RECENT[:-16]


def check_response_events(events: list, intent: dict):
    assert [e["sequence_number"] for e in events] == list(range(len(events))), "sequence numbers"
    assert events[0]["type"] == "response.created", events[0]
    last = events[-1]
    if last["type"] == "response.failed":
        if last["response"]["error"]["code"] == "server_error":
            raise Finding(f"a server error in the stream: {last}\n" + "".join(server_tracebacks[-1:]))
        return
    assert last["type"] in ("response.completed", "response.incomplete"), last["type"]
    deltas = "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta")
    final = "".join(p["text"] for item in last["response"]["output"] if item["type"] == "message"
                    for p in item["content"])
    assert deltas == final, (deltas, final)
    added = [e["output_index"] for e in events if e["type"] == "response.output_item.added"]
    done = [e["output_index"] for e in events if e["type"] == "response.output_item.done"]
    assert added == done == list(range(len(last["response"]["output"]))), (added, done)
    check_response(last["response"], intent)


def check_embeddings(reply: dict, intent: dict):
    assert reply["object"] == "list" and reply["data"], reply
    sizes = set()
    for i, d in enumerate(reply["data"]):
        assert d["index"] == i and d["object"] == "embedding", d
        v = d["embedding"]
        v = np.frombuffer(base64.b64decode(v), "<f4") if isinstance(v, str) else np.array(v, np.float64)
        assert np.isfinite(v).all(), v
        sizes.add(v.size)
        if intent.get("normalize") is not False:
            assert abs(np.linalg.norm(v) - 1) < 1e-3, np.linalg.norm(v)
    assert len(sizes) == 1, sizes
    u = reply["usage"]
    assert u["prompt_tokens"] == u["total_tokens"] > 0, u


def check_other(path: str, data: bytes, content_type: str, intent: dict):
    """A 200 of one of OTHER_PATHS is what that API answers."""
    streamed = content_type.startswith("text/event-stream")
    if streamed != (intent.get("stream") is True and path in ("/v1/messages", "/v1/responses")):
        raise Finding(f"content-type {content_type} for \"stream\": {intent.get('stream')!r}")
    if path == "/v1/messages":
        check_message_events(sse(data), intent) if streamed else check_message(json.loads(data), intent)
    elif path == "/v1/responses":
        check_response_events(sse(data), intent) if streamed else check_response(json.loads(data), intent)
    elif path == "/v1/embeddings":
        check_embeddings(json.loads(data), intent)
    elif path == "/v1/messages/count_tokens":
        n = json.loads(data)["input_tokens"]
        assert type(n) is int and n > 0, n
    elif path == "/tokenize":
        tokens = json.loads(data)["tokens"]
        assert all(type(t) is int or (type(t["id"]) is int and isinstance(t["piece"], (str, list))) for t in tokens)
    else:
        assert isinstance(json.loads(data)["content"], str)


def serialize(obj) -> bytes:
    text = json.dumps(obj, ensure_ascii=bool(len(obj) % 2) if isinstance(obj, dict) else True)
    for sentinel, raw in zip(RAW, RAW_NUMBERS):
        if sentinel in text:
            text = text.replace(json.dumps(sentinel), raw)
    return text.encode("utf-8", "surrogatepass")


def mutate(r: Recipe, data: bytes) -> bytes:
    data = bytearray(data)
    for _ in range(1 + r.below(8)):
        at = r.below(len(data) + 1)
        kind = r.below(7)
        if kind == 0 and data:
            data[min(at, len(data) - 1)] ^= 1 << r.below(8)
        elif kind == 1:
            data[at:at] = bytes([r.byte()]) * (1 + r.below(3))
        elif kind == 2:
            del data[at:at + 1 + r.below(16)]
        elif kind == 3:
            data[at:at] = r.pick([b"\xff", b"\xc0\x80", b"\xed\xa0\x80", b"\x00", b"\\u", b'"', b"{", b"[",
                                  b"]", b"}", b",", b":", b"NaN", b"-", b"1e999", b"\\ud800",
                                  r.pick(ESCAPE_RUNS) * (1 + r.below(4096))])
        elif kind == 4:
            del data[at:]
        elif kind == 5 and data:
            end = min(len(data), at + 1 + r.below(64))
            data[at:at] = data[at:end] * (1 + r.below(4))
        else:
            data[at:at] = r.rest()[:8]
    return bytes(data)


# A string opened and never closed, runs of escapes in it: what a pre-scan
# with a backtracking string pattern takes quadratic time over.
ESCAPE_RUNS = [b'\\"', b"\\", b'\\\\\\"', b'[\\"{', b"\\u00", b'\\\\"', b'"\\"']


def unterminated(r: Recipe) -> bytes:
    n = r.pick([10, 1000, 32_000, 300_000, 1_000_000])
    head = r.pick([b'{"prompt":"', b'{"messages":[{"role":"user","content":"', b'{"prompt":"hi","stop":["',
                   b'{"response_format":{"type":"json_schema","json_schema":{"schema":{"pattern":"', b'"'])
    run = r.pick(ESCAPE_RUNS) * (n // 2)
    return head + (run if not r.chance(64) else run + b'"}')


def malformed(r: Recipe) -> bytes:
    depth = r.pick([10, 100, 1000, 5000, 100_000])
    kind = r.below(12)
    if kind >= 10:
        return unterminated(r)
    if kind == 0:
        return b"[" * depth + b"]" * depth
    if kind == 1:
        return b'{"messages": ' + b"[" * depth + b"]" * depth + b"}"
    if kind == 2:
        inner = b'{"a":' * depth + b"1" + b"}" * depth
        return b'{"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1, "x": ' + inner + b"}"
    if kind == 3:
        return b'{"prompt": "hi", "max_tokens": 1, "stop": ' + b"[" * depth + b"]" * depth + b"}"
    if kind == 4:
        return b"[" * depth   # never closed
    return r.pick([b"", b"null", b"[]", b"1", b'"x"', b"true", b"{", b"}", b"\xef\xbb\xbf{}", b"\xff\xfe{",
                   b'{"prompt": "\xff", "max_tokens": 1}', b'{"prompt": "\\ud800", "max_tokens": 1}',
                   b'{"prompt": "hi", "max_tokens": 1, "max_tokens": 2}', b"{'prompt': 'hi'}",
                   b'{"messages": [{"role": "user", "content": "hi"}]}garbage',
                   b'{"prompt": "hi", "max_tokens": 1e999}', b'{"prompt": "hi"} \n\n ', b"\x00" * 100])


def huge(r: Recipe) -> bytes:
    """A body past any reasonable size limit (a few MiB), or just under."""
    size = r.pick([3 << 20, (4 << 20) + 3, 9 << 20])
    return b'{"prompt": "' + b"ab " * (size // 3) + b'", "max_tokens": 1}'


def written_request(data: bytes):
    """An input that is a request written out ("REQ <app> <METHOD> <path>" on
    its first line, then the body), as the inputs that found bugs are kept."""
    head, _, body = data.partition(b"\n")
    _, app, method, path = (head.decode("latin-1").split(" ", 3) + ["", "", ""])[:4]
    app = {"1": 1, "2": 2}.get(app, 0)
    headers = [(b"host", b"testserver"), (b"content-type", b"application/json"),
               (b"content-length", str(len(body)).encode())]
    if app == 1:
        headers.append((b"authorization", b"Bearer " + API_KEY.encode()))
    try:
        intent = json.loads(body)
    except (ValueError, RecursionError):
        intent = None
    return (app, method or "POST", path or "/", b"", headers, body, [body], None,
            intent if isinstance(intent, dict) else None)


def recipe_request(r: Recipe):
    """(app index, method, path, query, headers, body, chunks, disconnect, intent)."""
    if r.data.startswith(b"REQ "):
        return written_request(r.data)
    app = r.below(3)
    b = r.byte()
    if b < 232:
        k = r.byte()
        path = GENERATE_PATHS[k % 2] if k < 128 else OTHER_PATHS[k % len(OTHER_PATHS)]
        method = "POST" if not r.chance(8) else r.pick(["GET", "PUT", "DELETE", "HEAD", "OPTIONS", "PATCH"])
    else:
        path = r.pick(["/v1/models", "/models", "/completions", "/chat/completions", "/health", "/metrics", "/",
                       "/v1/embeddings", "/v1/chat/completions/",
                       "/v1/models/tiny", "/v1//completions", "/V1/COMPLETIONS", "/%00", "/v1/completions%20",
                       "/v1/chat/completions/../completions", "/docs", "/v1/responses", "/v1/messages/",
                       "/v1/messages/x", "/v1/responses/resp_x", "/v1/responses/" + (RECENT[-1] if RECENT else "r"),
                       "/tokenize/"])
        method = r.pick(["GET", "POST", "HEAD", "DELETE", "OPTIONS"])
    kind = r.byte()
    intent = None
    if r.chance(1) and r.chance(64):
        body = huge(r)
    elif kind < 200:
        intent = body_for(r, path)
        body = serialize(intent)
    elif kind < 235:
        body = mutate(r, serialize(body_for(r, path) if path in OTHER_PATHS else
                                   chat_body(r) if r.below(2) else completion_body(r)))
    else:
        body = malformed(r)
    query = b"" if not r.chance(8) else r.pick([b"stream=true", b"a=%ff", b"x" * 1000])
    headers = [(b"host", b"testserver")]
    ctype = r.pick([b"application/json"] * 6 + [None, b"text/plain", b"application/json; charset=utf-8",
                                                 b"multipart/form-data; boundary=x"])
    if ctype is not None:
        headers.append((b"content-type", ctype))
    if r.chance(24):   # a web page's request, or its CORS preflight
        headers.append((b"origin", r.pick([b"http://localhost:3000", b"http://127.0.0.1:5173", b"http://[::1]",
                                           b"http://evil.example", b"http://localhost.evil.example", b"null",
                                           b"", b"\xff"])))
        if method == "OPTIONS" or r.chance(16):
            method = "OPTIONS" if r.chance(192) else method
            headers.append((b"access-control-request-method", r.pick([b"POST", b"GET", b"DELETE", b"PATCH", b""])))
            if r.chance(192):
                headers.append((b"access-control-request-headers", r.pick(
                    [b"authorization, content-type", b"Authorization", b"x-custom", b"", b"a" * 5000])))
            if r.chance(8):
                headers.append((b"access-control-request-private-network", b"true"))
    if app == 1:
        auth = b"Bearer " + API_KEY.encode() if not r.chance(16) else r.pick(
            [b"", b"Bearer", b"Bearer wrong", b"Basic eA==", b"bearer " + API_KEY.encode(), b"\xff"])
        if r.chance(64):   # Anthropic's clients send the key as x-api-key
            headers.append((b"x-api-key", r.pick([API_KEY.encode(), b"wrong", b""])))
        else:
            headers.append((b"authorization", auth))
    if not r.chance(16):
        headers.append((b"content-length", str(len(body)).encode()))
    cuts = sorted(r.below(len(body) + 1) for _ in range(r.below(4) if r.chance(32) else 0))
    chunks = [body[i:j] for i, j in zip([0] + cuts, cuts + [len(body)])]
    disconnect = r.pick([None] * 28 + ["before body end", "after body", "after 1 chunk", "after 3 chunks"])
    return app, method, path, query, headers, body, chunks, disconnect, intent


# ---------------------------------------------------------------- the harness

def rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def tiny_with_qwen_template(folder: str) -> str:
    """The tiny model with Qwen3.5's chat template and room for 512 positions."""
    for name in ("model.safetensors", "tokenizer.json"):
        os.symlink(os.path.join(TINY, name), os.path.join(folder, name))
    with open(os.path.join(TINY, "config.json")) as f:
        config = json.load(f)
    config["max_position_embeddings"] = 512
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(config, f)
    with open(os.path.join(TINY, "tokenizer_config.json")) as f:
        tok = json.load(f)
    with open(os.path.join(HERE, "corpus", "chat_template", "qwen3_5"), "rb") as f:
        tok["chat_template"] = f.read().split(b"\0")[0].decode()
    with open(os.path.join(folder, "tokenizer_config.json"), "w") as f:
        json.dump(tok, f)
    return folder


class Served:
    """An app of one model or of several ([(name, model), ...]), an engine
    each; every request an engine is given is kept in `submitted` until
    the HTTP request ends (but a bystander's)."""

    def __init__(self, model, api_key, cors_origins=None):
        entries = model if isinstance(model, list) else [("tiny", model)]
        self.model = entries[0][1]
        self.engines = [BatchEngine(m, parallel=4, max_queue=16) for _, m in entries]
        self.engine = self.engines[0]
        self.submitted = []
        self.bystander_thread = None
        for engine in self.engines:
            for name in ("submit", "submit_many", "submit_prompts"):
                if hasattr(engine, name):
                    setattr(engine, name, self._tracked(getattr(engine, name)))
        options = server_module.ServeOptions(cors_origins=cors_origins)
        if isinstance(model, list):
            self.app = server_module.create_app(None, None, api_key=api_key, options=options, models=[
                (n, m, e) for (n, m), e in zip(entries, self.engines)])
        else:
            self.app = server_module.create_app(model, self.engine, "tiny", api_key, options)

    def _tracked(self, submit):
        def tracked(*args, **kwargs):
            requests = submit(*args, **kwargs)
            if threading.current_thread() is not self.bystander_thread:
                self.submitted += requests if isinstance(requests, list) else [requests]
            return requests
        return tracked

    def close(self):
        for engine in self.engines:
            engine.close()


def prompt_count(intent, chat: bool) -> int:
    """The prompts of a completions request that was answered: a list of
    strings or of token-id lists gives several."""
    prompt = intent.get("prompt") if isinstance(intent, dict) and not chat else None
    if isinstance(prompt, list) and prompt and not all(type(t) is int for t in prompt):
        return len(prompt)
    return 1


def generated(text: str, index: int, intent) -> str:
    """A completion choice's text without the prompt it echoes (a stop
    string may well be in the prompt)."""
    if not isinstance(intent, dict) or intent.get("echo") is not True:
        return text
    prompt = intent.get("prompt")
    if isinstance(prompt, list) and prompt_count(intent, False) > 1:
        n = intent.get("n", 1)
        prompt = prompt[index // (n if type(n) is int else 1)]
    if isinstance(prompt, str):
        if not text.startswith(prompt):
            raise Finding(f"an echo that does not start with its prompt: {text[:200]!r}")
        return text[len(prompt):]
    return ""   # token ids echo as their decoded text, which the check cannot split off


class Bystander:
    """Another client of served's app, streaming completions one after
    another on a thread and event loop of its own; worst_gap() says how long
    its stream waited at most for a chunk since it was last asked."""

    BODY = json.dumps({"prompt": "Once upon a time", "max_tokens": 100, "ignore_eos": True,
                       "stream": True}).encode()

    def __init__(self, served):
        self.app, self.last, self.worst, self.running = served.app, None, 0.0, True
        self.thread = threading.Thread(target=self._run, name="fuzz-bystander", daemon=True)
        served.bystander_thread = self.thread
        self.thread.start()

    def _run(self):
        loop = asyncio.new_event_loop()
        try:
            while self.running:
                loop.run_until_complete(self._stream())
        finally:
            loop.close()

    async def _stream(self):
        scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST",
                 "scheme": "http", "path": "/v1/completions", "raw_path": b"/v1/completions", "query_string": b"",
                 "root_path": "", "headers": [(b"host", b"x"), (b"content-type", b"application/json")],
                 "client": ("127.0.0.1", 40001), "server": ("127.0.0.1", 8000), "state": {}}
        sent, done = [False], asyncio.Event()

        async def receive():
            if not sent[0]:
                sent[0] = True
                return {"type": "http.request", "body": self.BODY, "more_body": False}
            await done.wait()
            return {"type": "http.disconnect"}

        async def send(message):
            if message["type"] == "http.response.body":
                if message.get("body"):
                    now = time.monotonic()
                    if self.last is not None:
                        self.worst = max(self.worst, now - self.last)
                    self.last = now
                if not message.get("more_body", False):
                    done.set()
        try:
            await self.app(scope, receive, send)
        finally:
            self.last = None
        if not done.is_set():
            await asyncio.sleep(0.05)

    def worst_gap(self) -> float:
        last, worst = self.last, self.worst
        self.worst = 0.0
        return max(worst, 0.0 if last is None else time.monotonic() - last)

    def stop(self):
        self.running = False
        self.thread.join(30)


def _done(request) -> bool:
    cancelled = getattr(request, "_cancelled", None)
    return bool(request.finish_reason) or (cancelled is not None and cancelled.is_set())


class Harness:
    def __init__(self):
        self.folder = tempfile.mkdtemp(prefix="fastllm-fuzz-http-")
        self.models = [Model.from_pretrained(TINY, n_ctx=128, threads=1),
                       Model.from_pretrained(tiny_with_qwen_template(self.folder), n_ctx=512, threads=1)]
        self.loop = asyncio.new_event_loop()
        self.start()
        self.count, self.known, self.started_at, self.statuses = 0, 0, time.monotonic(), {}
        self.rss_after_warmup = None
        self.log = os.environ.get("FASTLLM_FUZZ_HTTP_LOG")

    def start(self):
        self.served = [Served(self.models[0], None), Served(self.models[1], API_KEY, CORS_ORIGINS),
                       Served([("tiny", self.models[0]), ("qwen", self.models[1])], None)]
        self.bystander = Bystander(self.served[0]) if os.environ.get("FASTLLM_FUZZ_HTTP_BYSTANDER") == "1" else None

    def close(self):
        if self.bystander is not None:
            self.bystander.stop()
        for s in self.served:
            s.close()
        self.loop.close()
        shutil.rmtree(self.folder, ignore_errors=True)

    # one request

    async def _call(self, app, scope, chunks, disconnect):
        sent = {"status": None, "headers": [], "body": [], "done": False}
        finished = asyncio.Event()
        gone = asyncio.Event()
        incoming = [{"type": "http.request", "body": c, "more_body": i < len(chunks) - 1}
                    for i, c in enumerate(chunks)]
        if disconnect == "before body end":
            incoming = incoming[:-1] if len(incoming) > 1 else [{"type": "http.request", "body": chunks[0][:1],
                                                                 "more_body": True}]
        if disconnect in ("before body end", "after body"):
            gone.set()

        async def receive():
            if incoming:
                return incoming.pop(0)
            if not gone.is_set():
                waiters = [asyncio.ensure_future(gone.wait()), asyncio.ensure_future(finished.wait())]
                try:
                    await asyncio.wait(waiters, return_when=asyncio.FIRST_COMPLETED)
                finally:
                    for waiter in waiters:
                        waiter.cancel()
            return {"type": "http.disconnect"}

        async def send(message):
            if message["type"] == "http.response.start":
                if sent["status"] is not None:
                    raise Finding(f"a second http.response.start: {message}")
                sent["status"], sent["headers"] = message["status"], message.get("headers", [])
            elif message["type"] == "http.response.body":
                if sent["status"] is None or sent["done"]:
                    raise Finding("response body before its start or after its end")
                sent["body"].append(bytes(message.get("body", b"")))
                if not message.get("more_body", False):
                    sent["done"] = True
                    finished.set()
                if disconnect == "after 1 chunk" or (disconnect == "after 3 chunks" and len(sent["body"]) >= 3):
                    gone.set()
            else:
                raise Finding(f"unexpected ASGI message {message['type']}")

        await app(scope, receive, send)
        return sent

    def request(self, app_index, method, path, query, headers, chunks, disconnect):
        scope = {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.4"}, "http_version": "1.1",
                 "method": method, "scheme": "http", "path": path, "raw_path": path.encode(),
                 "query_string": query, "root_path": "", "headers": headers, "client": ("127.0.0.1", 40000),
                 "server": ("127.0.0.1", 8000), "state": {}}
        app = self.served[app_index].app
        server_tracebacks.clear()
        start = time.monotonic()
        try:
            sent = self.loop.run_until_complete(
                asyncio.wait_for(self._call(app, scope, chunks, disconnect), LIMIT))
        except asyncio.TimeoutError:
            raise Finding(f"no answer within {LIMIT:.0f} s") from None
        except Finding:
            raise
        except Exception as e:
            if disconnect and type(e).__name__ == "ClientDisconnect":
                return None, time.monotonic() - start
            frames = [f for f in traceback.extract_tb(e.__traceback__)
                      if not f.filename.endswith(("fuzz_http.py", "asyncio/tasks.py", "asyncio/base_events.py"))]
            raise Finding(f"{type(e).__name__} out of the app: {e}\n"
                          + "".join(traceback.format_list(frames[-12:]))) from None
        return sent, time.monotonic() - start

    # checks

    def check(self, r_app, method, path, body, disconnect, intent, sent, elapsed):
        served = self.served[r_app]
        submitted, served.submitted = served.submitted, []
        if elapsed > LIMIT:
            raise Finding(f"the answer took {elapsed:.1f} s")
        if sent is None:
            return
        status = sent["status"]
        self.statuses[status] = self.statuses.get(status, 0) + 1
        if status is None:
            raise Finding("no response at all")
        if not sent["done"] and not disconnect:
            raise Finding(f"{status} response never ended")
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in sent["headers"]}
        data = b"".join(sent["body"])
        if status >= 500:
            raise Finding(f"{status}: {data[:2000]!r}\n" + "".join(server_tracebacks[-1:]))
        if status >= 400:
            if any(not _done(q) for q in submitted):
                raise Finding(f"refused with {status}, but its generation is still queued or running")
            if method == "HEAD":
                return
            anthropic = path == "/v1/messages" or path.startswith("/v1/messages/")
            try:
                reply = json.loads(data)
                err = reply["error"]
                assert isinstance(err["message"], str) and err["message"], "message"
                assert isinstance(err["type"], str), "type"
                if anthropic:
                    assert reply["type"] == "error" and set(err) == {"type", "message"}, "Anthropic's shape"
                else:
                    assert "param" in err and "code" in err, "param and code"
            except Exception as e:
                raise Finding(f"{status} error not in {'Anthropic' if anthropic else 'OpenAI'}'s shape ({e!r}); "
                              f"content-type {headers.get('content-type')}: {data[:300]!r}") from None
            if not headers.get("content-type", "").startswith("application/json"):
                raise Finding(f"{status} error with content-type {headers.get('content-type')}")
            return
        if status in (307, 308) and "location" in headers:   # Starlette's redirect to the path without its /
            return
        if method == "OPTIONS":   # only a CORS preflight of an origin the app allows gets a 200
            if served is not self.served[1] or "access-control-allow-origin" not in headers \
                    or "access-control-allow-methods" not in headers:
                raise Finding(f"OPTIONS answered {status} without CORS headers: {headers}")
            return
        if status != 200:
            raise Finding(f"unexpected status {status}: {data[:300]!r}")
        if intent is None and path in GENERATE_PATHS:
            # a body written out or mutated: what the server took is what it says
            try:
                intent = json.loads(body)
            except ValueError:
                pass
        if intent is None and path in OTHER_PATHS:
            try:
                intent = json.loads(body)
            except (ValueError, RecursionError):
                pass
        if method == "HEAD" or disconnect:
            return
        if path in OTHER_PATHS:
            try:
                check_other(path, data, headers.get("content-type", ""), intent if isinstance(intent, dict) else {})
            except Finding:
                raise
            except Exception as e:
                raise Finding(f"a 200 of {path} that is not what the API answers ({e!r}): {data[:600]!r}\n"
                              + "".join(server_tracebacks[-1:])) from None
            if any(not _done(q) for q in submitted):
                raise Finding("the response ended, but its generation is still running")
            return
        if path not in GENERATE_PATHS:
            if path != "/metrics":
                json.loads(data)
            return
        chat = path.endswith("chat/completions")
        want_stream = isinstance(intent, dict) and intent.get("stream") is True
        if headers.get("content-type", "").startswith("text/event-stream"):
            if intent is not None and not want_stream:
                raise Finding("server-sent events for a request without \"stream\": true")
            self.check_events(data, chat, intent)
        else:
            if want_stream:
                raise Finding("JSON for a request with \"stream\": true")
            self.check_completion(data, chat, intent)
        if any(not _done(q) for q in submitted):
            raise Finding("the response ended, but its generation is still running")

    def check_completion(self, data, chat, intent):
        try:
            reply = json.loads(data)
            choices = reply["choices"]
            assert reply["object"] == ("chat.completion" if chat else "text_completion")
            assert isinstance(choices, list) and choices
            for c in choices:
                assert c["finish_reason"] in ("stop", "length", "tool_calls", "content_filter"), c
                if chat:
                    m = c["message"]
                    assert m["role"] == "assistant"
                    assert isinstance(m["content"], str) or (m["content"] is None and m.get("tool_calls")), m
                else:
                    assert isinstance(c["text"], str)
            u = reply["usage"]
            assert u["total_tokens"] == u["prompt_tokens"] + u["completion_tokens"], u
        except Exception as e:
            raise Finding(f"a 200 that is not a completion ({e!r}): {data[:500]!r}") from None
        if isinstance(intent, dict):
            n = intent.get("n", 1)
            if type(n) is int and len(choices) != n * prompt_count(intent, chat):
                raise Finding(f"n={n} of {prompt_count(intent, chat)} prompts but {len(choices)} choices")
            limit = intent.get("max_completion_tokens", intent.get("max_tokens"))
            if type(limit) is int and limit >= 0 and u["completion_tokens"] > limit * len(choices):
                raise Finding(f"{u['completion_tokens']} tokens with max_tokens {limit}")
            for c in choices:
                text = c["message"]["content"] if chat else generated(c["text"], c["index"], intent)
                self.check_stops(text, intent)
            fmt = intent.get("response_format")
            # a stop string may end the JSON early, as it does in OpenAI's API
            if chat and isinstance(fmt, dict) and fmt.get("type") in ("json_object", "json_schema") \
                    and not intent.get("stop"):
                for c in choices:
                    if c["finish_reason"] == "stop" and c["message"]["content"] is not None:
                        try:
                            json.loads(c["message"]["content"])
                        except ValueError:
                            raise Finding(f"response_format {fmt.get('type')} but the output is not JSON: "
                                          f"{c['message']['content']!r}") from None

    @staticmethod
    def check_stops(text, intent):
        """A stop string ends the output before it: it never shows in it."""
        stop = intent.get("stop") if isinstance(intent, dict) else None
        stops = [stop] if isinstance(stop, str) else stop if isinstance(stop, list) else []
        for s in stops:
            if isinstance(s, str) and s and isinstance(text, str) and s in text:
                raise Finding(f"the output holds the stop string {s!r}: {text[:300]!r}")

    def check_events(self, data, chat, intent):
        try:
            events = data.decode().split("\n\n")
            assert events[-1] == "" and events[-2] == "data: [DONE]", events[-3:]
            finished, errored, texts = set(), False, {}
            for event in events[:-2]:
                assert event.startswith("data: "), event[:100]
                chunk = json.loads(event[6:])
                if "error" in chunk:   # the caller's fault found late may end a stream; the server's may not
                    if chunk["error"].get("type") == "server_error":
                        raise Finding(f"a server error in the stream: {event[:2000]}\n"
                                      + "".join(server_tracebacks[-1:]))
                    errored = True
                    continue
                assert chunk["object"] == ("chat.completion.chunk" if chat else "text_completion"), chunk
                for c in chunk["choices"]:
                    assert ("delta" in c) if chat else isinstance(c["text"], str), c
                    piece = c["delta"].get("content") if chat else c["text"]
                    texts[c["index"]] = texts.get(c["index"], "") + (piece or "")
                    if c.get("finish_reason"):
                        finished.add(c["index"])
            n = intent.get("n", 1) if isinstance(intent, dict) else 1
            n = (n if type(n) is int else 1) * prompt_count(intent, chat)
            assert errored or finished == set(range(n)), f"finished choices {finished}"
            for index, text in texts.items():
                self.check_stops(text if chat else generated(text, index, intent), intent)
        except Finding:
            raise
        except Exception as e:
            raise Finding(f"a stream that is not server-sent chunks ({e!r}): {data[:500]!r}") from None

    def check_engines(self):
        """Every engine idle soon after its requests ended, and /health ok."""
        for i, s in enumerate(self.served):
            end = time.monotonic() + 5
            while any(e.active or e.queue_depth for e in s.engines):
                if time.monotonic() > end:
                    raise Finding(f"app {i}'s engines still have {[e.active for e in s.engines]} running and "
                                  f"{[e.queue_depth for e in s.engines]} waiting with no request open")
                time.sleep(0.01)
            sent, _ = self.request(i, "GET", "/health", b"", [(b"host", b"x")], [b""], None)
            if sent["status"] != 200 or json.loads(b"".join(sent["body"])).get("status") != "ok":
                raise Finding(f"/health answered {sent['status']} {b''.join(sent['body'])[:200]!r}")

    def run_one(self, data: bytes):
        r = Recipe(data)
        app, method, path, query, headers, body, chunks, disconnect, intent = recipe_request(r)
        try:
            if self.bystander is not None:
                self.bystander.worst_gap()
            sent, elapsed = self.request(app, method, path, query, headers, chunks, disconnect)
            self.check(app, method, path, body, disconnect, intent, sent, elapsed)
            gap = 0.0 if self.bystander is None else self.bystander.worst_gap()
            if gap > GAP:
                raise Finding(f"another client's stream waited {gap:.1f} s for a chunk during this request")
        except Finding as f:
            if KNOWN is not None and KNOWN.search(str(f)):
                self.known += 1
                return
            raise Finding(f"{f}\n  request: app {app} {method} {path}?{query[:50]!r} disconnect={disconnect} "
                          f"body ({len(body)} bytes): {body[:1500]!r}") from None
        finally:
            self.count += 1
        if self.count % CHECK_EVERY == 0:
            self.check_engines()
        if self.count == WARMUP:
            self.rss_after_warmup = rss_mb()
        if self.count % LOG_EVERY == 0:
            rss = rss_mb()
            if self.log:
                took = time.monotonic() - self.started_at
                with open(self.log, "a") as f:
                    f.write(f"{time.strftime('%H:%M:%S')} inputs {self.count} seconds {took:.0f} "
                            f"per_s {self.count / took:.0f} rss_mb {rss:.0f} known {self.known} statuses "
                            f"{json.dumps(dict(sorted(self.statuses.items(), key=str)))}\n")
            if self.rss_after_warmup is not None and rss > self.rss_after_warmup + MEMORY_GROWTH_MB:
                raise Finding(f"RSS grew from {self.rss_after_warmup:.0f} MB to {rss:.0f} MB")


_harness = None


def harness() -> Harness:
    global _harness
    if _harness is None:
        _harness = Harness()
    return _harness


def TestOneInput(data: bytes):
    harness().run_one(data)


if __name__ == "__main__":
    main(TestOneInput)
