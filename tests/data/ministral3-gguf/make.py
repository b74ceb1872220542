"""GGUF files of tiny Ministral 3 checkpoints, as llama.cpp's converter
writes them (arch mistral3), for tests/test_conformance.py and test_ministral3.py.

    PYTHONPATH=/path/to/llama.cpp/gguf-py python make.py /path/to/llama.cpp/convert_hf_to_gguf.py

For oracles/tiny_models.py's "ministral3" and "mistral3-wrapper" shapes,
without the wrapper's sliding window (llama.cpp's mistral3 has none). Each
folder gets a byte-level BPE vocabulary trained under Mistral's tekken
pre-tokenizer (oracles/bpe_gguf_vocabs.py's). The converter recognises a
pre-tokenizer by hashing its output for a test string, which only the
published vocabulary gives; here its get_vocab_base_pre is patched to
answer "tekken" - the one change made to the converter.

<kind>.gguf is the F32 file; <kind>.npz holds, for a fixed prompt longer
than the original context (ids), transformers' float64 logits on the folder
(folder_logits) and on the folder as llama.cpp reads the file (logits): the
same but for mscale, which llama.cpp's files do not hold and llama.cpp
takes as 1 (the wrapper's is 1.3; the text model's is 1 already).
"""
import json
import sys
import tempfile
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[2]
sys.path.insert(0, str(ROOT))

from oracles.bpe_gguf_vocabs import trained_family_tokenizer  # noqa: E402
from oracles.hf_reference import hf_logits, load_hf  # noqa: E402
from oracles.llama_cpp_converter import convert  # noqa: E402
from oracles.tiny_models import SHAPES, make_tiny_model, with_config  # noqa: E402

VOCAB = 640
GGUF_SHAPES = {
    "ministral3": dict(SHAPES["ministral3"], vocab_size=VOCAB),
    "mistral3-wrapper": dict(SHAPES["mistral3-wrapper"], vocab_size=VOCAB, sliding_window=None),
}


def prompt(vocab: int) -> list:
    return np.random.default_rng(33).integers(0, vocab, 60).tolist()


def tokenizer(folder: Path) -> None:
    from transformers import PreTrainedTokenizerFast
    tok = trained_family_tokenizer("tekken", vocab_size=VOCAB - 1)   # and <think>
    assert tok.get_vocab_size() <= VOCAB
    PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>").save_pretrained(folder)


def as_llama_cpp_reads_it(folder: Path, out: Path) -> Path:
    """The folder with mscale 1, as llama.cpp runs the converted file."""
    raw = json.loads((folder / "config.json").read_text())
    text = raw.get("text_config", raw)
    params = dict(text["rope_parameters"], mscale=1.0)
    if "text_config" in raw:
        return with_config(folder, out, text_config=dict(text, rope_parameters=params))
    return with_config(folder, out, rope_parameters=params)


def patch_pre_tokenizer_detection(converter: Path) -> None:
    """The converter names the tiny vocabulary's pre-tokenizer "tekken"."""
    sys.path.insert(0, str(converter.parent))
    import conversion.base  # the converter's own package
    conversion.base.TextModel.get_vocab_base_pre = lambda self, tok: "tekken"


if __name__ == "__main__":
    converter = Path(sys.argv[1]).resolve()
    patch_pre_tokenizer_detection(converter)
    with tempfile.TemporaryDirectory() as tmp:
        for kind, spec in GGUF_SHAPES.items():
            SHAPES[f"{kind}-gguf"] = spec
            folder = make_tiny_model(f"{kind}-gguf", Path(tmp) / kind)
            tokenizer(folder)
            convert(converter, folder, HERE / f"{kind}.gguf")
            ids = prompt(VOCAB)
            as_read = as_llama_cpp_reads_it(folder, Path(tmp) / f"{kind}-mscale1")
            np.savez(HERE / f"{kind}.npz", ids=np.array(ids, np.int32),
                     logits=hf_logits(load_hf(as_read), ids).astype(np.float32),
                     folder_logits=hf_logits(load_hf(folder), ids).astype(np.float32))
