"""Phi-3/3.5-mini and Phi-4-mini: fused q/k/v and gate/up rows; LongRoPE,
partial rotary and a sliding window come from config.json. llama.cpp keeps
LongRoPE's factors as two tensors."""
import math

import numpy as np

from ..errors import ConversionError
from ..family import EVERY_LAYER, Family
from ..values import shortest_float32


def gguf_read(meta, cfg: dict) -> None:
    """Partial rotary, LongRoPE and the sliding window from llama.cpp's
    rope_factors_long/short tensors and metadata."""
    if meta.rope_dim != meta.head_dim:
        cfg["partial_rotary_factor"] = meta.rope_dim / meta.head_dim
    window = meta.get("attention.sliding_window")
    if window is not None and (type(window) is not int or window < 0):
        raise meta.error(f"{meta.arch}.attention.sliding_window should be a count, not {window!r}")
    if window:   # the converter writes 0 for none
        cfg["sliding_window"] = window
    factors = meta.rope_factors or {}
    if not factors:
        return
    if set(factors) != {"long", "short"}:
        raise meta.error("a rope_factors_long tensor needs a rope_factors_short one, and back")
    orig = meta.get("rope.scaling.original_context_length")
    if type(orig) is not int or orig < 1:
        raise meta.error(f"rope factors without a valid {meta.arch}.rope.scaling.original_context_length "
                         f"(got {orig!r})")
    scaling = {"rope_type": "longrope"}
    for kind in ("short", "long"):
        values = np.asarray(factors[kind], np.float32).reshape(-1)
        if values.size != meta.rope_dim // 2 or not (np.isfinite(values).all() and (values > 0).all()):
            raise meta.error(f"rope_factors_{kind} must hold {meta.rope_dim // 2} positive numbers")
        scaling[f"{kind}_factor"] = [shortest_float32(v) for v in values]
    # The attention factor transformers would derive, unless the file's differs.
    attn = meta.get("rope.scaling.attn_factor")
    factor = meta.get("context_length") / orig
    default = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(orig))
    if attn is not None and np.float32(attn) != np.float32(default):
        scaling["attention_factor"] = shortest_float32(attn)
    cfg.update(original_max_position_embeddings=orig, rope_scaling=scaling)


def gguf_write(w, cfg, folder) -> dict:
    """The sliding window and LongRoPE as llama.cpp's converter writes them;
    returns the rope factor tensors, if any."""
    kind = (cfg.rope_scaling or {}).get("rope_type", (cfg.rope_scaling or {}).get("type", "default"))
    if kind not in ("default", "longrope"):
        raise ConversionError(folder / "config.json", f"rope scaling {kind!r} of {cfg.model_type} cannot "
                                                      f"be written to GGUF (supported: longrope)")
    w.add_sliding_window(cfg.sliding_window or 0)   # 0: none
    if not cfg.longrope:
        return {}
    scaling = cfg.rope_scaling
    w.add_rope_scaling_orig_ctx_len(scaling["original_max_position_embeddings"])
    w.add_rope_scaling_attn_factors(scaling["attention_factor"])
    return {f"rope_factors_{kind}.weight": np.asarray(scaling[f"{kind}_factor"], np.float32)
            for kind in ("long", "short")}


FAMILIES = {
    "phi3": Family("Phi3ForCausalLM", fused_qkv=True, fused_gate_up=True, sliding_window=EVERY_LAYER,
                   gguf=True, gguf_partial_rotary=True, gguf_sliding_window=True, gguf_longrope=True,
                   gguf_read=gguf_read, gguf_write=gguf_write),
}
