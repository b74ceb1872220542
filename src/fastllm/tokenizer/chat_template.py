"""Chat template rendering that matches transformers' apply_chat_template.

Chat templates are Jinja programs shipped with a model.  The text they render
is only right if the Jinja environment is set up exactly as transformers sets
it up (whitespace control, the sandbox, the helper functions and filters, and
the preprocessing of messages), so each of those choices mirrors transformers.
"""
import contextvars
import dataclasses
import json
import math
import re
from collections.abc import Mapping
from datetime import datetime
from functools import lru_cache

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.utils
import jinja2.visitor
import numpy as np
from jinja2.sandbox import ImmutableSandboxedEnvironment

from ..spec.errors import FastLLMError

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


# ------------------------------------------------------------ work bounds
#
# A template is a program from the model's files: one that loops for ever
# (nested loops, recursion) or builds a string of gigabytes ('a' * 10**10,
# center(10**10), '%1000000000d' % 1) must fail with a TemplateError, not
# hang or exhaust memory. Rendering has a budget of steps (loop iterations
# and calls), every value an operation builds is bounded in size before it
# is built, and so is the rendered text. The bounds are far above what a
# chat template does with a long conversation.
MAX_STEPS = 2_000_000       # loop iterations and calls in one rendering
MAX_VALUE = 1 << 24         # characters (or items) of one value a template builds
MAX_OUTPUT = 1 << 26        # characters of rendered text
MAX_ARG = 1024              # a width, indent or count given to a string method or filter
# Nesting of a template's syntax tree (blocks in blocks, operators, filter
# chains). jinja's code generation takes time cubic in it (300 unary minus
# signs: minutes), and Python refuses code nested past 100 blocks or 200
# parentheses; SmolLM2's and Qwen3.5's templates nest 5 and 12 deep.
MAX_DEPTH = 64
_steps = contextvars.ContextVar("chat_template_steps")


def _step(n=1):
    left = _steps.get(None)
    if left is None:
        return
    left[0] -= n
    if left[0] < 0:
        raise TemplateError(f"chat template gave up after {MAX_STEPS} steps (it loops too long)")


def _size_ok(n, what):
    if n > MAX_VALUE:
        raise TemplateError(f"chat template would build a value of {n} items by {what} "
                            f"(at most {MAX_VALUE})")
    _step(n // 256)


def _bounded_loop(iterable):
    for item in iterable:
        _step()
        yield item


def _bounded_concat(*parts):
    parts = [str(p) for p in parts]
    _size_ok(sum(map(len, parts)), "~")
    return "".join(parts)


def _sized(v):
    return len(v) if isinstance(v, (str, list, tuple, dict)) else 0


_WIDE_FORMAT = re.compile(r"\d{5,}|\*|:\{")   # a width of 10**4 or more, or one from the arguments


def _check_format(fmt, what):
    if isinstance(fmt, str) and _WIDE_FORMAT.search(fmt):
        raise TemplateError(f"chat template: {what} with a computed or huge width is not allowed")


def _check_args(name, args, kwargs):
    for a in list(args) + list(kwargs.values()):
        if isinstance(a, int) and not isinstance(a, bool) and abs(a) > MAX_ARG:
            raise TemplateError(f"chat template: {name}({a}) is larger than allowed ({MAX_ARG})")


def _result_size(name, value, args, kwargs):
    """An upper bound on the size of what a string method or filter builds."""
    if name == "replace" and len(args) >= 2 and isinstance(value, str):
        old, new = str(args[0]), str(args[1])
        return len(value) + (value.count(old) if old else len(value) + 1) * len(new)
    if name == "join" and isinstance(value, (list, tuple)):
        sep = str(args[0]) if args else str(kwargs.get("d", ""))
        return sum(_sized(v) + 24 for v in value) + len(sep) * len(value)
    if name == "join" and isinstance(value, str) and args and isinstance(args[0], (list, tuple)):
        return sum(_sized(v) for v in args[0]) + len(value) * len(args[0])
    if name == "indent" and isinstance(value, str):
        width = args[0] if args else kwargs.get("width", 4)
        per_line = len(width) if isinstance(width, str) else width if isinstance(width, int) else 0
        return len(value) + (value.count("\n") + 1) * per_line
    if name == "expandtabs" and isinstance(value, str):
        return len(value) + value.count("\t") * (args[0] if args and isinstance(args[0], int) else 8)
    return 0


def _bounded_filter(name, f):
    def bounded(*args, **kwargs):
        _step()
        # the value is the first argument, after the context or environment some filters take
        value_at = 1 if getattr(f, "jinja_pass_arg", None) else 0
        if name == "join" and len(args) > value_at and not isinstance(args[value_at], (str, list, tuple)):
            # a generator (map, select): listed, so that its size is known before joining
            args = args[:value_at] + (list(_bounded_loop(args[value_at])),) + args[value_at + 1:]
        value, rest = (args[value_at], args[value_at + 1:]) if len(args) > value_at else (None, ())
        _check_args(name, rest, kwargs)
        if name == "format":
            _check_format(value, "format")
        _size_ok(_result_size(name, value, rest, kwargs), name)
        out = f(*args, **kwargs)
        _size_ok(_sized(out), name)
        return out
    for attr in ("jinja_pass_arg",):
        if hasattr(f, attr):
            setattr(bounded, attr, getattr(f, attr))
    return bounded


def _check_depth(tree):
    stack = [(tree, 1)]   # no recursion: the depth is what is in question
    while stack:
        node, depth = stack.pop()
        if depth > MAX_DEPTH:
            raise TemplateError(f"chat template is nested more than {MAX_DEPTH} deep "
                                f"(blocks, operators or filters, line {node.lineno})")
        stack.extend((child, depth + 1) for child in node.iter_child_nodes())


class _Bounded(jinja2.visitor.NodeTransformer):
    """Routes every for loop and ~ concatenation through the bounded helpers."""

    def visit_For(self, node):
        self.generic_visit(node)
        node.iter = jinja2.nodes.Call(jinja2.nodes.Name("__fastllm_loop", "load"), [node.iter], [], None, None)
        return node

    def visit_Concat(self, node):
        self.generic_visit(node)
        return jinja2.nodes.Call(jinja2.nodes.Name("__fastllm_concat", "load"), node.nodes, [], None, None)


class _BoundedEnvironment(ImmutableSandboxedEnvironment):
    intercepted_binops = frozenset(["*", "%", "+", "**", "//"])

    def _parse(self, source, name, filename):
        tree = super()._parse(source, name, filename)
        _check_depth(tree)
        return _Bounded().visit(tree)

    def getattr(self, obj, attribute):
        if isinstance(obj, str) and attribute in ("format", "format_map"):
            _check_format(obj, "str.format")
        return super().getattr(obj, attribute)

    def getitem(self, obj, argument):
        if isinstance(obj, str) and argument in ("format", "format_map"):
            _check_format(obj, "str.format")
        return super().getitem(obj, argument)

    def call(__self, __context, __obj, *args, **kwargs):  # noqa: N805 (jinja's signature)
        _step()
        owner = getattr(__obj, "__self__", None)
        if isinstance(owner, (str, list, tuple, dict)):
            name = getattr(__obj, "__name__", "")
            if name == "join" and args and not isinstance(args[0], (str, list, tuple)):
                args = (list(_bounded_loop(args[0])),) + args[1:]
            _check_args(name, args, kwargs)
            _size_ok(_result_size(name, owner, args, kwargs), name)
        else:
            name = getattr(__obj, "__name__", "a call")
        out = super().call(__context, __obj, *args, **kwargs)
        _size_ok(_sized(out), name)
        return out

    def call_binop(self, context, operator, left, right):
        _step()
        if operator == "*":
            seq, n = (left, right) if isinstance(right, int) else (right, left)
            if isinstance(seq, (str, list, tuple)) and isinstance(n, int):
                _size_ok(len(seq) * max(n, 0), "*")
        elif operator == "%" and isinstance(left, str):
            _check_format(left, "%")
        elif operator == "+":
            _size_ok(_sized(left) + _sized(right), "+")
        elif operator == "**" and isinstance(left, (int, float)) and isinstance(right, (int, float)):
            if abs(left) > 1 and right > 0 and right * math.log2(abs(left)) > 1 << 16:
                raise TemplateError(f"chat template: {left} ** {right} is too large")
        out = super().call_binop(context, operator, left, right)
        if isinstance(out, int) and out.bit_length() > 1 << 16:
            raise TemplateError(f"chat template: the result of {operator} is too large")
        return out


@lru_cache(maxsize=32)
def compile_template(source):
    """Compile a chat template (cached by its text)."""
    if not isinstance(source, str):
        raise TypeError(f"chat template must be a string, not {type(source).__name__}")
    env = _BoundedEnvironment(trim_blocks=True, lstrip_blocks=True,
                              extensions=[_GenerationTag, jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals["dict"] = _TemplateDict()
    env.globals["namespace"] = _TemplateNamespace
    env.globals["__fastllm_loop"] = _bounded_loop
    env.globals["__fastllm_concat"] = _bounded_concat
    env.filters = {name: _bounded_filter(name, f) for name, f in env.filters.items()}
    try:
        return env.from_string(source)
    except jinja2.exceptions.TemplateSyntaxError as e:
        raise TemplateError(f"chat template has a syntax error at line {e.lineno}: {e.message}") from e
    except (RecursionError, MemoryError) as e:
        raise TemplateError(f"chat template is too deeply nested to compile ({type(e).__name__})") from None
    except SyntaxError as e:   # in the Python code jinja made: past Python's limits (21 loops in loops)
        raise TemplateError(f"chat template is too deeply nested to compile ({e.msg})") from None


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


def _render(compiled, variables):
    """The template's text within the work bounds; any failure of the
    template's own code is a TemplateError."""
    token = _steps.set([MAX_STEPS])
    try:
        pieces, size = [], 0
        for piece in compiled.generate(**variables):
            size += len(piece)
            if size > MAX_OUTPUT:
                raise TemplateError(f"chat template renders more than {MAX_OUTPUT} characters")
            pieces.append(piece)
        return "".join(pieces)
    except TemplateError:
        raise
    except jinja2.exceptions.TemplateError as e:
        raise TemplateError(f"chat template failed: {type(e).__name__}: {e}") from e
    except RecursionError:
        raise TemplateError("chat template failed: it recurses too deeply") from None
    except (ArithmeticError, LookupError, TypeError, ValueError, AttributeError, MemoryError) as e:
        # the template's own operations ({{ 1 + 'a' }}, x / 0): its error, not fastllm's
        raise TemplateError(f"chat template failed: {type(e).__name__}: {e}") from None
    finally:
        _steps.reset(token)


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
    text = _render(compiled, dict(messages=chat, tools=tools, documents=documents,
                                  add_generation_prompt=add_generation_prompt, **context))

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
