"""Character sets the components share: Rust's whitespace and GPT-2's
byte-level alphabet."""

# Rust's char::is_whitespace (the Unicode White_Space property).  Python's
# str.isspace() also accepts U+001C..U+001F, which Rust does not.
WHITESPACE = frozenset(
    "\t\n\x0b\x0c\r \x85\xa0\u1680\u2000\u2001\u2002\u2003\u2004\u2005\u2006"
    "\u2007\u2008\u2009\u200a\u2028\u2029\u202f\u205f\u3000")


def bytes_to_unicode():
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


BYTE_CHARS = bytes_to_unicode()
CHAR_TO_BYTE = {c: b for b, c in enumerate(BYTE_CHARS)}
# str.translate table from latin-1 decoded bytes to byte-level characters.
_LATIN1_TO_BYTE_CHARS = {b: BYTE_CHARS[b] for b in range(256)}


def byte_level(s):
    """s's UTF-8 bytes written in the byte-level alphabet."""
    return s.encode("utf-8").decode("latin-1").translate(_LATIN1_TO_BYTE_CHARS)
