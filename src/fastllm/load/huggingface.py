"""Models named by their Hugging Face repo id, fetched into the Hugging Face cache.

A name is ``org/name`` or ``org/name:FILE``, where FILE is a quantization
tag (``Q4_K_M``, any case), a GGUF file name or a glob (``*Q4_1.gguf``).
Without FILE a repo with config.json and .safetensors weights is a model
folder; else its one GGUF file, or the Q4_K_M one among several, as
llama.cpp's ``-hf`` picks.

Files come through ``huggingface_hub`` (the ``hub`` extra) into its cache
(HF_HUB_CACHE, else HF_HOME/hub), so a repo fetched once is reused, and
with HF_HUB_OFFLINE=1 (or when the Hub cannot be reached) only the cache is
read.
"""
from __future__ import annotations

import fnmatch
import os
import re
from pathlib import Path
from typing import Optional

from ..spec.errors import FastLLMError

__all__ = ["ModelNotFoundError", "fetch", "parse_repo_id", "pick_file", "repo_id_of"]

_INSTALL_HINT = "pip install 'fastllm-engine[hub]' (or: pip install huggingface_hub)"
# llama.cpp's -hf takes this quantization when a repo has several GGUF files
# and none is named.
DEFAULT_TAG = "Q4_K_M"

# org/name as the Hub spells repo ids, then an optional :FILE. An
# hf.co/ or huggingface.co/ in front (as ollama writes them) is allowed.
_REPO_ID = re.compile(r"^(?:(?:https?://)?(?:hf\.co|huggingface\.co)/)?"
                      r"(?P<repo>[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*)(?::(?P<file>[^:]+))?$")
_GLOB = re.compile(r"[*?\[]")


class ModelNotFoundError(FastLLMError, FileNotFoundError):
    """A named model is not a local folder or file and could not be had
    from the Hugging Face Hub; the message says why and what to do."""


def parse_repo_id(name: str) -> Optional[tuple]:
    """(repo id, FILE or None) when name reads as a Hub name, else None."""
    m = _REPO_ID.match(name)
    return (m["repo"], m["file"]) if m else None


def repo_id_of(path: Path) -> Optional[str]:
    """The repo id of a folder (or file in one) of the Hugging Face cache:
    .../models--org--name/snapshots/<commit>[/file]."""
    parts = Path(path).parts
    for i in range(len(parts) - 2):
        if parts[i].startswith("models--") and parts[i + 1] == "snapshots":
            return parts[i][len("models--"):].replace("--", "/", 1)
    return None


def _matches(files: list, pattern: str) -> list:
    """The GGUF files among files that pattern names: a glob or file name
    (case-insensitive, against the path in the repo or its last part), or
    else a quantization tag ending the file's name."""
    ggufs = [f for f in files if f.lower().endswith(".gguf")]
    if _GLOB.search(pattern) or pattern.lower().endswith(".gguf"):
        pat = pattern.lower()
        return [f for f in ggufs if fnmatch.fnmatchcase(f.lower(), pat)
                or fnmatch.fnmatchcase(f.rsplit("/", 1)[-1].lower(), pat)]
    tag = re.compile(rf"(^|[-._/]){re.escape(pattern)}\.gguf$", re.IGNORECASE)
    return [f for f in ggufs if tag.search(f)]


def _listing(files: list, limit: int = 12) -> str:
    shown = ", ".join(files[:limit])
    return shown + (f" and {len(files) - limit} more" if len(files) > limit else "")


def is_model_folder(files: list) -> bool:
    """Whether the files (paths in a repo or folder) make a model folder:
    config.json beside .safetensors weights."""
    top = [f for f in files if "/" not in f]
    return "config.json" in top and any(f.endswith(".safetensors") for f in top)


def pick_file(where: str, files: list, pattern: Optional[str], note: str = "") -> Optional[str]:
    """The GGUF file of files (paths in the repo or folder called where)
    that pattern names, or with no pattern None for a model folder, else
    the one GGUF file, else the Q4_K_M one. Anything else is an error that
    lists the choices (and ends with note)."""
    ggufs = sorted(f for f in files if f.lower().endswith(".gguf"))
    if pattern is None:
        if is_model_folder(files):
            return None
        if len(ggufs) == 1:
            return ggufs[0]
        if not ggufs:
            raise ModelNotFoundError(f"{where} has neither config.json with .safetensors weights nor a "
                                     f".gguf file (it has: {_listing(sorted(files)) or 'no files'}){note}")
        found = _matches(ggufs, DEFAULT_TAG)
        if len(found) == 1:
            return found[0]
        raise ModelNotFoundError(f"{where} has {len(ggufs)} GGUF files and none is {DEFAULT_TAG}; name one "
                                 f"as {where}:TAG (a quantization such as Q8_0) or {where}:FILE "
                                 f"(a file name or glob): {_listing(ggufs)}{note}")
    found = _matches(ggufs, pattern)
    if len(found) == 1:
        return found[0]
    if not found:
        raise ModelNotFoundError(f"no GGUF file of {where} matches {pattern!r} "
                                 f"(its GGUF files: {_listing(ggufs) or 'none'}){note}")
    raise ModelNotFoundError(f"{len(found)} GGUF files of {where} match {pattern!r}; name one: "
                             f"{_listing(found)}{note}")


def _hub_module():
    try:
        import huggingface_hub
        import huggingface_hub.constants
        import huggingface_hub.errors   # noqa: F401  (a submodule the package loads lazily)
    except ImportError:
        return None
    return huggingface_hub


def _truthy(value: Optional[str]) -> bool:
    return (value or "").strip().upper() in ("1", "ON", "YES", "TRUE")


def _cache_dir(hub) -> str:
    """HF_HUB_CACHE, else HF_HOME/hub, read now (huggingface_hub reads them
    once, when it is imported)."""
    if os.environ.get("HF_HUB_CACHE"):
        return os.path.expanduser(os.environ["HF_HUB_CACHE"])
    if os.environ.get("HF_HOME"):
        return os.path.join(os.path.expanduser(os.environ["HF_HOME"]), "hub")
    return hub.constants.HF_HUB_CACHE


# What a failed connection raises, by class name: which HTTP client
# huggingface_hub uses (requests before 1.0, httpx after) varies.
_NETWORK_ERRORS = ("ConnectionError", "Timeout", "TimeoutError", "TransportError", "gaierror",
                   "OfflineModeIsEnabled")


def _unreachable(e: BaseException) -> bool:
    return any(c.__name__ in _NETWORK_ERRORS for c in type(e).__mro__)


def _files_under(snapshot: Path) -> list:
    """The files of a snapshot folder (links to the repo's blobs); a link
    that leads out of the repo's folder in the cache is left out."""
    repo = Path(os.path.realpath(snapshot)).parents[1]
    return sorted(str(p.relative_to(snapshot).as_posix()) for p in snapshot.rglob("*")
                  if p.is_file() and repo in Path(os.path.realpath(p)).parents)


def _checked_snapshot(snapshot: Path, cache: str, repo_id: str) -> Path:
    """snapshot, once it is a folder of the repo's snapshots in cache: the
    commit a ref names is a folder name, and a ref edited to hold a path
    (/etc, ../..) must not make fastllm list or read files elsewhere."""
    snapshots = Path(os.path.realpath(cache)) / ("models--" + repo_id.replace("/", "--")) / "snapshots"
    if Path(os.path.realpath(snapshot)).parent != snapshots:
        raise ModelNotFoundError(f"the Hugging Face cache is damaged: {snapshots.parent / 'refs'} names "
                                 f"{snapshot} as {repo_id}'s snapshot, which is not a folder of {snapshots} "
                                 f"(refs/main should hold a commit hash); remove {snapshots.parent} and "
                                 f"download it again")
    return snapshot


def fetch(name: str, repo_id: str, pattern: Optional[str]) -> Path:
    """The local path of repo_id's model: its snapshot folder, or the GGUF
    file pattern names (see pick_file), downloaded unless cached or offline.
    name is what the user wrote, for the messages."""
    hub = _hub_module()
    if hub is None:
        raise ModelNotFoundError(f"{name} is not a local folder or file; as a Hugging Face repo id it needs "
                                 f"huggingface_hub: {_INSTALL_HINT}")
    errors = hub.errors
    cache = _cache_dir(hub)
    offline = _truthy(os.environ.get("HF_HUB_OFFLINE")) or bool(hub.constants.HF_HUB_OFFLINE)
    why_cached = "HF_HUB_OFFLINE is set" if offline else None
    try:
        if not offline:
            try:
                files = [s.rfilename for s in hub.HfApi().model_info(repo_id).siblings or ()]
            except Exception as e:   # an HTTP error answer is handled below
                if not _unreachable(e):
                    raise
                why_cached = f"the Hugging Face Hub cannot be reached ({e})"
            else:
                chosen = pick_file(repo_id, files, pattern)
                if chosen is not None:
                    return Path(hub.hf_hub_download(repo_id, chosen, cache_dir=cache))
                wanted = [f for f in files if "/" not in f and f.endswith((".json", ".safetensors"))]
                return Path(hub.snapshot_download(repo_id, allow_patterns=wanted, cache_dir=cache))
        try:
            snapshot = Path(hub.snapshot_download(repo_id, cache_dir=cache, local_files_only=True))
        except (FileNotFoundError, errors.LocalEntryNotFoundError):
            raise ModelNotFoundError(
                f"{name} is not a local folder or file, and {repo_id} is not in the Hugging Face cache "
                f"({cache}); {why_cached}, so nothing was downloaded. Download it with network access "
                f"(hf download {repo_id}), or point HF_HUB_CACHE at a cache that has it.") from None
        snapshot = _checked_snapshot(snapshot, cache, repo_id)
        chosen = pick_file(repo_id, _files_under(snapshot), pattern,
                           f" (only the files in the Hugging Face cache were looked at: {why_cached})")
        return snapshot if chosen is None else snapshot / chosen
    except errors.GatedRepoError:
        raise ModelNotFoundError(f"{repo_id} is gated: accept its terms on huggingface.co/{repo_id} and "
                                 f"log in (hf auth login)") from None
    except errors.RepositoryNotFoundError:
        raise ModelNotFoundError(f"{name} is not a local folder or file, nor a model on the Hugging Face "
                                 f"Hub; if it is private or gated, accept its terms on huggingface.co and "
                                 f"log in (hf auth login)") from None
    except errors.HfHubHTTPError as e:
        raise ModelNotFoundError(f"the Hugging Face Hub could not give {repo_id}: {e}") from None
    except Exception as e:
        if not _unreachable(e) and not isinstance(e, errors.LocalEntryNotFoundError):
            raise
        raise ModelNotFoundError(f"downloading {repo_id} from the Hugging Face Hub failed: {e}") from None
