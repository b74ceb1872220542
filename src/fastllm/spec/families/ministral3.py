"""Ministral 3: Mistral with YaRN and queries scaled by position. Its
checkpoints are the text model of the mistral3 wrapper, which also holds
Mistral Small 3.x (a mistral text model)."""
from ..errors import ConversionError, ModelFileError
from ..family import EVERY_LAYER, Family
from ..values import number, positive_int, shortest_float32

# transformers' Ministral3Config defaults (YaRN among them).
DEFAULTS = dict(
    vocab_size=131072, hidden_size=4096, intermediate_size=14336, num_hidden_layers=34, num_attention_heads=32,
    num_key_value_heads=8, head_dim=128, max_position_embeddings=262144, rms_norm_eps=1e-5,
    bos_token_id=1, eos_token_id=2, tie_word_embeddings=False,
    rope_parameters=dict(type="yarn", rope_theta=1000000.0, factor=16.0, original_max_position_embeddings=16384,
                         beta_fast=32.0, beta_slow=1.0, mscale_all_dim=1.0, mscale=1.0,
                         llama_4_scaling_beta=0.1))


def read_config(raw: dict, fields: dict, path) -> dict:
    """The query scaling by position: llama_4_scaling_beta and the original
    context of the rope parameters, as transformers reads them (whatever
    the rope type)."""
    params = raw.get("rope_parameters") if isinstance(raw.get("rope_parameters"), dict) else {}
    scaling = fields["rope_scaling"] or params
    beta = scaling.get("llama_4_scaling_beta")
    if beta is None:
        return {}
    period = scaling.get("original_max_position_embeddings")
    if not (number(beta) and beta >= 0) or not positive_int(period):
        raise ModelFileError(path, "llama_4_scaling_beta must be a number >= 0 and the rope parameters' "
                                   f"original_max_position_embeddings a positive integer, got {beta!r} "
                                   f"and {period!r}")
    return dict(query_scale_beta=float(beta), query_scale_period=period)


def gguf_read(meta, cfg: dict) -> None:
    """The rope parameters hold the query scaling beside YaRN, and say
    "default" outright (transformers' default is YaRN)."""
    params = dict(cfg.pop("rope_scaling", None) or {"rope_type": "default"}, rope_theta=cfg.pop("rope_theta"))
    beta = meta.get("attention.temperature_scale", 0.0)
    if beta:
        if not beta > 0:
            raise meta.error(f"{meta.arch}.attention.temperature_scale is {beta}; it must be positive")
        params["llama_4_scaling_beta"] = shortest_float32(beta)
        params.setdefault("original_max_position_embeddings",
                          meta.get("rope.scaling.original_context_length", cfg["max_position_embeddings"]))
    cfg["rope_parameters"] = params


def gguf_write(w, cfg, folder) -> dict:
    """llama.cpp scales queries by YaRN's original context: a query scaling
    without YaRN, or with another period, is refused."""
    if not cfg.query_scale_beta:
        return {}
    kind = (cfg.rope_scaling or {}).get("rope_type", (cfg.rope_scaling or {}).get("type", "default"))
    if kind != "yarn":
        raise ConversionError(folder / "config.json", "a query scaling (llama_4_scaling_beta) without YaRN "
                                                      "cannot be written to GGUF: llama.cpp scales by YaRN's "
                                                      "original context")
    if cfg.query_scale_period != cfg.rope_scaling["original_max_position_embeddings"]:
        raise ConversionError(folder / "config.json", "a query scaling period apart from YaRN's original context "
                                                      "cannot be written to GGUF: llama.cpp would run the file "
                                                      "otherwise")
    w.add_attn_temperature_scale(cfg.query_scale_beta)
    return {}


FAMILIES = {
    "ministral3": Family("Ministral3ForCausalLM", sliding_window=EVERY_LAYER, defaults=DEFAULTS, gguf="mistral3",
                         gguf_qk_interleaved=True, read_config=read_config, gguf_read=gguf_read,
                         gguf_write=gguf_write),
    "mistral3": Family("Mistral3ForConditionalGeneration", text_config="ministral3",
                       text_models=("ministral3", "mistral"), weight_prefix="language_model.model.",
                       head_prefix="language_model.", defaults=dict(tie_word_embeddings=True)),
}
