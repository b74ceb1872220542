"""Constrained decoding: replies that follow a grammar, through llguidance.

llguidance (`pip install fastllm-engine[structured]`) knows, for a grammar
and the tokens chosen so far, which tokens may come next. A Grammar is
checked once per request (a bad JSON Schema is a ValueError naming what is
wrong); its start() gives the request a GrammarConstraint, the Sampler's
constraint: it masks the tokens that cannot continue the grammar, follows
each token chosen, and is done once the grammar is complete and admits
nothing more.

The grammars: any JSON object ({"type": "json_object"}), a JSON Schema
({"type": "json_schema", ...}), and tool calls in the model's format (for
tool_choice "required" or a named function), each after the reasoning
block of a model that thinks first.

llguidance works on the bytes of each token id, which come from fastllm's
own tokenizer (built once per tokenizer, vocabulary size and end tokens).

llguidance builds parts of a grammar lazily, while decoding: a schema it
accepts may still admit no reply at all (a $ref to itself), or exceed its
limits at the first token of some part (a pattern of a million repetitions,
a megabyte const). A grammar is therefore probed before any request uses
it: decoding is walked a bounded way into it, trying at each step a token
for every byte that may come next, and a grammar that fails is refused
then (ValueError). llguidance's limits are set so that no step of it holds
the GIL for long; a failure the probe did not reach is a ConstraintError,
a ValueError too: the request's fault, not the server's.
"""
from __future__ import annotations

import json
import re
import threading
import time
import weakref
from dataclasses import dataclass

import numpy as np

from ..tokenizer import decoders
from .toolcalls import QWEN, THINK_CLOSE, THINK_OPEN, ToolFormat

# Whitespace allowed between JSON tokens: a bounded run, so that a model
# cannot fill its reply with newlines (the JSON stays valid either way).
JSON_WHITESPACE = r"[ \t\n\r]{0,32}"
# Tool calls are written as the models were trained to write them.
COMPACT_JSON = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
# llguidance's special-token marker, before the text of a special token.
SPECIAL = b"\xff"
_MAX_MESSAGE = 500   # characters of llguidance's message in an error
# The lexer's work at the first token of a part of the grammar (llguidance's
# "initial lexer fuel", ~50 per microsecond; its default is a million: a
# second, GIL held, for a pattern of a million repetitions). Real schemas
# need a small fraction of it.
LEXER_FUEL = 100_000
# How far a probe walks into a grammar, and the time it may take.
PROBE_TOKENS = 256
PROBE_SECONDS = 0.5
# Bytes a probe prefers to continue with: those that close what is open
# come first, so that the walk goes through a JSON value's structure
# rather than round a string or a number.
_WALK_ORDER = b'"}],:{[0123456789-tfnabcdefghijklmopqrsuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ_.<>/'


class ConstraintError(ValueError):
    """A grammar failed while decoding (a limit of llguidance's reached where
    the probe did not look): the request's grammar is at fault."""


def llguidance():
    """The llguidance module, or an ImportError that says how to install it."""
    try:
        import llguidance as llg
    except ImportError:
        raise ImportError("structured output (response_format, and tool_choice 'required' or a named "
                          "function) needs llguidance: pip install 'fastllm-engine[structured]'") from None
    return llg


# ------------------------------------------------------------- tokenizer

def token_bytes(tokenizer, token_id: int) -> bytes:
    """The bytes token_id adds to a text (b"" for an id the tokenizer does
    not know; a special token's text, which llguidance marks apart)."""
    pieces = tokenizer._tokens_for_decode([token_id], False)
    if not pieces:
        return b""
    piece = pieces[0]
    decoder = tokenizer.decoder
    steps = decoders.byte_level_token_steps(decoder) if decoder is not None else None
    if token_id in tokenizer.special_token_ids or decoder is None:
        return piece.encode("utf-8")
    if steps is not None:   # byte-level: each token is its own bytes
        for step in steps:
            piece = step.decode_chain([piece])[0]
        return decoders.token_bytes(piece)
    byte = decoders.byte_token_value(piece)
    if byte is not None:
        return bytes([byte])
    # Other decoders treat a text's first token apart (Metaspace drops its
    # space): the token's text is what it adds after another one.
    return "".join(decoder.decode_chain(["a", piece]))[1:].encode("utf-8")


class _Vocabulary:
    """What llguidance's TokenizerWrapper reads of a tokenizer."""

    def __init__(self, tokenizer, vocab_size: int, eos_ids):
        self.eos_token_id = eos_ids[0]
        self.bos_token_id = None
        self.special_token_ids = sorted(i for i in tokenizer.special_token_ids if i < vocab_size)
        special = set(self.special_token_ids)
        self.tokens = [SPECIAL + token_bytes(tokenizer, i) if i in special else token_bytes(tokenizer, i)
                       for i in range(vocab_size)]
        # weakly: llguidance's tokenizer, cached for the tokenizer's life,
        # keeps this object and must not keep the tokenizer alive
        self._tokenizer = weakref.ref(tokenizer)

    def __call__(self, text):
        if isinstance(text, bytes):
            text = text.decode("utf-8", "replace")
        return self._tokenizer().encode(text, add_special_tokens=False)


_tokenizers = weakref.WeakKeyDictionary()   # fastllm tokenizer -> {(vocab size, eos ids): _Built}
_building = threading.Lock()


@dataclass(frozen=True)
class _Built:
    ll: object                 # llguidance's LLTokenizer
    first_bytes: np.ndarray    # per token id, its first byte (-1: none, or an end token)
    lengths: np.ndarray        # per token id, its length in bytes


def _built(tokenizer, vocab_size: int, eos_ids) -> _Built:
    """llguidance's tokenizer for a fastllm tokenizer, a model's vocabulary
    size (the logits' length) and end-of-sequence ids, with what a probe
    reads of the tokens' bytes; built once (a second or two for a large
    vocabulary) and kept while the tokenizer lives."""
    llg = llguidance()
    eos = tuple(sorted(int(i) for i in eos_ids if 0 <= i < vocab_size))
    if not eos:
        raise ValueError("constrained decoding needs the model's end-of-sequence token, and it has none")
    key = (int(vocab_size), eos)
    with _building:
        built = _tokenizers.setdefault(tokenizer, {})
        if key not in built:
            vocabulary = _Vocabulary(tokenizer, vocab_size, eos)
            wrapper = llg.TokenizerWrapper(vocabulary)
            first = np.array([t[0] if t else -1 for t in vocabulary.tokens], np.int16)
            first[list(eos)] = -1
            built[key] = _Built(llg.LLTokenizer(wrapper, n_vocab=vocab_size, eos_token=list(eos)), first,
                                np.array([len(t) for t in vocabulary.tokens], np.int32))
        return built[key]


def ll_tokenizer(tokenizer, vocab_size: int, eos_ids):
    """llguidance's tokenizer for a fastllm tokenizer (see _built)."""
    return _built(tokenizer, vocab_size, eos_ids).ll


def for_model(model):
    """llguidance's tokenizer for a fastllm Model."""
    return ll_tokenizer(model._need_tokenizer(), model.config.vocab_size, model.eos_token_ids)


def _limits(llg):
    return llg.LLParserLimits(initial_lexer_fuel=LEXER_FUEL, verbose_errors=False)


# --------------------------------------------------------------- grammars

@dataclass(frozen=True)
class Grammar:
    """A grammar checked against a model's tokenizer; start() gives one
    request its own GrammarConstraint."""
    lark: str
    _matcher: object

    def start(self) -> "GrammarConstraint":
        return GrammarConstraint(self._matcher.deep_copy())


def compile_grammar(model, lark: str, what: str = "grammar", probe: str | None = None) -> Grammar:
    """A Grammar of llguidance's Lark text for model; ValueError (naming
    what) when llguidance refuses it or the probe finds it failing.
    probe: the Lark text probed instead of lark (the same grammar without
    what the probe cannot walk through, such as free reasoning text)."""
    llg = llguidance()
    built = _built(model._need_tokenizer(), model.config.vocab_size, model.eos_token_ids)
    matcher = _matcher(llg, built.ll, lark, what)
    _probe(matcher if probe is None else _matcher(llg, built.ll, probe, what), built, what)
    return Grammar(lark, matcher)


def _matcher(llg, tok, lark: str, what: str):
    grammar = llg.LLMatcher.grammar_from_lark(lark)
    limits = _limits(llg)
    failed, messages = llg.LLMatcher.validate_grammar_with_warnings(grammar, tok, limits=limits)
    if failed:
        raise ValueError(f"{what}: {_short(messages[0] if messages else 'refused')}")
    matcher = llg.LLMatcher(tok, grammar, log_level=0, limits=limits)
    if matcher.is_error():
        raise ValueError(f"{what}: {_short(matcher.get_error())}")
    return matcher


def _allowed(matcher, n: int) -> np.ndarray:
    bits = np.frombuffer(matcher.compute_bitmask(), dtype=np.uint8)
    return np.flatnonzero(np.unpackbits(bits, count=n, bitorder="little"))


def _probe(matcher, built: _Built, what: str):
    """Walk decoding into the grammar of matcher (left as it was), at most
    PROBE_TOKENS tokens or PROBE_SECONDS: at each step a token for every
    byte that may come next is tried, then the walk goes on by the byte of
    _WALK_ORDER that comes first. ValueError where the grammar admits no
    reply or llguidance fails."""
    state, n = matcher.deep_copy(), built.first_bytes.size
    deadline = time.monotonic() + PROBE_SECONDS
    rank = np.full(257, len(_WALK_ORDER), np.int32)
    rank[np.frombuffer(_WALK_ORDER, np.uint8)] = np.arange(len(_WALK_ORDER))
    rank[-1] = len(_WALK_ORDER) + 1   # ids without bytes: last
    for step in range(PROBE_TOKENS):
        allowed = _allowed(state, n)
        if state.is_error():
            raise ValueError(f"{what}: {_short(state.get_error())}")
        first = built.first_bytes[allowed]
        if not allowed.size:
            raise ValueError(f"{what}: the grammar admits no reply (a schema that only refers to itself?)")
        tokens = allowed[first >= 0]
        if not tokens.size:
            return   # only the end: the reply may be complete
        # one token per first byte (the shortest), and the longest of the preferred byte to walk on
        order = np.lexsort((built.lengths[tokens], built.first_bytes[tokens]))
        tokens = tokens[order]
        firsts = built.first_bytes[tokens]
        for token in tokens[np.r_[True, firsts[1:] != firsts[:-1]]]:
            aside = state.deep_copy()
            if not aside.consume_token(int(token)) or aside.is_error():
                raise ValueError(f"{what}: {_short(aside.get_error())}")
            if time.monotonic() > deadline:
                return
        best = firsts[np.argmin(rank[firsts])]
        walk = tokens[firsts == best]
        state.consume_token(int(walk[np.argmax(built.lengths[walk])]))
        if state.is_error():
            raise ValueError(f"{what}: {_short(state.get_error())}")
        if state.is_stopped():
            return


def _short(message: str) -> str:
    """llguidance's message on one line, without the grammar listing (and
    the caret under it) that it may add, nor the parser's state after it."""
    message = re.split(r"<state>|<non-verbose/>", str(message))[0]
    lines = [line.strip() for line in message.strip().split("\n")
             if line.strip() and not re.match(r"\s*(\d+ \||\^\s*$)", line)]
    message = re.sub(r"^at \d+\(\d+\): ", "", " ".join(lines))
    return message if len(message) <= _MAX_MESSAGE else message[:_MAX_MESSAGE] + "..."


def _json_rule(schema: dict, options: dict) -> str:
    """A Lark body for JSON following schema (llguidance's %json), with
    llguidance's JSON options (any the schema gave itself are replaced)."""
    schema = {k: v for k, v in schema.items() if k != "x-guidance"}
    return "%json " + json.dumps({**schema, "x-guidance": options}, ensure_ascii=False)


def response_format_schema(response_format):
    """(schema, strict) of OpenAI's response_format, or None for text.
    ValueError names what is wrong."""
    if response_format is None:
        return None
    if not isinstance(response_format, dict) or not isinstance(response_format.get("type"), str):
        raise ValueError("'response_format' must be an object with a 'type': 'text', 'json_object' "
                         "or 'json_schema'")
    kind = response_format["type"]
    if kind == "text":
        return None
    if kind == "json_object":
        return {"type": "object"}, False
    if kind != "json_schema":
        raise ValueError(f"response_format.type must be 'text', 'json_object' or 'json_schema', got {kind!r}")
    spec = response_format.get("json_schema")
    if not isinstance(spec, dict):
        raise ValueError("response_format.json_schema must be an object with 'name' and 'schema'")
    if spec.get("name") is not None and not isinstance(spec["name"], str):
        raise ValueError("response_format.json_schema.name must be a string")
    strict = spec.get("strict")
    if strict is not None and not isinstance(strict, bool):
        raise ValueError("response_format.json_schema.strict must be true or false")
    schema = spec.get("schema", {"type": "object"})
    if not isinstance(schema, dict):
        raise ValueError("response_format.json_schema.schema must be a JSON Schema object")
    return schema, bool(strict)


def _closed(params: dict) -> dict:
    """A function's parameters schema with no arguments beyond those it
    names (unless it says otherwise): a call has no use for others."""
    if "properties" in params and "additionalProperties" not in params:
        return {**params, "additionalProperties": False}
    return params


def _marker(tokenizer, text: str) -> str:
    """A call marker in the grammar: the special token itself where text is
    one (Mistral's [TOOL_CALLS]), else the text."""
    token = tokenizer.token_to_id(text)
    if token is not None and token in tokenizer.special_token_ids:
        return f"<[{token}]>"
    return json.dumps(text)


def _calls_rule(fmt: ToolFormat, tools: dict, parallel: bool, tokenizer) -> str:
    """Lark rules for tool calls of tools ({name: parameters schema})."""
    more = parallel and fmt.parallel
    if fmt.name_end:   # begin name name_end arguments, per call
        begin, name_end = _marker(tokenizer, fmt.begin), _marker(tokenizer, fmt.name_end)
        options = " | ".join(f"{json.dumps(name)} {name_end} {_json_rule(_closed(params), COMPACT_JSON)}"
                             for name, params in tools.items())
        return f"calls: call{'+' if more else ''}\ncall: {begin} ({options})\n"
    options = [{"type": "object", "properties": {"name": {"const": name}, fmt.arguments_key: _closed(params)},
                "required": ["name", fmt.arguments_key], "additionalProperties": False}
               for name, params in tools.items()]
    call = _json_rule({"anyOf": options} if len(options) > 1 else options[0], COMPACT_JSON)
    if not fmt.begin:
        return f"calls: {call}\n"
    if not fmt.end:   # begin, then a JSON list of calls
        listed = ' (", " call)*' if more else ""
        return f'calls: {_marker(tokenizer, fmt.begin)} " [" call{listed} "]"\ncall: {call}\n'
    more = ' ("\\n" call)*' if more else ""
    return (f"calls: call{more}\n"
            f"call: {json.dumps(fmt.begin + chr(10))} {call} {json.dumps(chr(10) + fmt.end)}\n")


def _reasoning_rules(reasoning: str | None) -> tuple:
    """(what start begins with, rules) for a model's reasoning block:
    None (it does not think), "optional" (it may open <think> itself) or
    "open" (the prompt opened it)."""
    if reasoning is None:
        return "", ""
    rules = (f"think_text[suffix={json.dumps(THINK_CLOSE)}]: /(.|\\n)*/\n"
             "after_think: /[ \\t\\n]*/\n")
    if reasoning == "open":
        return "think_text after_think ", rules
    return "think? ", rules + f"think: {json.dumps(THINK_OPEN)} think_text after_think\n"


def reply_grammar(model, *, response_format=None, tools: dict | None = None, tool_choice: str | None = None,
                  fmt: ToolFormat = QWEN, parallel: bool = True, reasoning: str | None = None):
    """The Grammar a reply must follow, or None when nothing constrains it.

    response_format: OpenAI's (JSON object or schema). tools ({name:
    parameters schema}, as toolcalls.check_tools gives) with tool_choice
    "required" or a function's name: only calls (of that function) in fmt.
    With tool_choice "auto" and a response_format, the reply is either
    calls or the JSON. reasoning: see _reasoning_rules. ValueError for a
    response_format or schema that cannot be used."""
    found = response_format_schema(response_format)
    forced = bool(tools) and tool_choice not in (None, "none", "auto")
    rules, bodies = "", []
    if forced:
        chosen = tools if tool_choice == "required" else {tool_choice: tools[tool_choice]}
        rules += _calls_rule(fmt, chosen, parallel and tool_choice == "required", model.tokenizer)
        bodies.append("calls")
    elif found is not None and tools and tool_choice == "auto":
        rules += _calls_rule(fmt, tools, parallel, model.tokenizer)
        bodies.append("calls")
    if found is not None and not forced:
        schema, strict = found
        options = {"whitespace_pattern": JSON_WHITESPACE, "lenient": not strict}
        rules += f"answer: {_json_rule(schema, options)}\n"
        bodies.append("answer")
    if not bodies:
        return None
    head, think_rules = _reasoning_rules(reasoning)
    body = bodies[0] if len(bodies) == 1 else "(" + " | ".join(bodies) + ")"
    lark = f"%llguidance {{}}\nstart: {head}{body}\n{think_rules}{rules}"
    what = "tools" if forced else "response_format or tools" if "calls" in bodies else "response_format"
    # the probe walks the reply after the reasoning (it would not leave free text)
    probe = f"%llguidance {{}}\nstart: {body}\n{rules}" if head else None
    return compile_grammar(model, lark, what, probe)


# ------------------------------------------------------------ constraint

class GrammarConstraint:
    """One request's place in a grammar: mask() leaves the logits of the
    tokens that may come next (the others at -inf), accept() follows the
    token chosen, done once the grammar admits nothing more."""

    def __init__(self, matcher):
        self._matcher = matcher

    def mask(self, logits: np.ndarray) -> np.ndarray:
        bits = self._matcher.compute_bitmask()
        if self._matcher.is_error():
            raise ConstraintError(f"constrained decoding failed: {_short(self._matcher.get_error())}")
        allowed = np.unpackbits(np.frombuffer(bits, dtype=np.uint8), count=logits.size, bitorder="little")
        out = np.array(logits, dtype=np.float32, copy=True)
        out[allowed == 0] = -np.inf
        return out

    def accept(self, token: int) -> None:
        if not self._matcher.consume_token(int(token)):
            raise ConstraintError(f"constrained decoding: token {token} does not continue the grammar "
                               f"({_short(self._matcher.get_error())})")

    @property
    def done(self) -> bool:
        return self._matcher.is_stopped()
