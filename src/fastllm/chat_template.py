"""Chat template rendering that matches transformers' apply_chat_template.

Chat templates are Jinja programs shipped with a model.  The text they render
is only right if the Jinja environment is set up exactly as transformers sets
it up (whitespace control, the sandbox, the helper functions and filters, and
the preprocessing of messages), so each of those choices mirrors transformers.
"""
import dataclasses
import json
from collections.abc import Mapping
from datetime import datetime
from functools import lru_cache

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.utils
import numpy as np
from jinja2.sandbox import ImmutableSandboxedEnvironment

from .errors import FastLLMError

__all__ = ["TemplateError", "render_chat", "get_template", "compile_template"]


class TemplateError(FastLLMError, ValueError):
    """A chat template could not be compiled or rendered, or raised an error itself."""


def _raise_exception(message):
    raise TemplateError(message)


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    # Jinja's own tojson HTML-escapes its output; templates expect plain JSON.
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


def _strftime_now(format):
    return datetime.now().strftime(format)


class _TemplateDict:
    """`dict` for templates: constructing only, no access to the type itself."""

    def __call__(self, *args, **kwargs):
        return dict(*args, **kwargs)

    def fromkeys(self, *args, **kwargs):
        return dict.fromkeys(*args, **kwargs)


def _check_namespace_name(name):
    if isinstance(name, str) and name.startswith("_"):
        raise jinja2.exceptions.SecurityError(
            f"Chat templates cannot store underscore-prefixed attributes on a namespace, but got {name!r}.")


class _TemplateNamespace(jinja2.utils.Namespace):
    """namespace() that refuses underscore attributes, which could reach interpreter internals."""

    def __init__(*args, **kwargs):
        self, args = args[0], args[1:]
        attrs = dict(*args, **kwargs)
        for name in attrs:
            _check_namespace_name(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name, value):
        _check_namespace_name(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)


class _GenerationTag(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}` marks assistant text for
    training masks; for rendering it is transparent."""

    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(["name:endgeneration"], drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_render"), [], [], body).set_lineno(lineno)

    def _render(self, caller):
        return caller()


@lru_cache(maxsize=32)
def compile_template(source):
    """Compile a chat template (cached by its text)."""
    if not isinstance(source, str):
        raise TypeError(f"chat template must be a string, not {type(source).__name__}")
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[_GenerationTag, jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals["dict"] = _TemplateDict()
    env.globals["namespace"] = _TemplateNamespace
    try:
        return env.from_string(source)
    except jinja2.exceptions.TemplateSyntaxError as e:
        raise TemplateError(f"chat template has a syntax error at line {e.lineno}: {e.message}") from e


def get_template(own, requested=None, tools=None):
    """Pick the template text: `requested` may be a template or the name of one
    of the model's named templates; a dict of named templates falls back to
    'tool_use' (when tools are given) or 'default'."""
    if isinstance(own, dict):
        if requested is not None and requested in own:
            return own[requested]
        if requested is None:
            if tools is not None and "tool_use" in own:
                return own["tool_use"]
            if "default" in own:
                return own["default"]
            raise TemplateError("this model has several chat templates and none is named 'default'; "
                                f"pass one of {sorted(own)} as chat_template")
        return requested
    if requested is not None:
        return requested
    if own is None:
        raise TemplateError("this tokenizer has no chat template (tokenizer_config.json has no "
                            "'chat_template' and there is no chat_template.jinja); pass chat_template=")
    return own


def _to_dicts(value):
    """Message objects (dataclasses, pydantic models) to plain dicts, recursively."""
    if isinstance(value, Mapping):
        return {k: _to_dicts(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_to_dicts(v) for v in value]
    if isinstance(value, tuple):
        return tuple(_to_dicts(v) for v in value)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: _to_dicts(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if callable(getattr(value, "model_dump", None)):
        return _to_dicts(value.model_dump())
    return value


def _plain(value):
    """Only plain JSON-like data reaches the sandbox; anything else becomes an
    inert "<TypeName>" placeholder (templates only test media for presence)."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    if isinstance(value, str):
        return str.__str__(value)
    if isinstance(value, int):
        return int.__int__(value)
    if isinstance(value, float):
        return float.__float__(value)
    if isinstance(value, Mapping):
        return {_plain(k): _plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_plain(v) for v in value]
    if isinstance(value, tuple):
        return tuple(_plain(v) for v in value)
    if isinstance(value, np.generic):
        # np.bool_(False) would otherwise become a truthy placeholder string
        return _plain(value.item())
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: _plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if callable(getattr(value, "model_dump", None)):
        return _plain(value.model_dump())
    return f"<{type(value).__name__}>"


_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")
_CONTINUE_TAG = "CONTINUE_FINAL_MESSAGE_TAG "


def _alias_reasoning(chat):
    # Templates read reasoning under different names; fill them all.
    out = []
    for m in chat:
        if isinstance(m, dict):
            r = next((m[k] for k in _REASONING_FIELDS if m.get(k) is not None), None)
            if r is not None:
                m = {"thinking": r, **m, "reasoning_content": r}
        out.append(m)
    return out


def render_chat(template, messages, tools=None, documents=None, add_generation_prompt=False,
                continue_final_message=False, special_tokens_map=None, **kwargs):
    """Render one conversation; same text as transformers' apply_chat_template(tokenize=False)."""
    messages = getattr(messages, "messages", messages)
    if not isinstance(messages, (list, tuple)):
        raise TypeError("messages must be a list of {'role': ..., 'content': ...} dicts")
    if len(messages) == 0:
        raise ValueError("cannot apply a chat template to an empty conversation")
    chat = []
    for m in _to_dicts(list(messages)):
        if not isinstance(m, dict):
            raise TypeError(f"chat messages must be dicts, dataclasses or pydantic models, got {m!r}")
        # None values are dropped: templates handle a missing key but would
        # render "None" or fail on content=None / tool_calls=None.
        chat.append({k: v for k, v in m.items() if v is not None})
    if continue_final_message and add_generation_prompt:
        raise ValueError("continue_final_message and add_generation_prompt cannot be used together")

    if tools is not None:
        schemas = []
        for t in tools:
            if not isinstance(t, dict):
                raise TypeError("tools must be JSON-schema dicts ({'type': 'function', 'function': {...}})")
            schemas.append(t)
        tools = schemas
    if documents is not None:
        for d in documents:
            if not isinstance(d, dict):
                raise TypeError("documents must be a list of dicts with 'title' and 'text' keys")
    tools = _plain(tools)
    documents = _plain(documents)
    # Named special tokens (bos_token, eos_token, ...) are template variables;
    # explicit keyword arguments override them.
    context = _plain({**(special_tokens_map or {}), **kwargs})
    chat = _alias_reasoning(_plain(chat))

    final = None
    if continue_final_message:
        field = continue_final_message if isinstance(continue_final_message, str) else "content"
        final = chat[-1].get(field)
        if final is None:
            raise ValueError(f"continue_final_message is set but the final message has no {field!r}")
        fields = [field]
        if field in _REASONING_FIELDS:
            fields = [f for f in _REASONING_FIELDS if chat[-1].get(f) == final]
        if not any(f in template for f in fields):
            raise ValueError(f"continue_final_message is set to {field!r} but the chat template never uses it")
        if isinstance(final, (list, tuple)):
            for block in reversed(final):
                if "text" in block:
                    final = block["text"]
                    block["text"] = block["text"] + _CONTINUE_TAG
                    break
            else:
                raise ValueError("continue_final_message is set but the final message has no text to continue")
        else:
            for f in fields:
                chat[-1][f] = chat[-1][f] + _CONTINUE_TAG

    compiled = compile_template(template)
    try:
        text = compiled.render(messages=chat, tools=tools, documents=documents,
                               add_generation_prompt=add_generation_prompt, **context)
    except TemplateError:
        raise
    except jinja2.exceptions.TemplateError as e:
        raise TemplateError(f"chat template failed: {type(e).__name__}: {e}") from e

    if continue_final_message:
        tag = _CONTINUE_TAG.strip()
        if final.strip() not in text or tag not in text:
            raise ValueError("continue_final_message is set but the final message does not appear in the "
                             "rendered chat (the template changed it)")
        loc = text.rindex(tag)
        if text[loc:loc + len(_CONTINUE_TAG)] == _CONTINUE_TAG:
            text = text[:loc]
        else:
            text = text[:loc].rstrip()
    return text
