"""The tensors that tests/test_block_quantization.py quantizes beside llama-quantize.

    python make.py /path/to/llama-quantize

writes source-F32.gguf (a one-layer llama's header and three small 2-D
tensors, no tokenizer: llama-quantize needs nothing more) and quantizes it
with llama-quantize --pure, every tensor into the same type, once per type
that fastllm writes. Rows mix blocks of many kinds, so that the
quantizers' searches meet sign changes, outliers, zeros, constants and
scales from 1e-8 to 1e4 within one 256-value superblock.
"""
import sys
from pathlib import Path

import gguf
import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parents[2]))

from oracles.gguf_maker import quantize  # noqa: E402

TYPES = ["Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q4_K", "Q5_K", "Q6_K"]


def block(kind: int, rng) -> np.ndarray:
    """32 values of one of a dozen kinds."""
    x = rng.standard_normal(32)
    return [
        x,                                           # Gaussian
        np.abs(x),                                   # all positive (the minimum of q4_1/K matters)
        -np.abs(x) - 3.0,                            # all negative, away from 0
        np.where(np.arange(32) == 7, 40.0, x),       # one outlier
        np.zeros(32),                                # all zero
        np.full(32, 0.75),                           # constant
        x * 1e-6,                                    # tiny: scales near f16's smallest
        x * 1e3,                                     # large (the f16 minimum of q4_1 stays finite)
        rng.uniform(-1, 1, 32),                      # uniform
        np.round(x * 4) / 4,                         # already on a grid
        np.where(np.arange(32) < 16, 0.0, x),        # half zero
        np.sign(x) * np.abs(x) ** 3,                 # heavy tails
    ][kind % 12]


def rows(n_rows: int, n_cols: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    kinds = rng.integers(0, 12, (n_rows, n_cols // 32))
    out = np.stack([np.concatenate([block(k, rng) for k in row]) for row in kinds])
    # each row at a scale of its own
    return (out * np.geomspace(0.01, 10, n_rows)[:, None]).astype(np.float32)


def source(path: Path) -> None:
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(1)
    w.add_context_length(64)
    w.add_embedding_length(256)
    w.add_feed_forward_length(512)
    w.add_head_count(2)
    w.add_head_count_kv(1)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_tensor("token_embd.weight", rows(8, 256, 1))
    w.add_tensor("blk.0.attn_v.weight", rows(4, 256, 2))
    w.add_tensor("blk.0.ffn_down.weight", rows(2, 512, 3))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


if __name__ == "__main__":
    source(HERE / "source-F32.gguf")
    for t in TYPES:
        quantize(Path(sys.argv[1]), HERE / "source-F32.gguf", HERE / f"{t}.gguf", t, pure=True)
