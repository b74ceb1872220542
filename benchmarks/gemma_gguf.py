"""Random-weight Gemma 2 and Gemma 3 checkpoints as llama.cpp's converter and
llama-quantize make them, for benchmarks/perplexity.py (fastllm's perplexity
and KL divergence beside llama-perplexity's on the same files).

    python benchmarks/gemma_gguf.py OUT_DIR --llama-cpp /path/to/llama.cpp
    python benchmarks/perplexity.py --base OUT_DIR/gemma3-F32.gguf OUT_DIR/gemma3-Q8_0.gguf \\
        OUT_DIR/gemma3-Q4_K_M.gguf --llama-perplexity /path/to/llama.cpp/build/bin/llama-perplexity \\
        --ctx 256 --chunks 16

The shapes are tests/data/gemma-gguf/make.py's (sliding windows, soft-caps,
Gemma 3's local RoPE base and linear scaling), widened to hidden 256 and 6
layers so that llama-quantize's K-quants apply, with a window of 64 that a
context of 256 passes. Each gets that script's Gemma-style SentencePiece
vocabulary.
"""
import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests" / "data" / "gemma-gguf"))

import make  # noqa: E402  (tests/data/gemma-gguf/make.py)
from oracles.gguf_maker import CONVERTER, QUANTIZE, convert, quantize, tiny_checkpoint  # noqa: E402

WIDER = dict(hidden_size=256, intermediate_size=512, num_hidden_layers=6, num_attention_heads=4,
             num_key_value_heads=2, head_dim=64, query_pre_attn_scalar=64, sliding_window=64)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--llama-cpp", type=Path, required=True, help="llama.cpp's source tree, built")
    args = parser.parse_args()
    llama = args.llama_cpp.resolve()
    for kind, spec in make.GGUF_SHAPES.items():
        folder = tiny_checkpoint(f"{kind}-bench", dict(spec, **WIDER), args.out / kind, init_scale=0.05)
        make.tokenizer(folder, args.out / "vocab")
        f32 = args.out / f"{kind}-F32.gguf"
        convert(llama / CONVERTER, folder, f32)
        for qtype in ("Q8_0", "Q4_K_M"):
            quantize(llama / QUANTIZE, f32, args.out / f"{kind}-{qtype}.gguf", qtype)
        print(f"wrote {folder} and {args.out}/{kind}-{{F32,Q8_0,Q4_K_M}}.gguf")


if __name__ == "__main__":
    main()
