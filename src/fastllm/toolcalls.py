"""Tool calls and reasoning in a chat reply, as OpenAI's API returns them.

A model writes a tool call as text in its family's format: Qwen2.5/3/3.5
(and Hermes-style templates) put `{"name": ..., "arguments": ...}` between
`<tool_call>` and `</tool_call>`; Llama 3.1+ replies with one JSON object
`{"name": ..., "parameters": ...}` (after `<|python_tag|>`, a special token
that decoding drops); Mistral's later models (Ministral 3, Mistral Small
3.2, Magistral) write `[TOOL_CALLS]name[ARGS]{...}` per call, and Mistral
7B v0.3's generation `[TOOL_CALLS] [{"name": ..., "arguments": ...}, ...]`,
with markers that are special tokens, decoded for this (ToolFormat.markers). Reasoning models (Qwen3, Qwen3.5) think between
`<think>` and `</think>` first; the prompt may already have opened the
`<think>`, so the reply starts inside the reasoning.

ReplyStream turns the text of a reply, piece by piece as it is decoded, into
deltas of content, reasoning and tool calls, holding back only text that may
still begin a tag or a call; parse_reply is the same over the whole text.
The checks of `tools` and `tool_choice` and the rewriting of a conversation
for a template that knows nothing of tools are here too.
"""
from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field


@dataclass(frozen=True)
class ToolFormat:
    """How a model family writes tool calls."""
    name: str
    begin: str            # opens a call ("" where the whole reply is the call)
    end: str              # closes it
    arguments_key: str    # the key of the arguments in the call's JSON
    parallel: bool        # whether the format holds several calls in one reply
    # Where set, a call is begin + name + name_end + the arguments' JSON
    # object, and ends with it (Mistral's [ARGS]); where not and end is "",
    # begin is followed by a JSON list of calls.
    name_end: str = ""

    @property
    def markers(self) -> tuple:
        """The texts that mark a call (special tokens that decoding must
        keep for the reply to be read)."""
        return tuple(m for m in (self.begin, self.name_end, self.end) if m)


QWEN = ToolFormat("qwen", "<tool_call>", "</tool_call>", "arguments", parallel=True)
LLAMA3_JSON = ToolFormat("llama3_json", "", "", "parameters", parallel=False)
MISTRAL = ToolFormat("mistral", "[TOOL_CALLS]", "", "arguments", parallel=True, name_end="[ARGS]")
MISTRAL_LIST = ToolFormat("mistral_list", "[TOOL_CALLS]", "", "arguments", parallel=True)

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"

# Tool descriptions for a template that has no place for them (written into
# the system turn, in the Qwen/Hermes style that the QWEN format parses).
_TOOLS_PROMPT = (
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n{tools}\n</tools>\n\n"
    "For each function call, return a json object with function name and arguments within "
    "<tool_call></tool_call> XML tags:\n<tool_call>\n"
    "{{\"name\": <function-name>, \"arguments\": <args-json-object>}}\n</tool_call>")

_NAME = re.compile(r"[A-Za-z0-9_.\-]{1,64}")


def template_text(template) -> str:
    """A chat template as text (all of a model's named templates together)."""
    if isinstance(template, dict):
        return "\n".join(t for t in template.values() if isinstance(t, str))
    return template or ""


def tool_format(template) -> ToolFormat:
    """The tool-call format of the model whose chat template is template:
    Mistral's where the template writes [TOOL_CALLS] (name then [ARGS], or
    a list), Llama 3's JSON form where the template is Llama 3's, else the
    <tool_call> form (Qwen's, and what fastllm asks of a template that
    does not describe tools itself)."""
    text = template_text(template)
    if MISTRAL.begin in text:
        return MISTRAL if MISTRAL.name_end in text else MISTRAL_LIST
    if "<tool_call>" not in text and ("<|python_tag|>" in text or "<|start_header_id|>" in text):
        return LLAMA3_JSON
    return QWEN


def template_handles_tools(template) -> bool:
    """Whether the template renders `tools` and tool messages itself."""
    return "tools" in template_text(template)


def thinks(template) -> bool:
    """Whether the template's model writes <think>...</think> reasoning."""
    return THINK_OPEN in template_text(template)


def opens_reasoning(prompt: str) -> bool:
    """Whether the rendered prompt ends inside an open <think> (the reply
    then starts with reasoning, without the tag)."""
    return prompt.rfind(THINK_OPEN) > prompt.rfind(THINK_CLOSE)


def reasoning_mode(template, prompt: str) -> str | None:
    """How the reply to prompt may reason: None (it does not: the model
    does not think, or the prompt closed an empty think block, as with
    enable_thinking false), "open" (the prompt opened <think>: the reply
    starts inside it) or "optional" (the reply may open <think> itself)."""
    if not thinks(template):
        return None
    if opens_reasoning(prompt):
        return "open"
    if prompt.rstrip().endswith(THINK_CLOSE):
        return None
    return "optional"


# ------------------------------------------------------------------ checks

def check_tools(tools) -> dict:
    """OpenAI's `tools`, checked: {name: parameters schema} in their order.
    ValueError names what is wrong."""
    if not isinstance(tools, list) or not tools:
        raise ValueError("'tools' must be a non-empty list of {'type': 'function', 'function': {...}}")
    out = {}
    for i, tool in enumerate(tools):
        where = f"tools[{i}]"
        if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(tool.get("function"), dict):
            raise ValueError(f"{where} must be {{'type': 'function', 'function': {{'name': ..., ...}}}}")
        fn = tool["function"]
        name = fn.get("name")
        if not isinstance(name, str) or not _NAME.fullmatch(name):
            raise ValueError(f"{where}.function.name must be 1 to 64 letters, digits, '_', '.' or '-', "
                             f"got {name!r}")
        if name in out:
            raise ValueError(f"{where}.function.name {name!r} is given twice")
        params = fn.get("parameters")
        if params is None:
            params = {"type": "object", "properties": {}}
        if not isinstance(params, dict):
            raise ValueError(f"{where}.function.parameters must be a JSON Schema object")
        if fn.get("description") is not None and not isinstance(fn["description"], str):
            raise ValueError(f"{where}.function.description must be a string")
        out[name] = params
    return out


def check_tool_choice(choice, names) -> str | None:
    """OpenAI's `tool_choice` given the tools' names: "none", "auto",
    "required", or the name of the function that must be called. Without
    tools only "none" (or nothing) makes sense; None is returned then."""
    if not names:
        if choice in (None, "none"):
            return None
        raise ValueError("'tool_choice' needs 'tools'")
    if choice is None:
        return "auto"
    if choice in ("none", "auto", "required"):
        return choice
    if isinstance(choice, dict) and choice.get("type") == "function" and isinstance(choice.get("function"), dict):
        name = choice["function"].get("name")
        if name in names:
            return name
        raise ValueError(f"'tool_choice' names the function {name!r}, which is not among the tools "
                         f"({', '.join(names)})")
    raise ValueError("'tool_choice' must be 'none', 'auto', 'required' or "
                     "{'type': 'function', 'function': {'name': ...}}")


# ------------------------------------------------------- the conversation

def call_json(name: str, arguments, fmt: ToolFormat = QWEN) -> str:
    """A call as the model writes it."""
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except ValueError:
            pass   # a model's own malformed arguments, passed back as they were
    return json.dumps({"name": name, fmt.arguments_key: arguments}, ensure_ascii=False)


def messages_for_template(messages, tools, template):
    """(messages, tools) to render with template. A template that renders
    tools gets both as they are; for one that does not, the tools are
    described in the system turn, earlier calls are written into the
    assistant's text and tool results into user turns, in the <tool_call>
    format that the reply is then read in."""
    if not tools or template_handles_tools(template):
        return messages, tools
    listing = "\n".join(json.dumps(t, ensure_ascii=False) for t in tools)
    system = _TOOLS_PROMPT.format(tools=listing)
    out = []
    for m in messages:
        m = dict(m)
        role = m.get("role")
        if role == "assistant" and m.get("tool_calls"):
            calls = []
            for call in m.pop("tool_calls"):
                fn = call.get("function", call) if isinstance(call, dict) else {}
                calls.append(f"{QWEN.begin}\n{call_json(fn.get('name'), fn.get('arguments', {}))}\n{QWEN.end}")
            text = m.get("content") or ""
            m["content"] = "\n".join(([text] if text else []) + calls)
        elif role == "tool":
            m = {"role": "user", "content": f"<tool_response>\n{m.get('content') or ''}\n</tool_response>"}
        out.append(m)
    if out and out[0].get("role") == "system" and isinstance(out[0].get("content"), str):
        out[0] = dict(out[0], content=out[0]["content"] + "\n\n" + system)
    else:
        out.insert(0, {"role": "system", "content": system})
    return out, None


# ------------------------------------------------------------- the reply

@dataclass(frozen=True)
class Delta:
    """A piece of a reply: kind "content" or "reasoning" with text, or
    "tool_call" with call (OpenAI's {"id", "type", "function"}) and index."""
    kind: str
    text: str = ""
    call: dict | None = None
    index: int = 0


@dataclass
class Reply:
    content: str = ""
    reasoning: str | None = None
    tool_calls: list = field(default_factory=list)


def _held_prefix(text: str, tag: str) -> int:
    """Length of the longest end of text that begins tag (held back: the
    next piece may complete the tag)."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0


class ReplyStream:
    """Reads a reply as it is decoded: feed(piece) and close() return
    Deltas. reasoning: as reasoning_mode gives: None (no reasoning read),
    "optional" (the reply may start with <think>...</think>) or "open"
    (it starts inside the <think> the prompt opened). tools: the
    names of the functions the model may call (None: no tool calls read);
    fmt: their format."""

    def __init__(self, *, reasoning: str | None = None, tools=None, fmt: ToolFormat = QWEN):
        if reasoning not in (None, "optional", "open"):
            raise ValueError(f"reasoning must be None, 'optional' or 'open', got {reasoning!r}")
        self._state = {None: "content", "optional": "start", "open": "reasoning"}[reasoning]
        self._held = ""             # text not yet given out
        self._reasoned = False      # whether reasoning text was given out
        self._tools = set(tools) if tools else None
        self._fmt = fmt
        self._calls = 0
        self._in_call = False
        self._space = ""           # whitespace content, given out once more content follows
        self._whole = fmt.begin == ""   # the whole reply may be one call (Llama 3)
        self._maybe_whole = None        # with _whole: None (undecided), True, False

    @property
    def called(self) -> bool:
        """Whether a tool call has been given out."""
        return self._calls > 0

    def feed(self, piece: str) -> list:
        """The Deltas that piece (the reply's next text) completes."""
        self._held += piece
        return self._run(final=False)

    def close(self) -> list:
        """The Deltas of what is held back, at the end of the reply."""
        return self._run(final=True)

    # -- reasoning ---------------------------------------------------------

    def _run(self, final: bool) -> list:
        out = []
        if self._state == "start":
            text = self._held.lstrip()
            if text.startswith(THINK_OPEN):
                self._state, self._held = "reasoning", text[len(THINK_OPEN):]
            elif THINK_OPEN.startswith(text) and not final:
                return out     # "", or the start of the tag
            else:
                self._state = "content"
        if self._state == "reasoning":
            if not self._reasoned:   # the newline after <think> is the tag's
                self._held = self._held.lstrip("\n")
                if not self._held and not final:
                    return out
            end = self._held.find(THINK_CLOSE)
            if end >= 0:
                if self._held[:end]:
                    out.append(Delta("reasoning", self._held[:end]))
                    self._reasoned = True
                self._state, self._held = "after_reasoning", self._held[end + len(THINK_CLOSE):]
            else:
                keep = 0 if final else _held_prefix(self._held, THINK_CLOSE)
                text, self._held = self._held[:len(self._held) - keep], self._held[len(self._held) - keep:]
                if text:
                    out.append(Delta("reasoning", text))
                    self._reasoned = True
                return out
        if self._state == "after_reasoning":
            self._held = self._held.lstrip()
            if not self._held and not final:
                return out
            self._state = "content"
        text, self._held = self._held, ""
        return out + self._content(text, final)

    # -- content and tool calls ------------------------------------------

    def _content(self, text: str, final: bool) -> list:
        if self._tools is None:
            return [Delta("content", text)] if text else []
        if self._whole:
            return self._whole_reply(text, final)
        out = []
        self._held = text
        fmt = self._fmt
        while True:
            if self._in_call and not fmt.end:
                calls = self._open_ended_call(final)
                if calls is None:
                    return out
                self._in_call = False
                if calls:
                    self._space = ""
                    out += [self._call_delta(c) for c in calls]
                else:   # not a call: the marker is content, and what follows is read on
                    out += self._text(fmt.begin)
                continue
            if self._in_call:
                end = self._held.find(fmt.end)
                if end < 0 and not final:
                    return out
                end = len(self._held) if end < 0 else end   # a call the reply ended before closing
                body, closing = self._held[:end], self._held[end:end + len(fmt.end)]
                self._in_call, self._held = False, self._held[end + len(closing):]
                call = self._read_call(body)
                if call is not None:
                    self._space = ""
                    out.append(self._call_delta(call))
                else:
                    out += self._text(fmt.begin + body + closing)
                continue
            start = self._held.find(fmt.begin)
            if start >= 0:
                out += self._text(self._held[:start])
                self._in_call, self._held = True, self._held[start + len(fmt.begin):]
                continue
            keep = 0 if final else _held_prefix(self._held, fmt.begin)
            text, self._held = self._held[:len(self._held) - keep], self._held[len(self._held) - keep:]
            out += self._text(text)
            if final:
                out += self._end_text()
            return out

    def _open_ended_call(self, final: bool):
        """The calls of a format without an end marker (Mistral's), whose
        text after begin is held: a list of calls once their JSON is whole
        (held text then starts after it), [] when the text is not a call,
        or None while more text may complete it."""
        fmt, body = self._fmt, self._held
        decoder = json.JSONDecoder()
        if fmt.name_end:
            cut = body.find(fmt.name_end)
            name = body[:cut] if cut >= 0 else body[:len(body) - _held_prefix(body, fmt.name_end)]
            if name and not _NAME.fullmatch(name):
                return []
            if cut < 0:
                return None if not final else []
            after = cut + len(fmt.name_end)
            start = len(body) - len(body[after:].lstrip())
        else:
            start = len(body) - len(body.lstrip())
            if start < len(body) and body[start] != "[":
                return []
        try:
            found, end = decoder.raw_decode(body, start)
        except ValueError:
            return None if not final else []
        if fmt.name_end:
            calls = [self._call_of({"name": name, fmt.arguments_key: found})]
        else:
            calls = [self._call_of(c) for c in found] if isinstance(found, list) and found else [None]
        if None in calls:
            return []
        self._held = body[end:]
        return calls

    def _text(self, text: str) -> list:
        """Content text; whitespace at its end waits to see what follows
        (it is dropped before and between tool calls)."""
        body = text.rstrip()
        if not body:
            self._space += text
            return []
        out, self._space = self._space + body, text[len(body):]
        return [Delta("content", out)]

    def _end_text(self) -> list:
        space, self._space = self._space, ""
        return [Delta("content", space)] if space and not self._calls else []

    def _whole_reply(self, text: str, final: bool) -> list:
        """Llama 3's JSON form: a reply that starts with "{" is held to its
        end, then read as one or more calls (";"-separated), else given out
        as content."""
        self._held = text
        if self._maybe_whole is None:
            start = self._held.lstrip()
            if not start and not final:
                return []
            self._maybe_whole = start.startswith("{")
        if not self._maybe_whole:
            text, self._held = self._held, ""
            return [Delta("content", text)] if text else []
        if not final:
            return []
        text, self._held = self._held, ""
        calls = self._read_calls(text)
        if calls is None:
            return [Delta("content", text)] if text else []
        return [self._call_delta(c) for c in calls]

    def _read_calls(self, text: str):
        decoder, calls, i = json.JSONDecoder(), [], 0
        while True:
            while i < len(text) and (text[i].isspace() or text[i] == ";"):
                i += 1
            if i == len(text):
                return calls or None
            try:
                obj, i = decoder.raw_decode(text, i)
            except ValueError:
                return None
            call = self._call_of(obj)
            if call is None:
                return None
            calls.append(call)

    def _read_call(self, body: str):
        try:
            obj = json.loads(body)
        except ValueError:
            return None
        return self._call_of(obj)

    def _call_of(self, obj):
        """(name, arguments as a JSON string) of a decoded call, or None
        when it is not a call of one of the tools."""
        if not isinstance(obj, dict) or obj.get("name") not in self._tools:
            return None
        args = obj.get(self._fmt.arguments_key, obj.get("arguments", obj.get("parameters", {})))
        if isinstance(args, str):
            try:
                args = json.loads(args)
            except ValueError:
                return None
        if not isinstance(args, dict):
            return None
        return obj["name"], json.dumps(args, ensure_ascii=False)

    def _call_delta(self, call) -> Delta:
        name, arguments = call
        index, self._calls = self._calls, self._calls + 1
        return Delta("tool_call", call={"id": "call_" + uuid.uuid4().hex[:24], "type": "function",
                                         "function": {"name": name, "arguments": arguments}}, index=index)


def gather(deltas) -> Reply:
    """The Reply that deltas add up to."""
    reply = Reply()
    content, reasoning = [], []
    for d in deltas:
        if d.kind == "content":
            content.append(d.text)
        elif d.kind == "reasoning":
            reasoning.append(d.text)
        else:
            reply.tool_calls.append(d.call)
    reply.content = "".join(content)
    reply.reasoning = "".join(reasoning) if reasoning else None
    return reply


def parse_reply(text: str, **options) -> Reply:
    """The content, reasoning and tool calls of a whole reply (options as
    for ReplyStream)."""
    stream = ReplyStream(**options)
    return gather(stream.feed(text) + stream.close())
