"""Normalizers: rewrite text before it is split into pre-tokens.

Each normalizer has normalize(s) and normalize_z(s, z).  z is the number of
leading characters aligned with the very first character of the input; it
is only tracked when a Metaspace pre-tokenizer with prepend_scheme="first"
needs to know whether a piece starts the input.
"""
import unicodedata

from .chars import WHITESPACE
from .errors import TokenizerError, UnsupportedTokenizerError, need_str
from .patterns import compile_pattern, onig_matches


_WHITESPACE = "".join(sorted(WHITESPACE))   # for str.strip: Rust's whitespace, not Python's

# Real normalizers change a text's length by a small factor (NFKC at most
# 18-fold). A Replace of "" or a chain of Replaces that feed each other can
# multiply it at every step; past this bound the tokenizer.json, not the
# text, is at fault, and encoding would run for minutes.
GROWTH = 64


def _check_growth(n_in: int, n_out: int, what: str):
    if n_out > GROWTH * n_in + 4096:
        raise TokenizerError(f"{what} grows a text of {n_in} characters to more than {n_out}: "
                             "this tokenizer.json cannot be used")


class _Rewrite:
    """A normalizer that rewrites characters where they stand: the first z
    characters of s become normalize(s[:z])."""

    def normalize_z(self, s, z):
        return self.normalize(s), (len(self.normalize(s[:z])) if z else 0)


class NF(_Rewrite):
    def __init__(self, form):
        self.form = form

    def normalize(self, s):
        if s.isascii():
            return s
        return unicodedata.normalize(self.form, s)


class Lowercase(_Rewrite):
    def normalize(self, s):
        # tokenizers lowercases char by char, so it never applies the Final_Sigma
        # rule that str.lower() applies to a word-final capital sigma.
        if "\u03a3" in s:
            s = s.replace("\u03a3", "\u03c3")
        return s.lower()


class Prepend:
    def __init__(self, prepend):
        self.prepend = prepend

    def normalize(self, s):
        return self.prepend + s if s else s

    def normalize_z(self, s, z):
        if not s:
            return s, z
        return self.prepend + s, (z + len(self.prepend) if z else 0)


class Strip:
    def __init__(self, left, right):
        self.left = left
        self.right = right

    def normalize(self, s):
        return self.normalize_z(s, 0)[0]

    def normalize_z(self, s, z):
        lead = len(s) - len(s.lstrip(_WHITESPACE)) if self.left else 0
        if lead == len(s):
            return "", 0
        trail = len(s) - len(s.rstrip(_WHITESPACE)) if self.right else 0
        return s[lead:len(s) - trail], max(0, z - lead)


class Replace:
    def __init__(self, pattern, content, where):
        self.pat = compile_pattern(pattern, where)
        self.content = content

    def normalize(self, s):
        out, n = [], 0
        for a, b, m in onig_matches(self.pat, s):
            out.append(self.content if m else s[a:b])
            n += len(out[-1])
            _check_growth(len(s), n, "a Replace normalizer")
        return "".join(out)

    def normalize_z(self, s, z):
        # Replaced text inherits the alignment of the last replaced character
        # (an insertion at the very start aligns with offset 0).
        out = []
        flags = []
        for a, b, m in onig_matches(self.pat, s):
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
            _check_growth(len(s), len(flags), "a Replace normalizer")
        nz = 0
        for f in flags:
            if not f:
                break
            nz += 1
        return "".join(out), nz


class Sequence:
    def __init__(self, items):
        self.items = items

    def normalize(self, s):
        n_in = len(s)
        for n in self.items:
            s = n.normalize(s)
            _check_growth(n_in, len(s), "the normalizer Sequence")
        return s

    def normalize_z(self, s, z):
        n_in = len(s)
        for n in self.items:
            s, z = n.normalize_z(s, z)
            _check_growth(n_in, len(s), "the normalizer Sequence")
        return s, z


def build(d, where="normalizer"):
    if d is None:
        return None
    if not isinstance(d, dict):
        raise TokenizerError(f"{where}: expected an object, got {d!r}")
    t = d.get("type")
    if t in ("NFC", "NFD", "NFKC", "NFKD"):
        return NF(t)
    if t == "Lowercase":
        return Lowercase()
    if t == "Prepend":
        return Prepend(need_str(d["prepend"], where, "prepend"))
    if t == "Strip":
        return Strip(bool(d.get("strip_left", True)), bool(d.get("strip_right", True)))
    if t == "Replace":
        return Replace(d["pattern"], need_str(d["content"], where, "content"), where)
    if t == "Precompiled":
        from .precompiled import Precompiled   # it builds on this module
        return Precompiled(d.get("precompiled_charsmap"), where)
    if t == "Sequence":
        items = [build(x, f"{where}.normalizers[{i}]")
                 for i, x in enumerate(d.get("normalizers", []))]
        return Sequence([x for x in items if x is not None])
    raise UnsupportedTokenizerError(f"{where}: normalizer type {t!r} is not supported "
                                    "(supported: NFC, NFD, NFKC, NFKD, Lowercase, Replace, "
                                    "Prepend, Strip, Precompiled, Sequence)")

