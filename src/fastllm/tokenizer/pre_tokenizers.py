"""Pre-tokenizers: split normalized text into the pieces the model encodes.

split(pieces) maps a list of strings to a list of strings; split_z does the
same on (string, z) pairs (z: see normalizers).  Empty pieces are always
dropped, as in tokenizers.
"""
import regex

from .chars import WHITESPACE, byte_level
from .errors import TokenizerError, UnsupportedTokenizerError
from .patterns import compile_pattern, onig_matches

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


def _apply_behavior(spans, behavior):
    """Turn match spans into kept (start, end) pieces, per SplitDelimiterBehavior."""
    if behavior == "Isolated":
        return [(a, b) for a, b, _ in spans]
    if behavior == "Removed":
        return [(a, b) for a, b, m in spans if not m]
    if behavior not in ("Contiguous", "MergedWithPrevious", "MergedWithNext"):
        raise TokenizerError(f"unknown split behavior {behavior!r}")
    # Contiguous joins a span to the previous one of its kind; a delimiter
    # joins the piece before it (MergedWithPrevious) or, read from the end,
    # the piece after it (MergedWithNext).
    contiguous = behavior == "Contiguous"
    backwards = behavior == "MergedWithNext"
    out = []
    prev_match = False
    for a, b, m in (reversed(spans) if backwards else spans):
        if out and (m == prev_match if contiguous else m and not prev_match):
            out[-1] = (a, out[-1][1]) if backwards else (out[-1][0], b)
        else:
            out.append((a, b))
        prev_match = m
    if backwards:
        out.reverse()
    return out


_BEHAVIORS = {"isolated": "Isolated", "removed": "Removed", "contiguous": "Contiguous",
              "mergedwithprevious": "MergedWithPrevious", "merged_with_previous": "MergedWithPrevious",
              "mergedwithnext": "MergedWithNext", "merged_with_next": "MergedWithNext"}


def _behavior(value, where):
    b = _BEHAVIORS.get(str(value).lower())
    if b is None:
        raise TokenizerError(f"{where}: unknown split behavior {value!r}")
    return b


def _sub_pieces_z(piece, z, spans):
    """Slice a piece, carrying z (see normalizers) into each slice."""
    out = []
    for a, b in spans:
        if b > a:
            out.append((piece[a:b], z - a if a < z else 0))
    return out


class ByteLevel:
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
                spans = [(a, b) for a, b, _ in onig_matches(_GPT2_PATTERN, p)]
                out.extend(_sub_pieces_z(p, z, spans))
            else:
                out.append((p, z))
        return out

    @staticmethod
    def map(pieces):
        return [byte_level(p) for p in pieces]

    @staticmethod
    def map_z(pieces):
        return [(byte_level(p), len(p[:z].encode("utf-8"))) for p, z in pieces]


class Split:
    def __init__(self, pattern, behavior, invert, where):
        self.pat = compile_pattern(pattern, where)
        self.behavior = behavior
        self.invert = invert

    def _spans(self, p):
        spans = onig_matches(self.pat, p)
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


class CharClass(Split):
    """Pre-tokenizers defined by a per-character predicate (Digits,
    WhitespaceSplit) or a fixed regex (Whitespace)."""

    def __init__(self, pat, behavior, invert=False):
        self.pat = pat
        self.behavior = behavior
        self.invert = invert


class Metaspace:
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
            spans = _apply_behavior(onig_matches(self.pat, p), "MergedWithNext")
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
_WHITESPACE_CHAR = regex.compile("[" + "".join(sorted(WHITESPACE)).replace("\\", "\\\\") + "]")
# tokenizers' Whitespace pre-tokenizer uses the Rust `regex` crate, whose \w
# matches the `regex` package's \w (not Oniguruma's).
_WHITESPACE_WORDS = regex.compile(r"\w+|[^\w\s]+")


def build(d, where):
    """List of pre-tokenizer steps, with nested Sequences flattened."""
    if d is None:
        return []
    if not isinstance(d, dict):
        raise TokenizerError(f"{where}: expected an object, got {d!r}")
    t = d.get("type")
    if t == "Sequence":
        out = []
        for i, x in enumerate(d.get("pretokenizers", [])):
            out.extend(build(x, f"{where}.pretokenizers[{i}]"))
        return out
    if t == "ByteLevel":
        return [ByteLevel(bool(d.get("add_prefix_space", True)), bool(d.get("use_regex", True)))]
    if t == "Split":
        return [Split(d["pattern"], _behavior(d.get("behavior", "Isolated"), where),
                          bool(d.get("invert", False)), where)]
    if t == "Digits":
        return [CharClass(_DIGIT, "Isolated" if d.get("individual_digits", False) else "Contiguous")]
    if t == "WhitespaceSplit":
        return [CharClass(_WHITESPACE_CHAR, "Removed")]
    if t == "Whitespace":
        return [CharClass(_WHITESPACE_WORDS, "Removed", invert=True)]
    if t == "Metaspace":
        rep = d.get("replacement", "\u2581")
        if not isinstance(rep, str) or len(rep) != 1:
            raise TokenizerError(f"{where}: Metaspace replacement must be one character, got {rep!r}")
        scheme = d.get("prepend_scheme")
        if scheme is None:
            scheme = "always" if d.get("add_prefix_space", True) else "never"
        if scheme not in ("always", "first", "never"):
            raise TokenizerError(f"{where}: unknown Metaspace prepend_scheme {scheme!r}")
        return [Metaspace(rep, scheme, bool(d.get("split", True)))]
    raise UnsupportedTokenizerError(
        f"{where}: pre-tokenizer type {t!r} is not supported (supported: ByteLevel, Split, Digits, "
        "Whitespace, WhitespaceSplit, Metaspace, Sequence)")

