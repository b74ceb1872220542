"""Gemma 2 and 3: GeLU, sandwich norms, (1 + w) norms, scaled embeddings,
soft-caps, local (sliding) layers between global ones; Gemma 3 adds q/k
norms and a RoPE of the local layers' own."""
import numpy as np

from ..errors import ConversionError
from ..family import LAYER_TYPES, Family
from ..values import shortest_float32

# transformers' Gemma2Config and Gemma3TextConfig defaults: published
# config.json files (the multimodal wrapper's text_config above all) rely on
# them for most sizes.
GEMMA2_DEFAULTS = dict(
    vocab_size=256000, hidden_size=2304, intermediate_size=9216, num_hidden_layers=26, num_attention_heads=8,
    num_key_value_heads=4, head_dim=256, hidden_activation="gelu_pytorch_tanh", max_position_embeddings=8192,
    rms_norm_eps=1e-6, tie_word_embeddings=True, rope_theta=10000.0, query_pre_attn_scalar=256,
    sliding_window=4096, sliding_window_pattern=2, final_logit_softcapping=30.0, attn_logit_softcapping=50.0,
    pad_token_id=0, eos_token_id=1, bos_token_id=2)
GEMMA3_DEFAULTS = dict(
    GEMMA2_DEFAULTS, vocab_size=262208, max_position_embeddings=131072, rope_theta=1000000.0,
    rope_local_base_freq=10000.0, sliding_window_pattern=6, final_logit_softcapping=None,
    attn_logit_softcapping=None)
# The switches Gemma 2, 3 and 4 share.
GEMMA = dict(attention_bias="attention_bias", o_bias="attention_bias", norm_plus_one=True, post_norms=True,
             sliding_window=LAYER_TYPES, hidden_act_key="hidden_activation", scale_embeddings=True,
             query_pre_attn_scalar=True, softcapping=True,
             refuse={"use_bidirectional_attention": "bidirectional attention is not supported"})

# What llama.cpp's gemma2 and gemma3 take where a file says nothing: the
# window (gemma3: none) and how many layers make one local/global period;
# the soft-caps (gemma3 reads no attention cap); and the block count of the
# 27B size, whose attention scale is 1/sqrt(hidden/heads), not 1/sqrt(head_dim).
GGUF_ASSUMED = {
    "gemma2": dict(window=4096, pattern=2, attn_softcap=50.0, final_softcap=30.0, width_scaled_layers=46,
                   local_rope=False),
    "gemma3": dict(window=None, pattern=6, attn_softcap=None, final_softcap=None, width_scaled_layers=62,
                   local_rope=True),
}


def gguf_read(meta, cfg: dict) -> None:
    """config.json keys of Gemma 2/3 from llama.cpp's metadata, as llama.cpp
    runs the file: which layers slide and how far, the local layers' RoPE
    base (Gemma 3), the soft-caps, and the attention scale llama.cpp
    derives from the shapes (its files hold no query_pre_attn_scalar)."""
    arch, n_layers, assumed = meta.arch, meta.n_layers, GGUF_ASSUMED[meta.arch]
    window = meta.get("attention.sliding_window", assumed["window"])
    if window is not None and (type(window) is not int or window < 0):
        raise meta.error(f"{arch}.attention.sliding_window should be a count, not {window!r}")
    pattern = meta.get("attention.sliding_window_pattern", assumed["pattern"])
    if isinstance(pattern, list):
        if len(pattern) < n_layers:
            raise meta.error(f"{arch}.attention.sliding_window_pattern has {len(pattern)} entries "
                             f"for {n_layers} layers")
        sliding = [bool(v) for v in pattern[:n_layers]]
    else:
        if pattern < 0:
            raise meta.error(f"{arch}.attention.sliding_window_pattern is {pattern}")
        sliding = [pattern == 0 or i % pattern < pattern - 1 for i in range(n_layers)]
    if not window:   # no window: every layer global
        sliding = [False] * n_layers
    cfg.pop("hidden_act")
    cfg.update({"layer_types": ["sliding_attention" if s else "full_attention" for s in sliding],
                "sliding_window": window or None,
                "query_pre_attn_scalar": meta.hidden // meta.n_heads if n_layers == assumed["width_scaled_layers"]
                else meta.head_dim,
                "hidden_activation": "gelu_pytorch_tanh"})
    # llama.cpp's gemma3 reads no attention cap, and a final cap of 0 (its default there) is none.
    attn = meta.get("attn_logit_softcapping", assumed["attn_softcap"]) if assumed["attn_softcap"] else None
    final = meta.get("final_logit_softcapping", assumed["final_softcap"])
    for name, value in (("attn_logit_softcapping", attn), ("final_logit_softcapping", final)):
        cfg[name] = shortest_float32(value) if value else None
    if assumed["local_rope"]:   # Gemma 3's local layers rotate with a base of their own
        swa_theta = meta.get("rope.freq_base_swa", 10000.0)
        scaling = cfg.pop("rope_scaling", None)
        cfg.pop("rope_theta")
        cfg["rope_parameters"] = {
            "full_attention": {**(scaling or {"rope_type": "default"}), "rope_theta": shortest_float32(meta.theta)},
            "sliding_attention": {"rope_type": "default", "rope_theta": shortest_float32(swa_theta)}}


def gguf_write(w, cfg, folder) -> dict:
    """Gemma 2/3's keys as llama.cpp's converter writes them (the soft-caps,
    the window, Gemma 3's local RoPE base), and the window pattern where it
    is not the one llama.cpp assumes; a setting llama.cpp cannot run is
    refused, naming it."""
    assumed, path = GGUF_ASSUMED[w.arch], folder / "config.json"

    def refuse(what):
        raise ConversionError(path, f"{what} cannot be written to a {w.arch} GGUF: llama.cpp would run "
                                    f"the file otherwise")
    width_scaled = cfg.num_hidden_layers == assumed["width_scaled_layers"]
    scale = (cfg.hidden_size // cfg.num_attention_heads if width_scaled else cfg.head_dim) ** -0.5
    if np.float32(scale) != np.float32(cfg.attention_scale):
        refuse(f"an attention scale of {cfg.attention_scale:.6g} (query_pre_attn_scalar; llama.cpp's is "
               f"{scale:.6g})")
    if assumed["attn_softcap"] is None:
        if cfg.attn_logit_softcapping:
            refuse("attn_logit_softcapping")
    elif not cfg.attn_logit_softcapping:
        refuse("attention without attn_logit_softcapping")
    else:
        w.add_attn_logit_softcapping(cfg.attn_logit_softcapping)
    if cfg.final_logit_softcapping:
        w.add_final_logit_softcapping(cfg.final_logit_softcapping)
    elif assumed["final_softcap"] is not None:
        refuse("logits without final_logit_softcapping")
    sliding = [bool(cfg.attention_window(i)) for i in range(cfg.num_hidden_layers)]
    if any(sliding):
        w.add_sliding_window(cfg.sliding_window)
    n = assumed["pattern"]
    if sliding != [i % n < n - 1 for i in range(cfg.num_hidden_layers)]:
        w.add_sliding_window_pattern(sliding)
    if cfg.local_rope_theta is not None:
        if cfg.local_rope_scaling is not None:
            refuse(f"rope scaling of the sliding layers ({cfg.local_rope_scaling})")
        w.add_rope_freq_base_swa(float(cfg.local_rope_theta))
    return {}


_GGUF = dict(gguf_sliding_window=True, gguf_read=gguf_read, gguf_write=gguf_write)

FAMILIES = {
    "gemma2": Family("Gemma2ForCausalLM", **GEMMA, defaults=GEMMA2_DEFAULTS, gguf=True, **_GGUF),
    "gemma3_text": Family("Gemma3ForCausalLM", **GEMMA, qk_norm=True, local_rope=True,
                          defaults=GEMMA3_DEFAULTS, gguf="gemma3", **_GGUF),
    # Its checkpoints (Google's, and transformers' save_pretrained) keep the
    # text model under language_model.model.
    "gemma3": Family("Gemma3ForConditionalGeneration", text_config="gemma3_text",
                     weight_prefix="language_model.model."),
}
