"""Random-weight mixture-of-experts checkpoints as llama.cpp's converter and
llama-quantize make them, for benchmarks/perplexity.py (fastllm's perplexity
and KL divergence beside llama-perplexity's on the same files).

    python benchmarks/moe_gguf.py OUT_DIR --llama-cpp /path/to/llama.cpp [--models qwen3moe,qwen35moe,mixtral]
    python benchmarks/perplexity.py --base OUT_DIR/qwen3moe-F32.gguf OUT_DIR/qwen3moe-Q8_0.gguf \\
        OUT_DIR/qwen3moe-Q4_K_M.gguf --llama-perplexity /path/to/llama.cpp/build/bin/llama-perplexity \\
        --chunks 16 --threads 2

Three families at hidden 512, every matrix's rows a multiple of 256 values so
that llama-quantize's K-quants apply: a Qwen3-MoE (arch qwen3moe: 64 experts,
top-8 with norm_topk_prob), a Qwen3.5-MoE (arch qwen35moe: Gated DeltaNet
and gated full attention, 32 experts, top-4, and a shared expert with its
sigmoid gate) and a Mixtral (arch llama with expert tensors: top-2 of 8).
Every layer is routed, as llama.cpp routes these archs. Each has Qwen3.5's
tokenizer cut to the 32,768 ids of its embedding (tests/data/qwen35-gguf/make.py
says how, and why the converter's pre-tokenizer detection is told "qwen35");
tests/data/moe-gguf/make.py's helpers write them.

The weights are drawn with a standard deviation of 0.03, so that the
standard deviation times sqrt(hidden) is near qwen35_gguf.py's and
gemma4_gguf.py's (0.64 and 0.8): the Qwen3-MoE's logits then spread by
about 0.7 (at 0.02 by 0.46, a flatter distribution; at 0.05 by 1.1, where
weight noise of Q8_0's size moves the output six times as much as at 0.03).
"""
import argparse
import importlib.util
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests" / "data" / "qwen35-gguf"))

import make as qwen35_make  # noqa: E402  (tests/data/qwen35-gguf/make.py)
from oracles.gguf_maker import CONVERTER, QUANTIZE, convert, quantize  # noqa: E402


def _load(name: str, path: Path):
    """A script by its path: tests/data/moe-gguf/make.py, whose name is taken by
    qwen35-gguf's (which it imports as make, so both share its N_RANKS)."""
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


moe_make = _load("moe_make", ROOT / "tests" / "data" / "moe-gguf" / "make.py")

VOCAB = 32768
INIT_SCALE = 0.03
_ATTENTION = dict(vocab_size=VOCAB, hidden_size=512, num_attention_heads=4, num_key_value_heads=2, head_dim=128,
                  tie_word_embeddings=False, max_position_embeddings=4096)
SHAPES = {
    "qwen3moe": dict(_ATTENTION, model_type="qwen3_moe", intermediate_size=1536, num_hidden_layers=4,
                     num_experts=64, num_experts_per_tok=8, moe_intermediate_size=256, norm_topk_prob=True,
                     decoder_sparse_step=1, mlp_only_layers=[]),
    "qwen35moe": dict(_ATTENTION, model_type="qwen3_5_moe_text", intermediate_size=1536, num_hidden_layers=4,
                      layer_types=["linear_attention"] * 3 + ["full_attention"], linear_num_key_heads=2,
                      linear_num_value_heads=4, linear_key_head_dim=128, linear_value_head_dim=128,
                      linear_conv_kernel_dim=4, num_experts=32, num_experts_per_tok=4, moe_intermediate_size=256,
                      shared_expert_intermediate_size=512),
    "mixtral": dict(_ATTENTION, model_type="mixtral", intermediate_size=1024, num_hidden_layers=4,
                    num_local_experts=8, num_experts_per_tok=2, bos_token_id=None),
}
# Mixtral's config would name id 1 its BOS (its "<s>"), which is '"' in this
# vocabulary, an ordinary token; like the Qwen models it has none.
SEEDS = {"qwen3moe": 40, "qwen35moe": 41, "mixtral": 42}
QUANTS = ("Q8_0", "Q4_K_M")


def make_folder(name: str, folder: Path) -> None:
    spec = SHAPES[name]
    # write_tokenizer keeps the first N_RANKS ranks; Qwen3.5's 33 added tokens follow them.
    qwen35_make.N_RANKS = VOCAB - 33
    if spec["model_type"].startswith("qwen3_5"):
        qwen35_make.make_folder(spec, folder, SEEDS[name], scale=INIT_SCALE)
    else:
        moe_make.make_folder(name, spec, folder, SEEDS[name], init_scale=INIT_SCALE)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--llama-cpp", type=Path, required=True, help="llama.cpp's source tree, built")
    parser.add_argument("--models", default=",".join(SHAPES), help="comma-separated, of " + ", ".join(SHAPES))
    args = parser.parse_args()
    llama = args.llama_cpp.resolve()
    out = args.out.resolve()
    names = args.models.split(",")
    unknown = [n for n in names if n not in SHAPES]
    if unknown:
        parser.error(f"unknown model(s) {', '.join(unknown)}: choose from {', '.join(SHAPES)}")
    for name in names:
        folder = out / name
        make_folder(name, folder)
        f32 = out / f"{name}-F32.gguf"
        convert(llama / CONVERTER, folder, f32, pre=qwen35_make.PRE_TOKENIZER,
                options=moe_make.NO_MTP.get(name, []))
        for qtype in QUANTS:
            quantize(llama / QUANTIZE, f32, out / f"{name}-{qtype}.gguf", qtype)
        print(f"wrote {folder} and {out}/{name}-{{F32,{','.join(QUANTS)}}}.gguf")


if __name__ == "__main__":
    main()
