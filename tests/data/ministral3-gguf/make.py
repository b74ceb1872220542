"""GGUF files of tiny Ministral 3 checkpoints, as llama.cpp's converter
writes them (arch mistral3), for tests/test_conformance.py and test_ministral3.py.

    python make.py /path/to/llama.cpp/convert_hf_to_gguf.py

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

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[2]
sys.path.insert(0, str(ROOT))

from oracles.bpe_gguf_vocabs import trained_family_tokenizer  # noqa: E402
from oracles.gguf_maker import convert, prompt, tiny_checkpoint, write_reference  # noqa: E402
from oracles.tiny_models import SHAPES, with_config  # noqa: E402

VOCAB = 640
PRE_TOKENIZER = "tekken"
GGUF_SHAPES = {
    "ministral3": dict(SHAPES["ministral3"], vocab_size=VOCAB),
    "mistral3-wrapper": dict(SHAPES["mistral3-wrapper"], vocab_size=VOCAB, sliding_window=None),
}


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


if __name__ == "__main__":
    converter = Path(sys.argv[1])
    with tempfile.TemporaryDirectory() as tmp:
        for kind, spec in GGUF_SHAPES.items():
            folder = tiny_checkpoint(f"{kind}-gguf", spec, Path(tmp) / kind)
            tokenizer(folder)
            convert(converter, folder, HERE / f"{kind}.gguf", pre=PRE_TOKENIZER)
            as_read = as_llama_cpp_reads_it(folder, Path(tmp) / f"{kind}-mscale1")
            write_reference(HERE / f"{kind}.npz", prompt(VOCAB, seed=33, length=60),
                            logits=as_read, folder_logits=folder)
