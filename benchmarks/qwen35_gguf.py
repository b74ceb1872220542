"""A random-weight Qwen3.5-shaped checkpoint as llama.cpp's converter and
llama-quantize make it, for benchmarks/perplexity.py (fastllm's perplexity
and KL divergence beside llama-perplexity's on the same files).

    python benchmarks/qwen35_gguf.py OUT_DIR --llama-cpp /path/to/llama.cpp
    python benchmarks/perplexity.py --base OUT_DIR/qwen35-F32.gguf OUT_DIR/qwen35-Q8_0.gguf \\
        OUT_DIR/qwen35-Q4_K_M.gguf --llama-perplexity /path/to/llama.cpp/build/bin/llama-perplexity --chunks 8

The shape is benchmarks/make_qwen35.py's 'mid' (Qwen3.5's small models at
hidden 1024 with 8 layers) with 8 key heads shared by 16 value heads, so
that llama.cpp's value-head order differs from HF's, as in Qwen3.5-9B. Its
tokenizer is Qwen3.5's own cut to the 32,768 ids of the embedding
(tests/data/qwen35-gguf/make.py says how, and why the converter's
pre-tokenizer detection is told "qwen35").
"""
import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests" / "data" / "qwen35-gguf"))

import make  # noqa: E402  (tests/data/qwen35-gguf/make.py)
from make_qwen35 import MID  # noqa: E402
from oracles.gguf_maker import QUANTIZE, quantize  # noqa: E402

SHAPE = dict(MID, linear_num_key_heads=8, tie_word_embeddings=True)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--llama-cpp", type=Path, required=True, help="llama.cpp's source tree, built")
    args = parser.parse_args()
    llama = args.llama_cpp.resolve()
    folder = args.out / "qwen35"
    make.N_RANKS = SHAPE["vocab_size"] - 33
    make.make_folder(SHAPE, folder, seed=0, scale=0.02)
    f32 = args.out / "qwen35-F32.gguf"
    make.convert_no_mtp(llama, folder, f32)
    for qtype in ("Q8_0", "Q4_K_M"):
        quantize(llama / QUANTIZE, f32, args.out / f"qwen35-{qtype}.gguf", qtype)
    print(f"wrote {folder} and {args.out}/qwen35-{{F32,Q8_0,Q4_K_M}}.gguf")


if __name__ == "__main__":
    main()
