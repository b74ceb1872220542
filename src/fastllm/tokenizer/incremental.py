"""Streaming decode: text of generated ids as they come, adding up to decode()."""
from . import decoders


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
        self._byte_runs = decoders.uses(tokenizer.decoder, decoders.ByteFallback)

    def _decode(self, ids):
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def _open_byte_run(self, ids):
        if not self._byte_runs:
            return False
        tokens = self.tokenizer._tokens_for_decode(ids[-16:], self.skip_special_tokens)
        return bool(tokens) and decoders.byte_token_value(tokens[-1]) is not None

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

