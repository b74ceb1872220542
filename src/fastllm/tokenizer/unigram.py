"""The Unigram model (SentencePiece's other kind): the ids of one pre-token
are the most likely segmentation under the pieces' log-probabilities.

The search is tokenizers' (itself SentencePiece's optimized Viterbi): for
each character position, from left to right, every piece that starts there
extends the best path that ends there; a later candidate replaces the path
to a position only when its score is strictly higher, so among equal scores
the path whose last piece starts earliest wins. A character that no piece
covers alone is an unknown token scored ten below the lowest piece score.
Consecutive unknown tokens are fused into one, which byte fallback then
spells as <0xXX> tokens.
"""
import math
import numbers

from .errors import TokenizerError

# What tokenizers (and SentencePiece) score an unknown character below the
# lowest piece score.
UNK_PENALTY = 10.0

# Marks a prefix of some piece that is not a piece itself.
_PREFIX = -1


class Unigram:
    # A Unigram model always fuses unknown tokens (tokenizers has no switch).
    fuse_unk = True

    def __init__(self, d, where="model"):
        vocab = d.get("vocab")
        if not isinstance(vocab, list):
            raise TokenizerError(f"{where}: a Unigram model needs 'vocab', a list of [piece, score] pairs")
        pieces, scores = [], []
        for i, item in enumerate(vocab):
            if (not isinstance(item, (list, tuple)) or len(item) != 2 or not isinstance(item[0], str)
                    or not isinstance(item[1], numbers.Real) or isinstance(item[1], bool)
                    or not math.isfinite(item[1])):
                raise TokenizerError(f"{where}.vocab[{i}]: expected [piece, finite score], got {item!r}")
            pieces.append(item[0])
            scores.append(float(item[1]))
        self.vocab = {p: i for i, p in enumerate(pieces)}
        if len(self.vocab) != len(pieces):
            dup = next(p for i, p in enumerate(pieces) if self.vocab[p] != i)
            raise TokenizerError(f"{where}.vocab: the piece {dup!r} is listed twice")
        unk_id = d.get("unk_id")
        if unk_id is not None and (not isinstance(unk_id, int) or isinstance(unk_id, bool)
                                   or not 0 <= unk_id < len(pieces)):
            raise TokenizerError(f"{where}: unk_id {unk_id!r} is not the id of a piece "
                                 f"(the vocabulary has {len(pieces)})")
        self.pieces = pieces
        self.vocab_r = dict(enumerate(pieces))
        self.scores = scores
        self.unk_id = unk_id
        self.unk_score = min(scores, default=float("inf")) - UNK_PENALTY
        self.byte_fallback = bool(d.get("byte_fallback", False))
        self.where = where
        self._nodes = None

    def validate(self):
        self.nodes  # noqa: B018 - builds the prefix dictionary now

    @staticmethod
    def byte_ids():
        """A Unigram model has no byte-level fast path."""
        return None

    @property
    def nodes(self):
        """Every prefix of a piece: the piece's id, or _PREFIX (built on first use)."""
        if self._nodes is None:
            nodes = {}
            for i, p in enumerate(self.pieces):
                for k in range(1, len(p)):
                    nodes.setdefault(p[:k], _PREFIX)
                if p:
                    nodes[p] = i
            self._nodes = nodes
        return self._nodes

    def _missing_unk(self):
        return TokenizerError(f"{self.where}: the text has a character that no piece covers, and the "
                              "model has no unk_id to stand for it")

    def segment(self, w):
        """The best segmentation of w: a list of (piece text, id), where id
        is None for a run of unknown characters."""
        n = len(w)
        nodes = self.nodes
        scores = self.scores
        unk_id = self.unk_id
        unk_score = self.unk_score
        best = [0.0] * (n + 1)
        start = [-1] * (n + 1)
        ids = [0] * (n + 1)
        for i in range(n):
            here = best[i]
            single = False
            j = i + 1
            while j <= n:
                tid = nodes.get(w[i:j])
                if tid is None:
                    break
                if tid != _PREFIX:
                    score = scores[tid] + here
                    if start[j] < 0 or score > best[j]:
                        best[j] = score
                        start[j] = i
                        ids[j] = tid
                    if j == i + 1:
                        single = True
                j += 1
            if not single:
                score = unk_score + here
                if start[i + 1] < 0 or score > best[i + 1]:
                    if unk_id is None:
                        raise self._missing_unk()
                    best[i + 1] = score
                    start[i + 1] = i
                    ids[i + 1] = unk_id
        out = []
        end = n
        unk_end = None   # end of the run of unknown tokens being read backwards
        while end > 0:
            b = start[end]
            if b < 0:
                raise TokenizerError(f"{self.where}: no segmentation reaches position {end} of {w!r}")
            if ids[end] == unk_id:
                if unk_end is None:
                    unk_end = end
            else:
                if unk_end is not None:
                    out.append((w[end:unk_end], None))
                    unk_end = None
                out.append((w[b:end], ids[end]))
            end = b
        if unk_end is not None:
            out.append((w[:unk_end], None))
        out.reverse()
        return out

    def tokenize(self, w):
        """Ids of one pre-token."""
        if not w:
            return []
        ids = []
        vocab = self.vocab
        for text, tid in self.segment(w):
            if tid is not None:
                ids.append(tid)
                continue
            # A fused run of unknown characters: a piece if it happens to be
            # one, else its bytes, else the unknown token.
            tid = vocab.get(text)
            if tid is None and self.byte_fallback:
                bts = [vocab.get("<0x%02X>" % b) for b in text.encode("utf-8")]
                if None not in bts:
                    ids.extend(bts)
                    continue
            if tid is None:
                if self.unk_id is None:
                    raise self._missing_unk()
                tid = self.unk_id
            ids.append(tid)
        return ids
