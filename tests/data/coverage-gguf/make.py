"""GGUF files of tiny SmolLM3, Granite, OLMo 2 and Seed-OSS checkpoints, as
llama.cpp's converter writes them, for tests/test_conformance.py.

    PYTHONPATH=/path/to/llama.cpp/gguf-py python make.py /path/to/llama.cpp/convert_hf_to_gguf.py [KIND ...]

For each of oracles/tiny_models.py's shapes "smollm3", "granite", "olmo2"
and "seed_oss" (or the KINDs named): makes the checkpoint, gives it a tiny byte-level BPE tokenizer
(oracles/bpe_gguf_vocabs.py's), converts it to <kind>.gguf (F32) and
writes <kind>.npz, transformers' float64 logits on the folder for a fixed
prompt (ids, logits), which the test holds fastllm's results against.

The converter recognises a BPE tokenizer by hashing how it splits a test
text; a tokenizer trained here is in none of its lists, so its detection is
replaced by the answer "gpt-2" (the GPT-2 pre-tokenizer this tokenizer
uses). Nothing else of the converter is changed.
"""
import json
import runpy
import sys
import tempfile
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[2]
sys.path.insert(0, str(ROOT))

from oracles.bpe_gguf_vocabs import trained_family_tokenizer  # noqa: E402
from oracles.hf_reference import hf_logits, load_hf  # noqa: E402
from oracles.tiny_models import SHAPES, make_tiny_model  # noqa: E402

KINDS = ["smollm3", "granite", "olmo2", "seed_oss"]


def prompt(vocab: int) -> list:
    return np.random.default_rng(24).integers(0, vocab, 40).tolist()


def tokenizer(folder: Path, vocab: int) -> None:
    """A byte-level BPE under GPT-2's pre-tokenizer; its specials <|endoftext|>,
    <s> and </s> are ids 0, 1 and 2: the shapes' pad, bos and eos."""
    trained_family_tokenizer("gpt-2", vocab).save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>", "eos_token": "</s>",
        "pad_token": "<|endoftext|>"}))


def convert(converter: Path, folder: Path, out: Path) -> None:
    sys.path.insert(0, str(converter.parent))
    from conversion import base
    base.TextModel.get_vocab_base_pre = lambda self, tokenizer: "gpt-2"
    argv = sys.argv
    sys.argv = [str(converter), str(folder), "--outtype", "f32", "--outfile", str(out)]
    try:
        runpy.run_path(str(converter), run_name="__main__")
    finally:
        sys.argv = argv


if __name__ == "__main__":
    converter = Path(sys.argv[1]).resolve()
    with tempfile.TemporaryDirectory() as tmp:
        for kind in sys.argv[2:] or KINDS:
            folder = make_tiny_model(kind, Path(tmp) / kind)
            vocab = SHAPES[kind]["vocab_size"]
            tokenizer(folder, vocab - 20)
            convert(converter, folder, HERE / f"{kind}.gguf")
            ids = prompt(vocab)
            np.savez(HERE / f"{kind}.npz", ids=np.array(ids, np.int32),
                     logits=hf_logits(load_hf(folder), ids).astype(np.float32))
