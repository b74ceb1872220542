"""Tokenizer for HuggingFace ``tokenizer.json`` files (BPE models).

This reimplements the encode/decode pipeline of the HuggingFace ``tokenizers``
library (added tokens -> normalizer -> pre-tokenizer -> BPE model ->
post-processor, and the decoder chain) so that token ids match it exactly.
Only components that appear in BPE tokenizer files are implemented; any other
component is refused with an error naming it, because an approximation would
silently produce different ids.

Usage::

    tok = Tokenizer.from_pretrained("path/to/model")   # tokenizer.json + tokenizer_config.json
    ids = tok.encode("Hello world")
    text = tok.decode(ids)
    prompt = tok.apply_chat_template(messages, add_generation_prompt=True)
    stream = tok.incremental_decoder()
    for i in generated_ids:
        print(stream.add(i), end="")
    print(stream.flush())

Hot paths: pre-tokens are cached (raw piece -> ids), and merging runs in the
Cython module ``_bpe`` (for byte-level models directly on UTF-8 bytes).

Known limits of exactness:

* Character classes (``\\p{L}``, ``\\s`` ...) come from the ``regex`` package
  and ``unicodedata``, whose Unicode versions differ from the Rust crates used
  by ``tokenizers``.  Text that contains characters assigned only in the newest
  Unicode versions may tokenize differently.
* Offsets are not tracked (only ids are produced), except for the one place
  where ``tokenizers`` lets offsets change ids: Metaspace with
  ``prepend_scheme="first"``, where the needed alignment is approximated for
  normalizers that rewrite the first character.
* A Replace normalizer whose regex matches the empty string at the start of
  a piece: ``tokenizers`` inserts the replacement twice there (and can then
  crash); fastllm inserts it once.
"""
import json
import os
import re
import unicodedata
from array import array

import regex

from . import _bpe
from .errors import FastLLMError, ModelFileError

__all__ = ["Tokenizer", "TokenizerError", "UnsupportedTokenizerError", "IncrementalDecoder"]


class TokenizerError(FastLLMError, ValueError):
    """Invalid input to a tokenizer, or an invalid tokenizer definition."""


class UnsupportedTokenizerError(TokenizerError):
    """The tokenizer.json uses a component (or option) fastllm does not implement."""


# --------------------------------------------------------------------------
# Character helpers
# --------------------------------------------------------------------------

# Rust's char::is_whitespace (the Unicode White_Space property).  Python's
# str.isspace() also accepts U+001C..U+001F, which Rust does not.
_WHITESPACE = frozenset(
    "\t\n\x0b\x0c\r \x85\xa0\u1680\u2000\u2001\u2002\u2003\u2004\u2005\u2006"
    "\u2007\u2008\u2009\u200a\u2028\u2029\u202f\u205f\u3000")

# The word character of Rust's `regex` crate (used by tokenizers for the
# single_word test): Alphabetic, marks, decimal digits, connector punctuation
# and join controls.  This is also what the `regex` package's \w means.
_WORD_CHAR = regex.compile(r"[\p{Alphabetic}\p{M}\p{Nd}\p{Pc}\p{Join_Control}]")


def _lstrip_ws_count(s):
    n = 0
    for c in s:
        if c not in _WHITESPACE:
            break
        n += 1
    return n


def _rstrip_ws_count(s):
    n = 0
    for c in reversed(s):
        if c not in _WHITESPACE:
            break
        n += 1
    return n


def _bytes_to_unicode():
    """GPT-2's reversible byte <-> printable character table."""
    bs = (list(range(ord("!"), ord("~") + 1)) + list(range(ord("\xa1"), ord("\xac") + 1))
          + list(range(ord("\xae"), ord("\xff") + 1)))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    table = [""] * 256
    for b, c in zip(bs, cs):
        table[b] = chr(c)
    return table


_BYTE_CHARS = _bytes_to_unicode()
_CHAR_TO_BYTE = {c: b for b, c in enumerate(_BYTE_CHARS)}
# str.translate table from latin-1 decoded bytes to byte-level characters.
_LATIN1_TO_BYTE_CHARS = {b: _BYTE_CHARS[b] for b in range(256)}


def _byte_level(s):
    return s.encode("utf-8").decode("latin-1").translate(_LATIN1_TO_BYTE_CHARS)


def _lower_per_char(s):
    # tokenizers lowercases char by char, so it never applies the Final_Sigma
    # rule that str.lower() applies to a word-final capital sigma.
    if "\u03a3" in s:
        s = s.replace("\u03a3", "\u03c3")
    return s.lower()


def _check_text(text, what="text"):
    if not isinstance(text, str):
        raise TypeError(f"{what} must be str, not {type(text).__name__}")
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        bad = text[e.start]
        raise TokenizerError(
            f"{what} contains the lone surrogate U+{ord(bad):04X} at index {e.start}; "
            "surrogates are not Unicode characters and cannot be tokenized "
            "(decode the source bytes with errors='replace' or fix the string)") from None


# --------------------------------------------------------------------------
# Regex patterns from tokenizer.json (Oniguruma syntax in `tokenizers`)
# --------------------------------------------------------------------------

# Oniguruma's \w: Alphabetic, marks, decimal digits and connector
# punctuation, plus the Latin-1 superscripts and fractions its single-byte
# table marks as word characters.
_ONIG_WORD = r"\p{Alphabetic}\p{M}\p{Nd}\p{Pc}\u00b2\u00b3\u00b9\u00bc-\u00be"


def _translate_onig(pattern, where):
    """Rewrite the few Oniguruma constructs whose meaning differs in `regex`.

    Oniguruma's \\w differs from the `regex` package's (no join controls,
    a few Latin-1 numbers), and \\h is a hex digit.  Everything else used by tokenizer files (\\p{..},
    \\s, \\d, lookaheads, (?i:...)) means the same in both.
    """
    out = []
    i = 0
    n = len(pattern)
    in_class = False
    while i < n:
        c = pattern[i]
        if c == "\\" and i + 1 < n:
            e = pattern[i + 1]
            if e in "wWhH":
                neg = e in "WH"
                body = _ONIG_WORD if e in "wW" else "0-9a-fA-F"
                if in_class:
                    if neg:
                        raise UnsupportedTokenizerError(
                            f"{where}: regex {pattern!r} uses \\{e} inside a character class, "
                            "which fastllm cannot translate exactly")
                    out.append(body)
                else:
                    out.append(("[^" if neg else "[") + body + "]")
            else:
                out.append(pattern[i:i + 2])
            i += 2
            continue
        if in_class:
            if c == "[":
                if pattern.startswith("[:", i):
                    raise UnsupportedTokenizerError(
                        f"{where}: regex {pattern!r} uses a POSIX bracket class, whose Oniguruma "
                        "meaning fastllm does not reproduce")
                raise UnsupportedTokenizerError(
                    f"{where}: regex {pattern!r} uses a nested character class")
            if c == "]" and not (out and out[-1] in ("[", "[^")):
                in_class = False
            out.append(c)
            i += 1
            continue
        if c == "[":
            in_class = True
            if i + 1 < n and pattern[i + 1] == "^":
                out.append("[^")
                i += 2
            else:
                out.append("[")
                i += 1
            # A ']' right after '[' or '[^' is a literal in Oniguruma.
            if i < n and pattern[i] == "]":
                out.append("\\]")
                i += 1
            continue
        out.append(c)
        i += 1
    return "".join(out)


def _compile_pattern(spec, where):
    """Compile a {"String": ...} or {"Regex": ...} pattern from tokenizer.json."""
    if isinstance(spec, str):
        spec = {"String": spec}
    if not isinstance(spec, dict) or len(spec) != 1:
        raise TokenizerError(f"{where}: pattern must be {{'String': ...}} or {{'Regex': ...}}, got {spec!r}")
    kind, value = next(iter(spec.items()))
    if kind == "String":
        return regex.compile(regex.escape(value), regex.V0)
    if kind == "Regex":
        try:
            # Oniguruma (Ruby syntax) treats ^ and $ as line anchors.
            return regex.compile(_translate_onig(value, where), regex.V0 | regex.MULTILINE)
        except regex.error as e:
            raise UnsupportedTokenizerError(f"{where}: cannot compile regex {value!r}: {e}") from None
    raise TokenizerError(f"{where}: unknown pattern kind {kind!r}")


def _onig_matches(pat, s):
    """(start, end, is_match) spans covering s, iterating matches like `tokenizers`.

    Oniguruma's iterator, as `tokenizers` drives it, rejects an empty match
    that starts where the previous match ended and retries one character
    later; Python's finditer instead also accepts a non-empty match there.
    The difference decides which text counts as a delimiter, so it is
    reproduced here.
    """
    n = len(s)
    if n == 0:
        return [(0, 0, False)]
    spans = []
    prev = 0
    pos = 0
    last_end = None
    search = pat.search
    while pos <= n:
        m = search(s, pos)
        if m is None:
            break
        a, b = m.span()
        if a == b and last_end == pos:
            pos += 1
            continue
        if prev != a:
            spans.append((prev, a, False))
        spans.append((a, b, True))
        prev = b
        last_end = b
        pos = b
    if prev != n:
        spans.append((prev, n, False))
    return spans


def _apply_behavior(spans, behavior):
    """Turn match spans into kept (start, end) pieces, per SplitDelimiterBehavior."""
    if behavior == "Isolated":
        return [(a, b) for a, b, _ in spans]
    if behavior == "Removed":
        return [(a, b) for a, b, m in spans if not m]
    out = []
    prev_match = False
    if behavior == "Contiguous":
        for a, b, m in spans:
            if m == prev_match and out:
                out[-1] = (out[-1][0], b)
            else:
                out.append((a, b))
            prev_match = m
        return out
    if behavior == "MergedWithPrevious":
        for a, b, m in spans:
            if m and not prev_match and out:
                out[-1] = (out[-1][0], b)
            else:
                out.append((a, b))
            prev_match = m
        return out
    if behavior == "MergedWithNext":
        for a, b, m in reversed(spans):
            if m and not prev_match and out:
                out[-1] = (a, out[-1][1])
            else:
                out.append((a, b))
            prev_match = m
        out.reverse()
        return out
    raise TokenizerError(f"unknown split behavior {behavior!r}")


_BEHAVIORS = {"isolated": "Isolated", "removed": "Removed", "contiguous": "Contiguous",
              "mergedwithprevious": "MergedWithPrevious", "merged_with_previous": "MergedWithPrevious",
              "mergedwithnext": "MergedWithNext", "merged_with_next": "MergedWithNext"}


def _behavior(value, where):
    b = _BEHAVIORS.get(str(value).lower())
    if b is None:
        raise TokenizerError(f"{where}: unknown split behavior {value!r}")
    return b


def _sub_pieces_z(piece, z, spans):
    """Slice a piece, carrying z (see _Pipeline) into each slice."""
    out = []
    for a, b in spans:
        if b > a:
            out.append((piece[a:b], z - a if a < z else 0))
    return out


# --------------------------------------------------------------------------
# Normalizers
# --------------------------------------------------------------------------
#
# Each normalizer has normalize(s) and normalize_z(s, z).  z is the number of
# leading characters aligned with the very first character of the input; it
# is only tracked when a Metaspace pre-tokenizer with prepend_scheme="first"
# needs to know whether a piece starts the input.

class _NF:
    def __init__(self, form):
        self.form = form

    def normalize(self, s):
        if s.isascii():
            return s
        return unicodedata.normalize(self.form, s)

    def normalize_z(self, s, z):
        return self.normalize(s), (len(self.normalize(s[:z])) if z else 0)


class _Lowercase:
    def normalize(self, s):
        return _lower_per_char(s)

    def normalize_z(self, s, z):
        return _lower_per_char(s), (len(_lower_per_char(s[:z])) if z else 0)


class _Prepend:
    def __init__(self, prepend):
        self.prepend = prepend

    def normalize(self, s):
        return self.prepend + s if s else s

    def normalize_z(self, s, z):
        if not s:
            return s, z
        return self.prepend + s, (z + len(self.prepend) if z else 0)


class _Strip:
    def __init__(self, left, right):
        self.left = left
        self.right = right

    def normalize(self, s):
        return self.normalize_z(s, 0)[0]

    def normalize_z(self, s, z):
        lead = _lstrip_ws_count(s) if self.left else 0
        if lead == len(s):
            return "", 0
        trail = _rstrip_ws_count(s) if self.right else 0
        return s[lead:len(s) - trail], max(0, z - lead)


class _Replace:
    def __init__(self, pattern, content, where):
        self.pat = _compile_pattern(pattern, where)
        self.content = content

    def normalize(self, s):
        out = []
        for a, b, m in _onig_matches(self.pat, s):
            out.append(self.content if m else s[a:b])
        return "".join(out)

    def normalize_z(self, s, z):
        # Replaced text inherits the alignment of the last replaced character
        # (an insertion at the very start aligns with offset 0).
        out = []
        flags = []
        for a, b, m in _onig_matches(self.pat, s):
            if m:
                if b > a:
                    f = b - 1 < z
                else:
                    f = (a - 1 < z) if a > 0 else True
                out.append(self.content)
                flags.extend([f] * len(self.content))
            else:
                out.append(s[a:b])
                flags.extend(i < z for i in range(a, b))
        nz = 0
        for f in flags:
            if not f:
                break
            nz += 1
        return "".join(out), nz


class _NormalizerSequence:
    def __init__(self, items):
        self.items = items

    def normalize(self, s):
        for n in self.items:
            s = n.normalize(s)
        return s

    def normalize_z(self, s, z):
        for n in self.items:
            s, z = n.normalize_z(s, z)
        return s, z


def _build_normalizer(d, where="normalizer"):
    if d is None:
        return None
    if not isinstance(d, dict):
        raise TokenizerError(f"{where}: expected an object, got {d!r}")
    t = d.get("type")
    if t in ("NFC", "NFD", "NFKC", "NFKD"):
        return _NF(t)
    if t == "Lowercase":
        return _Lowercase()
    if t == "Prepend":
        return _Prepend(d["prepend"])
    if t == "Strip":
        return _Strip(bool(d.get("strip_left", True)), bool(d.get("strip_right", True)))
    if t == "Replace":
        return _Replace(d["pattern"], d["content"], where)
    if t == "Sequence":
        items = [_build_normalizer(x, f"{where}.normalizers[{i}]")
                 for i, x in enumerate(d.get("normalizers", []))]
        return _NormalizerSequence([x for x in items if x is not None])
    raise UnsupportedTokenizerError(f"{where}: normalizer type {t!r} is not supported "
                                    "(supported: NFC, NFD, NFKC, NFKD, Lowercase, Replace, "
                                    "Prepend, Strip, Sequence)")


# --------------------------------------------------------------------------
# Pre-tokenizers
# --------------------------------------------------------------------------
#
# split(pieces) maps a list of strings to a list of strings; split_z does the
# same on (string, z) pairs.  Empty pieces are always dropped, as in
# tokenizers.

_GPT2_PATTERN = regex.compile(
    r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+""")


def _isolated_split(pat, pieces):
    """Fast path for Isolated splitting: pieces are matches plus gaps."""
    out = []
    # findall returns capture groups instead of whole matches when the
    # pattern has groups, so it is only usable for group-free patterns.
    findall = pat.findall if pat.groups == 0 else None
    for p in pieces:
        found = findall(p) if findall is not None else None
        total = -1
        if found is not None:
            total = 0
            for f in found:
                total += len(f)
        if total == len(p):
            out.extend([f for f in found if f])
        else:
            prev = 0
            for m in pat.finditer(p):
                a, b = m.span()
                if a > prev:
                    out.append(p[prev:a])
                if b > a:
                    out.append(p[a:b])
                prev = b
            if prev < len(p):
                out.append(p[prev:])
    return out


class _ByteLevelPre:
    """ByteLevel pre-tokenizer.  The byte mapping itself is separate (map())
    so that, when ByteLevel is the last step, it can be deferred to the model
    and done on bytes directly."""

    def __init__(self, add_prefix_space, use_regex):
        self.add_prefix_space = add_prefix_space
        self.use_regex = use_regex

    def split(self, pieces):
        if self.add_prefix_space:
            pieces = [p if p.startswith(" ") else " " + p for p in pieces]
        if self.use_regex:
            pieces = _isolated_split(_GPT2_PATTERN, pieces)
        return pieces

    def split_z(self, pieces):
        out = []
        for p, z in pieces:
            if self.add_prefix_space and not p.startswith(" "):
                p, z = " " + p, (z + 1 if z else 0)
            if self.use_regex:
                spans = [(a, b) for a, b, _ in _onig_matches(_GPT2_PATTERN, p)]
                out.extend(_sub_pieces_z(p, z, spans))
            else:
                out.append((p, z))
        return out

    @staticmethod
    def map(pieces):
        return [_byte_level(p) for p in pieces]

    @staticmethod
    def map_z(pieces):
        return [(_byte_level(p), len(p[:z].encode("utf-8"))) for p, z in pieces]


class _SplitPre:
    def __init__(self, pattern, behavior, invert, where):
        self.pat = _compile_pattern(pattern, where)
        self.behavior = behavior
        self.invert = invert

    def _spans(self, p):
        spans = _onig_matches(self.pat, p)
        if self.invert:
            spans = [(a, b, not m) for a, b, m in spans]
        return _apply_behavior(spans, self.behavior)

    def split(self, pieces):
        if self.behavior == "Isolated" and not self.invert:
            return _isolated_split(self.pat, pieces)
        out = []
        for p in pieces:
            out.extend(p[a:b] for a, b in self._spans(p) if b > a)
        return out

    def split_z(self, pieces):
        out = []
        for p, z in pieces:
            out.extend(_sub_pieces_z(p, z, self._spans(p)))
        return out


class _CharClassPre(_SplitPre):
    """Pre-tokenizers defined by a per-character predicate (Digits,
    WhitespaceSplit) or a fixed regex (Whitespace)."""

    def __init__(self, pat, behavior, invert=False):
        self.pat = pat
        self.behavior = behavior
        self.invert = invert


class _MetaspacePre:
    def __init__(self, replacement, prepend_scheme, split):
        self.replacement = replacement
        self.prepend_scheme = prepend_scheme
        self.split_on = split
        self.pat = regex.compile(regex.escape(replacement))

    def _one(self, p, first):
        p = p.replace(" ", self.replacement)
        prefixed = False
        if self.prepend_scheme == "always" or (self.prepend_scheme == "first" and first):
            if not p.startswith(self.replacement):
                p = self.replacement + p
                prefixed = True
        if self.split_on:
            spans = _apply_behavior(_onig_matches(self.pat, p), "MergedWithNext")
        else:
            spans = [(0, len(p))]
        return p, prefixed, spans

    def split(self, pieces):
        out = []
        for piece in pieces:
            p, _, spans = self._one(piece, False)
            out.extend(p[a:b] for a, b in spans if b > a)
        return out

    def split_z(self, pieces):
        out = []
        for piece, z in pieces:
            p, prefixed, spans = self._one(piece, z > 0)
            if prefixed and z:
                z += 1
            out.extend(_sub_pieces_z(p, z, spans))
        return out


_DIGIT = regex.compile(r"\p{N}")
_WHITESPACE_CHAR = regex.compile("[" + "".join(sorted(_WHITESPACE)).replace("\\", "\\\\") + "]")
# tokenizers' Whitespace pre-tokenizer uses the Rust `regex` crate, whose \w
# matches the `regex` package's \w (not Oniguruma's).
_WHITESPACE_WORDS = regex.compile(r"\w+|[^\w\s]+")


def _flatten_pre(d, where):
    """List of pre-tokenizer steps, with nested Sequences flattened."""
    if d is None:
        return []
    if not isinstance(d, dict):
        raise TokenizerError(f"{where}: expected an object, got {d!r}")
    t = d.get("type")
    if t == "Sequence":
        out = []
        for i, x in enumerate(d.get("pretokenizers", [])):
            out.extend(_flatten_pre(x, f"{where}.pretokenizers[{i}]"))
        return out
    if t == "ByteLevel":
        return [_ByteLevelPre(bool(d.get("add_prefix_space", True)), bool(d.get("use_regex", True)))]
    if t == "Split":
        return [_SplitPre(d["pattern"], _behavior(d.get("behavior", "Isolated"), where),
                          bool(d.get("invert", False)), where)]
    if t == "Digits":
        return [_CharClassPre(_DIGIT, "Isolated" if d.get("individual_digits", False) else "Contiguous")]
    if t == "WhitespaceSplit":
        return [_CharClassPre(_WHITESPACE_CHAR, "Removed")]
    if t == "Whitespace":
        return [_CharClassPre(_WHITESPACE_WORDS, "Removed", invert=True)]
    if t == "Metaspace":
        rep = d.get("replacement", "\u2581")
        if not isinstance(rep, str) or len(rep) != 1:
            raise TokenizerError(f"{where}: Metaspace replacement must be one character, got {rep!r}")
        scheme = d.get("prepend_scheme")
        if scheme is None:
            scheme = "always" if d.get("add_prefix_space", True) else "never"
        if scheme not in ("always", "first", "never"):
            raise TokenizerError(f"{where}: unknown Metaspace prepend_scheme {scheme!r}")
        return [_MetaspacePre(rep, scheme, bool(d.get("split", True)))]
    raise UnsupportedTokenizerError(
        f"{where}: pre-tokenizer type {t!r} is not supported (supported: ByteLevel, Split, Digits, "
        "Whitespace, WhitespaceSplit, Metaspace, Sequence)")


# --------------------------------------------------------------------------
# BPE model
# --------------------------------------------------------------------------

_CACHE_LIMIT = 200_000


class _BPE:
    def __init__(self, d, where="model"):
        t = d.get("type", "BPE")
        if t != "BPE":
            raise UnsupportedTokenizerError(
                f"{where}: model type {t!r} is not supported; fastllm implements BPE models only")
        if "vocab" not in d or "merges" not in d:
            raise TokenizerError(f"{where}: a BPE model needs 'vocab' and 'merges'")
        dropout = d.get("dropout")
        if dropout not in (None, 0, 0.0):
            raise UnsupportedTokenizerError(
                f"{where}: BPE dropout={dropout!r} is random at encode time; fastllm refuses it")
        self.vocab = d["vocab"]
        if not isinstance(self.vocab, dict):
            raise TokenizerError(f"{where}.vocab: expected an object mapping tokens to ids")
        self.merges = d["merges"]
        if not isinstance(self.merges, list):
            raise TokenizerError(f"{where}.merges: expected a list")
        self.unk_token = d.get("unk_token")
        self.prefix = d.get("continuing_subword_prefix") or ""
        self.suffix = d.get("end_of_word_suffix") or ""
        self.fuse_unk = bool(d.get("fuse_unk", False))
        self.byte_fallback = bool(d.get("byte_fallback", False))
        self.ignore_merges = bool(d.get("ignore_merges", False))
        self.where = where
        self._table = None
        self._vocab_r = None
        self._byte_ids = None

    # Building the merge table costs ~0.2 s for a 250k-merge file, so it is
    # deferred to the first encode that misses the cache.
    @property
    def table(self):
        if self._table is None:
            table = _bpe.MergeTable(len(self.merges))
            err = table.load_merges(self.merges, self.vocab, len(self.prefix))
            if err is not None:
                i, tok = err
                if tok is None:
                    raise TokenizerError(f"{self.where}.merges[{i}]: {self.merges[i]!r} is not a pair of tokens")
                raise TokenizerError(f"{self.where}.merges[{i}]: token {tok!r} is not in the vocabulary")
            self._table = table
        return self._table

    def validate(self):
        self.table  # noqa: B018 - raises on a broken merges list

    @property
    def vocab_r(self):
        if self._vocab_r is None:
            self._vocab_r = {v: k for k, v in self.vocab.items()}
        return self._vocab_r

    def byte_ids(self):
        """Vocabulary ids of the 256 byte-level characters, or None if the
        model cannot use the fast byte path."""
        if self._byte_ids is None:
            ids = [self.vocab.get(c) for c in _BYTE_CHARS]
            if None in ids or self.prefix or self.suffix:
                self._byte_ids = False
            else:
                self._byte_ids = array("i", ids)
        return self._byte_ids or None

    def _unk_id(self):
        uid = self.vocab.get(self.unk_token)
        if uid is None:
            raise TokenizerError(f"{self.where}: unk_token {self.unk_token!r} is not in the vocabulary")
        return uid

    def tokenize(self, w):
        """Ids of one pre-token (already in the model's alphabet)."""
        if not w:
            return []
        vocab = self.vocab
        if self.ignore_merges:
            tid = vocab.get(w)
            if tid is not None:
                return [tid]
        ids = []
        unk = None
        last = len(w) - 1
        prefix, suffix = self.prefix, self.suffix
        for i, ch in enumerate(w):
            s = ch
            if i and prefix:
                s = prefix + s
            if i == last and suffix:
                s = s + suffix
            tid = vocab.get(s)
            if tid is not None:
                if unk is not None:
                    ids.append(unk)
                    unk = None
                ids.append(tid)
                continue
            if self.byte_fallback:
                bts = [vocab.get("<0x%02X>" % b) for b in s.encode("utf-8")]
                if None not in bts:
                    # A pending unk is deliberately not flushed here: tokenizers
                    # keeps it until the next known character.
                    ids.extend(bts)
                    continue
            if self.unk_token is not None:
                uid = self._unk_id()
                if unk is not None and not self.fuse_unk:
                    ids.append(unk)
                unk = uid
        if unk is not None:
            ids.append(unk)
        return self.table.merge_ids(ids)

    def byte_miss(self):
        """Function computing the ids of a raw pre-token on the byte path."""
        table = self.table
        byte_ids = self.byte_ids()
        merge = table.merge_bytes
        if self.ignore_merges:
            vocab = self.vocab

            def miss(piece):
                tid = vocab.get(_byte_level(piece))
                if tid is not None:
                    return [tid]
                return merge(piece.encode("utf-8"), byte_ids)
        else:
            def miss(piece):
                return merge(piece.encode("utf-8"), byte_ids)
        return miss


# --------------------------------------------------------------------------
# Added tokens
# --------------------------------------------------------------------------

class AddedToken:
    __slots__ = ("content", "id", "single_word", "lstrip", "rstrip", "normalized", "special", "text")

    def __init__(self, content, id, single_word=False, lstrip=False, rstrip=False,
                 normalized=True, special=False):
        self.content = content
        self.id = id
        self.single_word = single_word
        self.lstrip = lstrip
        self.rstrip = rstrip
        self.normalized = normalized
        self.special = special
        # What decode() and id_to_token() show: tokenizers uses the normalized
        # content for normalized tokens (so a decoder can invert it).
        self.text = content

    def __repr__(self):
        return (f"AddedToken({self.content!r}, id={self.id}, special={self.special}, "
                f"normalized={self.normalized}, lstrip={self.lstrip}, rstrip={self.rstrip}, "
                f"single_word={self.single_word})")


class _Matcher:
    """Leftmost-longest matching of added tokens (an Aho-Corasick automaton
    with MatchKind::LeftmostLongest in tokenizers).  A regex alternation with
    longer literals first finds the same matches.  The stdlib `re` engine is
    used here: for thousands of literals it compiles and searches several
    times faster than the `regex` package."""

    def __init__(self, entries):
        # entries: list of (pattern_string, AddedToken)
        self.by_text = {}
        for text, tok in entries:
            if text and text not in self.by_text:
                self.by_text[text] = tok
        self.active = bool(self.by_text)
        self._pat = None

    @property
    def pat(self):
        if self._pat is None and self.active:
            alts = sorted(self.by_text, key=len, reverse=True)
            self._pat = re.compile("|".join(re.escape(a) for a in alts))
        return self._pat

    def split(self, s):
        """[(start, end, token or None)] covering s; tokenizers' find_matches."""
        if not self.active or not s:
            return None
        spans = []
        start_offset = 0
        n = len(s)
        for m in self.pat.finditer(s):
            start, stop = m.span()
            tok = self.by_text[m.group()]
            if tok.single_word:
                if start > 0 and _WORD_CHAR.match(s, start - 1):
                    continue
                if stop < n and _WORD_CHAR.match(s, stop):
                    continue
            if tok.lstrip:
                newstart = start
                while newstart > 0 and s[newstart - 1] in _WHITESPACE:
                    newstart -= 1
                start = max(newstart, start_offset)
            if tok.rstrip:
                while stop < n and s[stop] in _WHITESPACE:
                    stop += 1
            if start_offset < start:
                spans.append((start_offset, start, None))
            spans.append((start, stop, tok))
            start_offset = stop
        if not spans:
            return None
        if start_offset != n:
            spans.append((start_offset, n, None))
        return spans


# --------------------------------------------------------------------------
# Post-processors
# --------------------------------------------------------------------------

class _TemplateProcessing:
    def __init__(self, d, where):
        single = d.get("single", [])
        if isinstance(single, str):
            raise TokenizerError(f"{where}.single: expected the serialized list form")
        self.pieces = []
        specials = d.get("special_tokens", {}) or {}
        for i, item in enumerate(single):
            if "SpecialToken" in item:
                name = item["SpecialToken"]["id"]
                if name not in specials:
                    raise TokenizerError(f"{where}: special token {name!r} used in the template "
                                         "is missing from special_tokens")
                self.pieces.append(list(specials[name]["ids"]))
            elif "Sequence" in item:
                if item["Sequence"].get("id", "A") != "A":
                    raise TokenizerError(f"{where}.single[{i}]: a single-sequence template can only use $A")
                self.pieces.append(None)
            else:
                raise TokenizerError(f"{where}.single[{i}]: unknown template item {item!r}")

    def added(self):
        return sum(len(p) for p in self.pieces if p is not None)

    def process(self, ids):
        out = []
        for p in self.pieces:
            out.extend(ids if p is None else p)
        return out


class _WrapProcessing:
    """BertProcessing / RobertaProcessing: cls + ids + sep."""

    def __init__(self, d):
        self.cls = d["cls"][1]
        self.sep = d["sep"][1]

    def added(self):
        return 2

    def process(self, ids):
        return [self.cls] + list(ids) + [self.sep]


class _NoopProcessing:
    def added(self):
        return 0

    def process(self, ids):
        return ids


class _ProcessorSequence:
    def __init__(self, items):
        self.items = items

    def added(self):
        return sum(p.added() for p in self.items)

    def process(self, ids):
        for p in self.items:
            ids = p.process(ids)
        return ids


def _build_post(d, where="post_processor"):
    if d is None:
        return None
    t = d.get("type")
    if t == "TemplateProcessing":
        return _TemplateProcessing(d, where)
    if t == "ByteLevel":
        return _NoopProcessing()
    if t in ("BertProcessing", "RobertaProcessing"):
        return _WrapProcessing(d)
    if t == "Sequence":
        return _ProcessorSequence([_build_post(x, f"{where}.processors[{i}]")
                                   for i, x in enumerate(d.get("processors", []))])
    raise UnsupportedTokenizerError(f"{where}: post-processor type {t!r} is not supported "
                                    "(supported: TemplateProcessing, ByteLevel, Sequence)")


# --------------------------------------------------------------------------
# Decoders: each maps a list of token strings to a list of strings.
# --------------------------------------------------------------------------

def _utf8_lossy(b):
    # Python's 'replace' handler substitutes one U+FFFD per maximal invalid
    # subsequence, which is what Rust's String::from_utf8_lossy does.
    return b.decode("utf-8", "replace")


class _ByteLevelDec:
    def decode_chain(self, tokens):
        buf = bytearray()
        c2b = _CHAR_TO_BYTE
        for t in tokens:
            try:
                buf.extend([c2b[c] for c in t])
            except KeyError:
                # A token with any character outside the byte alphabet (an
                # added token, typically) is taken as its own UTF-8 text.
                buf.extend(t.encode("utf-8"))
        return [_utf8_lossy(bytes(buf))]


def _byte_token_value(t):
    if len(t) == 6 and t.startswith("<0x") and t.endswith(">"):
        h = t[3:5]
        # Rust's u8::from_str_radix accepts an optional '+' sign, nothing else.
        digits = h[1:] if h[0] == "+" else h
        if digits and all(c in "0123456789abcdefABCDEF" for c in digits):
            return int(digits, 16)
    return None


class _ByteFallbackDec:
    def decode_chain(self, tokens):
        out = []
        pending = bytearray()

        def flush():
            try:
                out.append(bytes(pending).decode("utf-8"))
            except UnicodeDecodeError:
                out.extend(["\ufffd"] * len(pending))
            pending.clear()

        for t in tokens:
            b = _byte_token_value(t)
            if b is not None:
                pending.append(b)
                continue
            if pending:
                flush()
            out.append(t)
        if pending:
            flush()
        return out


class _FuseDec:
    def decode_chain(self, tokens):
        return ["".join(tokens)]


class _StripDec:
    def __init__(self, content, start, stop):
        self.content = content
        self.start = start
        self.stop = stop

    def decode_chain(self, tokens):
        out = []
        c = self.content
        for t in tokens:
            a = 0
            while a < self.start and a < len(t) and t[a] == c:
                a += 1
            b = len(t)
            k = 0
            while k < self.stop and b > a and t[b - 1] == c:
                b -= 1
                k += 1
            out.append(t[a:b])
        return out


class _ReplaceDec:
    def __init__(self, pattern, content, where):
        self.norm = _Replace(pattern, content, where)

    def decode_chain(self, tokens):
        return [self.norm.normalize(t) for t in tokens]


class _MetaspaceDec:
    def __init__(self, replacement, prepend_scheme):
        self.replacement = replacement
        self.prepend_scheme = prepend_scheme

    def decode_chain(self, tokens):
        out = []
        for i, t in enumerate(tokens):
            if i == 0 and self.prepend_scheme != "never":
                out.append(t.replace(self.replacement, ""))
            else:
                out.append(t.replace(self.replacement, " "))
        return out


class _DecoderSequence:
    def __init__(self, items):
        self.items = items

    def decode_chain(self, tokens):
        for d in self.items:
            tokens = d.decode_chain(tokens)
        return tokens


def _build_decoder(d, where="decoder"):
    if d is None:
        return None
    t = d.get("type")
    if t == "ByteLevel":
        return _ByteLevelDec()
    if t == "ByteFallback":
        return _ByteFallbackDec()
    if t == "Fuse":
        return _FuseDec()
    if t == "Strip":
        content = d.get("content", " ")
        return _StripDec(content, int(d.get("start", 0)), int(d.get("stop", 0)))
    if t == "Replace":
        return _ReplaceDec(d["pattern"], d["content"], where)
    if t == "Metaspace":
        scheme = d.get("prepend_scheme")
        if scheme is None:
            scheme = "always" if d.get("add_prefix_space", True) else "never"
        return _MetaspaceDec(d.get("replacement", "\u2581"), scheme)
    if t == "Sequence":
        return _DecoderSequence([_build_decoder(x, f"{where}.decoders[{i}]")
                                 for i, x in enumerate(d.get("decoders", []))])
    raise UnsupportedTokenizerError(f"{where}: decoder type {t!r} is not supported (supported: "
                                    "ByteLevel, ByteFallback, Fuse, Strip, Replace, Metaspace, Sequence)")


# --------------------------------------------------------------------------
# Tokenizer
# --------------------------------------------------------------------------

_NAMED_SPECIALS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token",
                   "mask_token")


def _token_str(v):
    if isinstance(v, dict):
        return v.get("content")
    return v


def _read_json(path, what):
    try:
        with open(path, "rb") as f:
            data = f.read()
    except FileNotFoundError:
        raise ModelFileError(path, f"{what} not found") from None
    except OSError as e:
        raise ModelFileError(path, f"cannot read {what}: {e.strerror or e}") from None
    try:
        return json.loads(data)
    except (UnicodeDecodeError, ValueError) as e:
        raise ModelFileError(path, f"{what} is not valid JSON: {e}") from None


class Tokenizer:
    """A BPE tokenizer loaded from a HuggingFace ``tokenizer.json``.

    Encoding and decoding give the same ids and text as the ``tokenizers``
    library on the same file; ``from_pretrained`` also applies what
    transformers takes from ``tokenizer_config.json`` (special-token names,
    add_bos_token/add_eos_token, the chat template).
    """

    def __init__(self, spec, path=None):
        where = str(path) if path is not None else "tokenizer.json"
        try:
            self._build(spec, where)
        except (KeyError, TypeError, AttributeError, IndexError) as e:
            raise TokenizerError(f"{where}: malformed tokenizer definition ({type(e).__name__}: {e})") from None
        self.path = path
        self.chat_template = None
        self.bos_token = None
        self.eos_token = None
        self.special_tokens_map = {}
        self.config = {}

    # ---- construction -------------------------------------------------

    def _build(self, spec, where):
        if not isinstance(spec, dict):
            raise TokenizerError(f"{where}: top level must be a JSON object")
        version = spec.get("version", "1.0")
        if version != "1.0":
            raise UnsupportedTokenizerError(f"{where}: unknown tokenizer.json version {version!r}")
        if "model" not in spec or not isinstance(spec["model"], dict):
            raise TokenizerError(f"{where}: no 'model' section")
        self.model = _BPE(spec["model"], f"{where}: model")
        self.normalizer = _build_normalizer(spec.get("normalizer"), f"{where}: normalizer")
        steps = _flatten_pre(spec.get("pre_tokenizer"), f"{where}: pre_tokenizer")
        self.post_processor = _build_post(spec.get("post_processor"), f"{where}: post_processor")
        self.decoder = _build_decoder(spec.get("decoder"), f"{where}: decoder")
        self._truncation = spec.get("truncation")
        self._padding = spec.get("padding")
        self._check_truncation_padding(where)

        # When ByteLevel is the last pre-tokenizer step its character mapping
        # is left to the model, which then works on UTF-8 bytes and caches by
        # the unmapped piece.
        self._deferred_byte_level = bool(steps) and isinstance(steps[-1], _ByteLevelPre)
        self._steps = steps
        self._need_z = any(isinstance(s, _MetaspacePre) and s.prepend_scheme == "first" for s in steps)
        self._cache = {}
        self._miss = None

        self._build_added(spec.get("added_tokens") or [], where)

    def _check_truncation_padding(self, where):
        t = self._truncation
        if t is not None:
            if not isinstance(t, dict) or "max_length" not in t:
                raise TokenizerError(f"{where}: malformed truncation {t!r}")
            if t.get("direction", "Right") not in ("Right", "Left"):
                raise TokenizerError(f"{where}: unknown truncation direction {t.get('direction')!r}")
        p = self._padding
        if p is not None:
            if not isinstance(p, dict):
                raise TokenizerError(f"{where}: malformed padding {p!r}")
            strat = p.get("strategy", "BatchLongest")
            if not (strat == "BatchLongest" or (isinstance(strat, dict) and "Fixed" in strat)):
                raise TokenizerError(f"{where}: unknown padding strategy {strat!r}")

    def _build_added(self, entries, where):
        self._added = {}          # content -> AddedToken, in insertion order
        self._added_by_id = {}
        self._max_added_id = None
        self._special_contents = set()
        for i, e in enumerate(entries):
            if not isinstance(e, dict) or not isinstance(e.get("content"), str):
                raise TokenizerError(f"{where}: added_tokens[{i}] is malformed: {e!r}")
            self._add_token(e["content"], bool(e.get("special", False)),
                            single_word=bool(e.get("single_word", False)),
                            lstrip=bool(e.get("lstrip", False)), rstrip=bool(e.get("rstrip", False)),
                            normalized=bool(e.get("normalized", not e.get("special", False))))
        self._refresh_added()

    def _add_token(self, content, special, single_word=False, lstrip=False, rstrip=False,
                   normalized=None):
        if normalized is None:
            normalized = not special
        if not content:
            return
        # Ids are assigned the way tokenizers does when it loads a file: an
        # existing (added or model) id is reused, otherwise the next id after
        # the model vocabulary and previous added tokens.  The "id" field in
        # the file is not consulted, exactly as in tokenizers.
        tid = self._added[content].id if content in self._added else self.model.vocab.get(content)
        if tid is None:
            model_size = len(self.model.vocab)
            mx = self._max_added_id
            if mx is None:
                tid = model_size
            else:
                tid = mx + 1 if (mx >= model_size or model_size == 0) else model_size
        tok = AddedToken(content, tid, single_word, lstrip, rstrip, normalized, special)
        if normalized and self.normalizer is not None:
            tok.text = self.normalizer.normalize(content)
        self._added[content] = tok
        self._added_by_id[tid] = tok
        if self._max_added_id is None or tid > self._max_added_id:
            self._max_added_id = tid
        if special:
            self._special_contents.add(content)

    def _refresh_added(self):
        toks = list(self._added.values())
        self._raw_matcher = _Matcher([(t.content, t) for t in toks if not t.normalized])
        norm = self.normalizer
        self._norm_matcher = _Matcher(
            [(t.text if norm else t.content, t) for t in toks if t.normalized])
        self.special_token_ids = {t.id for t in toks if t.special}

    @classmethod
    def from_file(cls, path):
        """Load a tokenizer.json file.

        The merge table is built on first use (it is most of the work for
        large vocabularies), so a merge naming a token that is not in the
        vocabulary is reported by the first encode(), or by validate().
        """
        path = os.fspath(path)
        spec = _read_json(path, "tokenizer.json")
        return cls(spec, path)

    @classmethod
    def from_str(cls, json_text):
        """Build a tokenizer from the text of a tokenizer.json."""
        try:
            spec = json.loads(json_text)
        except ValueError as e:
            raise TokenizerError(f"tokenizer.json text is not valid JSON: {e}") from None
        return cls(spec)

    @classmethod
    def from_pretrained(cls, folder):
        """Load tokenizer.json, tokenizer_config.json and chat templates from a folder.

        Follows transformers: special-token names come from
        tokenizer_config.json (or the legacy special_tokens_map.json), named
        special tokens missing from tokenizer.json are added, and a
        chat_template.jinja file overrides the config's template.  Whether
        BOS/EOS are added is up to tokenizer.json's post-processor (transformers
        ignores add_bos_token/add_eos_token when tokenizer.json exists).
        """
        folder = os.fspath(folder)
        if os.path.isfile(folder) and folder.endswith(".json"):
            return cls.from_file(folder)
        if not os.path.isdir(folder):
            raise ModelFileError(folder, "tokenizer folder not found")
        tj = os.path.join(folder, "tokenizer.json")
        if not os.path.exists(tj):
            raise ModelFileError(tj, "tokenizer.json not found (fastllm needs the HuggingFace "
                                     "tokenizer.json file; vocab.json/merges.txt alone are not supported)")
        tok = cls.from_file(tj)
        cfg_path = os.path.join(folder, "tokenizer_config.json")
        cfg = {}
        if os.path.exists(cfg_path):
            cfg = _read_json(cfg_path, "tokenizer_config.json")
            if not isinstance(cfg, dict):
                raise ModelFileError(cfg_path, "tokenizer_config.json must contain a JSON object")
        tok._apply_config(cfg, folder, cfg_path)
        return tok

    def _apply_config(self, cfg, folder, cfg_path):
        self.config = cfg
        named = {k: cfg.get(k) for k in _NAMED_SPECIALS if cfg.get(k) is not None}
        stm = os.path.join(folder, "special_tokens_map.json")
        if "added_tokens_decoder" not in cfg and os.path.exists(stm):
            m = _read_json(stm, "special_tokens_map.json")
            if isinstance(m, dict):
                for k in _NAMED_SPECIALS:
                    if m.get(k) is not None:
                        named[k] = m[k]

        # transformers adds the added_tokens_decoder entries and the named
        # special tokens that tokenizer.json lacks.
        changed = False
        atd = cfg.get("added_tokens_decoder") or {}
        if not isinstance(atd, dict):
            raise ModelFileError(cfg_path, "added_tokens_decoder must be an object")
        try:
            entries = sorted(atd.items(), key=lambda kv: int(kv[0]))
        except (TypeError, ValueError):
            raise ModelFileError(cfg_path, "added_tokens_decoder keys must be token ids") from None
        for _, t in entries:
            if isinstance(t, dict) and t.get("content") and t["content"] not in self._added:
                self._add_token(t["content"], bool(t.get("special", False)),
                                single_word=bool(t.get("single_word", False)),
                                lstrip=bool(t.get("lstrip", False)), rstrip=bool(t.get("rstrip", False)),
                                normalized=bool(t.get("normalized", not t.get("special", False))))
                changed = True
        self.special_tokens_map = {}
        for k, v in named.items():
            s = _token_str(v)
            if not isinstance(s, str):
                raise ModelFileError(cfg_path, f"{k} must be a string or a token object, got {v!r}")
            self.special_tokens_map[k] = s
            if s not in self._added:
                if isinstance(v, dict):
                    self._add_token(s, True, single_word=bool(v.get("single_word", False)),
                                    lstrip=bool(v.get("lstrip", False)), rstrip=bool(v.get("rstrip", False)),
                                    normalized=bool(v.get("normalized", False)))
                else:
                    self._add_token(s, True)
                changed = True
        if changed:
            self._refresh_added()
        self.bos_token = self.special_tokens_map.get("bos_token")
        self.eos_token = self.special_tokens_map.get("eos_token")

        # add_bos_token/add_eos_token are deliberately not applied: when a
        # tokenizer.json exists, transformers (5.x) drops them and lets the
        # file's post-processor decide which special tokens encode() adds.

        template = cfg.get("chat_template")
        if isinstance(template, list):
            try:
                template = {t["name"]: t["template"] for t in template}
            except (KeyError, TypeError):
                raise ModelFileError(cfg_path, "chat_template list entries need 'name' and 'template'") from None
        templates = {}
        jinja = os.path.join(folder, "chat_template.jinja")
        if os.path.exists(jinja):
            with open(jinja, encoding="utf-8") as f:
                templates["default"] = f.read()
        extra_dir = os.path.join(folder, "additional_chat_templates")
        if os.path.isdir(extra_dir):
            for name in sorted(os.listdir(extra_dir)):
                if name.endswith(".jinja"):
                    with open(os.path.join(extra_dir, name), encoding="utf-8") as f:
                        templates[name[:-len(".jinja")]] = f.read()
        if len(templates) == 1 and "default" in templates:
            template = templates["default"]
        elif templates:
            template = templates
        self.chat_template = template

    def validate(self):
        """Build the lazily built structures now, raising on a broken merges list."""
        self.model.validate()
        return self

    # ---- vocabulary ---------------------------------------------------

    @property
    def vocab_size(self):
        """Size of the vocabulary including added tokens (len(tokenizer) in transformers)."""
        n = len(self.model.vocab)
        vocab = self.model.vocab
        for content in self._added:
            if content not in vocab:
                n += 1
        return n

    def __len__(self):
        return self.vocab_size

    def get_vocab(self):
        v = dict(self.model.vocab)
        for content, t in self._added.items():
            v[content] = t.id
        return v

    def token_to_id(self, token):
        t = self._added.get(token)
        if t is not None:
            return t.id
        return self.model.vocab.get(token)

    def id_to_token(self, id):
        t = self._added_by_id.get(id)
        if t is not None:
            return t.text
        return self.model.vocab_r.get(id)

    def convert_ids_to_tokens(self, ids):
        return [self.id_to_token(i) for i in ids]

    @property
    def added_tokens(self):
        """Added tokens by id."""
        return dict(sorted(self._added_by_id.items()))

    @property
    def bos_token_id(self):
        return self.token_to_id(self.bos_token) if self.bos_token is not None else None

    @property
    def eos_token_id(self):
        return self.token_to_id(self.eos_token) if self.eos_token is not None else None

    # ---- encoding -----------------------------------------------------

    def _piece_encoder(self):
        if self._miss is None:
            model = self.model
            if self._deferred_byte_level and model.byte_ids() is not None:
                self._miss = model.byte_miss()
            elif self._deferred_byte_level:
                tokenize = model.tokenize
                self._miss = lambda piece: tokenize(_byte_level(piece))
            else:
                self._miss = model.tokenize
        return self._miss

    def _pre_tokenize(self, segs):
        """Pieces (model input strings) of normalized text segments."""
        steps = self._steps
        if self._need_z:
            pieces = segs
            for i, step in enumerate(steps):
                pieces = step.split_z(pieces)
                if isinstance(step, _ByteLevelPre) and not (i == len(steps) - 1 and self._deferred_byte_level):
                    pieces = step.map_z(pieces)
            return [p for p, _ in pieces]
        pieces = segs
        for i, step in enumerate(steps):
            pieces = step.split(pieces)
            if isinstance(step, _ByteLevelPre) and not (i == len(steps) - 1 and self._deferred_byte_level):
                pieces = _ByteLevelPre.map(pieces)
        return pieces

    def _encode_text(self, text):
        """Ids of text without post-processing (add_special_tokens=False)."""
        if not text:
            return []
        need_z = self._need_z
        # 1. added tokens matched on the raw text
        raw = self._raw_matcher.split(text) if self._raw_matcher.active else None
        if raw is None:
            segs = [(text, 1 if need_z else 0)]
        else:
            segs = [(tok if tok is not None else text[a:b], 1 if (need_z and a == 0) else 0)
                    for a, b, tok in raw if b > a]
        # 2. normalize text segments, then match normalized added tokens
        norm = self.normalizer
        nm = self._norm_matcher if self._norm_matcher.active else None
        items = []   # AddedToken or (text, z)
        for seg, z in segs:
            if isinstance(seg, AddedToken):
                items.append(seg)
                continue
            if norm is not None:
                if need_z:
                    seg, z = norm.normalize_z(seg, z)
                else:
                    seg = norm.normalize(seg)
            if not seg:
                continue
            sp = nm.split(seg) if nm is not None else None
            if sp is None:
                items.append((seg, z))
            else:
                for a, b, tok in sp:
                    if b > a:
                        items.append(tok if tok is not None else (seg[a:b], z - a if a < z else 0))
        # 3. pre-tokenize and run the model on each run of text segments
        ids = []
        miss = self._piece_encoder()
        run = []
        for it in items:
            if isinstance(it, AddedToken):
                if run:
                    ids.extend(self._encode_run(run, miss))
                    run = []
                ids.append(it.id)
            else:
                run.append(it)
        if run:
            ids.extend(self._encode_run(run, miss))
        return ids

    def _encode_run(self, run, miss):
        segs = run if self._need_z else [s for s, _ in run]
        pieces = self._pre_tokenize(segs)
        return _bpe.encode_pieces(pieces, self._cache, miss, _CACHE_LIMIT)

    def _post(self, ids, add_special_tokens):
        t = self._truncation
        if t is not None:
            added = self.post_processor.added() if (add_special_tokens and self.post_processor) else 0
            room = int(t["max_length"]) - added
            # tokenizers subtracts in unsigned arithmetic: a max_length below
            # the number of special tokens wraps around and truncates nothing.
            if 0 <= room < len(ids):
                ids = ids[len(ids) - room:] if t.get("direction", "Right") == "Left" else ids[:room]
        if add_special_tokens and self.post_processor is not None:
            ids = self.post_processor.process(ids)
        return list(ids)

    def _pad(self, seqs, batch):
        p = self._padding
        if p is None:
            return seqs
        strat = p.get("strategy", "BatchLongest")
        if isinstance(strat, dict):
            target = int(strat["Fixed"])
        else:
            target = max((len(s) for s in seqs), default=0)
        multiple = p.get("pad_to_multiple_of")
        if multiple:
            target = ((target + multiple - 1) // multiple) * multiple
        pad_id = int(p.get("pad_id", 0))
        left = p.get("direction", "Right") == "Left"
        out = []
        for s in seqs:
            n = target - len(s)
            if n > 0:
                s = [pad_id] * n + s if left else s + [pad_id] * n
            out.append(s)
        return out

    def encode(self, text, add_special_tokens=True):
        """Token ids of text, as tokenizers' Tokenizer.encode(text).ids."""
        _check_text(text)
        ids = self._post(self._encode_text(text), add_special_tokens)
        if self._padding is not None:
            ids = self._pad([ids], False)[0]
        return ids

    def encode_batch(self, texts, add_special_tokens=True):
        """encode() for each text; padding from tokenizer.json applies across the batch."""
        if isinstance(texts, str):
            raise TypeError("encode_batch expects a list of strings, not a single string")
        out = []
        for i, text in enumerate(texts):
            _check_text(text, f"texts[{i}]")
            out.append(self._post(self._encode_text(text), add_special_tokens))
        return self._pad(out, True)

    def tokenize(self, text, add_special_tokens=False):
        """Token strings of text."""
        return self.convert_ids_to_tokens(self.encode(text, add_special_tokens=add_special_tokens))

    def __call__(self, text, add_special_tokens=True):
        return self.encode(text, add_special_tokens=add_special_tokens)

    # ---- decoding -----------------------------------------------------

    def _tokens_for_decode(self, ids, skip_special_tokens):
        out = []
        added = self._added_by_id
        vocab_r = self.model.vocab_r
        specials = self._special_contents
        for i in ids:
            t = added.get(i)
            s = t.text if t is not None else vocab_r.get(i)
            if s is None:
                continue   # unknown ids are dropped, as tokenizers does
            if skip_special_tokens and s in specials:
                continue
            out.append(s)
        return out

    def decode(self, ids, skip_special_tokens=False):
        """Text of token ids, as tokenizers' Tokenizer.decode."""
        if isinstance(ids, int):
            ids = [ids]
        else:
            ids = [int(i) for i in ids]
        tokens = self._tokens_for_decode(ids, skip_special_tokens)
        if self.decoder is None:
            return " ".join(tokens)
        return "".join(self.decoder.decode_chain(tokens))

    def decode_batch(self, seqs, skip_special_tokens=False):
        return [self.decode(s, skip_special_tokens) for s in seqs]

    def incremental_decoder(self, skip_special_tokens=True):
        """A streaming decoder: .add(token_id) returns newly completed text."""
        return IncrementalDecoder(self, skip_special_tokens)

    # ---- chat templates -----------------------------------------------

    def apply_chat_template(self, messages, add_generation_prompt=False, tools=None, tokenize=False,
                            chat_template=None, documents=None, continue_final_message=False,
                            **template_kwargs):
        """Render a conversation with the chat template, as transformers does.

        Returns the text, or its ids when tokenize=True (encoded with
        add_special_tokens=False, so special tokens written by the template
        are recognised and nothing else is added).
        """
        from .chat_template import get_template, render_chat

        template = get_template(self.chat_template, chat_template, tools)
        text = render_chat(template, messages, tools=tools, documents=documents,
                           add_generation_prompt=add_generation_prompt,
                           continue_final_message=continue_final_message,
                           special_tokens_map=self.special_tokens_map, **template_kwargs)
        if tokenize:
            return self.encode(text, add_special_tokens=False)
        return text

    def __repr__(self):
        return (f"Tokenizer(vocab_size={self.vocab_size}, path={self.path!r}, "
                f"bos_token={self.bos_token!r}, eos_token={self.eos_token!r})")


class IncrementalDecoder:
    """Streaming detokenizer whose outputs concatenate to decode(all ids).

    Each add() decodes a short window of recent ids: the ids since the last
    point where the text was stable (the prefix) plus the new ones.  Text is
    released only when the window's decoding grows past the prefix and does
    not end in U+FFFD, i.e. no multi-byte character is still incomplete.
    Decoding the prefix together with the new ids keeps context-dependent
    decoders (Metaspace's leading space, Strip) consistent with a full
    decode().  With a ByteFallback decoder a run of <0xXX> tokens is held
    back until a non-byte token ends it, because one more byte can turn the
    whole run into replacement characters.
    """

    def __init__(self, tokenizer, skip_special_tokens=True):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.ids = []
        self.prefix = ""
        self.prefix_index = 0
        self._byte_runs = _has_decoder(tokenizer.decoder, _ByteFallbackDec)

    def _decode(self, ids):
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def _open_byte_run(self, ids):
        if not self._byte_runs:
            return False
        tokens = self.tokenizer._tokens_for_decode(ids[-16:], self.skip_special_tokens)
        return bool(tokens) and _byte_token_value(tokens[-1]) is not None

    def add(self, token_id):
        """Feed one id; returns the newly completed text (possibly "")."""
        ids = self.ids
        if not self.prefix and ids and not self._open_byte_run(ids):
            p = self._decode(ids)
            if not p.endswith("\ufffd"):
                self.prefix = p
                self.prefix_index = len(ids)
        ids.append(int(token_id))
        if self._open_byte_run(ids):
            return ""
        text = self._decode(ids)
        if len(text) > len(self.prefix) and not text.endswith("\ufffd") and text.startswith(self.prefix):
            new = text[len(self.prefix):]
            keep = ids[self.prefix_index:]
            self.ids = keep
            self.prefix = self._decode(keep)
            self.prefix_index = len(keep)
            return new
        return ""

    def flush(self):
        """Text still held back (an incomplete character decodes as U+FFFD)."""
        text = self._decode(self.ids)
        out = text[len(self.prefix):]
        self.ids = []
        self.prefix = ""
        self.prefix_index = 0
        return out


def _has_decoder(dec, cls):
    if isinstance(dec, cls):
        return True
    if isinstance(dec, _DecoderSequence):
        return any(_has_decoder(d, cls) for d in dec.items)
    return False
