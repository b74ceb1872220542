"""A BPE tokenizer.json kept in a form that loads in a fraction of the time.

A large vocabulary's tokenizer.json (262k tokens and 515k merges: 14 MB of
JSON) takes seconds to parse into Python objects and to turn into the merge
table. The first load keeps, through fastllm.pack_cache (same cache folder,
same checks: a file whose checksums, source or fastllm build do not match
is made again), the vocabulary as one string and the offsets and ids of its
tokens, the merge table's own bytes, and the rest of the file as JSON;
later loads rebuild the vocabulary in one pass and copy the table. Only BPE
models whose merges all resolve are kept so (anything else is read from
the JSON as before, and raises what it always raised).
"""
from __future__ import annotations

import json
import os

import numpy as np

from .. import _bpe, pack_cache
from .bpe import BPE

# Smaller files parse quickly enough.
_WORTH_IT = 1 << 20


class _NotCompact(Exception):
    pass


def read_spec(path: str, read):
    """tokenizer.json's spec (what read() parses), its BPE model's "merges"
    a ready MergeTable where the compact form serves."""
    if not pack_cache.enabled(None) or os.path.getsize(path) < _WORTH_IT:
        return read()
    parsed, rebuilt = [], []

    def build():
        spec = read()
        parsed.append(spec)
        tree = _compact(spec)
        if tree is None:
            raise _NotCompact
        return tree, {}

    def check(tree):
        rebuilt.append(_spec_from(tree))

    try:
        tree = pack_cache.load([path], {"kind": "tokenizer"}, build, True, check)[0]
    except _NotCompact:
        return parsed[0]
    return rebuilt[-1] if rebuilt else _spec_from(tree)   # none: not cached, as built


def _compact(spec):
    """The compact form of a spec whose model is BPE and builds, else None."""
    model = spec.get("model") if isinstance(spec, dict) else None
    if not isinstance(model, dict) or model.get("type", "BPE") != "BPE":
        return None
    try:
        bpe = BPE(model)
        table = bpe.table
    except Exception:   # the JSON path raises what is wrong, where it always did
        return None
    keys = list(bpe.vocab)
    text = "".join(keys).encode("utf-8")
    offsets = np.zeros(len(keys) + 1, np.int64)
    np.cumsum([len(k) for k in keys], out=offsets[1:])
    slots, count = table.to_bytes()
    rest = dict(spec, model={k: v for k, v in model.items() if k not in ("vocab", "merges")})
    return {"spec": json.dumps(rest), "text": np.frombuffer(text, np.uint8),
            "offsets": offsets, "ids": np.fromiter(bpe.vocab.values(), np.int64, len(keys)),
            "table": np.frombuffer(slots, np.uint8), "count": count}


def _spec_from(tree) -> dict:
    """The spec a compact form stands for (ValueError or TypeError where it
    does not hold together)."""
    spec = json.loads(tree["spec"])
    text = bytes(tree["text"]).decode("utf-8")
    offsets, ids = tree["offsets"], tree["ids"]
    if offsets.ndim != 1 or ids.shape != (len(offsets) - 1,) or offsets[0] != 0 or offsets[-1] != len(text) \
            or np.any(np.diff(offsets) < 0) or np.any(ids < 0) or np.any(ids >= 2**32):
        raise ValueError("the vocabulary does not hold together")
    at = offsets.tolist()
    vocab = dict(zip([text[a:b] for a, b in zip(at, at[1:])], ids.tolist()))
    if len(vocab) != len(ids):
        raise ValueError("a token appears twice")
    spec["model"]["vocab"] = vocab
    spec["model"]["merges"] = _bpe.MergeTable.from_bytes(tree["table"], tree["count"])
    return spec
