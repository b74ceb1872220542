"""GGUF files of tiny Gemma 2 and Gemma 3 checkpoints, as llama.cpp's
converter writes them, for tests/test_conformance.py and test_gemma.py.

    python make.py /path/to/llama.cpp/convert_hf_to_gguf.py

For oracles/tiny_models.py's "gemma2" and "gemma3-text" shapes, changed
where llama.cpp runs a file otherwise than transformers runs the folder:
its files hold no query_pre_attn_scalar (llama.cpp scales by 1/sqrt(head_dim))
and no Gemma 3 window pattern (llama.cpp assumes every sixth layer global).
Each checkpoint gets a Gemma-style SentencePiece vocabulary of its
vocab_size (oracles/spm_vocabs.py's), is converted to <kind>.gguf (F32), and
<kind>.npz holds transformers' float64 logits on the folder for a fixed
prompt (ids, logits), which the tests hold fastllm's results against.
Nothing of the converter is changed.
"""
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[2]
sys.path.insert(0, str(ROOT))

from oracles import spm_vocabs  # noqa: E402
from oracles.gguf_maker import add_spm_tokenizer, convert, prompt, tiny_checkpoint, write_reference  # noqa: E402
from oracles.tiny_models import SHAPES  # noqa: E402

VOCAB = spm_vocabs.DEFAULT_VOCAB_SIZE
GGUF_SHAPES = {
    "gemma2": dict(SHAPES["gemma2"], vocab_size=VOCAB, query_pre_attn_scalar=24),
    "gemma3": dict(SHAPES["gemma3-text"], vocab_size=VOCAB, num_hidden_layers=6, sliding_window_pattern=6),
}


def tokenizer(folder: Path, work: Path) -> None:
    """Gemma's layout: <pad> <eos> <bos> <unk> at 0..3, no dummy prefix."""
    settings = dict(spm_vocabs.VOCABS["gemma-bpe-bf"][0])
    add_spm_tokenizer(folder, spm_vocabs.train(vocab_size=VOCAB, out_dir=work, **settings), work, "gemma")


if __name__ == "__main__":
    converter = Path(sys.argv[1])
    with tempfile.TemporaryDirectory() as tmp:
        for kind, spec in GGUF_SHAPES.items():
            folder = tiny_checkpoint(f"{kind}-gguf", spec, Path(tmp) / kind)
            tokenizer(folder, Path(tmp) / "vocab")
            convert(converter, folder, HERE / f"{kind}.gguf")
            write_reference(HERE / f"{kind}.npz", prompt(VOCAB), logits=folder)
