"""Added tokens (special tokens and the like) and finding them in text."""
import re

import regex

from .chars import WHITESPACE

# The word character of Rust's `regex` crate (used by tokenizers for the
# single_word test): Alphabetic, marks, decimal digits, connector punctuation
# and join controls.  This is also what the `regex` package's \w means.
_WORD_CHAR = regex.compile(r"[\p{Alphabetic}\p{M}\p{Nd}\p{Pc}\p{Join_Control}]")


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


class Matcher:
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
                while newstart > 0 and s[newstart - 1] in WHITESPACE:
                    newstart -= 1
                start = max(newstart, start_offset)
            if tok.rstrip:
                while stop < n and s[stop] in WHITESPACE:
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

