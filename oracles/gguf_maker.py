"""What the makers of llama.cpp-made files share: tests/data/*/make.py
(CI has no llama.cpp: they are run by hand) and benchmarks/*_gguf.py.

A tiny random checkpoint goes into an HF folder, llama.cpp's
convert_hf_to_gguf.py converts it (in this process, so that its
pre-tokenizer detection can be given an answer), llama-quantize may
quantize the result, and transformers' float64 logits on the folder may be
kept beside it for the tests to hold fastllm's against.
"""
from __future__ import annotations

import json
import os
import runpy
import shutil
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

import numpy as np

# Where a llama.cpp source tree, built, keeps the two tools.
CONVERTER = "convert_hf_to_gguf.py"
QUANTIZE = "build/bin/llama-quantize"


def tiny_checkpoint(name: str, spec: dict, folder: Path, **options) -> Path:
    """oracles/tiny_models.py's checkpoint of spec (options: make_tiny_model's),
    which makes only the shapes registered in its SHAPES."""
    from oracles import tiny_models
    tiny_models.SHAPES[name] = spec
    return tiny_models.make_tiny_model(name, folder, **options)


def add_spm_tokenizer(folder: Path, model: Path, work: Path, flavor: str) -> None:
    """The SentencePiece model's tokenizer files (tokenizer.model and what
    transformers makes of it as flavor) copied into the checkpoint folder."""
    from oracles import spm_vocabs
    for path in spm_vocabs.hf_folder(model, work, flavor).iterdir():
        shutil.copy(path, folder / path.name)


def update_tokenizer_config(folder: Path, **values) -> None:
    path = folder / "tokenizer_config.json"
    config = dict(json.loads(path.read_text()), **values)
    path.write_text(json.dumps(config, indent=2, ensure_ascii=False))


def convert(converter: Path, folder: Path, out: Path, outtype: str = "f32", pre: str | None = None,
            options: Sequence[str] = ()) -> None:
    """convert_hf_to_gguf.py FOLDER --outtype OUTTYPE --outfile OUT [OPTIONS].

    pre: the answer the converter's BPE pre-tokenizer detection gives. It
    names a tokenizer by hashing how it splits a probe text, and a tiny or
    cut vocabulary splits it otherwise than any it knows; nothing else of
    the converter is changed.

    Each call imports the converter's package afresh and forgets it after:
    its model classes keep a run's options (--no-mtp) and the answer as
    class attributes, which would carry into the next call."""
    converter = _existing(Path(converter).resolve(), "llama.cpp's convert_hf_to_gguf.py")
    _import_from(converter.parent)
    argv = sys.argv
    sys.argv = [str(converter), str(folder), "--outtype", outtype, "--outfile", str(out), *options]
    try:
        if pre:
            from conversion import base
            base.TextModel.get_vocab_base_pre = lambda self, tokenizer: pre
        runpy.run_path(str(converter), run_name="__main__")
    finally:
        sys.argv = argv
        for name in [n for n in sys.modules if n == "conversion" or n.startswith("conversion.")]:
            del sys.modules[name]


def quantize(quantize_bin: Path, src: Path, dst: Path, qtype: str, pure: bool = False) -> None:
    """llama-quantize SRC DST QTYPE on one thread; pure: every tensor in
    QTYPE, none kept at a higher precision as its mixes keep some."""
    binary = _existing(Path(quantize_bin), "llama-quantize (in a llama.cpp build's bin/)")
    subprocess.run([str(binary), *(["--pure"] if pure else []), str(src), str(dst), qtype, "1"], check=True,
                   env=dict(os.environ, LD_LIBRARY_PATH=str(binary.parent)))


def prompt(vocab: int, seed: int = 24, length: int = 40) -> list:
    return np.random.default_rng(seed).integers(0, vocab, length).tolist()


def write_reference(path: Path, ids: list, **folders: Path) -> None:
    """path.npz: the ids and, per keyword, transformers' float64 logits on
    that folder, stored as float32."""
    from oracles.hf_reference import hf_logits, load_hf
    logits = {key: hf_logits(load_hf(folder), ids).astype(np.float32) for key, folder in folders.items()}
    np.savez(path, ids=np.array(ids, np.int32), **logits)


def _existing(path: Path, what: str) -> Path:
    if not path.is_file():
        raise FileNotFoundError(f"no {what} at {path}")
    return path


def _import_from(llama_cpp: Path) -> None:
    """The converter's conversion package and gguf-py first on the path: it
    writes with whatever gguf is imported, and an installed one may be of
    another version than the converter's."""
    gguf_py = llama_cpp / "gguf-py"
    for entry in (gguf_py, llama_cpp):
        if str(entry) not in sys.path:
            sys.path.insert(0, str(entry))
    loaded = sys.modules.get("gguf")
    if loaded is not None and gguf_py not in Path(loaded.__file__).resolve().parents:
        raise RuntimeError(f"gguf was imported from {loaded.__file__} before the converter could take "
                           f"its own; put {gguf_py} first on PYTHONPATH")
