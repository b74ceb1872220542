"""The Precompiled normalizer: SentencePiece's own normalization rules
(nmt_nfkc, nfkc_cf, ...) as the .model file stores them, a double-array trie
from UTF-8 strings to their replacements.

tokenizers applies it grapheme cluster by grapheme cluster: a cluster of
fewer than 6 bytes is replaced whole when the trie has an entry for some
prefix of it (the shortest such entry, whatever follows it in the cluster);
otherwise each character is replaced by its own entry or kept. This is not
what SentencePiece itself does (it replaces the longest matching prefix of
the remaining text), so the two libraries differ on a few clusters; fastllm
follows tokenizers, whose file it reads.
"""
import base64
import binascii
import struct

import regex

from .errors import TokenizerError
from .normalizers import _Rewrite

_GRAPHEME = regex.compile(r"\X")
_MEMO_LIMIT = 100_000   # grapheme clusters whose replacement is remembered


class Precompiled(_Rewrite):
    def __init__(self, charsmap_b64, where="normalizer"):
        if not isinstance(charsmap_b64, str):
            raise TokenizerError(f"{where}: precompiled_charsmap must be a base64 string")
        try:
            blob = base64.b64decode(charsmap_b64, validate=True)
        except (binascii.Error, ValueError) as e:
            raise TokenizerError(f"{where}: precompiled_charsmap is not base64: {e}") from None
        self.where = where
        if not blob:
            # tokenizers refuses an empty charsmap too.
            raise TokenizerError(f"{where}: precompiled_charsmap is empty")
        if len(blob) < 4:
            raise TokenizerError(f"{where}: precompiled_charsmap is shorter than its header")
        (trie_bytes,) = struct.unpack_from("<I", blob)
        units = trie_bytes // 4
        if 4 + 4 * units > len(blob):
            raise TokenizerError(f"{where}: precompiled_charsmap's trie runs past its end")
        self.array = struct.unpack_from(f"<{units}I", blob, 4)
        self.normalized = blob[4 + 4 * units:]
        try:
            self.normalized.decode("utf-8")
        except UnicodeDecodeError:
            raise TokenizerError(f"{where}: precompiled_charsmap's replacement strings are not UTF-8") from None
        if not self.array:
            raise TokenizerError(f"{where}: precompiled_charsmap has an empty trie")
        self._memo = {}

    def _shortest_entry(self, key: bytes):
        """The value of the shortest prefix of key that the trie holds, or
        None (keys end at a zero byte, as in C strings)."""
        array = self.array
        n = len(array)
        unit = array[0]
        pos = (unit >> 10) << ((unit & (1 << 9)) >> 6)
        for c in key:
            if c == 0:
                return None
            pos ^= c
            if pos >= n:
                return None
            unit = array[pos]
            if unit & ((1 << 31) | 0xFF) != c:
                return None
            pos ^= (unit >> 10) << ((unit & (1 << 9)) >> 6)
            if (unit >> 8) & 1:
                if pos >= n:
                    raise TokenizerError(f"{self.where}: precompiled_charsmap's trie points past its end")
                return array[pos] & ((1 << 31) - 1)
        return None

    def transform(self, chunk: str):
        """chunk's replacement, or None where the trie has no entry for it."""
        value = self._shortest_entry(chunk.encode("utf-8"))
        if value is None:
            return None
        norm = self.normalized
        if value > len(norm):
            raise TokenizerError(f"{self.where}: precompiled_charsmap points past its strings")
        end = norm.find(b"\0", value)
        try:
            return norm[value:end if end >= 0 else len(norm)].decode("utf-8")
        except UnicodeDecodeError:
            raise TokenizerError(f"{self.where}: precompiled_charsmap points inside a character") from None

    def _replacements(self, g):
        """(replacement, characters replaced) pairs that make up grapheme
        cluster g's normalized text."""
        if len(g.encode("utf-8")) < 6:
            t = self.transform(g)
            if t is not None:
                return [(t, len(g))]
        out = []
        for c in g:
            t = self.transform(c)
            out.append((c if t is None else t, 1))
        return out

    def normalize(self, s):
        memo = self._memo
        out = []
        for g in _GRAPHEME.findall(s):
            r = memo.get(g)
            if r is None:
                r = "".join(t for t, _ in self._replacements(g))
                if len(memo) < _MEMO_LIMIT:
                    memo[g] = r
            out.append(r)
        return "".join(out)

    def normalize_z(self, s, z):
        """As tokenizers aligns the result. Each replacement of m characters
        by k is written as k changes: 0 (the character replaces the next
        unread one), the last k - m of them +1 (inserted: aligned with the
        character before, or the piece's start) when k > m, and m - k
        subtracted from the last change so far (it drops as many unread
        characters) when k < m. A deletion at the very start has no change
        to go to, so what follows aligns with the deleted characters."""
        out = self.normalize(s)
        changes = []
        for g in _GRAPHEME.findall(s):
            for text, m in self._replacements(g):
                k = len(text)
                changes.extend([0] * k)
                if k > m:
                    changes[len(changes) - (k - m):] = [1] * (k - m)
                elif k < m and changes:
                    changes[-1] -= m - k
        read = 0    # characters of s read so far
        nz = 0
        for change in changes:
            if change > 0:
                first = read - 1 < z if read else z > 0
            else:
                first = read < z
                read += 1 - change
            if not first:
                break
            nz += 1
        return out, nz
