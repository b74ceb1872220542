"""Generated tokens as text, cut at stop strings.

Pieces are whole characters, and text that may still turn out to begin a
stop string is held back until it is known not to. Model and the server
both turn tokens into text through feed():

    for token in tokens + [None]:      # None: the end
        piece = text.feed(token)
        ...                            # show piece
        if text.ended: break           # a stop string, or the end
"""
from __future__ import annotations


class TextStream:
    """Feed tokens with add(); each call returns the text that can be shown
    now. stopped turns True once a stop string appears (the text before it
    is all that is returned); flush() returns what is held at the end."""

    def __init__(self, tokenizer, stops=(), keep=()):
        # keep: special tokens shown all the same (a tool call's markers,
        # which the reply is read by)
        self._decoder = tokenizer.incremental_decoder(skip_special_tokens=True, keep=keep)
        # Callers refuse empty stop strings (model._stop_strings): "" would
        # match before any text.
        self.stops = [stops] if isinstance(stops, str) else list(stops or ())
        self._held = ""
        self.stopped = False
        self.stop = None     # the stop string that came, once stopped
        self.ended = False   # a stop string came, or the end was fed

    def feed(self, token: int | None) -> str:
        """The text token completes (None: the end of the tokens, when what
        is held comes out); afterwards ended says whether to stop feeding."""
        piece = self.add(token) if token is not None else self.flush()
        self.ended = self.ended or self.stopped or token is None
        return piece

    def add(self, token: int) -> str:
        return self._take(self._decoder.add(token), final=False)

    def flush(self) -> str:
        return self._take(self._decoder.flush(), final=True)

    def _take(self, text: str, final: bool) -> str:
        if self.stopped:
            return ""
        held = self._held + text
        hit, stop = min(((i, s) for i, s in ((held.find(s), s) for s in self.stops) if i >= 0),
                        default=(-1, None))
        if hit >= 0:
            self.stopped, self.stop, self._held = True, stop, ""
            return held[:hit]
        keep = 0 if final else partial_stop_suffix(held, self.stops)
        self._held = held[len(held) - keep:]
        return held[:len(held) - keep]


def partial_stop_suffix(text: str, stops) -> int:
    """Length of the longest end of text that begins some stop string."""
    best = 0
    for s in stops:
        for n in range(min(len(s) - 1, len(text)), best, -1):
            if text.endswith(s[:n]):
                best = n
                break
    return best
