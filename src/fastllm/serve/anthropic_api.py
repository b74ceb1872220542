"""Anthropic's Messages API (/v1/messages, /v1/messages/count_tokens) over
the chat machinery of fastllm.serve.openai_api.

A Messages request is rewritten as the chat completion it amounts to
(system prompt, turns, tool_use blocks as tool calls, tool_result blocks
as tool messages, thinking blocks as reasoning_content, tools and
tool_choice, stop_sequences as stop strings, thinking as the template's
enable_thinking), and read by openai_api.parse_request, which checks and
renders it. The reply is shaped as Anthropic shapes it: content blocks
(thinking, text, tool_use), stop_reason, and when streamed, its events
(message_start, content_block_start/delta/stop, message_delta,
message_stop, with a ping). Errors have Anthropic's shape ({"type":
"error", "error": {"type", "message"}}). Nothing here speaks HTTP.
"""
from __future__ import annotations

import json
import uuid
from dataclasses import dataclass

from . import openai_api as api
from ..generate import toolcalls
from .openai_api import APIError, engine_error

# Anthropic's error types by HTTP status.
_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                404: "not_found_error", 408: "timeout_error", 413: "request_too_large",
                429: "rate_limit_error", 503: "overloaded_error", 529: "overloaded_error"}
_MEDIA = ("image", "document", "search_result", "container_upload")


def error_body(e: APIError) -> dict:
    kind = _ERROR_TYPES.get(e.status, "api_error" if e.status >= 500 else "invalid_request_error")
    return {"type": "error", "error": {"type": kind, "message": str(e)}}


def _bad(message: str, param: str | None = None) -> APIError:
    return APIError(400, message, param=param)


# -------------------------------------------------------------- the request

@dataclass
class Job:
    """A checked Messages request: the chat Generation and what its reply needs."""
    g: api.Generation
    name: str            # the model that answers


def chat_body(body: dict, count_only: bool = False) -> dict:
    """The OpenAI chat completion body that a Messages body amounts to,
    its Anthropic fields checked (count_only: /count_tokens', which
    needs no max_tokens)."""
    out = {}
    if count_only:
        api.field_of(body, "max_tokens", int, None, 1)
    else:
        if body.get("max_tokens") is None:
            raise _bad("'max_tokens' is required", "max_tokens")
        out["max_tokens"] = api.field_of(body, "max_tokens", int, None, 1)
    out["temperature"] = api.field_of(body, "temperature", float, None, 0, 1)
    out["top_p"] = api.field_of(body, "top_p", float, None, 0, 1)
    out["top_k"] = api.field_of(body, "top_k", int, None, 0)
    out["stream"] = api.field_of(body, "stream", bool, False)
    stops = body.get("stop_sequences")
    try:
        out["stop"] = api.stops_of({"stop": stops})
    except APIError as e:
        raise _bad(str(e).replace("'stop'", "'stop_sequences'"), "stop_sequences") from None
    messages = system_messages(body.get("system"))
    turns = body.get("messages")
    if not isinstance(turns, list) or not turns:
        raise _bad("'messages' must be a non-empty array of messages", "messages")
    for i, m in enumerate(turns):
        messages += chat_messages(m, i)
    out["messages"] = messages
    if body.get("tools") is not None:
        out["tools"] = tools_of(body["tools"])
    if body.get("tool_choice") is not None:
        out["tool_choice"], parallel = tool_choice_of(body["tool_choice"])
        if parallel is not None:
            out["parallel_tool_calls"] = parallel
    config = api.field_of(body, "output_config", dict, {})
    fmt = config.get("format")
    if fmt is not None:
        if not isinstance(fmt, dict) or fmt.get("type") != "json_schema" or not isinstance(fmt.get("schema"), dict):
            raise _bad("'output_config.format' must be {\"type\": \"json_schema\", \"schema\": {...}}",
                       "output_config")
        out["response_format"] = {"type": "json_schema", "json_schema": {"name": "output", "schema": fmt["schema"]}}
    thinking = body.get("thinking")
    if thinking is not None:
        kind = thinking.get("type") if isinstance(thinking, dict) else None
        if kind not in ("enabled", "disabled", "adaptive"):
            raise _bad("'thinking' must be {\"type\": \"enabled\", \"budget_tokens\": N} or "
                       "{\"type\": \"disabled\"}", "thinking")
        out["chat_template_kwargs"] = {"enable_thinking": kind != "disabled"}
    return {k: v for k, v in out.items() if v is not None}


def system_messages(system) -> list:
    if system is None:
        return []
    if isinstance(system, str):
        return [{"role": "system", "content": system}] if system else []
    if not isinstance(system, list):
        raise _bad("'system' must be a string or an array of text blocks", "system")
    texts = []
    for k, block in enumerate(system):
        if not isinstance(block, dict) or block.get("type") != "text" or not isinstance(block.get("text"), str):
            raise _bad(f"'system[{k}]' must be a text block ({{\"type\": \"text\", \"text\": \"...\"}})",
                       "system")
        texts.append(block["text"])
    return [{"role": "system", "content": "\n".join(texts)}] if texts else []


def chat_messages(m, i: int) -> list:
    """The chat messages of one Messages turn: an assistant turn is one
    message (text, reasoning, tool calls); a user turn gives a tool message
    per tool_result block, then its text."""
    where = f"messages[{i}]"
    if not isinstance(m, dict) or m.get("role") not in ("user", "assistant"):
        raise _bad(f"'{where}' must be an object with role 'user' or 'assistant'", "messages")
    role, content = m["role"], m.get("content")
    if isinstance(content, str):
        return [{"role": role, "content": content}]
    if not isinstance(content, list):
        raise _bad(f"'{where}.content' must be a string or an array of content blocks", "messages")
    texts, reasoning, calls, results = [], [], [], []
    for k, block in enumerate(content):
        at = f"{where}.content[{k}]"
        kind = block.get("type") if isinstance(block, dict) else None
        if kind == "text" and isinstance(block.get("text"), str):
            texts.append(block["text"])
        elif kind in _MEDIA:
            raise _bad(f"'{at}' is of type {kind!r}: this model reads text only", "messages")
        elif role == "assistant" and kind == "tool_use":
            calls.append(_tool_call(block, at))
        elif role == "assistant" and kind == "thinking" and isinstance(block.get("thinking"), str):
            reasoning.append(block["thinking"])
        elif role == "assistant" and kind == "redacted_thinking":
            continue   # encrypted for Anthropic's own models: nothing to read
        elif role == "user" and kind == "tool_result":
            results.append(_tool_result(block, at))
        else:
            raise _bad(f"'{at}' is not a content block of a {role} turn (text, "
                       f"{'tool_use, thinking' if role == 'assistant' else 'tool_result'})", "messages")
    if role == "assistant":
        out = {"role": "assistant", "content": "".join(texts)}
        if reasoning:
            out["reasoning_content"] = "\n".join(reasoning)
        if calls:
            out["tool_calls"] = calls
        return [out]
    return results + ([{"role": "user", "content": "\n".join(texts)}] if texts or not results else [])


def _tool_call(block: dict, at: str) -> dict:
    name, tool_id, arguments = block.get("name"), block.get("id"), block.get("input", {})
    if not isinstance(name, str) or not isinstance(tool_id, str) or not isinstance(arguments, dict):
        raise _bad(f"'{at}' must be a tool_use block with a string id and name and an object input",
                   "messages")
    return {"id": tool_id, "type": "function", "function": {"name": name, "arguments": arguments}}


def _tool_result(block: dict, at: str) -> dict:
    tool_id, content = block.get("tool_use_id"), block.get("content", "")
    if not isinstance(tool_id, str):
        raise _bad(f"'{at}.tool_use_id' must be a string", "messages")
    if isinstance(content, list):
        texts = []
        for j, part in enumerate(content):
            kind = part.get("type") if isinstance(part, dict) else None
            if kind == "text" and isinstance(part.get("text"), str):
                texts.append(part["text"])
            elif kind in _MEDIA:
                raise _bad(f"'{at}.content[{j}]' is of type {kind!r}: this model reads text only", "messages")
            else:
                raise _bad(f"'{at}.content[{j}]' must be a text block", "messages")
        content = "\n".join(texts)
    elif not isinstance(content, str):
        raise _bad(f"'{at}.content' must be a string or an array of text blocks", "messages")
    if block.get("is_error") is True:
        content = f"Error: {content}"
    return {"role": "tool", "tool_call_id": tool_id, "content": content}


def tools_of(tools) -> list:
    """Anthropic's tools as OpenAI's function tools (server tools refused)."""
    if not isinstance(tools, list):
        raise _bad("'tools' must be an array of tools", "tools")
    out = []
    for i, tool in enumerate(tools):
        if not isinstance(tool, dict):
            raise _bad(f"'tools[{i}]' must be an object", "tools")
        if tool.get("type") not in (None, "custom"):
            raise _bad(f"'tools[{i}]' is a server tool ({str(tool.get('type'))[:60]!r}): only tools the client "
                       "runs (name, description, input_schema) are supported", "tools")
        function = {"name": tool.get("name"), "parameters": tool.get("input_schema")}
        if tool.get("description") is not None:
            function["description"] = tool["description"]
        if function["parameters"] is None:
            raise _bad(f"'tools[{i}].input_schema' is required", "tools")
        out.append({"type": "function", "function": function})
    return out


def tool_choice_of(choice) -> tuple:
    """(OpenAI's tool_choice, parallel_tool_calls or None) of Anthropic's tool_choice."""
    kind = choice.get("type") if isinstance(choice, dict) else None
    parallel = None
    if isinstance(choice, dict) and choice.get("disable_parallel_tool_use") is not None:
        if not isinstance(choice["disable_parallel_tool_use"], bool):
            raise _bad("'tool_choice.disable_parallel_tool_use' must be true or false", "tool_choice")
        parallel = not choice["disable_parallel_tool_use"]
    if kind in ("auto", "none"):
        return kind, parallel
    if kind == "any":
        return "required", parallel
    if kind == "tool" and isinstance(choice.get("name"), str):
        return {"type": "function", "function": {"name": choice["name"]}}, parallel
    raise _bad("'tool_choice' must be {\"type\": \"auto\"}, {\"type\": \"any\"}, {\"type\": \"none\"} or "
               "{\"type\": \"tool\", \"name\": ...}", "tool_choice")


def read_request(body: dict, model, name: str, seed: int | None = None) -> Job:
    """A /v1/messages body (a JSON object) as a Job, every field checked;
    seed: the server's for sampling (None: random)."""
    return Job(api.parse_request(chat_body(body), True, model, max_choices=1, seed=seed), name)


def count_tokens(body: dict, model) -> dict:
    """/v1/messages/count_tokens: the prompt's tokens, as the model's
    template renders it with its tools."""
    chat = chat_body(body, count_only=True)
    tools, choice = api.tools_of(chat)
    ids, _ = api.chat_prompt(chat, model, tools if choice != "none" else None)
    return {"input_tokens": len(ids)}


# -------------------------------------------------------------- the reply

def _message_id() -> str:
    return "msg_" + uuid.uuid4().hex[:24]


def _tool_id() -> str:
    return "toolu_" + uuid.uuid4().hex[:24]


def stop_reason(job: Job, index: int, request, state: dict, completions, called: bool) -> tuple:
    """(stop_reason, stop_sequence) of how a reply ended."""
    stop = state["stopped"].get(index)
    if stop is not None:
        return "stop_sequence", stop
    reason = completions.finish(index, request, state)
    if reason == "length":
        return "max_tokens", None
    return ("tool_use" if called else "end_turn"), None


def usage(job: Job, output_tokens: int) -> dict:
    return {"input_tokens": len(job.g.prompt_ids), "output_tokens": output_tokens,
            "cache_creation_input_tokens": 0, "cache_read_input_tokens": 0}


def content_blocks(job: Job, text: str) -> tuple:
    """(content blocks, whether it calls tools) of a whole reply's text."""
    reply = toolcalls.parse_reply(text, **job.g.reply) if job.g.reply else toolcalls.Reply(content=text)
    blocks = []
    if reply.reasoning is not None:
        blocks.append({"type": "thinking", "thinking": reply.reasoning, "signature": ""})
    if reply.content or not reply.tool_calls:
        blocks.append({"type": "text", "text": reply.content})
    for call in reply.tool_calls:
        blocks.append({"type": "tool_use", "id": _tool_id(), "name": call["function"]["name"],
                       "input": json.loads(call["function"]["arguments"] or "{}")})
    return blocks, bool(reply.tool_calls)


def message(job: Job, mid: str, content: list, reason, stop, output_tokens: int) -> dict:
    return {"id": mid, "type": "message", "role": "assistant", "model": job.name, "content": content,
            "stop_reason": reason, "stop_sequence": stop, "usage": usage(job, output_tokens)}


async def whole(job: Job, completions, requests, http_request) -> dict:
    """The Message that answers job (run as completions.run runs it)."""
    text, state = await completions.reply(job.g, requests, http_request)
    content, called = content_blocks(job, text)
    reason, stop = stop_reason(job, 0, requests[0], state, completions, called)
    return message(job, _message_id(), content, reason, stop, requests[0].generated)


def event(kind: str, data: dict) -> str:
    return f"event: {kind}\ndata: {json.dumps(dict(type=kind, **data))}\n\n"


def error_event(e: APIError) -> str:
    return f"event: error\ndata: {json.dumps(error_body(e))}\n\n"


class _Blocks:
    """The content blocks of a streamed reply: one is open at a time, and
    a delta of another kind closes it and opens the next."""

    def __init__(self):
        self.index, self.kind, self.tool = -1, None, None

    def open(self, kind: str, block: dict) -> list:
        out = self.close()
        self.index, self.kind = self.index + 1, kind
        return out + [event("content_block_start", {"index": self.index, "content_block": block})]

    def close(self) -> list:
        if self.kind is None:
            return []
        out = []
        if self.kind == "thinking":   # a thinking block ends with its signature
            out.append(event("content_block_delta", {"index": self.index,
                                                     "delta": {"type": "signature_delta", "signature": ""}}))
        out.append(event("content_block_stop", {"index": self.index}))
        self.kind, self.tool = None, None
        return out

    def delta(self, d) -> list:
        """The events of a toolcalls.Delta."""
        if d.kind == "tool_call":
            out = []
            function = d.call.get("function", {})
            if self.kind != "tool_use" or self.tool != d.index:
                out = self.open("tool_use", {"type": "tool_use", "id": _tool_id(),
                                             "name": function.get("name", ""), "input": {}})
                self.tool = d.index
            if function.get("arguments"):
                out.append(event("content_block_delta", {"index": self.index, "delta": {
                    "type": "input_json_delta", "partial_json": function["arguments"]}}))
            return out
        if not d.text:
            return []
        kind, field, delta = (("thinking", "thinking", "thinking_delta") if d.kind == "reasoning"
                              else ("text", "text", "text_delta"))
        out = [] if self.kind == kind else self.open(kind, {"type": kind, field: ""})
        return out + [event("content_block_delta", {"index": self.index,
                                                    "delta": {"type": delta, field: d.text}})]


async def events(job: Job, completions, requests, http_request):
    """The server-sent events of a streamed reply."""
    reader = api.reply_stream(job.g)
    blocks, state, opened = _Blocks(), completions.new_state(), False
    try:
        yield event("message_start", {"message": message(job, _message_id(), [], None, None, 0)})
        yield event("ping", {})
        async for index, piece, extra in completions.run(job.g, requests, http_request, state):
            if piece is None:
                if extra is not None:
                    yield error_event(engine_error(extra))
                    return
                deltas = reader.close() if reader is not None else []
            else:
                deltas = reader.feed(piece) if reader is not None else \
                    [toolcalls.Delta("content", piece)]
            for d in deltas:
                for e in blocks.delta(d):
                    opened = True
                    yield e
        if not opened:   # an empty reply still has its (empty) text block
            for e in blocks.open("text", {"type": "text", "text": ""}):
                yield e
        for e in blocks.close():
            yield e
        called = reader is not None and reader.called
        reason, stop = stop_reason(job, 0, requests[0], state, completions, called)
        yield event("message_delta", {"delta": {"stop_reason": reason, "stop_sequence": stop},
                                      "usage": {"output_tokens": requests[0].generated}})
        yield event("message_stop", {})
    finally:
        for r in requests:
            r.cancel()
