"""llama.cpp's SentencePiece ("llama") tokenizer, in Python, as a reference
for the tokenizer.json that fastllm rebuilds from such a GGUF vocabulary.

It follows llama.cpp's src/llama-vocab.cpp step by step:

* the text is cut at the tokens of type CONTROL, USER_DEFINED and UNKNOWN
  (tokenize with parse_special), leftmost first, longest first;
* each remaining fragment gets a space in front when add_space_prefix is set
  and it starts the text or follows a cut-out token, then every " " becomes
  "▁";
* llm_tokenizer_spm_session: the fragment starts as one symbol per
  character; the adjacent pair whose concatenation is a token of highest
  score is joined (leftmost on a tie), again and again; a final symbol that
  is not a token is split back along the joins that made it, or, for a
  single character, spelled as <0xXX> byte tokens (llama.cpp throws where
  the vocabulary has none; so does this);
* BOS in front where add_bos is set.

benchmarks/spm_gguf_tokenizer.py checks this against llama.cpp's own library
on the same GGUF files.
"""
from __future__ import annotations

import heapq

CONTROL, USER_DEFINED, UNKNOWN = 3, 4, 2


class LlamaSpm:
    def __init__(self, tokens, scores, types, add_space_prefix=True, add_bos=True, bos_id=None):
        self.ids = {}
        for i, t in enumerate(tokens):
            self.ids[t] = i
        self.scores = scores
        self.add_space_prefix = add_space_prefix
        self.add_bos = add_bos
        self.bos_id = bos_id
        specials = {t for t, k in zip(tokens, types) if k in (CONTROL, USER_DEFINED, UNKNOWN) and t}
        self.specials = sorted(specials, key=len, reverse=True)

    @classmethod
    def from_metadata(cls, md):
        return cls(md["tokenizer.ggml.tokens"], md["tokenizer.ggml.scores"], md["tokenizer.ggml.token_type"],
                   md.get("tokenizer.ggml.add_space_prefix", True), md.get("tokenizer.ggml.add_bos_token", True),
                   md.get("tokenizer.ggml.bos_token_id"))

    def _fragments(self, text):
        """[(text, None) or (None, token id)], cutting out the specials."""
        out, start, i = [], 0, 0
        while i < len(text):
            hit = next((s for s in self.specials if text.startswith(s, i)), None)
            if hit is None:
                i += 1
                continue
            if i > start:
                out.append((text[start:i], None))
            out.append((None, self.ids[hit]))
            i += len(hit)
            start = i
        if start < len(text):
            out.append((text[start:], None))
        return out

    def encode(self, text, add_special_tokens=True):
        out = [self.bos_id] if add_special_tokens and self.add_bos else []
        prev_special = True
        for frag, token in self._fragments(text):
            if token is not None:
                out.append(token)
                prev_special = True
                continue
            if self.add_space_prefix and prev_special:
                frag = " " + frag
            self._session(frag.replace(" ", "\u2581"), out)
            prev_special = False
        return out

    def _session(self, text, out):
        n = len(text)
        starts = list(range(n))        # symbol i covers text[starts[i]:starts[i] + lens[i]]
        lens = [1] * n
        prev = [i - 1 for i in range(n)]
        nxt = [i + 1 if i + 1 < n else -1 for i in range(n)]
        heap, rev_merge = [], {}

        def add_bigram(left, right):
            if left == -1 or right == -1:
                return
            joined = text[starts[left]:starts[left] + lens[left] + lens[right]]
            token = self.ids.get(joined)
            if token is None:
                return
            heapq.heappush(heap, (-self.scores[token], left, right, len(joined)))
            rev_merge[joined] = (left, right)

        for i in range(1, n):
            add_bigram(i - 1, i)
        while heap:
            _, left, right, size = heapq.heappop(heap)
            if lens[left] == 0 or lens[right] == 0 or lens[left] + lens[right] != size:
                continue
            lens[left] += lens[right]
            lens[right] = 0
            nxt[left] = nxt[right]
            if nxt[right] >= 0:
                prev[nxt[right]] = left
            add_bigram(prev[left], left)
            add_bigram(left, nxt[left])

        def resegment(i):
            piece = text[starts[i]:starts[i] + lens[i]]
            token = self.ids.get(piece)
            if token is not None:
                out.append(token)
                return
            parts = rev_merge.get(piece)
            if parts is None:
                for b in piece.encode("utf-8"):
                    name = f"<0x{b:02X}>"
                    if name not in self.ids:
                        raise KeyError(f"no byte token {name} for {piece!r}")
                    out.append(self.ids[name])
                return
            resegment(parts[0])
            resegment(parts[1])

        i = 0 if n else -1
        while i != -1:
            resegment(i)
            i = nxt[i]
