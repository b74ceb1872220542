"""SentencePiece vocabularies as llama.cpp's converter writes them into GGUF
(tokenizer.ggml.model "llama"), for tests/test_gguf_tokenizer.py.

    python make.py /path/to/llama.cpp

For each vocabulary of VOCABS it trains a SentencePiece model with
oracles.spm_vocabs (the same training the other SentencePiece tests use),
keeps it here as <name>.model, lays out a tiny HF folder with that
tokenizer (tokenizer.model plus transformers' tokenizer.json and
tokenizer_config.json, and a config.json of the family's architecture) and
runs llama.cpp's convert_hf_to_gguf.py --vocab-only on it, giving
<name>.gguf: tokens, scores and token types, no tensors.

The .model files are kept beside the GGUF files, so that the tests compare
against exactly the vocabulary llama.cpp converted, whatever version of
sentencepiece the test machine trains with.
"""
import json
import shutil
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[2]
sys.path.insert(0, str(ROOT))

from oracles import spm_vocabs  # noqa: E402
from oracles.gguf_maker import CONVERTER, convert  # noqa: E402

# GGUF name -> (spm_vocabs.VOCABS name, converter flavor, HF architecture)
VOCABS = {
    "llama-bpe-bf": ("llama-bpe-bf", "llama", "LlamaForCausalLM"),
    "llama-bpe": ("llama-bpe", "llama", "LlamaForCausalLM"),
    "llama-unigram-bf": ("llama-unigram-bf", "llama", "LlamaForCausalLM"),
    "gemma-bpe-bf": ("gemma-bpe-bf", "gemma", "GemmaForCausalLM"),
}


def config(arch: str, vocab_size: int, specials: dict) -> dict:
    model_type = "gemma" if arch.startswith("Gemma") else "llama"
    cfg = {"architectures": [arch], "model_type": model_type, "vocab_size": vocab_size,
           "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 1,
           "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 32,
           "max_position_embeddings": 256, "rms_norm_eps": 1e-6, "rope_theta": 10000.0}
    cfg.update(specials)
    return cfg


def make(name: str, llama_cpp: Path, work: Path) -> None:
    vocab, flavor, arch = VOCABS[name]
    settings, _ = spm_vocabs.VOCABS[vocab]
    trained = spm_vocabs.train(out_dir=work, **settings)
    model = HERE / f"{name}.model"
    shutil.copy(trained, model)
    hf = spm_vocabs.hf_folder(model, work, flavor)
    folder = work / f"{name}-model"
    shutil.copytree(hf, folder)
    proto = spm_vocabs.model_proto(model)
    t = proto.trainer_spec
    specials = {f"{k}_token_id": i for k, i in (("bos", t.bos_id), ("eos", t.eos_id), ("pad", t.pad_id)) if i >= 0}
    (folder / "config.json").write_text(json.dumps(config(arch, len(proto.pieces), specials)))
    # A --vocab-only file still records a file type: that of the converter's default, "auto".
    convert(llama_cpp / CONVERTER, folder, HERE / f"{name}.gguf", outtype="auto", options=["--vocab-only"])


if __name__ == "__main__":
    llama_cpp = Path(sys.argv[1])
    with tempfile.TemporaryDirectory() as tmp:
        for n in VOCABS:
            make(n, llama_cpp, Path(tmp))
