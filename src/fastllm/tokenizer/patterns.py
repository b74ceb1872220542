"""Regex patterns of tokenizer.json, written for Oniguruma (what `tokenizers`
uses), run with the `regex` package."""
import regex

from .errors import TokenizerError, UnsupportedTokenizerError

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


def compile_pattern(spec, where):
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


def onig_matches(pat, s):
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
