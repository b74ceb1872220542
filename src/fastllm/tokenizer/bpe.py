"""The BPE model: ids of one pre-token, merged by the Cython module _bpe."""
import contextlib
from array import array

from . import _bpe
from .chars import BYTE_CHARS, byte_level
from .errors import TokenizerError, UnsupportedTokenizerError


class TokensById:
    """The tokens of a vocabulary by id, with dict's get: a list where the
    ids are dense (as in every vocabulary in use: 2 MB for 262k tokens,
    against 16 MB as a dict), else a dict. An id two tokens share gives the
    later one, as {id: token for token, id in vocab.items()} does."""
    __slots__ = ("_by_id",)

    def __init__(self, vocab: dict):
        n = max(vocab.values(), default=-1) + 1
        if n > 2 * len(vocab) + 1024:
            self._by_id = {i: t for t, i in vocab.items()}
            return
        self._by_id = [None] * n
        for t, i in vocab.items():
            self._by_id[i] = t

    def get(self, i, default=None):
        if isinstance(self._by_id, dict):
            return self._by_id.get(i, default)
        try:
            token = self._by_id[i] if i >= 0 else None
        except (IndexError, TypeError):
            return default
        return default if token is None else token


class BPE:
    def __init__(self, d, where="model"):
        t = d.get("type", "BPE")
        if t != "BPE":
            raise UnsupportedTokenizerError(
                f"{where}: model type {t!r} is not supported; fastllm implements BPE models only")
        if "vocab" not in d or "merges" not in d:
            raise TokenizerError(f"{where}: a BPE model needs 'vocab' and 'merges'")
        dropout = d.get("dropout")
        if dropout not in (None, 0, 0.0):
            raise UnsupportedTokenizerError(
                f"{where}: BPE dropout={dropout!r} is random at encode time; fastllm refuses it")
        self.vocab = d["vocab"]
        if not isinstance(self.vocab, (dict, _bpe.Vocab)):
            raise TokenizerError(f"{where}.vocab: expected an object mapping tokens to ids")
        # merges may be a merge table already made of this vocabulary (the
        # compact form of a tokenizer.json that passed these checks).
        self.merges = d["merges"]
        made = isinstance(self.merges, _bpe.MergeTable)
        for token, i in () if made else self.vocab.items():
            if not isinstance(i, int) or isinstance(i, bool) or not 0 <= i < 2**32:
                raise TokenizerError(f"{where}.vocab: the id of {token!r} must be a whole number "
                                     f"from 0 to 2**32-1, got {i!r}")
        if not made and not isinstance(self.merges, list):
            raise TokenizerError(f"{where}.merges: expected a list")
        self.unk_token = d.get("unk_token")
        self.prefix = d.get("continuing_subword_prefix") or ""
        self.suffix = d.get("end_of_word_suffix") or ""
        for key, value in (("unk_token", self.unk_token), ("continuing_subword_prefix", self.prefix),
                           ("end_of_word_suffix", self.suffix)):
            if value is not None and not isinstance(value, str):
                raise TokenizerError(f"{where}.{key}: expected a string, got {value!r}")
        self.fuse_unk = bool(d.get("fuse_unk", False))
        self.byte_fallback = bool(d.get("byte_fallback", False))
        self.ignore_merges = bool(d.get("ignore_merges", False))
        self.where = where
        self._vocab_r = None
        self._byte_ids = None
        # The merges go into the merge table now (16 bytes a merge), and the
        # list of them is dropped: as tokenizer.json's Python strings and
        # lists it took ~200 bytes a merge (112 MB for a 262k vocabulary's
        # 515k merges). A list the table cannot be made of is kept, and its
        # error raised where it always was: at the first encode, or validate().
        if made:
            table, self._merge_error = self.merges, None
        else:
            table = _bpe.MergeTable(len(self.merges))
            self._merge_error = table.load_merges(self.merges, self.vocab, len(self.prefix))
        self._table = table if self._merge_error is None else None
        if self._table is not None:
            self.merges = None
            # The vocabulary kept compact too (a dict of 248k tokens is 30 MB).
            # A token with a lone surrogate has no UTF-8: such a vocabulary stays a dict.
            if isinstance(self.vocab, dict):
                with contextlib.suppress(UnicodeEncodeError):
                    self.vocab = _bpe.Vocab.from_dict(self.vocab)

    @property
    def table(self):
        if self._table is None:
            i, tok = self._merge_error
            if tok is None:
                raise TokenizerError(f"{self.where}.merges[{i}]: {self.merges[i]!r} is not a pair of tokens")
            raise TokenizerError(f"{self.where}.merges[{i}]: token {tok!r} is not in the vocabulary")
        return self._table

    def validate(self):
        self.table  # noqa: B018 - raises on a broken merges list

    @property
    def vocab_r(self):
        if self._vocab_r is None:
            self._vocab_r = TokensById(self.vocab)
        return self._vocab_r

    def byte_ids(self):
        """Vocabulary ids of the 256 byte-level characters, or None if the
        model cannot use the fast byte path."""
        if self._byte_ids is None:
            ids = [self.vocab.get(c) for c in BYTE_CHARS]
            if None in ids or self.prefix or self.suffix:
                self._byte_ids = False
            else:
                self._byte_ids = array("i", ids)
        return self._byte_ids or None

    def _unk_id(self):
        uid = self.vocab.get(self.unk_token)
        if uid is None:
            raise TokenizerError(f"{self.where}: unk_token {self.unk_token!r} is not in the vocabulary")
        return uid

    def tokenize(self, w):
        """Ids of one pre-token (already in the model's alphabet)."""
        if not w:
            return []
        vocab = self.vocab
        if self.ignore_merges:
            tid = vocab.get(w)
            if tid is not None:
                return [tid]
        ids = []
        unk = None
        last = len(w) - 1
        prefix, suffix = self.prefix, self.suffix
        for i, ch in enumerate(w):
            s = ch
            if i and prefix:
                s = prefix + s
            if i == last and suffix:
                s = s + suffix
            tid = vocab.get(s)
            if tid is not None:
                if unk is not None:
                    ids.append(unk)
                    unk = None
                ids.append(tid)
                continue
            if self.byte_fallback:
                bts = [vocab.get("<0x%02X>" % b) for b in s.encode("utf-8")]
                if None not in bts:
                    # A pending unk is deliberately not flushed here: tokenizers
                    # keeps it until the next known character.
                    ids.extend(bts)
                    continue
            if self.unk_token is not None:
                uid = self._unk_id()
                if unk is not None and not self.fuse_unk:
                    ids.append(unk)
                unk = uid
        if unk is not None:
            ids.append(unk)
        return self.table.merge_ids(ids)

    def byte_miss(self):
        """Function computing the ids of a raw pre-token on the byte path."""
        table = self.table
        byte_ids = self.byte_ids()
        merge = table.merge_bytes
        if self.ignore_merges:
            vocab = self.vocab

            def miss(piece):
                tid = vocab.get(byte_level(piece))
                if tid is not None:
                    return [tid]
                return merge(piece.encode("utf-8"), byte_ids)
        else:
            def miss(piece):
                return merge(piece.encode("utf-8"), byte_ids)
        return miss

