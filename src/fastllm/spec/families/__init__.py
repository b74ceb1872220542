"""The model families fastllm runs, one module each (or one per group of
near-identical ones): its Family rows of switches and whatever reading of
config.json or llama.cpp metadata is its own. A module here is found by
itself; a Llama-like family is one new module (and its tests).

No other module compares model_type strings.
"""
from __future__ import annotations

import importlib
import pkgutil

from ..errors import ModelFileError
from ..family import Family

# model_types fastllm knows and refuses: why.
REFUSED = {
    "qwen2_moe": "Qwen2-MoE (mixture of experts with a shared expert per layer) is not supported",
    "gpt_oss": "gpt-oss is not supported (its MXFP4 experts and attention sinks are not implemented)",
    "deepseek_v2": "DeepSeek-V2 is not supported (multi-head latent attention is not implemented)",
    "deepseek_v3": "DeepSeek-V3 is not supported (multi-head latent attention is not implemented)",
    "kimi_k2": "Kimi K2 is not supported (DeepSeek's multi-head latent attention is not implemented)",
}
# Architectures llama.cpp writes that fastllm knows and refuses: why.
GGUF_REFUSED = {"gpt-oss": REFUSED["gpt_oss"], "deepseek2": REFUSED["deepseek_v3"],
                "qwen2moe": REFUSED["qwen2_moe"]}


def _collect() -> dict:
    """Every module's FAMILIES, in the modules' alphabetical order."""
    found = {}
    for info in sorted(pkgutil.iter_modules(__path__), key=lambda m: m.name):
        rows = importlib.import_module(f"{__name__}.{info.name}").FAMILIES
        for name, row in rows.items():
            if not isinstance(row, Family) or name in found:
                raise RuntimeError(f"families/{info.name}.py: {name!r} is not a Family, or is in two modules")
            found[name] = row
    return found


FAMILIES = _collect()
# llama.cpp's architecture name -> the model_type it is imported as.
GGUF_ARCHITECTURES = {(name if f.gguf is True else f.gguf): name for name, f in FAMILIES.items() if f.gguf}


def family(model_type, path=None) -> Family:
    """The family of a model_type, or a ModelFileError naming the file."""
    if isinstance(model_type, str) and model_type in REFUSED:
        raise ModelFileError(path, f"model_type {model_type!r}: {REFUSED[model_type]}")
    if not isinstance(model_type, str) or model_type not in FAMILIES:
        raise ModelFileError(path, f"model_type {model_type!r} is not supported "
                                   f"(supported: {', '.join(FAMILIES)})")
    return FAMILIES[model_type]
