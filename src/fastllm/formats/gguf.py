"""Import a llama.cpp GGUF file as a HuggingFace model folder.

The folder holds config.json, generation_config.json, model.safetensors,
tokenizer.json and tokenizer_config.json, laid out so that both fastllm and
transformers load it without network access.

Only numpy, the standard library and the ``gguf`` package (for its
quantization tables and dequantizers) are used here, so importing a model
never needs torch or transformers. The work is split by concern:
gguf_file reads the container, with every size checked against the file;
gguf_config maps each architecture's hyperparameters to config.json;
gguf_tokenizer rebuilds tokenizer.json; gguf_tensors plans and dequantizes
the tensors. This module reads a file's header once into a GgufModel (what
running the file's own tensors starts from) and writes the folder,
atomically.
"""
from __future__ import annotations

import json
import os
import re
import secrets
import shutil
import socket
import struct
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional, Union

import numpy as np

from ..spec.config import ModelConfig
from ..spec.errors import FastLLMError, ModelFileError
from ..spec.families import GGUF_ARCHITECTURES, GGUF_REFUSED
from .gguf_config import check_metadata_types, generation_config, model_config
from .gguf_file import ConversionError
from .gguf_tensors import (dequantize, expert_tensors_to_write, hf_entries_of, plan_tensors, read_contents,
                           slices_to_write, tensor_shapes, with_strings)
from .gguf_tokenizer import SUPPORTED_PRE_TOKENIZERS, check_vocabulary_size, tokenizer_files

__all__ = [
    "ConversionError",
    "OutputExistsError",
    "SUPPORTED_ARCHITECTURES",
    "SUPPORTED_PRE_TOKENIZERS",
    "MODEL_FILES",
    "convert_gguf",
    "is_complete_model_dir",
]

PathLike = Union[str, "os.PathLike[str]"]
ProgressFn = Callable[[int, int], None]

# Files a converted folder always has; a folder missing any of them is not
# a finished conversion.
MODEL_FILES = (
    "config.json",
    "generation_config.json",
    "model.safetensors",
    "tokenizer.json",
    "tokenizer_config.json",
)
# convert_gguf's dtype for a folder of the tokenizer files alone: what a
# GGUF file run at its own precision keeps beside it, since rebuilding
# tokenizer.json from the metadata is the slow part of reading the file.
TOKENIZER_ONLY = "tokenizer"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


def folder_files(dtype: str) -> tuple:
    """The files a conversion to dtype writes."""
    return TOKENIZER_FILES if dtype == TOKENIZER_ONLY else MODEL_FILES


SUPPORTED_ARCHITECTURES = GGUF_ARCHITECTURES


class OutputExistsError(FastLLMError, FileExistsError):
    """The output folder of a conversion already exists."""


class _SafetensorsWriter:
    """Write a safetensors file one tensor at a time.

    The header needs every offset up front, and every shape is known from the
    GGUF tensor table before anything is dequantized, so a tensor is written
    slice by slice as it is dequantized, and no whole tensor is held.
    """

    _DTYPES = {"F32": 4, "BF16": 2, "F16": 2}

    def __init__(self, path: Path, entries: list, metadata: Optional[dict] = None):
        header = {}
        if metadata:
            header["__metadata__"] = {str(k): str(v) for k, v in metadata.items()}
        offset = 0
        self._expected = []
        for name, dtype, shape in entries:
            nbytes = int(np.prod(shape, dtype=np.int64)) * self._DTYPES[dtype]
            header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
            self._expected.append((name, nbytes))
            offset += nbytes
        raw = json.dumps(header, separators=(",", ":")).encode("utf-8")
        raw += b" " * (-len(raw) % 8)
        self._f = open(path, "wb")
        self._f.write(struct.pack("<Q", len(raw)))
        self._f.write(raw)
        self._next = 0

    def write(self, name: str, parts) -> None:
        """The next tensor, given as its consecutive slices (arrays)."""
        want_name, want_bytes = self._expected[self._next]
        written = 0
        for data in parts:
            # safetensors is little-endian whatever the host is.
            data = np.ascontiguousarray(data, dtype=data.dtype.newbyteorder("<"))
            self._f.write(memoryview(data).cast("B"))
            written += data.nbytes
        if name != want_name or written != want_bytes:
            raise AssertionError(f"safetensors writer: got {name} ({written} B), "
                                 f"expected {want_name} ({want_bytes} B)")
        self._next += 1

    def close(self) -> None:
        if self._next != len(self._expected):
            raise AssertionError("safetensors writer closed before all tensors were written")
        self._f.flush()
        os.fsync(self._f.fileno())
        self._f.close()

    def abort(self) -> None:
        self._f.close()


# --------------------------------------------------------------------------
# Progress


class _StderrBar:
    def __init__(self, label: str):
        self.label = label
        self.last = 0.0

    def __call__(self, done: int, total: int) -> None:
        now = time.monotonic()
        if done < total and now - self.last < 0.1:
            return
        self.last = now
        width = 30
        filled = width * done // max(total, 1)
        sys.stderr.write(f"\r{self.label} [{'#' * filled}{'.' * (width - filled)}] {done}/{total} tensors")
        if done >= total:
            sys.stderr.write("\n")
        sys.stderr.flush()


def progress_fn(progress, label: str) -> Optional[ProgressFn]:
    if callable(progress):
        return progress
    if progress is None:
        try:
            progress = sys.stderr is not None and sys.stderr.isatty()
        except (AttributeError, ValueError):
            progress = False
    return _StderrBar(label) if progress else None


# --------------------------------------------------------------------------
# Atomic output folder


def _pid_alive(pid: int) -> bool:
    if os.name != "posix":
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _host_tag() -> str:
    return re.sub(r"[^A-Za-z0-9]", "", socket.gethostname())[:32] or "host"


def _remove_stale_partials(out_dir: Path) -> None:
    # A conversion killed outright (SIGKILL, power loss) cannot clean up
    # after itself; the next one removes what it left, but only where its
    # process is known to be gone.
    prefix = f".{out_dir.name}.partial-"
    host = _host_tag()
    try:
        siblings = list(out_dir.parent.iterdir())
    except OSError:
        return
    for p in siblings:
        if not p.name.startswith(prefix):
            continue
        parts = p.name[len(prefix):].split("-")
        if len(parts) != 3 or parts[0] != host or not parts[1].isdigit():
            continue
        if not _pid_alive(int(parts[1])):
            shutil.rmtree(p, ignore_errors=True)


def _make_partial_dir(out_dir: Path) -> Path:
    while True:
        tmp = out_dir.parent / f".{out_dir.name}.partial-{_host_tag()}-{os.getpid()}-{secrets.token_hex(4)}"
        try:
            os.mkdir(tmp)
            return tmp
        except FileExistsError:
            continue


def _is_empty_dir(p: Path) -> bool:
    try:
        return p.is_dir() and not any(p.iterdir())
    except OSError:
        return False


def _publish(tmp: Path, out_dir: Path, overwrite: bool) -> None:
    """Move the finished folder into place in one rename."""
    if _is_empty_dir(out_dir):
        try:
            os.rmdir(out_dir)
        except OSError:
            pass
    try:
        os.rename(tmp, out_dir)
        return
    except OSError:
        if not out_dir.exists():
            raise
    if not overwrite:
        raise OutputExistsError(f"{out_dir} already exists (pass overwrite=True to replace it)")
    old = out_dir.parent / f".{out_dir.name}.old-{os.getpid()}-{secrets.token_hex(4)}"
    os.rename(out_dir, old)
    try:
        os.rename(tmp, out_dir)
    except BaseException:
        os.rename(old, out_dir)
        raise
    if old.is_dir() and not old.is_symlink():
        shutil.rmtree(old, ignore_errors=True)
    else:
        old.unlink()


def is_complete_model_dir(path: PathLike, dtype: str = "f32") -> bool:
    """Whether path holds every file a conversion to dtype writes."""
    p = Path(path)
    try:
        return all((p / f).is_file() for f in folder_files(dtype)) and (
            dtype == TOKENIZER_ONLY or (p / "model.safetensors").stat().st_size > 8)
    except OSError:
        return False


def _write_json(path: Path, obj) -> None:
    with open(path, "w", encoding="utf-8") as f:
        json.dump(obj, f, indent=2, ensure_ascii=False)
        f.write("\n")
        f.flush()
        os.fsync(f.fileno())


# --------------------------------------------------------------------------
# Reading a file

# The one default precision of converted folders: `fastllm convert`, the
# default model and GGUF files converted on first use all write float32,
# the dequantized values exactly, so results match a float32 reference.
DEFAULT_DTYPE = "f32"


@dataclass(frozen=True)
class GgufModel:
    """A GGUF file's header, read and checked once: its tensor table and
    metadata (string arrays decoded only when asked for), the model's config
    built from them, and its generation settings. Loading the file's own
    tensors, and converting it, both start from here."""
    path: Path
    contents: object        # gguf_file.GGUFContents
    config_dict: dict       # as config.json would hold it
    config: ModelConfig
    generation_config: dict

    @property
    def metadata(self) -> dict:
        return self.contents.metadata

    @property
    def tensors(self) -> dict:
        """The tensors by name, the rope factors and frequencies (read into
        the config) left out."""
        return {t.name: t for t in self.contents.tensors if t.name not in _CONFIG_TENSORS}

    @property
    def shapes(self) -> dict:
        return tensor_shapes(self.contents.tensors)


# Tensors whose values the config holds: rope frequencies (llama 3's
# scaling) and LongRoPE's factors (Phi-3).
_CONFIG_TENSORS = ("rope_freqs.weight", "rope_factors_long.weight", "rope_factors_short.weight")


def read_gguf_model(gguf_path: PathLike, string_arrays: bool = False, dtype: str = DEFAULT_DTYPE) -> GgufModel:
    """Read and check a GGUF file's header and build its model's config.

    string_arrays: decode the vocabulary and merges too (only the tokenizer
    needs them); their counts are checked against the embedding first, so
    a file claiming 16 million tokens is refused before gigabytes of
    strings are made. dtype: the torch_dtype the config names."""
    path = Path(gguf_path).expanduser()
    contents = read_contents(path, string_arrays=False)
    check_vocabulary_size(contents, path)
    if string_arrays:
        contents = with_strings(path, contents)
    md = contents.metadata
    check_metadata_types(md, path)
    arch = md.get("general.architecture")
    if isinstance(arch, str) and arch in GGUF_REFUSED:
        raise ConversionError(path, f"architecture {arch!r}: {GGUF_REFUSED[arch]}")
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ConversionError(
            path, f"architecture {arch!r} is not supported (supported: {', '.join(SUPPORTED_ARCHITECTURES)})")
    if int(md.get("split.count", 1)) > 1:
        raise ConversionError(path, "split GGUF files are not supported; merge the parts first "
                              "(llama-gguf-split --merge)")
    tensors = {t.name: t for t in contents.tensors}
    rope_freqs = tensors.get("rope_freqs.weight")
    rope_factors = {kind: dequantize(tensors[f"rope_factors_{kind}.weight"], path)
                    for kind in ("long", "short") if f"rope_factors_{kind}.weight" in tensors}
    config = model_config(md, tensor_shapes(contents.tensors), path, dtype,
                          None if rope_freqs is None else dequantize(rope_freqs, path), rope_factors)
    # As config.json holds it (lists, plain numbers): the config a folder
    # converted from this file would give, to the bit.
    config = json.loads(json.dumps(config))
    try:
        cfg = ModelConfig.from_dict(config, path)
    except ModelFileError as e:
        raise ConversionError(path, e.problem) from None
    return GgufModel(path, contents, config, cfg, generation_config(md))


# --------------------------------------------------------------------------
# Entry point

def convert_gguf(gguf_path: PathLike, out_dir: PathLike, dtype: str = DEFAULT_DTYPE,
                 progress: Union[None, bool, ProgressFn] = None, *, overwrite: bool = False,
                 extra_files: Optional[dict] = None, model: Optional[GgufModel] = None) -> Path:
    """Convert a GGUF file into a HuggingFace model folder at out_dir.

    dtype: "f32" (the exact dequantized values; the default, as for the
    default model and for GGUF files converted on first use) or "bf16"
    (weights rounded to bfloat16 as torch rounds: half the size), or
    TOKENIZER_ONLY: tokenizer.json and tokenizer_config.json alone, kept
    beside a GGUF file run at its own precision.
    progress: a callable progress(done, total) called after each tensor,
    True/False to force the stderr progress bar on/off, or None for a bar
    only when stderr is a terminal.
    overwrite: replace an existing out_dir; otherwise OutputExistsError
    (a FileExistsError).
    extra_files: {file name: JSON-serialisable object} written into the
    folder as well, before it becomes visible and after everything else; a
    callable value is called with the finished folder and its result
    written (to record, say, the sizes of the files written).
    model: the file's header as read_gguf_model already read it, so that it
    is not checked and built again (only its strings are read then).

    The folder is built beside out_dir under a hidden name and renamed into
    place at the end, so out_dir either appears complete or not at all.
    """
    if dtype not in ("bf16", "f32", TOKENIZER_ONLY):
        raise ValueError(f"dtype must be 'bf16' or 'f32', not {dtype!r}")
    path = Path(gguf_path).expanduser()
    out_dir = Path(out_dir).expanduser().absolute()
    if out_dir.exists() and not overwrite and not _is_empty_dir(out_dir):
        raise OutputExistsError(f"{out_dir} already exists (pass overwrite=True to replace it)")

    if model is None:
        model = read_gguf_model(path, string_arrays=True, dtype=dtype)
        md = model.metadata
    else:   # its vocabulary's size was checked when it was read
        md = with_strings(path, model.contents).metadata
        check_metadata_types(md, path)
    config, cfg = model.config_dict, model.config
    order = []
    if dtype != TOKENIZER_ONLY:
        arch = md["general.architecture"]
        order = plan_tensors(model.tensors, model.shapes, cfg, path,
                             n_mtp=int(md.get(f"{arch}.nextn_predict_layers", 0)))
    tokenizer_json, tokenizer_config = tokenizer_files(md, path)
    if len(tokenizer_json["model"]["vocab"]) > config["vocab_size"]:
        raise ConversionError(path, f"{len(tokenizer_json['model']['vocab'])} tokens but only "
                              f"{config['vocab_size']} embedding rows")

    n_heads, n_kv = config["num_attention_heads"], config["num_key_value_heads"]
    st_dtype = "BF16" if dtype == "bf16" else "F32"
    entries = [(name, st_dtype, shape) for hf, _, t, lc in order for name, shape in hf_entries_of(hf, t, lc)]
    report = progress_fn(progress, f"Converting {path.name}")

    out_dir.parent.mkdir(parents=True, exist_ok=True)
    _remove_stale_partials(out_dir)
    tmp = _make_partial_dir(out_dir)
    writer = None
    try:
        if dtype != TOKENIZER_ONLY:
            _write_json(tmp / "config.json", config)
            _write_json(tmp / "generation_config.json", model.generation_config)
        _write_json(tmp / "tokenizer_config.json", tokenizer_config)
        with open(tmp / "tokenizer.json", "w", encoding="utf-8") as f:
            # dumps, not dump: only a whole-string encoding runs json's C
            # encoder, 5-10 times faster on a vocabulary of 150k-260k tokens.
            f.write(json.dumps(tokenizer_json, ensure_ascii=False, separators=(",", ":")))
            f.flush()
            os.fsync(f.fileno())

        if order:
            writer = _SafetensorsWriter(tmp / "model.safetensors", entries,
                                        {"format": "pt", "source": path.name})
        total = len(order)
        if report:
            report(0, total)
        heads = {"q": n_heads, "k": n_kv} if cfg.family.gguf_qk_interleaved else {}
        for i, (hf, g, t, lc) in enumerate(order):
            if t.experts:
                for name, values in expert_tensors_to_write(g, path, dtype, hf, t, lc):
                    writer.write(name, [values])
            else:
                writer.write(hf, slices_to_write(g, path, heads.get(t.rope), dtype, t, lc))
            if report:
                report(i + 1, total)
        if writer is not None:
            writer.close()
            writer = None
        for name, obj in (extra_files or {}).items():
            _write_json(tmp / name, obj(tmp) if callable(obj) else obj)
        _publish(tmp, out_dir, overwrite)
    except BaseException:
        if writer is not None:
            writer.abort()
        shutil.rmtree(tmp, ignore_errors=True)
        if isinstance(report, _StderrBar):
            sys.stderr.write("\n")
        raise
    return out_dir
