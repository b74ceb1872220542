"""Granite: Llama with multipliers of the embeddings, of each sublayer's
output and of the attention scores, and a divisor of the logits."""
from ..errors import ModelFileError
from ..family import Family
from ..values import number, shortest_float32

# transformers' GraniteConfig defaults (the attention's too is 1, not 1/sqrt(head_dim)).
MULTIPLIERS = {"embedding_multiplier": 1.0, "residual_multiplier": 1.0, "attention_multiplier": 1.0,
               "logits_scaling": 1.0}
# llama.cpp's key (after "ARCH.") for each, read and written.
GGUF_KEYS = {"embedding_multiplier": "embedding_scale", "residual_multiplier": "residual_scale",
             "attention_multiplier": "attention.scale", "logits_scaling": "logit_scale"}


def read_config(raw: dict, fields: dict, path) -> dict:
    """The multipliers where config.json gives them: each a positive number."""
    out = {}
    for key, default in MULTIPLIERS.items():
        value = raw.get(key, default)
        if not (number(value) and value > 0):
            raise ModelFileError(path, f"{key} must be a positive number, got {value!r}")
        out[key] = float(value)
    return out


def gguf_read(meta, cfg: dict) -> None:
    """The multipliers from llama.cpp's scales, with llama.cpp's defaults
    where a key is absent (its converter leaves out zeros): no scaling, and
    the attention's 1/sqrt(head_dim)."""
    for hf, key in GGUF_KEYS.items():
        default = meta.head_dim ** -0.5 if hf == "attention_multiplier" else 1.0
        value = meta.get(key)
        if value is not None and not value > 0:
            raise meta.error(f"{meta.arch}.{key} is {value}; it must be positive")
        cfg[hf] = default if value is None else shortest_float32(value)


def gguf_write(w, cfg, folder) -> dict:
    for hf, key in GGUF_KEYS.items():
        w.add_float32(f"{w.arch}.{key}", getattr(cfg, hf))
    return {}


FAMILIES = {
    "granite": Family("GraniteForCausalLM", attention_bias="attention_bias", o_bias="attention_bias",
                      mlp_bias="mlp_bias", gguf=True, gguf_qk_interleaved=True, gguf_head_dim=False,
                      read_config=read_config, gguf_read=gguf_read, gguf_write=gguf_write),
}
