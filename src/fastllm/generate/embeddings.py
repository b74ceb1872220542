"""Text embeddings: a model's final-normed hidden states pooled into one
vector per text, as sentence-transformers pools them.

How a model pools is read from its folder the way sentence-transformers
reads it: modules.json names the pipeline (Transformer, then Pooling, then
maybe Normalize), and the Pooling module's config.json its mode ("mean",
"cls", "lasttoken", ... or the older pooling_mode_*_token switches). A GGUF
file says it with its pooling_type key, as llama.cpp's converter writes
it. A model that says nothing is pooled from its last token, which is the
only one that has read the whole text in a causal model (what Qwen3-
Embedding and other decoder-based embedding models do).
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..spec.errors import ModelFileError

# sentence-transformers' pooling modes, in the order it concatenates them.
MODES = ("cls", "max", "mean", "mean_sqrt_len_tokens", "weightedmean", "lasttoken")
# Short names, as llama.cpp's --pooling spells them.
ALIASES = {"last": "lasttoken"}
_LEGACY = {"pooling_mode_cls_token": "cls", "pooling_mode_max_tokens": "max",
           "pooling_mode_mean_tokens": "mean", "pooling_mode_mean_sqrt_len_tokens": "mean_sqrt_len_tokens",
           "pooling_mode_weightedmean_tokens": "weightedmean", "pooling_mode_lasttoken": "lasttoken"}
# llama.cpp's pooling_type values (llama_pooling_type): 0 none, 1 mean, 2 cls, 3 last, 4 rank.
_GGUF_POOLING = {1: "mean", 2: "cls", 3: "lasttoken"}
# sentence-transformers modules that leave the pooled vector as fastllm computes it.
_FOLLOWED = ("Transformer", "Pooling", "Normalize")


@dataclass(frozen=True)
class Pooling:
    """How hidden states become one vector: modes (concatenated, in MODES'
    order); unsupported: why fastllm cannot compute this model's
    embeddings as its own pipeline would (None when it can)."""
    modes: tuple = ("lasttoken",)
    source: str = "the default for a causal model"
    unsupported: str | None = None

    @classmethod
    def of(cls, mode) -> "Pooling":
        """A pooling named by the caller: a mode, or a list of them."""
        names = [mode] if isinstance(mode, str) else list(mode) if isinstance(mode, (list, tuple)) else None
        if not names:
            raise ValueError(f"pooling must be one of {', '.join(MODES)} (or 'last'), or a list of them; "
                             f"got {mode!r}")
        modes = []
        for name in names:
            name = ALIASES.get(name, name)
            if name not in MODES:
                raise ValueError(f"pooling must be one of {', '.join(MODES)} (or 'last'), got {name!r}")
            modes.append(name)
        return cls(tuple(m for m in MODES if m in modes), "asked for")


def read_pooling(folder: Path) -> Pooling:
    """The pooling of the model in folder, from sentence-transformers'
    modules.json and the Pooling module's config.json; ModelFileError when
    those files are there but unreadable."""
    folder = Path(folder)
    modules_file = folder / "modules.json"
    if not modules_file.is_file():
        return Pooling()
    modules = _json(modules_file)
    if not isinstance(modules, list) or not all(isinstance(m, dict) for m in modules):
        raise ModelFileError(modules_file, "must be a list of modules ({'path': ..., 'type': ...})")
    pooling, unsupported = None, None
    for m in modules:
        kind = str(m.get("type", "")).rsplit(".", 1)[-1]
        if kind == "Pooling":
            path = m.get("path")
            if not isinstance(path, str) or Path(path).is_absolute() or ".." in Path(path).parts:
                raise ModelFileError(modules_file, f"the Pooling module's path must be a folder inside "
                                                   f"the model's, got {path!r}")
            pooling = _pooling_config(folder / path / "config.json")
        elif kind not in _FOLLOWED and unsupported is None:
            unsupported = (f"its sentence-transformers pipeline has a {kind or 'nameless'} module, "
                           "which fastllm does not apply")
    if pooling is None:
        return Pooling(unsupported=unsupported)
    return Pooling(pooling, "modules.json", unsupported)


def _pooling_config(path: Path) -> tuple:
    config = _json(path)
    if not isinstance(config, dict):
        raise ModelFileError(path, "must be a JSON object")
    mode = config.get("pooling_mode")
    if mode is None:   # the older form: one switch per mode, mean where none is on
        mode = [m for key, m in _LEGACY.items() if config.get(key) is True] or ["mean"]
    try:
        return Pooling.of(mode).modes
    except ValueError as e:
        raise ModelFileError(path, str(e)) from None


def gguf_pooling(metadata: dict) -> Pooling:
    """The pooling a GGUF file's metadata names (its architecture's
    pooling_type), else the default."""
    value = metadata.get(f"{metadata.get('general.architecture')}.pooling_type")
    if value is None or value == 0:
        return Pooling()
    if value not in _GGUF_POOLING:
        return Pooling(unsupported=f"its GGUF pooling_type is {value!r} (1 mean, 2 cls and 3 last are "
                                   "supported)")
    return Pooling((_GGUF_POOLING[value],), "the GGUF file's pooling_type")


def _json(path: Path):
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError, RecursionError) as e:
        raise ModelFileError(path, f"cannot be read as JSON: {e}") from None


def pool(hidden: np.ndarray, modes) -> np.ndarray:
    """One vector of hidden states (n, dim), n >= 1, for each mode,
    concatenated; float64, as sentence-transformers computes them (its
    masks are all ones for one text alone)."""
    h = np.asarray(hidden, np.float64)
    n = h.shape[0]
    out = []
    for mode in modes:
        if mode == "cls":
            out.append(h[0])
        elif mode == "max":
            out.append(h.max(axis=0))
        elif mode == "mean":
            out.append(h.sum(axis=0) / n)
        elif mode == "mean_sqrt_len_tokens":
            out.append(h.sum(axis=0) / np.sqrt(n))
        elif mode == "weightedmean":
            w = np.arange(1, n + 1, dtype=np.float64)
            out.append((h * w[:, None]).sum(axis=0) / w.sum())
        elif mode == "lasttoken":
            out.append(h[-1])
        else:
            raise ValueError(f"unknown pooling mode {mode!r}")
    return np.concatenate(out)


def normalized(v: np.ndarray) -> np.ndarray:
    """v scaled to length 1 (a zero vector stays zero, as
    torch.nn.functional.normalize leaves it)."""
    norm = np.linalg.norm(v)
    return v / max(norm, 1e-12)


def embed_ids(model, session, ids, pooling=None, normalize: bool = True, dimensions: int | None = None):
    """The embedding of one sequence of token ids, run on session (which
    it resets): float32, as Model.embed describes it."""
    if pooling is None:
        chosen = model.pooling
        if chosen.unsupported:
            raise ValueError(f"{model.name}: {chosen.unsupported}, so its embeddings would not be the "
                             "model's; pass pooling= to pool its hidden states all the same")
    else:
        chosen = pooling if isinstance(pooling, Pooling) else Pooling.of(pooling)
    if len(ids) == 0:
        raise ValueError("an empty text has no tokens to embed")
    v = pool(session.hidden(ids), chosen.modes)
    if dimensions is not None:
        if not isinstance(dimensions, int) or isinstance(dimensions, bool) or not 1 <= dimensions <= v.size:
            raise ValueError(f"dimensions must be a whole number from 1 to {v.size}, got {dimensions!r}")
        v = v[:dimensions]
    return (normalized(v) if normalize else v).astype(np.float32)
