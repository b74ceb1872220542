"""A GGUF file's tensors: the plan that maps them onto the schema's HF
names for a config, and their values as float32, read and dequantized
slice by slice so that no whole tensor need be held.
"""
from __future__ import annotations

import math
from pathlib import Path
from typing import Optional

import numpy as np
import warnings

from ..spec import schema
from ..spec.config import ModelConfig
from ..spec.files import open_regular
from .gguf_file import (ConversionError, GGUFContents, GGUFError, GGUFTensor, read_gguf, read_string_arrays,
                        read_tensor_bytes)
from .safetensors import f32_to_bf16


def _gguf_module():
    try:
        import gguf  # noqa: F401
    except ImportError as exc:  # pragma: no cover - gguf is a dependency
        raise ImportError(
            "Importing GGUF files needs the 'gguf' package: pip install gguf"
        ) from exc
    return gguf


def read_contents(path: Path, string_arrays: bool = True) -> GGUFContents:
    if not path.exists():
        raise FileNotFoundError(f"GGUF file not found: {path}")
    try:
        return read_gguf(path, _gguf_module(), string_arrays)
    except GGUFError as e:
        raise ConversionError(path, e.problem) from None


def with_strings(path: Path, contents: GGUFContents) -> GGUFContents:
    """contents (read without string arrays) with its vocabulary and merges
    decoded, from where the header's one walk found them."""
    try:
        return read_string_arrays(path, contents)
    except GGUFError as e:
        raise ConversionError(path, e.problem) from None

def tensor_shapes(tensors) -> dict:
    return {t.name: t.shape for t in tensors}

def unpermute(w: np.ndarray, n_heads: int) -> np.ndarray:
    # llama.cpp's converter interleaves the two rotary halves of every head
    # (rows [x0..x(d/2-1), y0..] become [x0, y0, x1, y1, ...]) to suit its
    # own RoPE; this puts them back in HF's half-split order.
    half = w.shape[0] // n_heads // 2
    return w.reshape(n_heads, half, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


# Values converted at a time (1 MB of float32): a big tensor (a 49152 x 576
# embedding) is read, dequantized, converted and written in slices, so
# converting holds neither a whole tensor nor its dequantizer's temporaries.
_SLICE_VALUES = 1 << 18


def _decode(raw: np.ndarray, tensor: GGUFTensor, shape: tuple, path: Path) -> np.ndarray:
    """raw, the bytes of whole rows of tensor, as float32 of shape."""
    gguf = _gguf_module()
    qt = gguf.GGMLQuantizationType
    ttype = tensor.tensor_type
    if ttype == qt.F64:
        out = raw.view("<f8").astype(np.float32)
    else:
        # The dequantizers take whole rows of blocks, as bytes.
        rows = raw.reshape(gguf.quants.quant_shape_to_byte_shape(shape or (1,), ttype))
        try:
            out = gguf.quants.dequantize(rows, ttype)
        except NotImplementedError as exc:
            raise ConversionError(
                path, f"tensor {tensor.name} uses {getattr(ttype, 'name', ttype)}, which gguf "
                f"{getattr(gguf, '__version__', '')} cannot dequantize: {exc}") from exc
    return np.ascontiguousarray(out, dtype=np.float32).reshape(shape)


def slices(shape: tuple, step: int = 1) -> list:
    """(start, stop) of the slices along the first axis of shape that a
    tensor is converted in: about _SLICE_VALUES values each, and a whole
    multiple of step entries."""
    count = max(step, _SLICE_VALUES // max(1, math.prod(shape[1:])) // step * step)
    return [(start, min(start + count, shape[0])) for start in range(0, shape[0], count)]


def dequantized_slices(tensor: GGUFTensor, path: Path, step: int = 1):
    """The tensor as float32, in slices along its first axis of a whole
    multiple of step entries each (the rows of a head, say, so that each
    slice can be unpermuted alone); a vector comes whole."""
    qt = _gguf_module().GGMLQuantizationType
    ttype, shape = tensor.tensor_type, tensor.shape
    if ttype in (qt.I8, qt.I16, qt.I32, qt.I64):
        raise ConversionError(path, f"tensor {tensor.name} has integer type {ttype.name}, not a weight")
    if 0 in shape:
        yield np.zeros(shape, np.float32)
        return
    if len(shape) < 2:
        yield _decode(read_tensor_bytes(path, tensor), tensor, shape, path)
        return
    # Every index of the first axis holds whole rows, so whole blocks.
    per_index = tensor.n_bytes // shape[0]
    with open_regular(path, "GGUF file") as f:
        for start, stop in slices(shape, step):
            n = stop - start
            raw = np.empty(n * per_index, np.uint8)
            f.seek(tensor.offset + start * per_index)
            if f.readinto(memoryview(raw)) != raw.nbytes:
                raise GGUFError(path, f"tensor {tensor.name!r}: the file ends before the tensor does; "
                                      f"it was truncated after it was opened")
            yield _decode(raw, tensor, (n, *shape[1:]), path)


def dequantize(tensor: GGUFTensor, path: Path) -> np.ndarray:
    """The whole tensor as float32."""
    slices = dequantized_slices(tensor, path)
    if len(tensor.shape) < 2 or 0 in tensor.shape:
        return next(slices)
    out = np.empty(tensor.shape, np.float32)
    start = 0
    for part in slices:
        out[start:start + len(part)] = part
        start += len(part)
    return out


def v_head_index(t: schema.Tensor, cfg: ModelConfig) -> Optional[np.ndarray]:
    """Where each of HF's rows (or columns, as t.v_heads says) of a Gated
    DeltaNet tensor sits in llama.cpp's, where the two orders differ.

    HF groups the value heads by the key head they share (k0's, then k1's);
    llama.cpp's converter tiles them (the first of every key head's, then
    the second ...) to suit its broadcasting. So HF's = GGUF's[index], and
    GGUF's = HF's[argsort(index)]."""
    hk, hv = cfg.linear_num_key_heads, cfg.linear_num_value_heads
    if t.v_heads is None or hk in (0, hv):
        return None
    per_key = hv // hk
    head = np.arange(hv)
    tiled = (head % per_key) * hk + head // per_key
    n = t.shape(cfg)[1 if t.v_heads == "columns" else 0]
    unit = 1 if n == hv else cfg.linear_value_head_dim
    index = (tiled[:, None] * unit + np.arange(unit)).reshape(-1)
    if t.v_heads == "rows after q, k":
        qk = 2 * hk * cfg.linear_key_head_dim
        index = np.concatenate([np.arange(qk), qk + index])
    return index


def check_decay(arr: np.ndarray, t: schema.Tensor, name: str, path: Path) -> None:
    """ssm_a holds -exp(A_log): a value that is not negative would make the
    recurrence grow without bound (and has no A_log)."""
    if t.field == "lin_A" and not (np.asarray(arr) < 0).all():
        raise ConversionError(path, f"tensor {name} holds values that are not negative; it should "
                                    f"hold -exp(A_log)")


def to_hf_values(arr: np.ndarray, t: schema.Tensor, cfg: ModelConfig) -> np.ndarray:
    """A float32 tensor as llama.cpp's converter stored it -> as HF stores it:
    value heads in HF's order, A_log back from -exp(A_log), zero-centred
    norms back from (1 + w), the conv kernel in HF's (channels, 1, K)."""
    index = v_head_index(t, cfg)
    if index is not None:
        arr = arr[:, index] if t.v_heads == "columns" else arr[index]
    if t.field == "lin_A":
        arr = np.log(-arr.astype(np.float64)).astype(np.float32)
    elif t.norm and cfg.norm_plus_one:
        arr = (arr - np.float32(1.0)).astype(np.float32)
    return np.ascontiguousarray(arr.reshape(schema.hf_shape(t, cfg)), np.float32)


def to_gguf_values(arr: np.ndarray, t: schema.Tensor, cfg: ModelConfig) -> np.ndarray:
    """The inverse of to_hf_values: a float32 HF tensor as llama.cpp's converter stores it."""
    arr = np.asarray(arr, np.float32).reshape(schema.gguf_shape(t, cfg))
    index = v_head_index(t, cfg)
    if index is not None:
        back = np.argsort(index)
        arr = arr[:, back] if t.v_heads == "columns" else arr[back]
    if t.field == "lin_A":
        arr = -np.exp(arr)
    elif t.norm and cfg.norm_plus_one:
        arr = np.float32(1.0) + arr
    return np.ascontiguousarray(arr, np.float32)


def reshaped(t: schema.Tensor, cfg: ModelConfig) -> bool:
    """Whether the tensor's values move or change between the two layouts."""
    return v_head_index(t, cfg) is not None or t.field == "lin_A" or (t.norm and cfg.norm_plus_one) \
        or schema.gguf_shape(t, cfg) != schema.hf_shape(t, cfg)


def slices_to_write(tensor: GGUFTensor, path: Path, n_heads: Optional[int], dtype: str,
                    t: schema.Tensor, cfg: ModelConfig):
    """The tensor's slices as the folder stores them: Q/K rows back in HF's
    order (n_heads: their heads, or None), the values of t as HF has them,
    in dtype."""
    if reshaped(t, cfg):
        # Layer-sized: converted whole, as its rows move across slices.
        w = dequantize(tensor, path)
        check_decay(w, t, tensor.name, path)
        w = to_hf_values(w, t, cfg)
        yield f32_to_bf16(w) if dtype == "bf16" else w
        return
    rows_per_head = tensor.shape[0] // n_heads if n_heads else 1
    for w in dequantized_slices(tensor, path, rows_per_head):
        if n_heads:
            w = unpermute(w, len(w) // rows_per_head)
        yield f32_to_bf16(w) if dtype == "bf16" else w


def gguf_names(cfg: ModelConfig, fused_experts=frozenset()) -> dict:
    """GGUF name -> (HF name, schema.Tensor, the config its shape follows:
    its layer's view) of every tensor cfg implies (w_attn_gate has none: it
    comes inside attn_q); the layers in fused_experts hold their experts'
    gate and up rows as one tensor."""
    names = {}
    for t in schema.MODEL + tuple(t for t in schema.PER_LAYER_MODEL if getattr(cfg, t.switch)):
        if t is not schema.LM_HEAD or not cfg.tie_word_embeddings:
            names[t.gguf] = (schema.hf_name(t, cfg), t, cfg)
    for i, lc in enumerate(cfg.layer_configs()):
        tensors = schema.file_tensors(lc, cfg.layer_kind(i), cfg.layer_ffn(i))
        if i in fused_experts:
            fused = schema.FUSED_GATE_UP_EXPERTS
            tensors = [fused if t.field == "w_exp_gate" else t for t in tensors if t.field != "w_exp_up"]
        for t in tensors:
            if schema.gguf_name(t, cfg):
                names[f"blk.{i}.{schema.gguf_name(t, cfg)}"] = (schema.hf_name(t, cfg, i), t, lc)
    return names


def hf_entries_of(hf: str, t: schema.Tensor, cfg: ModelConfig) -> list:
    """(name, shape) of the HF tensors a planned tensor becomes: itself, or
    one per expert (gate then up of each where they come fused)."""
    if not t.experts:
        return [(hf, schema.hf_shape(t, cfg))]
    shape = schema.hf_shape(t, cfg)[1:]
    if not t.parts:
        return [(hf.format(e=e), shape) for e in range(cfg.num_experts)]
    part = (shape[0] // 2, shape[1])
    return [(hf.replace(t.hf, schema.BY_FIELD[field].hf).format(e=e), part)
            for e in range(cfg.num_experts) for field in t.parts]


def expert_tensors_to_write(tensor: GGUFTensor, path: Path, dtype: str, hf: str, t: schema.Tensor,
                            cfg: ModelConfig):
    """(name, values) of each expert's HF tensor(s) from a merged GGUF one,
    in hf_entries_of's order, read a slice of whole experts at a time."""
    names = iter(hf_entries_of(hf, t, cfg))
    for part in dequantized_slices(tensor, path):
        for expert in part:
            pieces = np.split(expert, len(t.parts)) if t.parts else [expert]
            for values in pieces:
                values = np.ascontiguousarray(values)
                yield next(names)[0], f32_to_bf16(values) if dtype == "bf16" else values


class IgnoredTensorsWarning(UserWarning):
    """A GGUF file holds tensors fastllm does not use (multi-token-prediction layers)."""


def drop_mtp_layers(tensors: dict, cfg: ModelConfig, path: Path, notify: bool) -> dict:
    """tensors without those of the layers past cfg's: llama.cpp's converter
    appends a checkpoint's multi-token-prediction layers as extra blocks
    (nextn_predict_layers says how many), which decoding never runs."""
    def layer(name):
        parts = name.split(".")
        return int(parts[1]) if parts[0] == "blk" and len(parts) > 2 and parts[1].isdigit() else -1
    extra = sorted({layer(n) for n in tensors if layer(n) >= cfg.num_hidden_layers})
    if not extra:
        return tensors
    if notify:
        which = ", ".join(f"blk.{i}" for i in extra)
        warnings.warn(f"{path.name}: its multi-token-prediction layer{'s' if len(extra) > 1 else ''} {which} "
                      f"{'are' if len(extra) > 1 else 'is'} ignored: fastllm predicts one token at a time",
                      IgnoredTensorsWarning, stacklevel=4)
    return {n: g for n, g in tensors.items() if layer(n) < cfg.num_hidden_layers}


def plan_tensors(tensors: dict, shapes: dict, cfg: ModelConfig, path: Path, n_mtp: int = 0,
                 notify: bool = False) -> list:
    """(hf_name, gguf_tensor, schema tensor, its layer's config) in output order, once the file
    has exactly the tensors cfg implies, each of the shape it implies, and
    the n_mtp multi-token-prediction layers the metadata announces past
    them (which are left out, with a warning where notify)."""
    if n_mtp:
        tensors = drop_mtp_layers(tensors, cfg, path, notify)
    fused = {i for i in range(cfg.num_hidden_layers)
             if f"blk.{i}.{schema.FUSED_GATE_UP_EXPERTS.gguf}" in tensors}
    planned = gguf_names(cfg, fused)
    missing = [name for name in planned if name not in tensors]
    unexpected = [name for name in tensors if name not in planned]
    if missing or unexpected:
        parts = ([f"missing {', '.join(missing[:6])}"] if missing else []) + \
                ([f"unexpected {', '.join(unexpected[:6])}"] if unexpected else [])
        raise ConversionError(path, f"tensors do not fit the {cfg.model_type} architecture: {'; '.join(parts)}")
    for name, (_, t, lc) in planned.items():
        want = schema.gguf_shape(t, lc)
        # A leading dimension of 1 (Qwen3.5-MoE's shared-expert gate, (1, dim))
        # is dropped by ggml when llama-quantize writes the file again.
        if shapes[name] != want and not (len(want) > 1 and want[0] == 1 and shapes[name] == want[1:]):
            raise ConversionError(path, f"tensor {name} has shape {list(shapes[name])}, "
                                        f"the metadata implies {list(schema.gguf_shape(t, lc))}")
    # The embedding first, then the layers, then the final norm and the head.
    order = sorted(planned.items(), key=lambda item: item[1][1] is not schema.EMBED and
                   (2 if item[1][1] in schema.MODEL else 1))
    return [(hf, tensors[name], t, lc) for name, (hf, t, lc) in order]


