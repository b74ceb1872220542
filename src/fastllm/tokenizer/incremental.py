"""Streaming decode: text of generated ids as they come, adding up to decode()."""
import codecs

from . import decoders

_utf8_decoder = codecs.getincrementaldecoder("utf-8")


def _decode_chain(decoder, tokens):
    return "".join(decoder.decode_chain(tokens))


def _incomplete_end(data):
    """The incomplete UTF-8 character that data ends in (b"" if none)."""
    # It is at most 3 bytes from its lead byte, and decoding starts afresh at
    # a lead byte whatever comes before: the last 4 bytes tell.
    tail = _utf8_decoder("replace")
    tail.decode(data[-4:])
    return tail.getstate()[0]


def _splits_cleanly(head, next_byte):
    """Whether the UTF-8 text of head + rest is head's then rest's: head ends
    on a character boundary, or its incomplete end is broken by the next byte
    (a U+FFFD of its own either way)."""
    end = _incomplete_end(head)
    if not end:
        return True
    try:
        _utf8_decoder().decode(end + next_byte)
    except UnicodeDecodeError:
        return True
    return False


class IncrementalDecoder:
    """Streaming detokenizer whose outputs concatenate to decode(all ids).

    add() releases text as soon as no later id can change it, so little is
    held back, and the work done for a stream grows linearly with its length.

    With a ByteLevel decoder (alone, or after steps that rewrite each token
    on its own) the text is the UTF-8 decoding of the bytes each token gives,
    so they go through an incremental UTF-8 decoder: it holds back
    only an incomplete character (at most 3 bytes), and bytes that can never
    complete one come out at once as the U+FFFD that decode() shows for them.

    Other decoders depend on where a token stands (Metaspace treats the
    first one apart; a step after ByteLevel gets all of the text as one
    string), so, as in tokenizers' DecodeStream, each add()
    decodes the ids of the last release (the prefix) with the new ones, and
    releases what the new ones add.  When a ByteLevel step is among them
    and the text can be cut at its characters (decoders.cuts_at_characters),
    only an incomplete character (at most 3 bytes) is held back: DecodeStream
    holds all text that ends in U+FFFD, so a stream of invalid bytes was
    held, and decoded again, for good.  With a ByteFallback decoder a run of
    <0xXX> tokens that is valid UTF-8 so far is held back, because one more
    byte can turn the whole run into replacement characters; once it can
    never be valid, each of its bytes is one U+FFFD, released as it comes.
    """

    def __init__(self, tokenizer, skip_special_tokens=True, keep=()):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.keep = frozenset(keep)
        decoder = tokenizer.decoder
        self._token_steps = decoders.byte_level_token_steps(decoder)
        self._utf8 = _utf8_decoder("replace") if self._token_steps is not None else None
        self._byte_runs = decoders.uses(decoder, decoders.ByteFallback)
        # Whether each byte of a run that can never be valid adds one U+FFFD,
        # as in the ByteFallback chains in use (a step that rewrote <0xXX>
        # tokens or U+FFFD would not: such runs are then held to their end).
        self._release_invalid_runs = self._byte_runs and (
            _decode_chain(decoder, ["<0xFF>"] * 2) == _decode_chain(decoder, ["<0xFF>"]) + "\ufffd")
        # A ByteLevel step among others: its text may end in an incomplete
        # character, which later ids complete. Where the text can be cut at
        # the characters of that step, only an incomplete one is held;
        # otherwise, as in DecodeStream, all text that ends in U+FFFD.
        self._byte_level_step = decoders.uses(decoder, decoders.ByteLevel)
        self._cuts_at_characters = decoders.cuts_at_characters(decoder)
        self._reset()

    def _reset(self):
        self.ids = []            # the prefix's ids, then the ones not yet released
        self.prefix = ""
        self.prefix_index = 0
        # The open <0xXX> run: None (none), an incremental UTF-8 decoder (valid
        # so far), "invalid" (can never be valid; held to its end) or
        # "released" (can never be valid; each further byte is one U+FFFD).
        self._run = None
        if self._utf8 is not None:
            self._utf8.reset()

    def _tokens(self, ids):
        return self.tokenizer._tokens_for_decode(ids, self.skip_special_tokens, self.keep)

    def _decode(self, ids):
        return self.tokenizer._join_tokens(self._tokens(ids))

    def add(self, token_id):
        """Feed one id; returns the newly completed text (possibly "")."""
        token_id = int(token_id)
        tokens = self._tokens([token_id])
        if not tokens:
            return ""   # an id decode() drops: unknown, or a skipped special token
        if self._utf8 is not None:
            token = tokens[0]
            for step in self._token_steps:
                token = step.decode_chain([token])[0]
            return self._utf8.decode(decoders.token_bytes(token))
        byte = decoders.byte_token_value(tokens[0]) if self._byte_runs else None
        if byte is not None and self._run == "released":
            return "\ufffd"
        ids = self.ids
        if not self.prefix and ids and self._run is None:
            p = self._decode(ids)
            if not (self._ends_mid_character(ids) if self._cuts_at_characters else p.endswith("\ufffd")):
                self.prefix = p
                self.prefix_index = len(ids)
        ids.append(token_id)
        if byte is None:
            self._run = None
        elif self._run == "invalid":
            return ""
        else:
            self._run = self._run or _utf8_decoder()
            try:
                self._run.decode(bytes([byte]))
                return ""
            except UnicodeDecodeError:
                self._run = "invalid"
        text = self._decode(ids)
        if not text.startswith(self.prefix):
            return ""
        new = text[len(self.prefix):]
        if self._run == "invalid":
            if not self._release_invalid_runs:
                return ""
            # All of the run is U+FFFD whatever comes next: release it, and
            # keep its last byte as the prefix for the token that ends it.
            self._run = "released"
            self._anchor([token_id])
            return new
        if not new or (self._byte_level_step and not self._cuts_at_characters and new.endswith("\ufffd")):
            return ""
        if self._cuts_at_characters and self._ends_mid_character(ids):
            return self._release_before_incomplete(ids, text)
        self._anchor(ids[self.prefix_index:])
        return new

    def _byte_level_input(self, ids):
        tokens = self._tokens(ids)
        return decoders.byte_level_input(self.tokenizer.decoder, tokens)

    def _ends_mid_character(self, ids):
        """Whether the bytes that the decoder's ByteLevel step gets for ids
        end in an incomplete UTF-8 character."""
        return bool(_incomplete_end(self._byte_level_input(ids)))

    def _release_before_incomplete(self, ids, text):
        """Releases the text of the ids before the incomplete character that
        ends the window (whose text is text), when they decode on their own;
        without this a lead byte after a lead byte after ... would hold the
        window open for good."""
        data = self._byte_level_input(ids)
        # The incomplete character is at most 3 bytes: the ids before it are
        # among the last few.
        for j in range(len(ids) - 1, max(self.prefix_index, len(ids) - 5), -1):
            head = self._byte_level_input(ids[:j])
            if not (data.startswith(head) and _splits_cleanly(head, data[len(head):len(head) + 1])):
                continue
            head_text = self._decode(ids[:j])
            # A step after ByteLevel may treat a shorter text otherwise (a
            # ByteFallback turns a text that is all "<0x50>" into "P").
            if not (text.startswith(head_text) and head_text.startswith(self.prefix)
                    and len(head_text) > len(self.prefix)):
                return ""
            new, pending = head_text[len(self.prefix):], ids[j:]
            self._anchor(ids[self.prefix_index:j])
            self.ids += pending
            return new
        return ""

    def _anchor(self, ids):
        self.ids = ids
        self.prefix = self._decode(ids)
        self.prefix_index = len(ids)

    def flush(self):
        """Text still held back (an incomplete character decodes as U+FFFD)."""
        if self._utf8 is not None:
            out = self._utf8.decode(b"", final=True)
        else:
            out = self._decode(self.ids)[len(self.prefix):]
        self._reset()
        return out
