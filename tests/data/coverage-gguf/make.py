"""GGUF files of tiny SmolLM3, Granite, OLMo 2, Seed-OSS and InternLM3
checkpoints, as llama.cpp's converter writes them, for tests/test_conformance.py.

    python make.py /path/to/llama.cpp/convert_hf_to_gguf.py [KIND ...]

For each of oracles/tiny_models.py's shapes "smollm3", "granite", "olmo2",
"seed_oss" and "internlm3" (or the KINDs named): makes the checkpoint, gives
it a tiny byte-level BPE tokenizer (oracles/bpe_gguf_vocabs.py's; InternLM3,
whose converter reads only SentencePiece, the llama-bpe vocabulary of
../spm-gguf, cut by the converter to the model's 300 ids), converts it to
<kind>.gguf (F32) and
writes <kind>.npz, transformers' float64 logits on the folder for a fixed
prompt (ids, logits), which the test holds fastllm's results against.

The converter recognises a BPE tokenizer by hashing how it splits a test
text; a tokenizer trained here is in none of its lists, so its detection is
replaced by the answer "gpt-2" (the GPT-2 pre-tokenizer this tokenizer
uses). Nothing else of the converter is changed.
"""
import json
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[2]
sys.path.insert(0, str(ROOT))

from oracles.bpe_gguf_vocabs import trained_family_tokenizer  # noqa: E402
from oracles.gguf_maker import add_spm_tokenizer, convert, prompt, write_reference  # noqa: E402
from oracles.tiny_models import SHAPES, make_tiny_model  # noqa: E402

KINDS = ["smollm3", "granite", "olmo2", "seed_oss", "internlm3"]
# Kinds whose converter reads a SentencePiece tokenizer.model: the one they get.
SENTENCEPIECE = {"internlm3": HERE.parent / "spm-gguf" / "llama-bpe.model"}


def tokenizer(folder: Path, vocab: int) -> None:
    """A byte-level BPE under GPT-2's pre-tokenizer; its specials <|endoftext|>,
    <s> and </s> are ids 0, 1 and 2: the shapes' pad, bos and eos."""
    trained_family_tokenizer("gpt-2", vocab).save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>", "eos_token": "</s>",
        "pad_token": "<|endoftext|>"}))


if __name__ == "__main__":
    converter = Path(sys.argv[1])
    with tempfile.TemporaryDirectory() as tmp:
        for kind in sys.argv[2:] or KINDS:
            folder = make_tiny_model(kind, Path(tmp) / kind)
            vocab = SHAPES[kind]["vocab_size"]
            if kind in SENTENCEPIECE:
                add_spm_tokenizer(folder, SENTENCEPIECE[kind], Path(tmp) / "spm", "llama")
                convert(converter, folder, HERE / f"{kind}.gguf")
            else:
                tokenizer(folder, vocab - 20)
                convert(converter, folder, HERE / f"{kind}.gguf", pre="gpt-2")
            write_reference(HERE / f"{kind}.npz", prompt(vocab), logits=folder)
