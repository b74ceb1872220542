"""OpenAI's completions and chat completions API as plain functions: a
request body read into what the engine runs (prompt ids, sampling, limits),
every field checked before anything is submitted, and the engine's output
shaped into OpenAI's responses and stream chunks. Nothing here speaks HTTP
(fastllm.serve.server routes requests to these functions).

The server's fallbacks for fields a request leaves out are, in order: the
model's generation_config.json, then OpenAI's defaults (temperature 1,
16 tokens for a completion; a chat reply may run to the end of the context).
"""
from __future__ import annotations

import json
import math
import numbers
from dataclasses import dataclass, field


from ..generate import toolcalls
from ..generate.constrain import reply_grammar, response_format_schema
from ..formats.safetensors import json_depth
from ..generate.sampling import SamplingParams
from ..tokenizer.errors import TokenizerError
from ..spec.version import __version__
from ..core._core import int8_path, simd_path

ROLES = ("system", "developer", "user", "assistant", "tool")
MAX_CHOICES = 16          # n
MAX_STOPS = 16            # stop strings per request
MAX_STOP_CHARS = 200      # each is looked for at every token: kept short
MAX_TOP_LOGPROBS = 20     # chat (completions: 5, as OpenAI's)
MAX_PROMPTS = 64          # prompts of one completions request (the server's own bound: its queue)
MAX_ECHO_TOKENS = 16384   # prompt tokens one request may have scored (echo with logprobs)
MAX_JSON_DEPTH = 64       # nesting of the request body
# Arguments of apply_chat_template that chat_template_kwargs may not set.
_TEMPLATE_ARGUMENTS = ("messages", "add_generation_prompt", "tools", "tokenize", "chat_template",
                       "documents", "continue_final_message")


class APIError(Exception):
    """A request answered with an error, in OpenAI's shape (error_body)."""

    def __init__(self, status: int, message: str, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None, headers: dict | None = None):
        super().__init__(message)
        self.status, self.type, self.param, self.code, self.headers = status, type, param, code, headers


def error_body(e: APIError) -> dict:
    return {"error": {"message": str(e), "type": e.type, "param": e.param, "code": e.code}}


def server_error(message: str, status: int = 500) -> APIError:
    return APIError(status, message, type="server_error")


# -------------------------------------------------------------- the body

def parse_json(raw: bytes, max_depth: int = MAX_JSON_DEPTH) -> dict:
    """The request body as a JSON object, its nesting bounded before it is
    parsed (Python's parser recurses once per level)."""
    if _nesting(raw) > max_depth:
        raise APIError(400, f"the request body nests JSON deeper than {max_depth} levels")
    try:
        body = json.loads(raw, parse_constant=_no_constant)
    except (ValueError, UnicodeDecodeError, RecursionError):
        raise APIError(400, "the request body is not valid JSON") from None
    if not isinstance(body, dict):
        raise APIError(400, "the request body must be a JSON object")
    return body


def _no_constant(name):
    raise ValueError(f"{name} is not JSON")   # NaN and Infinity, which Python's json accepts


def _nesting(raw: bytes) -> int:
    """The deepest nesting of brackets outside strings (the JSON's depth,
    counted without parsing, in one pass)."""
    if raw.count(b"[") + raw.count(b"{") == 0:
        return 0
    return json_depth(raw)


def _whole(v) -> bool:
    return isinstance(v, numbers.Integral) and not isinstance(v, bool)


def _number(v) -> bool:
    return isinstance(v, numbers.Real) and not isinstance(v, bool) and math.isfinite(v)


_KINDS = {int: ("an integer", _whole), float: ("a number", _number), bool: ("true or false", None),
          str: ("a string", None), list: ("an array", None), dict: ("an object", None)}


def field_of(body: dict, name: str, kind, default=None, lo=None, hi=None):
    """body[name] checked: of kind (int, float, bool, str, list, dict) and
    within [lo, hi]; absent or null gives default."""
    value = body.get(name)
    if value is None:
        return default
    what, check = _KINDS[kind]
    ok = check(value) if check else isinstance(value, kind)
    if ok and ((lo is not None and value < lo) or (hi is not None and value > hi)):
        ok = False
    if not ok:
        if lo is not None and hi is not None:
            what += f" from {lo} to {hi}"
        elif lo is not None:
            what += f" >= {lo}"
        raise APIError(400, f"'{name}' must be {what}, got {_short(value)}", param=name)
    return float(value) if kind is float else value


def _short(value) -> str:
    text = json.dumps(value) if not isinstance(value, float) else repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


# ----------------------------------------------------------- the request

@dataclass
class Generation:
    """A request, checked and ready for the engine."""
    chat: bool
    prompt_ids: list
    max_tokens: int
    samplings: list               # one SamplingParams per choice (n)
    stops: list                   # stop strings
    stop_ids: set | None          # None: the model's end-of-sequence tokens
    top_logprobs: int | None      # None: no logprobs
    stream: bool = False
    include_usage: bool = False
    constraints: list | None = None   # one per choice, for constrained decoding
    extra: dict = field(default_factory=dict)
    # How a chat reply is read (toolcalls.ReplyStream's options: reasoning,
    # tools and their format); None: the text as it is.
    reply: dict | None = None
    # llama-server's "speculative.n_max": at most this many guesses a pass
    # (0: no speculative decoding for this request); None: the server's.
    draft_max: int | None = None
    # A completions request of several prompts: those after prompt_ids, each
    # with choices of its own (choice index: prompt * n + choice, as OpenAI's).
    more_prompts: list = field(default_factory=list)
    # echo: per prompt, its text, given before what is generated (and, with
    # logprobs, the logprobs of its tokens); None: no echo.
    echo: list | None = None
    fingerprint: str | None = None    # system_fingerprint

    @property
    def prompts(self) -> list:
        return [self.prompt_ids, *self.more_prompts]

    @property
    def prompt_tokens(self) -> int:
        return sum(len(p) for p in self.prompts)


def parse_request(body: dict, chat: bool, model, max_choices: int = MAX_CHOICES,
                  max_prompts: int = MAX_PROMPTS, seed: int | None = None) -> Generation:
    """body (a JSON object) of /v1/chat/completions (chat) or /v1/completions
    as a Generation, every field checked; the prompt is rendered and
    tokenized last, and only once it is known to fit the context.
    A completions request may give up to max_prompts prompts; seed is
    that of a request that gives none (None: a random one).
    APIError (400) names the first bad field."""
    model_field = body.get("model")
    if model_field is not None and not isinstance(model_field, str):
        raise APIError(400, "'model' must be a string", param="model")
    samplings = sampling_of(body, model, max_choices, seed)
    stops = stops_of(body)
    stream = field_of(body, "stream", bool, False)
    options = field_of(body, "stream_options", dict, {})
    include_usage = field_of(options, "include_usage", bool, False) if stream else False
    stop_ids = set() if field_of(body, "ignore_eos", bool, False) else None
    draft_max = field_of(body, "speculative.n_max", int, None, 0, 64)
    response_format = body.get("response_format")
    try:
        response_format_schema(response_format)
    except ValueError as e:
        raise APIError(400, str(e), param="response_format") from None
    reply = None
    if chat:
        limit = field_of(body, "max_completion_tokens", int, None, 1)
        limit = field_of(body, "max_tokens", int, None, 1) if limit is None else limit
        want = field_of(body, "logprobs", bool, False)
        top = field_of(body, "top_logprobs", int, 0, 0, MAX_TOP_LOGPROBS)
        top_logprobs = top if want else None
        tools, choice = tools_of(body)
        parallel = field_of(body, "parallel_tool_calls", bool, True)
        ids, prompt = chat_prompt(body, model, tools if choice != "none" else None)
        reply = reply_options(model, prompt, tools, choice)
        grammar = grammar_of(model, response_format=response_format, tools=tools, tool_choice=choice,
                             fmt=reply["fmt"], parallel=parallel, reasoning=reply["reasoning"])
    else:
        echo = field_of(body, "echo", bool, False)
        # max_tokens 0 scores a text without generating (echo, as OpenAI's)
        limit = field_of(body, "max_tokens", int, None, 0 if echo else 1)
        top_logprobs = field_of(body, "logprobs", int, None, 0, 5)
        if field_of(body, "suffix", str, None):
            raise APIError(400, "'suffix' is not supported", param="suffix")
        prompts, texts = completion_prompts(body, model, max_prompts)
        if echo and top_logprobs is not None and sum(map(len, prompts)) > MAX_ECHO_TOKENS:
            raise APIError(400, f"'echo' with 'logprobs' scores at most {MAX_ECHO_TOKENS} prompt tokens "
                                f"per request; these prompts have {sum(map(len, prompts))}", param="echo")
        ids = max(prompts, key=len)
        grammar = grammar_of(model, response_format=response_format)
    room = model.n_ctx - len(ids)
    if limit is None:
        limit = model.default_max_new_tokens(len(ids), room if chat else 16)
    if chat:
        prompts, echoed, least = [ids], None, 1
    else:
        echoed = [t if t is not None else model.tokenizer.decode(p) for p, t in zip(prompts, texts)] \
            if echo else None
        least = 0 if echo else 1
    constraints = None if grammar is None else [grammar.start() for _ in range(len(prompts) * len(samplings))]
    return Generation(chat, prompts[0], max(least, min(limit, room)), samplings, stops, stop_ids,
                      top_logprobs, stream, include_usage, constraints, reply=reply,
                      draft_max=draft_max, more_prompts=prompts[1:], echo=echoed,
                      fingerprint=system_fingerprint(model))


def sampling_of(body: dict, model, max_choices: int = MAX_CHOICES, default_seed: int | None = None) -> list:
    """One SamplingParams per choice: the request's settings over the
    model's generation_config.json over OpenAI's defaults. A seed (the
    request's, else default_seed: a server's, as llama-server's --seed)
    gives choice i the seed + i, so that every choice is reproducible and
    differs."""
    n = field_of(body, "n", int, 1, 1, max_choices)
    base = SamplingParams(temperature=1.0).replace(**{
        k: v for k, v in model.generation_defaults.items() if k != "max_new_tokens"})
    top_k = field_of(body, "top_k", int, None, -1)
    seed = field_of(body, "seed", int, default_seed, -1, 2**64 - 1)
    changes = {
        "temperature": field_of(body, "temperature", float, None, 0, 2),
        "top_p": field_of(body, "top_p", float, None, 0, 1),
        "top_k": None if top_k is None else max(top_k, 0),   # -1: off, as in llama.cpp
        "min_p": field_of(body, "min_p", float, None, 0, 1),
        "repetition_penalty": field_of(body, "repetition_penalty", float, None),
        "frequency_penalty": field_of(body, "frequency_penalty", float, None, -2, 2),
        "presence_penalty": field_of(body, "presence_penalty", float, None, -2, 2),
        "logit_bias": logit_bias_of(body, model.config.vocab_size),
    }
    try:
        params = base.replace(**{k: v for k, v in changes.items() if v is not None})
    except ValueError as e:
        raise APIError(400, str(e), param=str(e).split()[0]) from None
    if seed is None or seed == -1:   # -1: a random seed, as in llama.cpp
        return [params] * n
    return [params.replace(seed=(seed + i) % 2**64) for i in range(n)]


def logit_bias_of(body: dict, vocab_size: int):
    """logit_bias ({"token id": bias}) as {id: bias}, ids in the vocabulary."""
    bias = field_of(body, "logit_bias", dict, None)
    if bias is None:
        return None
    out = {}
    for key, value in bias.items():
        try:
            token = int(key)
        except ValueError:
            token = -1
        if not 0 <= token < vocab_size or str(token) != key.strip():
            raise APIError(400, f"'logit_bias' keys must be token ids from 0 to {vocab_size - 1}, "
                                f"got {_short(key)}", param="logit_bias")
        if not _number(value) or not -100 <= value <= 100:
            raise APIError(400, f"'logit_bias' values must be numbers from -100 to 100, got "
                                f"{_short(value)}", param="logit_bias")
        out[token] = float(value)
    return out


def stops_of(body: dict) -> list:
    stop = body.get("stop")
    if stop is None:
        return []
    stops = [stop] if isinstance(stop, str) else stop
    if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops) or \
            len(stops) > MAX_STOPS:
        raise APIError(400, f"'stop' must be a string or an array of at most {MAX_STOPS} strings",
                       param="stop")
    if not all(0 < len(s) <= MAX_STOP_CHARS for s in stops):
        raise APIError(400, f"'stop' strings must have 1 to {MAX_STOP_CHARS} characters "
                            "(an empty one would match before any text)", param="stop")
    return stops


def completion_prompts(body: dict, model, max_prompts: int = MAX_PROMPTS) -> tuple:
    """(ids of each prompt, the text of each, None where it came as ids) of
    a completions request, whose prompt is, as in OpenAI's API, a string, an
    array of strings, an array of token ids or an array of such arrays. Their
    count is checked before any is tokenized."""
    prompt = body.get("prompt")
    if isinstance(prompt, str) or (isinstance(prompt, list) and prompt and all(_whole(t) for t in prompt)):
        prompt = [prompt]
    shape = APIError(400, "'prompt' must be a string, an array of strings, a non-empty array of token "
                          "ids, or an array of such arrays", param="prompt")
    if not isinstance(prompt, list) or not prompt:
        raise shape
    if len(prompt) > max_prompts:
        raise APIError(400, f"'prompt' gives {len(prompt)} prompts: this server takes at most "
                            f"{max_prompts} per request", param="prompt")
    if not all(isinstance(p, str) or (isinstance(p, list) and p and all(_whole(t) for t in p)) for p in prompt):
        raise shape
    ids, texts = [], []
    for i, p in enumerate(prompt):
        where = "prompt" if len(prompt) == 1 else f"prompt[{i}]"
        ids.append(encode(model, p, True, where) if isinstance(p, str) else token_ids(p, model, where))
        texts.append(p if isinstance(p, str) else None)
    return ids, texts


def token_ids(prompt: list, model, where: str) -> list:
    """A prompt given as token ids, checked: it fits the context and every
    id is in the vocabulary."""
    fit_context(len(prompt), model, where)
    bad = next((t for t in prompt if not 0 <= t < model.config.vocab_size), None)
    if bad is not None:
        raise APIError(400, f"'{where}' token id {bad} is outside the vocabulary "
                            f"(0..{model.config.vocab_size - 1})", param="prompt")
    return [int(t) for t in prompt]


def encode(model, text: str, add_special_tokens: bool, param: str) -> list:
    """text's ids; text that cannot fit the context whatever its tokens is
    refused before it is tokenized, so a huge prompt costs no more than one
    the context holds."""
    per_token = model.tokenizer.max_chars_per_token
    if per_token is not None and len(text) > model.n_ctx * per_token:
        raise APIError(400, f"the {param} has {len(text)} characters: more tokens than the context "
                            f"of {model.n_ctx} holds", param=param, code="context_length_exceeded")
    try:
        ids = model.tokenizer.encode(text, add_special_tokens=add_special_tokens)
    except TokenizerError as e:   # text that is not Unicode (a lone surrogate)
        raise APIError(400, f"the {param} cannot be tokenized: {e}", param=param) from None
    fit_context(len(ids), model, param)
    return ids


def fit_context(n: int, model, param: str):
    if n >= model.n_ctx:
        raise APIError(400, f"the {param} has {n} tokens: the context holds {model.n_ctx} "
                            f"(the server's --ctx)", param=param, code="context_length_exceeded")


def chat_prompt(body: dict, model, tools: dict | None = None) -> tuple:
    """(ids, text) of the chat prompt, tools (check_tools's) described to
    the model: by its template, or else in the system turn."""
    messages = [message_of(m, i) for i, m in enumerate(_messages(body))]
    kwargs = field_of(body, "chat_template_kwargs", dict, {})
    clash = [k for k in kwargs if k in _TEMPLATE_ARGUMENTS]
    if clash:
        raise APIError(400, f"'chat_template_kwargs' may not set {clash[0]!r}",
                       param="chat_template_kwargs")
    tool_list = None if tools is None else body["tools"]
    messages, tool_list = toolcalls.messages_for_template(messages, tool_list, model.tokenizer.chat_template)
    try:
        prompt = model.tokenizer.apply_chat_template(messages, add_generation_prompt=True,
                                                     tools=tool_list, **kwargs)
    except Exception as e:   # the model's own template refuses these messages
        raise APIError(400, f"the chat template cannot render these messages: {e}",
                       param="messages") from None
    return encode(model, prompt, False, "messages"), prompt


def tools_of(body: dict) -> tuple:
    """(tools as {name: parameters schema} or None, tool_choice: None,
    "none", "auto", "required" or a function's name), checked."""
    tools = body.get("tools")
    try:
        checked = None if tools is None else toolcalls.check_tools(tools)
    except ValueError as e:
        raise APIError(400, str(e), param="tools") from None
    try:
        return checked, toolcalls.check_tool_choice(body.get("tool_choice"), checked)
    except ValueError as e:
        raise APIError(400, str(e), param="tool_choice") from None


def reply_options(model, prompt: str, tools: dict | None, choice: str | None) -> dict:
    """How the reply to prompt is read (toolcalls.ReplyStream's options)."""
    template = model.tokenizer.chat_template
    return {"reasoning": toolcalls.reasoning_mode(template, prompt),
            "tools": dict(tools) if tools and choice != "none" else None,
            "fmt": toolcalls.tool_format(template)}


def grammar_of(model, **options):
    """constrain.reply_grammar's Grammar (or None), its refusals as 400s."""
    try:
        return reply_grammar(model, **options)
    except ImportError as e:
        raise APIError(501, str(e), type="server_error", param="response_format") from None
    except ValueError as e:
        param = "tools" if str(e).startswith("tools") else "response_format"
        raise APIError(400, str(e), param=param) from None


def _messages(body: dict) -> list:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise APIError(400, "'messages' must be a non-empty array of messages", param="messages")
    return messages


def message_of(m, i: int) -> dict:
    """An OpenAI message as chat templates take it: content parts joined
    into one string, null content (an assistant's tool calls) as "", and a
    tool call's JSON arguments as an object, as transformers' templates
    expect them."""
    where = f"messages[{i}]"
    if not isinstance(m, dict):
        raise APIError(400, f"'{where}' must be an object", param="messages")
    role = m.get("role")
    if role not in ROLES:
        raise APIError(400, f"'{where}.role' must be one of {', '.join(ROLES)}, got {_short(role)}",
                       param="messages")
    out = {"role": role, "content": content_of(m.get("content"), role, where)}
    for key in ("name", "tool_call_id", "reasoning_content"):
        if m.get(key) is not None:
            if not isinstance(m[key], str):
                raise APIError(400, f"'{where}.{key}' must be a string", param="messages")
            out[key] = m[key]
    if m.get("tool_calls") is not None:
        if role != "assistant":
            raise APIError(400, f"'{where}': only assistant messages carry tool_calls", param="messages")
        out["tool_calls"] = [tool_call_of(c, f"{where}.tool_calls[{k}]")
                             for k, c in enumerate(_list(m["tool_calls"], f"{where}.tool_calls"))]
    elif m.get("content") is None and role != "assistant":
        raise APIError(400, f"'{where}.content' must be a string or an array of content parts",
                       param="messages")
    return out


def _list(value, where: str) -> list:
    if not isinstance(value, list):
        raise APIError(400, f"'{where}' must be an array", param="messages")
    return value


def content_of(content, role: str, where: str) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    parts = []
    for k, part in enumerate(_list(content, f"{where}.content")):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind == "text" and isinstance(part.get("text"), str):
            parts.append(part["text"])
        elif kind in ("image_url", "input_image", "input_audio", "file", "image", "audio"):
            raise APIError(400, f"'{where}.content[{k}]' is of type {kind!r}: this model reads "
                                "text only", param="messages")
        else:
            raise APIError(400, f"'{where}.content[{k}]' must be a text part "
                                '({"type": "text", "text": "..."})', param="messages")
    return "\n".join(parts)


def tool_call_of(call, where: str) -> dict:
    function = call.get("function") if isinstance(call, dict) else None
    if not isinstance(function, dict) or not isinstance(function.get("name"), str):
        raise APIError(400, f"'{where}' must be an object with a function and its name",
                       param="messages")
    arguments = function.get("arguments", {})
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments) if arguments.strip() else {}
        except ValueError:
            pass   # passed on as the client wrote it
    out = {"type": call.get("type", "function"),
           "function": {"name": function["name"], "arguments": arguments}}
    if isinstance(call.get("id"), str):
        out["id"] = call["id"]
    return out


# ---------------------------------------------------------- the response

def finish_reason(reason: str) -> str:
    """The engine's finish reason in OpenAI's words."""
    return "stop" if reason in ("stop", "cancelled") else "length"


def usage(n_prompt: int, completion_tokens: int, cached_tokens: int = 0) -> dict:
    """OpenAI's usage; cached_tokens: the prompt tokens whose keys and values
    the server already held (a prefix shared with an earlier request)."""
    return {"prompt_tokens": n_prompt, "completion_tokens": completion_tokens,
            "total_tokens": n_prompt + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens}}


def system_fingerprint(model) -> str:
    """What a reply's bits depend on besides the request: fastllm's version,
    the SIMD and int8 kernels this CPU runs, and the activations' type."""
    return f"fastllm-{__version__}-{simd_path()}-{int8_path()}-{model.activations}"


def chat_logprobs(tokenizer, entries, top: int) -> dict:
    """Chat logprobs of [(token, (logprob, [(id, logprob), ...]))]."""
    out = []
    for token, (lp, best) in entries:
        s = tokenizer.decode([token])
        out.append({"token": s, "logprob": lp, "bytes": list(s.encode()),
                    "top_logprobs": [{"token": (t := tokenizer.decode([i])), "logprob": v,
                                      "bytes": list(t.encode())} for i, v in best[:top]]})
    return {"content": out}


def completion_logprobs(tokenizer, entries, offset: int) -> dict:
    """Completions logprobs, text offsets counted from offset. An entry of
    None (an echoed prompt's first token, which nothing predicts) is null."""
    tokens, lps, tops, offsets = [], [], [], []
    for token, entry in entries:
        s = tokenizer.decode([token])
        tokens.append(s), offsets.append(offset)
        lps.append(None if entry is None else entry[0])
        tops.append(None if entry is None else {tokenizer.decode([i]): v for i, v in entry[1]})
        offset += len(s)
    return {"tokens": tokens, "token_logprobs": lps, "top_logprobs": tops, "text_offset": offsets}


def logprobs_of(g: Generation, tokenizer, entries, offset: int = 0):
    if g.top_logprobs is None:
        return None
    return chat_logprobs(tokenizer, entries, g.top_logprobs) if g.chat else \
        completion_logprobs(tokenizer, entries, offset)


def choice(g: Generation, index: int, text: str, reason: str, logprobs) -> dict:
    """One choice of a whole (not streamed) response."""
    out = {"index": index, "finish_reason": reason, "logprobs": logprobs}
    if g.chat:
        out["message"], out["finish_reason"] = chat_message(g, text, reason)
    else:
        out["text"] = text
    return out


def chat_message(g: Generation, text: str, reason: str) -> tuple:
    """(the assistant's message, finish reason) of a chat reply's text: its
    reasoning_content and tool_calls apart from its content."""
    if g.reply is None:
        return {"role": "assistant", "content": text}, reason
    reply = toolcalls.parse_reply(text, **g.reply)
    message = {"role": "assistant", "content": reply.content if reply.content or not reply.tool_calls else None}
    if reply.reasoning is not None:
        message["reasoning_content"] = reply.reasoning
    if reply.tool_calls:
        message["tool_calls"] = reply.tool_calls
    return message, finish_with_calls(reason, bool(reply.tool_calls))


def finish_with_calls(reason: str, called: bool) -> str:
    """OpenAI's "tool_calls" for a reply that ended calling tools."""
    return "tool_calls" if called and reason == "stop" else reason


def kept_specials(g: Generation) -> tuple:
    """Special tokens a reply is decoded with: the markers of the tool
    calls it is read for (Mistral's are special tokens)."""
    if not g.chat or g.reply is None or not g.reply["tools"]:
        return ()
    return g.reply["fmt"].markers


def reply_stream(g: Generation):
    """A choice's toolcalls.ReplyStream, or None where the text goes out as it is."""
    return toolcalls.ReplyStream(**g.reply) if g.chat and g.reply is not None else None


def delta_choices(g: Generation, index: int, deltas, logprobs=None) -> list:
    """Stream chunk choices of a ReplyStream's deltas (the logprobs of the
    tokens they came from on the first; an empty content delta carries
    them where the text is held back)."""
    out = []
    for d in deltas:
        if d.kind == "tool_call":
            delta = {"tool_calls": [{"index": d.index, **d.call}]}
        else:
            delta = {"reasoning_content" if d.kind == "reasoning" else "content": d.text}
        out.append({"index": index, "logprobs": None if out else logprobs, "finish_reason": None,
                    "delta": delta})
    if not out and logprobs is not None:
        out.append({"index": index, "logprobs": logprobs, "finish_reason": None, "delta": {"content": ""}})
    return out


def response(g: Generation, rid: str, created: int, model_name: str, choices: list,
             completion_tokens: int, cached_tokens: int = 0) -> dict:
    return {"id": rid, "object": "chat.completion" if g.chat else "text_completion",
            "created": created, "model": model_name, "system_fingerprint": g.fingerprint,
            "choices": choices, "usage": usage(g.prompt_tokens, completion_tokens, cached_tokens)}


def chunk_choice(g: Generation, index: int, text: str | None = None, reason: str | None = None,
                 logprobs=None, role: bool = False) -> dict:
    """One choice of a stream chunk: the first (role), a piece of text, or
    the last (reason)."""
    out = {"index": index, "logprobs": logprobs, "finish_reason": reason}
    if g.chat:
        delta = {"role": "assistant", "content": ""} if role else {} if reason else {"content": text}
        out["delta"] = delta
    else:
        out["text"] = text or ""
    return out


def chunk(g: Generation, rid: str, created: int, model_name: str, choices: list, **extra) -> str:
    """A server-sent event of a stream."""
    body = {"id": rid, "object": "chat.completion.chunk" if g.chat else "text_completion",
            "created": created, "model": model_name, "system_fingerprint": g.fingerprint,
            "choices": choices, **extra}
    return f"data: {json.dumps(body)}\n\n"


def error_event(e: APIError) -> str:
    """An error after a stream has begun (its status was 200 already)."""
    return f"data: {json.dumps(error_body(e))}\n\n"


def engine_error(e: BaseException) -> APIError:
    """An error the engine met while running a request: the caller's fault
    (ValueError) is a 400, anything else a 500."""
    if isinstance(e, ValueError):
        return APIError(400, str(e))
    return server_error(f"generation failed: {type(e).__name__}: {e}")
