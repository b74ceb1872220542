"""A BPE tokenizer.json kept in a form that loads in a fraction of the time.

A large vocabulary's tokenizer.json (262k tokens and 515k merges: 14 MB of
JSON) takes seconds to parse into Python objects and to turn into the merge
table. The first load keeps, through fastllm.load.pack_cache (same cache folder,
same checks: a file whose checksums, source or fastllm build do not match
is made again), the vocabulary as _bpe.Vocab holds it (its tokens' UTF-8
bytes, their offsets and ids), the merge table's own bytes, and the rest
of the file as JSON; later loads copy those bytes. Only BPE models whose
merges all resolve are kept so (anything else is read from the JSON as
before, and raises what it always raised).
"""
from __future__ import annotations

import json
import os

import numpy as np

from . import _bpe
from ..load import pack_cache
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
    if not isinstance(bpe.vocab, _bpe.Vocab):   # a token with no UTF-8 (a lone surrogate)
        return None
    text, offsets, ids = bpe.vocab.parts()
    slots, count = table.to_bytes()
    rest = dict(spec, model={k: v for k, v in model.items() if k not in ("vocab", "merges")})
    return {"spec": json.dumps(rest), "text": np.frombuffer(text, np.uint8), "offsets": offsets,
            "ids": ids.astype(np.int64), "table": np.frombuffer(slots, np.uint8), "count": count}


def _spec_from(tree) -> dict:
    """The spec a compact form stands for (ValueError or TypeError where it
    does not hold together). Nothing of the mapped file is kept."""
    spec = json.loads(tree["spec"])
    spec["model"]["vocab"] = _bpe.Vocab.from_parts(bytes(tree["text"]), np.array(tree["offsets"]),
                                                   np.array(tree["ids"]))
    spec["model"]["merges"] = _bpe.MergeTable.from_bytes(tree["table"], tree["count"])
    return spec
