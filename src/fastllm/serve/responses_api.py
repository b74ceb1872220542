"""OpenAI's Responses API (/v1/responses) over the chat machinery of
fastllm.serve.openai_api.

A request's instructions and input items (messages, function calls and
their outputs, reasoning) become the chat conversation they amount to,
after the conversation of previous_response_id where it names one; tools,
tool_choice, max_output_tokens and text.format (structured output) map to
their chat completion fields, and openai_api.parse_request checks and
renders the whole. The reply comes back as output items (reasoning,
message, function_call), whole or as the Responses stream's events.

Responses are kept (unless "store": false) in a ResponseStore, bounded in
count and in size, least recently used out first: previous_response_id
continues a kept conversation, GET and DELETE /v1/responses/{id} read and
drop one. Nothing here speaks HTTP.
"""
from __future__ import annotations

import collections
import json
import threading
import time
import uuid
from dataclasses import dataclass, field

from . import openai_api as api
from ..generate import toolcalls
from .openai_api import APIError, engine_error

_MEDIA = ("input_image", "input_file", "input_audio", "image_url", "image", "file")


def _new_id(prefix: str) -> str:
    return prefix + uuid.uuid4().hex[:24]


class ResponseStore:
    """Responses by id, with the chat conversation each one ended: at most
    max_items of them and max_chars of their JSON together; the least
    recently used go first, and one larger than max_chars is not kept."""

    def __init__(self, max_items: int = 1024, max_chars: int = 64 * 2**20):
        self.max_items, self.max_chars = max_items, max_chars
        self._items = collections.OrderedDict()   # id -> (messages, response, chars)
        self._chars = 0
        self._lock = threading.Lock()   # requests are read on worker threads

    def put(self, rid: str, messages: list, response: dict):
        chars = len(json.dumps(messages)) + len(json.dumps(response))
        with self._lock:
            if chars > self.max_chars:
                return
            while self._items and (len(self._items) >= self.max_items or self._chars + chars > self.max_chars):
                self._chars -= self._items.popitem(last=False)[1][2]
            self._items[rid] = (messages, response, chars)
            self._chars += chars

    def _entry(self, rid, status: int, param: str | None, code: str):
        with self._lock:
            entry = self._items.get(rid) if isinstance(rid, str) else None
            if entry is not None:
                self._items.move_to_end(rid)
                return entry
        name = rid[:100] if isinstance(rid, str) else rid
        raise APIError(status, f"Previous response with id {name!r} not found (never made here, made with "
                               f"\"store\": false, or no longer kept)" if param else
                       f"Response with id {name!r} not found", param=param, code=code)

    def messages(self, rid) -> list:
        """The conversation that response rid ended (APIError 400 when it is not kept)."""
        return list(self._entry(rid, 400, "previous_response_id", "previous_response_not_found")[0])

    def get(self, rid: str) -> dict:
        return self._entry(rid, 404, None, "not_found")[1]

    def delete(self, rid: str) -> dict:
        self._entry(rid, 404, None, "not_found")
        with self._lock:
            entry = self._items.pop(rid, None)
            if entry is not None:
                self._chars -= entry[2]
        return {"id": rid, "object": "response", "deleted": True}

    def __len__(self):
        return len(self._items)


# -------------------------------------------------------------- the request

@dataclass
class Job:
    """A checked Responses request: the chat Generation, what the response
    repeats of the request, and the conversation it continues."""
    g: api.Generation
    name: str
    echo: dict                 # request fields the response object carries
    messages: list             # the conversation so far, without instructions
    store: object = None       # the ResponseStore, where the response is kept
    rid: str = field(default_factory=lambda: _new_id("resp_"))
    created: int = field(default_factory=lambda: int(time.time()))


def _bad(message: str, param: str | None = None) -> APIError:
    return APIError(400, message, param=param)


def read_request(body: dict, model, name: str, store: ResponseStore, seed: int | None = None) -> Job:
    """A /v1/responses body (a JSON object) as a Job, every field checked;
    seed: the server's for sampling (None: random)."""
    for unsupported in ("background", "conversation", "prompt"):
        if body.get(unsupported) not in (None, False):
            raise _bad(f"'{unsupported}' is not supported by this server", unsupported)
    instructions = api.field_of(body, "instructions", str, None)
    previous = body.get("previous_response_id")
    if previous is not None and not isinstance(previous, str):
        raise _bad("'previous_response_id' must be a string", "previous_response_id")
    keep = api.field_of(body, "store", bool, True)
    history = store.messages(previous) if previous is not None else []
    new = input_messages(body.get("input"))
    chat = {"messages": ([{"role": "system", "content": instructions}] if instructions else []) + history + new,
            "max_tokens": api.field_of(body, "max_output_tokens", int, None, 1),
            "temperature": api.field_of(body, "temperature", float, None, 0, 2),
            "top_p": api.field_of(body, "top_p", float, None, 0, 1),
            "stream": api.field_of(body, "stream", bool, False),
            "parallel_tool_calls": api.field_of(body, "parallel_tool_calls", bool, None)}
    tools = body.get("tools")
    if tools is not None and tools != []:
        chat["tools"] = tools_of(tools)
    if body.get("tool_choice") is not None:
        chat["tool_choice"] = tool_choice_of(body["tool_choice"])
    text = api.field_of(body, "text", dict, {})
    fmt = text_format(text.get("format"))
    if fmt is not None:
        chat["response_format"] = fmt
    reasoning = api.field_of(body, "reasoning", dict, {})
    effort = reasoning.get("effort")
    if effort is not None and effort not in ("none", "minimal", "low", "medium", "high", "xhigh"):
        raise _bad("'reasoning.effort' must be one of none, minimal, low, medium, high, xhigh", "reasoning")
    if effort is not None:   # the template's thinking, on or off
        chat["chat_template_kwargs"] = {"enable_thinking": effort != "none"}
    metadata = api.field_of(body, "metadata", dict, {})
    if len(metadata) > 16 or not all(isinstance(k, str) and isinstance(v, str) and len(k) <= 64 and len(v) <= 512
                                     for k, v in metadata.items()):
        raise _bad("'metadata' must be at most 16 string keys (64 characters) with string values "
                   "(512 characters)", "metadata")
    truncation = api.field_of(body, "truncation", str, "disabled")
    if truncation not in ("auto", "disabled"):
        raise _bad("'truncation' must be 'auto' or 'disabled'", "truncation")
    user = api.field_of(body, "user", str, None)
    g = api.parse_request({k: v for k, v in chat.items() if v is not None}, True, model, max_choices=1,
                          seed=seed)
    echo = {"instructions": instructions, "max_output_tokens": chat["max_tokens"], "metadata": metadata,
            "parallel_tool_calls": chat["parallel_tool_calls"] is not False,
            "previous_response_id": previous, "reasoning": {"effort": effort, "summary": None},
            "store": keep, "temperature": g.samplings[0].temperature, "top_p": g.samplings[0].top_p,
            "text": {"format": text.get("format") or {"type": "text"}},
            "tool_choice": body.get("tool_choice") or "auto", "tools": tools or [],
            "truncation": truncation, "user": user}
    return Job(g, name, echo, history + new, store if keep else None)


def input_messages(value) -> list:
    """The chat messages of `input`: a string (one user turn) or an array
    of items. Consecutive function calls join one assistant message, and
    reasoning goes with the assistant message after it."""
    if isinstance(value, str):
        return [{"role": "user", "content": value}]
    if not isinstance(value, list) or not value:
        raise _bad("'input' must be a string or a non-empty array of input items", "input")
    out, reasoning = [], None
    for i, item in enumerate(value):
        where = f"input[{i}]"
        if not isinstance(item, dict):
            raise _bad(f"'{where}' must be an object", "input")
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "assistant", "system", "developer"):
                raise _bad(f"'{where}.role' must be user, assistant, system or developer", "input")
            m = {"role": role, "content": _content(item.get("content"), where)}
            if role == "assistant" and reasoning is not None:
                m["reasoning_content"], reasoning = reasoning, None
            out.append(m)
        elif kind == "function_call":
            call_id, name, arguments = item.get("call_id"), item.get("name"), item.get("arguments", "{}")
            if not all(isinstance(v, str) for v in (call_id, name, arguments)):
                raise _bad(f"'{where}' must be a function_call with string call_id, name and arguments", "input")
            call = {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}
            last = out[-1] if out else None
            if last is not None and last["role"] == "assistant" and (last.get("tool_calls") or not reasoning):
                last.setdefault("tool_calls", []).append(call)
            else:
                out.append({"role": "assistant", "content": "", "tool_calls": [call]})
            if reasoning is not None:
                out[-1]["reasoning_content"], reasoning = reasoning, None
        elif kind == "function_call_output":
            call_id, output = item.get("call_id"), item.get("output")
            if not isinstance(call_id, str):
                raise _bad(f"'{where}.call_id' must be a string", "input")
            out.append({"role": "tool", "tool_call_id": call_id,
                        "content": output if isinstance(output, str) else _content(output, f"{where}.output")})
        elif kind == "reasoning":
            parts = item.get("content") or item.get("summary") or []
            if not isinstance(parts, list):
                raise _bad(f"'{where}.content' must be an array", "input")
            reasoning = "\n".join(p.get("text", "") for p in parts if isinstance(p, dict)
                                  and isinstance(p.get("text"), str))
        else:
            raise _bad(f"'{where}' is of type {str(kind)[:60]!r}: input items may be messages, function_call, "
                       "function_call_output or reasoning", "input")
    return out


def _content(content, where: str) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise _bad(f"'{where}.content' must be a string or an array of content parts", "input")
    texts = []
    for k, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind in ("input_text", "output_text", "text") and isinstance(part.get("text"), str):
            texts.append(part["text"])
        elif kind == "refusal" and isinstance(part.get("refusal"), str):
            texts.append(part["refusal"])
        elif kind in _MEDIA:
            raise _bad(f"'{where}.content[{k}]' is of type {kind!r}: this model reads text only", "input")
        else:
            raise _bad(f"'{where}.content[{k}]' must be a text part ({{\"type\": \"input_text\", "
                       "\"text\": ...}})", "input")
    return "\n".join(texts)


def tools_of(tools) -> list:
    """The Responses API's function tools as chat completion tools."""
    if not isinstance(tools, list):
        raise _bad("'tools' must be an array of tools", "tools")
    out = []
    for i, tool in enumerate(tools):
        if not isinstance(tool, dict) or tool.get("type") != "function":
            kind = tool.get("type") if isinstance(tool, dict) else None
            raise _bad(f"'tools[{i}]' is of type {str(kind)[:60]!r}: only function tools (the client runs them) "
                       "are supported", "tools")
        function = {k: tool[k] for k in ("name", "description", "parameters", "strict") if k in tool}
        out.append({"type": "function", "function": function})
    return out


def tool_choice_of(choice):
    if choice in ("auto", "none", "required"):
        return choice
    if isinstance(choice, dict) and choice.get("type") == "function" and isinstance(choice.get("name"), str):
        return {"type": "function", "function": {"name": choice["name"]}}
    raise _bad("'tool_choice' must be 'auto', 'none', 'required' or {\"type\": \"function\", \"name\": ...}",
               "tool_choice")


def text_format(fmt):
    """text.format as a chat completion's response_format (None: text)."""
    if fmt is None:
        return None
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if kind == "text":
        return None
    if kind == "json_object":
        return {"type": "json_object"}
    if kind == "json_schema":
        schema = {k: fmt[k] for k in ("name", "schema", "strict", "description") if k in fmt}
        return {"type": "json_schema", "json_schema": schema}
    raise _bad("'text.format' must be {\"type\": \"text\"}, {\"type\": \"json_object\"} or "
               "{\"type\": \"json_schema\", \"name\": ..., \"schema\": {...}}", "text")


# -------------------------------------------------------------- the reply

def response_object(job: Job, output: list, status: str, output_tokens: int, error=None) -> dict:
    n = len(job.g.prompt_ids)
    incomplete = {"reason": "max_output_tokens"} if status == "incomplete" else None
    return {"id": job.rid, "object": "response", "created_at": job.created, "status": status,
            "error": error, "incomplete_details": incomplete, "model": job.name, "output": output,
            **job.echo,
            "usage": {"input_tokens": n, "input_tokens_details": {"cached_tokens": 0},
                      "output_tokens": output_tokens, "output_tokens_details": {"reasoning_tokens": 0},
                      "total_tokens": n + output_tokens}}


def _message_item(text: str, mid: str | None = None) -> dict:
    return {"type": "message", "id": mid or _new_id("msg_"), "status": "completed", "role": "assistant",
            "content": [_text_part(text)]}


def _text_part(text: str) -> dict:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def _reasoning_item(text: str, rid: str | None = None) -> dict:
    return {"type": "reasoning", "id": rid or _new_id("rs_"), "summary": [],
            "content": [{"type": "reasoning_text", "text": text}], "status": "completed"}


def _call_item(name: str, arguments: str, fid: str | None = None, call_id: str | None = None) -> dict:
    return {"type": "function_call", "id": fid or _new_id("fc_"), "call_id": call_id or _new_id("call_"),
            "name": name, "arguments": arguments, "status": "completed"}


def output_items(job: Job, text: str) -> list:
    reply = toolcalls.parse_reply(text, **job.g.reply) if job.g.reply else toolcalls.Reply(content=text)
    items = []
    if reply.reasoning is not None:
        items.append(_reasoning_item(reply.reasoning))
    if reply.content or not reply.tool_calls:
        items.append(_message_item(reply.content))
    items += [_call_item(c["function"]["name"], c["function"]["arguments"]) for c in reply.tool_calls]
    return items


def conversation_after(job: Job, output: list) -> list:
    """The chat conversation once the reply's output items are added."""
    reply = {"role": "assistant", "content": ""}
    for item in output:
        if item["type"] == "reasoning":
            reply["reasoning_content"] = item["content"][0]["text"]
        elif item["type"] == "message":
            reply["content"] = item["content"][0]["text"]
        else:
            reply.setdefault("tool_calls", []).append(
                {"id": item["call_id"], "type": "function",
                 "function": {"name": item["name"], "arguments": item["arguments"]}})
    return job.messages + [reply]


def _status(completions, request, state) -> str:
    return "incomplete" if completions.finish(0, request, state) == "length" else "completed"


def _keep(job: Job, response: dict):
    if job.store is not None and response["status"] != "failed":
        job.store.put(job.rid, conversation_after(job, response["output"]), response)


async def whole(job: Job, completions, requests, http_request) -> dict:
    text, state = await completions.reply(job.g, requests, http_request)
    response = response_object(job, output_items(job, text), _status(completions, requests[0], state),
                               requests[0].generated)
    _keep(job, response)
    return response


class _Items:
    """The output items of a streamed reply, one open at a time, and the
    events that open, extend and close them."""

    def __init__(self):
        self.seq, self.items, self.open_kind, self.item, self.text, self.tool = 0, [], None, None, "", None

    def event(self, kind: str, **data) -> str:
        data = {"type": kind, "sequence_number": self.seq, **data}
        self.seq += 1
        return f"event: {kind}\ndata: {json.dumps(data)}\n\n"

    @property
    def index(self) -> int:
        return len(self.items)

    def _start(self, kind: str, item: dict, part: dict | None) -> list:
        out = self.close()
        self.open_kind, self.item, self.text = kind, item, ""
        out.append(self.event("response.output_item.added", output_index=self.index,
                              item=dict(item, status="in_progress")))
        if part is not None:
            out.append(self.event("response.content_part.added", item_id=item["id"], output_index=self.index,
                                  content_index=0, part=part))
        return out

    def close(self) -> list:
        if self.open_kind is None:
            return []
        item, at, out = self.item, self.index, []
        if self.open_kind == "message":
            item = _message_item(self.text, item["id"])
            out.append(self.event("response.output_text.done", item_id=item["id"], output_index=at,
                                  content_index=0, text=self.text, logprobs=[]))
            out.append(self.event("response.content_part.done", item_id=item["id"], output_index=at,
                                  content_index=0, part=item["content"][0]))
        elif self.open_kind == "reasoning":
            item = _reasoning_item(self.text, item["id"])
            out.append(self.event("response.reasoning_text.done", item_id=item["id"], output_index=at,
                                  content_index=0, text=self.text))
            out.append(self.event("response.content_part.done", item_id=item["id"], output_index=at,
                                  content_index=0, part=item["content"][0]))
        else:
            item = _call_item(item["name"], self.text, item["id"], item["call_id"])
            out.append(self.event("response.function_call_arguments.done", item_id=item["id"],
                                  output_index=at, name=item["name"], arguments=self.text))
        out.append(self.event("response.output_item.done", output_index=at, item=item))
        self.items.append(item)
        self.open_kind, self.item, self.tool = None, None, None
        return out

    def delta(self, d) -> list:
        """The events of a toolcalls.Delta."""
        if d.kind == "tool_call":
            function, out = d.call.get("function", {}), []
            if self.open_kind != "function_call" or self.tool != d.index:
                out = self._start("function_call", _call_item(function.get("name", ""), ""), None)
                self.tool = d.index
            if function.get("arguments"):
                self.text += function["arguments"]
                out.append(self.event("response.function_call_arguments.delta", item_id=self.item["id"],
                                      output_index=self.index, delta=function["arguments"]))
            return out
        if not d.text:
            return []
        if d.kind == "reasoning":
            out = [] if self.open_kind == "reasoning" else self._start(
                "reasoning", dict(_reasoning_item(""), content=[]), {"type": "reasoning_text", "text": ""})
            kind = "response.reasoning_text.delta"
        else:
            out = [] if self.open_kind == "message" else self._start(
                "message", dict(_message_item(""), content=[]), _text_part(""))
            kind = "response.output_text.delta"
        self.text += d.text
        extra = {"logprobs": []} if d.kind != "reasoning" else {}
        return out + [self.event(kind, item_id=self.item["id"], output_index=self.index, content_index=0,
                                 delta=d.text, **extra)]


async def events(job: Job, completions, requests, http_request):
    """The server-sent events of a streamed response."""
    reader = api.reply_stream(job.g)
    items, state = _Items(), completions.new_state()
    try:
        start = response_object(job, [], "in_progress", 0)
        yield items.event("response.created", response=start)
        yield items.event("response.in_progress", response=start)
        async for _, piece, extra in completions.run(job.g, requests, http_request, state):
            if piece is None:
                if extra is not None:
                    e = engine_error(extra)
                    failed = response_object(job, items.items, "failed", requests[0].generated,
                                             error={"code": "server_error" if e.status >= 500 else
                                                    "invalid_prompt", "message": str(e)})
                    yield items.event("response.failed", response=failed)
                    return
                deltas = reader.close() if reader is not None else []
            else:
                deltas = reader.feed(piece) if reader is not None else [toolcalls.Delta("content", piece)]
            for d in deltas:
                for e in items.delta(d):
                    yield e
        if not items.items and items.open_kind is None:   # an empty reply is an empty message
            for e in items.delta(toolcalls.Delta("content", "")) or items._start(
                    "message", dict(_message_item(""), content=[]), _text_part("")):
                yield e
        for e in items.close():
            yield e
        status = _status(completions, requests[0], state)
        response = response_object(job, items.items, status, requests[0].generated)
        _keep(job, response)
        yield items.event("response.completed" if status == "completed" else "response.incomplete",
                          response=response)
    finally:
        for r in requests:
            r.cancel()
