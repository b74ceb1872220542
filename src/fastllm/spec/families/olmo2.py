"""OLMo 2: norms after the attention and the MLP instead of before, and
q/k norms over the whole projection."""
from ..family import Family

FAMILIES = {
    "olmo2": Family("Olmo2ForCausalLM", attention_bias="attention_bias", o_bias="attention_bias",
                    qk_norm=True, qk_norm_whole=True, pre_norms=False, post_norms=True, gguf=True,
                    gguf_head_dim=False),
}
