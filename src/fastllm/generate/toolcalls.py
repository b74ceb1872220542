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
        # parameters schemas by name, where tools gives them ({name: schema})
        self._schemas = tools if isinstance(tools, dict) else {}
        self._fmt = fmt
        self._calls = 0
        self._space = ""           # whitespace content, given out once more content follows
        # Reading content: "text", "tag" (after a <tool_call> that has not
        # shown its form yet), "call" (a reader reads a call), "close" (the
        # call read, its closer may follow) or "tag_text" (what a <tool_call>
        # holds that is no call: content up to its </tool_call>).
        self._mode = "text"
        self._reader = None
        self._opener = self._closer = ""   # the text that opened the call, and what closes it
        # Where a call may stand without a marker: at the start of the
        # content and right after a call (a JSON object, or one in a ```
        # fence: Qwen2.5's and Llama 3's bare calls).
        self._at_call = True

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
        self._held = text
        out = []
        while True:
            deltas, go_on = self._step(final)
            out += deltas
            if not go_on:
                break
        if final:
            out += self._end_text()
        return out

    def _step(self, final: bool) -> tuple:
        """(Deltas, whether to step again) of the text held, in the mode the
        reading is in."""
        mode, held, fmt = self._mode, self._held, self._fmt
        if mode == "call":
            deltas, state, used = self._reader.read(held, final)
            if deltas:
                self._space = ""
            if state == "more":
                return deltas, False
            self._reader, self._held = None, held[used:]
            if state == "done":
                self._mode, self._at_call = ("close" if self._closer else "text"), True
                return deltas, True
            # no call after all: what it read is content, and what follows is read on
            text = self._opener + held[:used]
            self._mode, self._at_call = ("tag_text" if self._closer == fmt.end and fmt.end else "text"), False
            return deltas + self._text(text), True
        if mode == "close":
            rest = held.lstrip()
            if rest.startswith(self._closer):
                self._held = rest[len(self._closer):]
            elif self._closer.startswith(rest) and not final:
                return [], False
            self._mode = "text"
            return [], True
        if mode == "tag_text":
            end = held.find(fmt.end)
            if end >= 0:
                self._mode, self._held = "text", held[end + len(fmt.end):]
                return self._text(held[:end + len(fmt.end)]), True
            keep = 0 if final else _held_prefix(held, fmt.end)
            self._held = held[len(held) - keep:]
            return self._text(held[:len(held) - keep]), False
        if mode == "tag":
            body = held.lstrip()
            if body.startswith("{"):
                return [], self._read_with(_JsonCall(self), fmt.begin, fmt.end)
            if body.startswith(_FUNCTION_OPEN) or (_FUNCTION_OPEN.startswith(body) and not final):
                if len(body) < len(_FUNCTION_OPEN):
                    return [], False
                return [], self._read_with(_XmlCall(self), fmt.begin, fmt.end)
            if not body and not final:
                return [], False
            self._mode = "tag_text"
            return self._text(fmt.begin), True
        # text
        if self._at_call and fmt is not MISTRAL and fmt is not MISTRAL_LIST:
            lead = len(held) - len(held.lstrip(" \t\r\n;" if fmt is LLAMA3_JSON else " \t\r\n"))
            rest = held[lead:]
            if not rest:   # only space (or Llama 3's ";") so far: what follows decides
                if not final:
                    return [], False
                self._held = ""
                return self._text(held) if fmt is not LLAMA3_JSON else [], False
            if rest.startswith("{"):
                self._held = rest
                return [], self._read_with(_JsonCall(self), "", "")
            if rest.startswith("`"):
                fence = _FENCE.match(rest)
                if fence is None and not final and (_FENCE_START.fullmatch(rest) or "```json".startswith(rest)):
                    return [], False
                if fence is not None:
                    after = rest[fence.end():].lstrip()
                    if not after and not final:
                        return [], False
                    if after.startswith("{"):
                        self._held = rest[fence.end():]
                        return [], self._read_with(_JsonCall(self), fence.group(0), "```")
            self._at_call = False
        if not fmt.begin:
            self._held = ""
            return self._text(held), False
        start = held.find(fmt.begin)
        if start >= 0:
            out = self._text(held[:start])
            self._held = held[start + len(fmt.begin):]
            if fmt is MISTRAL:
                return out, self._read_with(_MistralCall(self), fmt.begin, "")
            if fmt is MISTRAL_LIST:
                return out, self._read_with(_CallList(self), fmt.begin, "")
            self._mode = "tag"
            return out, True
        keep = 0 if final else _held_prefix(held, fmt.begin)
        self._held = held[len(held) - keep:]
        return self._text(held[:len(held) - keep]), False

    def _read_with(self, reader, opener: str, closer: str) -> bool:
        self._mode, self._reader, self._opener, self._closer = "call", reader, opener, closer
        return True

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
        """A whole call: its id, name and arguments at once."""
        name, arguments = call
        index, self._calls = self._calls, self._calls + 1
        return Delta("tool_call", call={"id": "call_" + uuid.uuid4().hex[:24], "type": "function",
                                         "function": {"name": name, "arguments": arguments}}, index=index)

    def _opening(self, name: str) -> Delta:
        """The start of a call whose arguments come after it, as OpenAI
        streams one: its id and name, the arguments empty."""
        return self._call_delta((name, ""))

    def _arguments(self, text: str) -> Delta:
        """More of the arguments of the call last opened."""
        return Delta("tool_call", call={"function": {"arguments": text}}, index=self._calls - 1)


# -------------------------------------------------------------- the readers
#
# Each reads one call (or a list of them) from the text held, which starts
# where it does: read(text, final) -> (deltas, state, used). state is
# "more" (it needs more text), "done" (the call ended at text[used]) or
# "not" (it is no call: text[:used] is content, read on from there). A
# call goes out as soon as its name is known to be a tool's and its
# arguments have begun; its arguments then go out as they come.

_DECODER = json.JSONDecoder()
# A JSON call's start, up to its arguments: {"name": "...", "arguments": .
_HEAD = re.compile(r'\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"(?:arguments|parameters)"\s*:\s*(?=\S)', re.S)
_FENCE = re.compile(r"```(?:json)?[ \t]*\r?\n")
_FENCE_START = re.compile(r"```(?:json)?[ \t]*")
_FUNCTION_OPEN = "<function="
_FUNCTION = re.compile(r"<function=([^>\n]+)>")
_PARAMETER = re.compile(r"<parameter=([^>\n]+)>(.*?)</parameter>", re.S)


def _skip_space(text: str, i: int) -> int:
    while i < len(text) and text[i].isspace():
        i += 1
    return i


class _JsonEnd:
    """Where the JSON object (or array) that starts at a given place of a
    text ends, found as the text grows: strings and escapes followed."""

    def __init__(self, start: int, depth: int = 0):
        self.pos, self.depth, self.string, self.escape, self.end = start, depth, False, False, None

    def find(self, text: str):
        """The index just past the value, or None while it goes on."""
        if self.end is not None:
            return self.end
        for i in range(self.pos, len(text)):
            c = text[i]
            if self.string:
                if self.escape:
                    self.escape = False
                elif c == "\\":
                    self.escape = True
                elif c == '"':
                    self.string = False
            elif c == '"':
                self.string = True
            elif c in "{[":
                self.depth += 1
            elif c in "}]":
                self.depth -= 1
                if self.depth == 0:
                    self.end = self.pos = i + 1
                    return self.end
        self.pos = len(text)
        return None


class _Arguments:
    """A call's arguments, the JSON object that starts at a given place of
    the text: read() gives out what more of it came, and where it ended."""

    def __init__(self, stream: ReplyStream, start: int):
        self.stream, self.start, self.sent, self.scan = stream, start, 0, _JsonEnd(start)

    def read(self, text: str, out: list):
        """Puts the new piece of the arguments on out; the index just past
        them once they closed, else None."""
        end = self.scan.find(text)
        piece = text[self.start + self.sent:self.scan.pos if end is None else end]
        if piece:
            self.sent += len(piece)
            out.append(self.stream._arguments(piece))
        return end


class _JsonCall:
    """A call as JSON: {"name": ..., "arguments": {...}} (or "parameters").
    Read at once where the name does not come first or the arguments are
    not an object (a JSON string of them)."""

    def __init__(self, stream: ReplyStream, start: int = 0):
        self.stream, self.start = stream, start
        self.args = self.close = None     # the _Arguments, then the _JsonEnd of the call

    def read(self, text: str, final: bool) -> tuple:
        if self.args is not None:
            return self._go_on(text, final, [])
        i = _skip_space(text, self.start)
        head = _HEAD.match(text, i)
        if head and head.end() < len(text) and text[head.end()] == "{":
            try:
                name = json.loads(f'"{head.group(1)}"')
            except ValueError:
                name = None
            if name in self.stream._tools:
                self.args = _Arguments(self.stream, head.end())
                return self._go_on(text, final, [self.stream._opening(name)])
        try:
            obj, end = _DECODER.raw_decode(text, i)
        except ValueError:
            return [], "not" if final else "more", len(text)
        call = self.stream._call_of(obj)
        if call is None:
            return [], "not", end
        return [self.stream._call_delta(call)], "done", end

    def _go_on(self, text: str, final: bool, out: list) -> tuple:
        end = self.args.read(text, out)
        if end is not None:
            if self.close is None:
                self.close = _JsonEnd(end, depth=1)
            closed = self.close.find(text)
            if closed is not None:
                return out, "done", closed
        return out, "done" if final else "more", len(text)


class _XmlCall:
    """Qwen3.5's (and Qwen3-Coder's) form, inside <tool_call>:
    <function=name>, <parameter=key>value</parameter> per argument, then
    </function>. The arguments go out as a JSON object, a parameter at a
    time; a value is JSON where the tool's schema types it so, else text."""

    def __init__(self, stream: ReplyStream, start: int = 0):
        self.stream, self.pos = stream, start
        self.name, self.count = None, 0

    def read(self, text: str, final: bool) -> tuple:
        out = []
        if self.name is None:
            i = _skip_space(text, self.pos)
            found = _FUNCTION.match(text, i)
            if found is None:
                waiting = not final and ">" not in text[i:] and "\n" not in text[i + len(_FUNCTION_OPEN):]
                return [], "more" if waiting else "not", 0
            if found.group(1).strip() not in self.stream._tools:
                return [], "not", 0
            self.name, self.pos = found.group(1).strip(), found.end()
            out.append(self.stream._opening(self.name))
        while True:
            i = _skip_space(text, self.pos)
            parameter = _PARAMETER.match(text, i) if text.startswith("<parameter=", i) else None
            if parameter is not None:
                key = parameter.group(1).strip()
                piece = f"{', ' if self.count else '{'}{json.dumps(key, ensure_ascii=False)}: " + \
                        json.dumps(self._value(key, parameter.group(2)), ensure_ascii=False)
                self.count += 1
                self.pos = parameter.end()
                out.append(self.stream._arguments(piece))
                continue
            if not final and ("<parameter=".startswith(text[i:i + 11]) or "</function>".startswith(text[i:])):
                if text.startswith("<parameter=", i) or len(text) - i < 11:
                    return out, "more", len(text)
            out.append(self.stream._arguments("}" if self.count else "{}"))
            if text.startswith("</function>", i):
                return out, "done", i + len("</function>")
            return out, "done", i if not final else len(text)

    def _value(self, key: str, text: str):
        if text.startswith("\n"):
            text = text[1:]
        if text.endswith("\n"):
            text = text[:-1]
        schema = self.stream._schemas.get(self.name) or {}
        kind = ((schema.get("properties") or {}).get(key) or {}).get("type")
        if kind in (None, "string") or (isinstance(kind, list) and "string" in kind):
            return text
        try:
            return json.loads(text)
        except ValueError:
            return text


class _MistralCall:
    """Mistral's later form: [TOOL_CALLS]name[ARGS]{...}, the name and
    then its arguments; the call ends with them."""

    def __init__(self, stream: ReplyStream):
        self.stream, self.args = stream, None

    def read(self, text: str, final: bool) -> tuple:
        stream, name_end = self.stream, self.stream._fmt.name_end
        if self.args is None:
            cut = text.find(name_end)
            name = text[:cut] if cut >= 0 else text[:len(text) - _held_prefix(text, name_end)]
            if name and not _NAME.fullmatch(name) or cut < 0 and final:
                return [], "not", 0
            if cut < 0:
                return [], "more", 0
            start = _skip_space(text, cut + len(name_end))
            if start == len(text) and not final:
                return [], "more", 0
            if name not in stream._tools or not text.startswith("{", start):
                return [], "not", 0
            self.args = _Arguments(stream, start)
            return self._arguments(text, final, [stream._opening(name)])
        return self._arguments(text, final, [])

    def _arguments(self, text: str, final: bool, out: list) -> tuple:
        end = self.args.read(text, out)
        if end is not None:
            return out, "done", end
        return out, "done" if final else "more", len(text)


class _CallList:
    """Mistral 7B v0.3's form: [TOOL_CALLS] and a JSON list of calls."""

    def __init__(self, stream: ReplyStream):
        self.stream, self.pos, self.call = stream, None, None

    def read(self, text: str, final: bool) -> tuple:
        out = []
        if self.pos is None:
            i = _skip_space(text, 0)
            if i == len(text):
                return [], "not" if final else "more", 0
            if text[i] != "[":
                return [], "not", 0
            self.pos = i + 1
        while True:
            if self.call is not None:
                deltas, state, used = self.call.read(text, final)
                out += deltas
                if state == "more":
                    return out, "more", len(text)
                self.call = None
                if state == "not":
                    return (out, "done", self.pos) if self.stream._calls else ([], "not", 0)
                self.pos = used
            i = _skip_space(text, self.pos)
            if i == len(text):
                return out, "done" if final else "more", len(text)
            if text[i] == "]":
                return (out, "done", i + 1) if self.stream._calls else ([], "not", 0)
            if text[i] == "," and self.stream._calls:
                self.pos = i + 1
                continue
            if text[i] == "{":
                self.call = _JsonCall(self.stream, i)
                continue
            return (out, "done", i) if self.stream._calls else ([], "not", 0)


def gather(deltas) -> Reply:
    """The Reply that deltas add up to (a call's arguments joined from the
    pieces it came in)."""
    reply = Reply()
    content, reasoning, calls = [], [], {}
    for d in deltas:
        if d.kind == "content":
            content.append(d.text)
        elif d.kind == "reasoning":
            reasoning.append(d.text)
        elif d.index in calls:
            calls[d.index]["function"]["arguments"] += d.call["function"]["arguments"]
        else:
            calls[d.index] = {**d.call, "function": dict(d.call["function"])}
    reply.content = "".join(content)
    reply.reasoning = "".join(reasoning) if reasoning else None
    reply.tool_calls = [calls[i] for i in sorted(calls)]
    return reply


def parse_reply(text: str, **options) -> Reply:
    """The content, reasoning and tool calls of a whole reply (options as
    for ReplyStream)."""
    stream = ReplyStream(**options)
    return gather(stream.feed(text) + stream.close())
