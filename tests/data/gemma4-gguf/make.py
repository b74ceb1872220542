"""GGUF files of tiny Gemma 4 checkpoints, as llama.cpp's converter and
llama-quantize write them, for tests/test_conformance.py and test_gemma4.py.

    python make.py /path/to/llama.cpp

(the folder holding convert_hf_to_gguf.py, gguf-py, build/bin/llama-quantize
and models/templates). Both checkpoints have every Gemma 4 switch:
per-layer inputs, global layers with wider heads, one KV head and values
that are their keys, the last layers attending to earlier layers' caches
with a double-wide MLP, the global layers' proportional RoPE, a window
shorter than the prompts and a reached final soft-cap.

* gemma4.gguf (F32) of oracles/tiny_models.py's "gemma4-text" shape (its
  layers alternating as llama.cpp's cache sharing needs), and
  gemma4.npz: transformers' float64 logits on the folder it was made from
  for a fixed prompt (ids, logits);
* gemma4-256-Q4_K_M.gguf of a 256-wide version (so that most matrices take
  K-quants), whose F32 conversion is not kept: the test compares it with
  the folder fastllm dequantizes it to.

Each checkpoint gets a Gemma-style vocabulary of 2000 tokens
(oracles/spm_vocabs.py's) and Gemma 4's chat template as llama.cpp ships it,
which the converter writes into the files. Nothing of the converter is
changed.
"""
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[2]
sys.path.insert(0, str(ROOT))

from oracles import spm_vocabs  # noqa: E402
from oracles.gguf_maker import (CONVERTER, QUANTIZE, add_spm_tokenizer, convert, prompt, quantize,  # noqa: E402
                                tiny_checkpoint, update_tokenizer_config, write_reference)
from oracles.tiny_models import SHAPES  # noqa: E402

VOCAB = spm_vocabs.DEFAULT_VOCAB_SIZE
# llama.cpp's layers that share caches read those of the last two layers
# before them, which must then be a sliding one and a global one.
TEXT = dict(SHAPES["gemma4-text"], vocab_size=VOCAB, vocab_size_per_layer_input=VOCAB,
            layer_types=["sliding_attention", "full_attention"] * 3)
WIDE = dict(TEXT, hidden_size=256, intermediate_size=256, num_hidden_layers=4, num_attention_heads=2,
            num_key_value_heads=1, head_dim=128, global_head_dim=256, hidden_size_per_layer_input=64,
            layer_types=["sliding_attention", "full_attention"] * 2)
TEMPLATE = "models/templates/google-gemma-4-31B-it.jinja"


def folder_of(kind: str, spec: dict, work: Path, llama_cpp: Path, init_scale: float = 0.2) -> Path:
    """The tiny checkpoint with a Gemma vocabulary (<pad> <eos> <bos> <unk>
    at 0..3, no dummy prefix) and Gemma 4's chat template."""
    folder = tiny_checkpoint(kind, spec, work / kind, init_scale=init_scale)
    settings = dict(spm_vocabs.VOCABS["gemma-bpe-bf"][0])
    model = spm_vocabs.train(vocab_size=VOCAB, out_dir=work / "vocab", **settings)
    add_spm_tokenizer(folder, model, work / "vocab", "gemma")
    update_tokenizer_config(folder, chat_template=(llama_cpp / TEMPLATE).read_text())
    return folder


if __name__ == "__main__":
    llama_cpp = Path(sys.argv[1]).resolve()
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        folder = folder_of("gemma4-gguf", TEXT, work, llama_cpp)
        convert(llama_cpp / CONVERTER, folder, HERE / "gemma4.gguf")
        write_reference(HERE / "gemma4.npz", prompt(VOCAB), logits=folder)
        wide = folder_of("gemma4-gguf-256", WIDE, work, llama_cpp)
        convert(llama_cpp / CONVERTER, wide, work / "gemma4-256-F32.gguf")
        quantize(llama_cpp / QUANTIZE, work / "gemma4-256-F32.gguf", HERE / "gemma4-256-Q4_K_M.gguf", "Q4_K_M")
