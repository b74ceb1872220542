"""Tiny random mixture-of-experts checkpoints and the GGUF files llama.cpp
makes of them, for tests/test_moe_gguf.py.

    python make.py /path/to/llama.cpp        # the source tree, built (build/bin)

Each checkpoint below is written as an HF folder (float32, tokenizer
included) and converted with llama.cpp's own convert_hf_to_gguf.py to F32:
a Qwen3-MoE (arch qwen3moe), a Mixtral (arch llama with expert tensors),
and a Qwen3.5-MoE (arch qwen35moe: Gated DeltaNet layers, routed experts
and a shared expert). llama.cpp routes every layer of these archs and
always renormalises the chosen experts' weights, so the checkpoints do too.
The "wide" Qwen3-MoE, 256 values per row everywhere for the K-quants, is
converted to F32 in a scratch folder and quantized with llama-quantize to
Q8_0 and Q4_K_M; only those files are kept, to keep the data small (the
tests compare them with the folder fastllm's importer makes of them). The
Qwen3.5-MoE is also converted with --fuse-gate-up-exps, which stores gate
and up as one ffn_gate_up_exps tensor, and its F32 file quantized to Q8_0
(llama-quantize writes the shared expert's (1, dim) gate as a vector).

The tokenizer is the real Qwen3.5 one cut to its first ranks (see
tests/data/qwen35-gguf/make.py, whose helpers this reuses); the
converter's pre-tokenizer detection is patched to name it.
"""
from __future__ import annotations

import shutil
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(HERE.parent / "qwen35-gguf"))

from make import PRE_TOKENIZER, write_tokenizer  # noqa: E402  (tests/data/qwen35-gguf/make.py)
from oracles.gguf_maker import CONVERTER, QUANTIZE, convert, quantize, tiny_checkpoint  # noqa: E402

CHECKPOINTS = {
    "qwen3moe": dict(model_type="qwen3_moe", vocab_size=300, hidden_size=64, intermediate_size=96,
                     num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                     num_experts=8, num_experts_per_tok=3, moe_intermediate_size=32, norm_topk_prob=True,
                     tie_word_embeddings=False),
    "mixtral": dict(model_type="mixtral", vocab_size=300, hidden_size=64, intermediate_size=64,
                    num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, num_local_experts=6,
                    num_experts_per_tok=2, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2),
    "qwen35moe": dict(model_type="qwen3_5_moe_text", vocab_size=300, hidden_size=64, intermediate_size=96,
                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                      linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
                      linear_value_head_dim=24, linear_conv_kernel_dim=4,
                      layer_types=["linear_attention", "full_attention"], num_experts=8, num_experts_per_tok=3,
                      moe_intermediate_size=32, shared_expert_intermediate_size=64, tie_word_embeddings=False),
}
SEEDS = {"qwen3moe": 30, "mixtral": 31, "qwen35moe": 32}
WIDE = dict(CHECKPOINTS["qwen3moe"], hidden_size=256, intermediate_size=256, num_hidden_layers=2,
            num_attention_heads=2, num_key_value_heads=1, head_dim=128, num_experts=4, num_experts_per_tok=2,
            moe_intermediate_size=256)
QUANTS = ("Q8_0", "Q4_K_M")
# Without --no-mtp the converter's Qwen3.5 classes expect MTP layers, which these checkpoints lack.
NO_MTP = {"qwen35moe": ["--no-mtp"]}


def make_folder(name: str, spec: dict, folder: Path, seed: int, init_scale: float = 0.2) -> None:
    """init_scale: the weights' standard deviation (Qwen3.5-MoE's is tiny_models' own)."""
    if folder.exists():
        shutil.rmtree(folder)
    tiny_checkpoint(name, spec, folder, seed=seed, init_scale=init_scale)
    write_tokenizer(folder)


def main(llama: Path) -> None:
    converter = llama / CONVERTER
    for name, spec in CHECKPOINTS.items():
        make_folder(name, spec, HERE / name, SEEDS[name])
        convert(converter, HERE / name, HERE / f"{name}-F32.gguf", pre=PRE_TOKENIZER, options=NO_MTP.get(name, []))
    convert(converter, HERE / "qwen35moe", HERE / "qwen35moe-fused-F32.gguf", pre=PRE_TOKENIZER,
            options=NO_MTP["qwen35moe"] + ["--fuse-gate-up-exps"])
    quantize(llama / QUANTIZE, HERE / "qwen35moe-F32.gguf", HERE / "qwen35moe-Q8_0.gguf", "Q8_0")
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp) / "wide"
        make_folder("qwen3moe-wide", WIDE, folder, seed=33)
        convert(converter, folder, Path(tmp) / "wide-F32.gguf", pre=PRE_TOKENIZER)
        for qtype in QUANTS:
            quantize(llama / QUANTIZE, Path(tmp) / "wide-F32.gguf", HERE / f"wide-{qtype}.gguf", qtype)


if __name__ == "__main__":
    main(Path(sys.argv[1]).resolve())
