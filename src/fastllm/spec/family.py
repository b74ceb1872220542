"""What a model family is to fastllm: the Llama decoder plus a few switches
of the one C layer, and the hooks where a family reads config.json keys or
llama.cpp metadata of its own. Each family module under families/ fills one
or more Family rows.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Optional

from .errors import ConversionError

# Which layers attend through a sliding window (Family.sliding_window).
EVERY_LAYER = "every_layer"            # all of them, when config.json's sliding_window is set (Mistral)
USE_SLIDING_WINDOW = "use_sliding_window"  # only with use_sliding_window: the layers layer_types
                                           # names, or from max_window_layers on (Qwen2, Qwen3)
LAYER_TYPES = "layer_types"            # the layers layer_types names, else all but every
                                       # sliding_window_pattern-th (Gemma 2, Gemma 3)

# The MLP gate activations the run loop has (config.json's names).
ACTIVATIONS = ("silu", "gelu_pytorch_tanh")


def require(md: dict, key: str, path):
    """The GGUF metadata value of key, or a ConversionError naming it."""
    if key not in md:
        raise ConversionError(path, f"GGUF metadata lacks {key!r}")
    return md[key]


class GgufMetadata:
    """A GGUF file's metadata as a family's gguf_read hook sees it: the
    values under its architecture's name, and what the common reading has
    worked out (sizes, the head's shape, the rope base)."""

    def __init__(self, md: dict, arch: str, path, shapes: dict, **facts):
        self.md, self.arch, self.path, self.shapes = md, arch, path, shapes
        # source_md and rope_freqs (as the file has them, before gguf_prepare), n_layers,
        # hidden, n_heads, head_dim, rope_dim, theta, rope_factors
        self.__dict__.update(facts)

    def get(self, key: str, default=None):
        return self.md.get(f"{self.arch}.{key}", default)

    def require(self, key: str):
        return require(self.md, f"{self.arch}.{key}", self.path)

    def error(self, problem: str) -> ConversionError:
        return ConversionError(self.path, problem)


@dataclass(frozen=True)
class Family:
    hf_class: str
    # Optional tensors: True (always there), False (never), or the
    # config.json key whose value says.
    attention_bias: bool | str = False   # q, k and v projections
    o_bias: bool | str = False           # output projection
    mlp_bias: bool | str = False
    qk_norm: bool = False                # per-head RMSNorm of q and k
    qk_norm_whole: bool = False          # q and k normed over the whole projection (all heads at once)
    pre_norms: bool = True               # RMSNorm before the attention and before the MLP
    post_norms: bool = False             # RMSNorm of the attention's and the MLP's outputs
    norm_plus_one: bool = False          # RMSNorm weights stored zero-centred: y = norm(x) * (1 + w)
    attn_output_gate: bool = False       # q_proj also yields a sigmoid gate on the attention output
    linear_attention: bool = False       # Gated DeltaNet layers beside full attention (read_config
                                         # says which)
    partial_rotary_factor: float = 1.0   # when config.json gives none
    sliding_window: str | None = None    # EVERY_LAYER, USE_SLIDING_WINDOW, LAYER_TYPES, or None: every
                                         # layer sees the whole context
    refuse: dict = field(default_factory=dict)   # config.json key that must not be true: why
    untie_with_head: bool = False        # an lm_head the file carries is used even when tied
    mtp: bool = False                    # its multi-token-prediction block runs (as a drafter)
    fused_qkv: bool = False              # q, k and v rows stored as one qkv_proj
    fused_gate_up: bool = False          # gate and up rows stored as one gate_up_proj
    hidden_act_key: str = "hidden_act"   # the config.json key naming the MLP's activation
    scale_embeddings: bool = False       # the embeddings are multiplied by sqrt(hidden_size)
    query_pre_attn_scalar: bool = False  # config.json's query_pre_attn_scalar: the softmax scale
                                         # is its inverse square root
    softcapping: bool = False            # config.json's attn_logit_softcapping and
                                         # final_logit_softcapping (tanh soft-caps), where set
    local_rope: bool = False             # sliding layers rotate with their own RoPE (theta, scaling)
    defaults: dict = field(default_factory=dict)   # transformers' values of keys config.json
                                                   # may leave out, where they are not Llama's
    attribute_map: dict = field(default_factory=dict)   # config.json key -> the HF key it stands
                                                        # for (transformers' attribute_map)
    text_config: str | None = None       # a multimodal wrapper: the family of its text model ...
    text_models: tuple = ()              # ... or of these, where its text_config's model_type says
    weight_prefix: str = "model."        # of the text model's tensors in the checkpoint
    head_prefix: str = ""                # of its lm_head
    # Mixture of experts: the config.json keys of the expert count (the
    # first present) and of an expert's intermediate size; None: dense.
    experts_keys: tuple | None = None
    expert_size_key: str = "moe_intermediate_size"
    norm_topk_prob: bool | str = True    # the chosen experts' weights are renormalised (or the key that says)
    sparse_layer_keys: bool = False      # config.json's mlp_only_layers and decoder_sparse_step say
                                         # which layers have experts (else every layer)
    shared_expert: bool = False          # a shared expert with a sigmoid gate beside the routed ones
    hf_names: dict = field(default_factory=dict)   # schema field -> HF name where the family's differs
    # llama.cpp's GGUF files.
    gguf: bool | str = False             # importable from llama.cpp's GGUF: True (its arch name is the
                                         # model_type) or llama.cpp's name for the architecture
    gguf_experts: str | None = None      # the model_type of this architecture's GGUF files that have experts
    gguf_export: str | None = None       # written to GGUF as this llama.cpp architecture, which imports
                                         # as another model_type (a Mistral is a llama there)
    gguf_qk_interleaved: bool = False    # llama.cpp stores each Q/K head's rotary halves interleaved
    gguf_tensors: dict = field(default_factory=dict)   # schema field -> llama.cpp's name under blk.N.,
                                                       # where this architecture's differs
    gguf_refuse: dict = field(default_factory=dict)    # ModelConfig switch that llama.cpp's architecture
                                                       # cannot load when true: why (on export)
    gguf_head_dim: bool = True           # HF's config can say head_dim (else it must be hidden/heads)
    gguf_partial_rotary: bool = False    # llama.cpp's architecture can rotate part of each head
    gguf_sliding_window: bool = False    # llama.cpp's architecture keeps the sliding window (else it is
                                         # not written, with a warning)
    gguf_longrope: bool = False          # the family's gguf_write writes the rope scaling (LongRoPE as
                                         # rope_factors_long/short tensors), not the common writer
    # A family's own reading and writing, where the switches above do not
    # say it all (see families/ for each):
    # read_config(raw, fields, path) -> dict: ModelConfig fields from its config.json keys,
    #   given the fields read so far;
    read_config: Optional[Callable] = field(default=None, compare=False)
    # gguf_prepare(md, arch, shapes, rope_freqs, path) -> (md, rope_freqs): metadata the common
    #   reading can take (per-layer lists, tensors it would misread);
    gguf_prepare: Optional[Callable] = field(default=None, compare=False)
    # gguf_read(meta: GgufMetadata, cfg: dict): its config.json keys from llama.cpp's metadata;
    gguf_read: Optional[Callable] = field(default=None, compare=False)
    # gguf_write(w, cfg, folder) -> dict: its llama.cpp keys, and tensors that hold them.
    gguf_write: Optional[Callable] = field(default=None, compare=False)

    def switch(self, name: str, raw: dict) -> bool:
        """The value of an optional-tensor switch for config.json raw."""
        value = getattr(self, name)
        return bool(raw.get(value, False)) if isinstance(value, str) else value
