"""Decoders: each maps a list of token strings to a list of strings."""
from . import normalizers
from .chars import CHAR_TO_BYTE
from .errors import UnsupportedTokenizerError, need_int, need_str


def token_bytes(t):
    """The bytes a ByteLevel token stands for.  A token with any character
    outside the byte alphabet (an added token, typically) is taken as its own
    UTF-8 text."""
    try:
        return bytes([CHAR_TO_BYTE[c] for c in t])
    except KeyError:
        return t.encode("utf-8")


class ByteLevel:
    def decode_chain(self, tokens):
        # Python's 'replace' handler substitutes one U+FFFD per maximal invalid
        # subsequence, which is what Rust's String::from_utf8_lossy does.
        return [b"".join([token_bytes(t) for t in tokens]).decode("utf-8", "replace")]


def byte_token_value(t):
    if len(t) == 6 and t.startswith("<0x") and t.endswith(">"):
        h = t[3:5]
        # Rust's u8::from_str_radix accepts an optional '+' sign, nothing else.
        digits = h[1:] if h[0] == "+" else h
        if digits and all(c in "0123456789abcdefABCDEF" for c in digits):
            return int(digits, 16)
    return None


class ByteFallback:
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
            b = byte_token_value(t)
            if b is not None:
                pending.append(b)
                continue
            if pending:
                flush()
            out.append(t)
        if pending:
            flush()
        return out


class Fuse:
    def decode_chain(self, tokens):
        return ["".join(tokens)]


class Strip:
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


class Replace:
    def __init__(self, pattern, content, where):
        self.norm = normalizers.Replace(pattern, content, where)

    def decode_chain(self, tokens):
        return [self.norm.normalize(t) for t in tokens]


class Metaspace:
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


class Sequence:
    def __init__(self, items):
        self.items = items

    def decode_chain(self, tokens):
        for d in self.items:
            tokens = d.decode_chain(tokens)
        return tokens


def build(d, where="decoder"):
    if d is None:
        return None
    t = d.get("type")
    if t == "ByteLevel":
        return ByteLevel()
    if t == "ByteFallback":
        return ByteFallback()
    if t == "Fuse":
        return Fuse()
    if t == "Strip":
        content = need_str(d.get("content", " "), where, "content")
        start, stop = (need_int(d.get(k, 0), where, k) for k in ("start", "stop"))
        return Strip(content, start, stop)
    if t == "Replace":
        return Replace(d["pattern"], need_str(d["content"], where, "content"), where)
    if t == "Metaspace":
        scheme = d.get("prepend_scheme")
        if scheme is None:
            scheme = "always" if d.get("add_prefix_space", True) else "never"
        return Metaspace(need_str(d.get("replacement", "\u2581"), where, "replacement"), scheme)
    if t == "Sequence":
        return Sequence([build(x, f"{where}.decoders[{i}]") for i, x in enumerate(d.get("decoders", []))])
    raise UnsupportedTokenizerError(f"{where}: decoder type {t!r} is not supported (supported: "
                                    "ByteLevel, ByteFallback, Fuse, Strip, Replace, Metaspace, Sequence)")


def _steps(decoder):
    """The decoder as a flat list of steps (a Sequence in a Sequence is its steps)."""
    if isinstance(decoder, Sequence):
        return [s for d in decoder.items for s in _steps(d)]
    return [decoder]


def byte_level_token_steps(decoder):
    """The steps before ByteLevel when the decoder's text is the UTF-8
    decoding of bytes that each token gives on its own: ByteLevel, after
    steps that rewrite each token alone (Replace, Strip) and before none but
    Fuse (nothing to join in ByteLevel's one string).  None otherwise."""
    steps = _steps(decoder)
    first = next((i for i, d in enumerate(steps) if isinstance(d, ByteLevel)), None)
    if first is None:
        return None
    if all(isinstance(d, (Replace, Strip)) for d in steps[:first]) and all(
            isinstance(d, Fuse) for d in steps[first + 1:]):
        return steps[:first]
    return None


def cuts_at_characters(decoder):
    """Whether the decoder's text can be cut wherever the bytes entering its
    ByteLevel step end on a character: it has one ByteLevel step, no step
    before it joins tokens (Fuse: ByteLevel then reads them as one) and none
    after it reads the text as tokens again (ByteLevel, ByteFallback)."""
    steps = _steps(decoder)
    at = [i for i, d in enumerate(steps) if isinstance(d, ByteLevel)]
    return len(at) == 1 and not any(isinstance(d, Fuse) for d in steps[:at[0]]) and not any(
        isinstance(d, ByteFallback) for d in steps[at[0] + 1:])


def byte_level_input(decoder, tokens):
    """The bytes that the decoder's first ByteLevel step decodes as UTF-8
    when the decoder is given tokens (None if it has no ByteLevel step)."""
    if isinstance(decoder, ByteLevel):
        return b"".join([token_bytes(t) for t in tokens])
    if isinstance(decoder, Sequence):
        for d in decoder.items:
            if uses(d, ByteLevel):
                return byte_level_input(d, tokens)
            tokens = d.decode_chain(tokens)
    return None


def uses(decoder, kind):
    """Whether the decoder, or a step of it, is of the given class."""
    if isinstance(decoder, kind):
        return True
    if isinstance(decoder, Sequence):
        return any(uses(d, kind) for d in decoder.items)
    return False
