"""GGML block quantization: float32 rows to the exact bytes llama.cpp stores.

quantize(w, qtype) gives, for a float32 matrix of shape (N, K), the uint8
array (N, row_bytes) a GGUF file holds for that tensor, and dequantize()
turns such rows back into floats (with the ``gguf`` package's dequantizers).

Q8_0, Q4_0, Q4_1, Q5_0 and Q5_1 come from ``gguf.quants``, which follows
llama.cpp's reference quantizers. The K-quants (Q4_K, Q5_K, Q6_K) are done
here, after llama.cpp's reference (no importance matrix) quantizers, which
is what llama-quantize runs without --imatrix: the same searches in float32
with every sum taken in the same order, so that the blocks come out equal to
llama.cpp's byte for byte, not merely as good. Sums run along rows with
np.add.accumulate, which adds strictly left to right (np.sum pairs terms up
and would round differently).
"""
from __future__ import annotations

import numpy as np

from ..core import _core

__all__ = ["QTYPES", "FLOAT_TYPES", "block_size", "row_bytes", "ggml_type", "quantize", "dequantize"]

F32 = np.float32
_GROUP_MAX_EPS = F32(1e-15)

# name -> (elements per block, bytes per block), as the C core's table has them
QTYPES = {t["name"]: (t["block"], t["block_bytes"]) for t in _core.weight_types() if t["quantized"]}
FLOAT_TYPES = {t["name"]: (t["block"], t["block_bytes"]) for t in _core.weight_types() if not t["quantized"]}
QK_K = QTYPES["q4_k"][0]   # the K-quants' super-block
_SIZES = {**QTYPES, **FLOAT_TYPES}

# Rows quantized at once: bounds the temporaries to some tens of MB.
_CHUNK_ELEMENTS = 1 << 20


def _gguf():
    import gguf
    return gguf


def ggml_type(qtype: str):
    """The gguf.GGMLQuantizationType of a type name ("q4_k", "f16", ...)."""
    _check_type(qtype)
    return _gguf().GGMLQuantizationType[qtype.upper()]


def _check_type(qtype: str) -> None:
    if qtype not in _SIZES:
        raise ValueError(f"unknown quantization type {qtype!r} (known: {', '.join(_SIZES)})")


def block_size(qtype: str) -> int:
    _check_type(qtype)
    return _SIZES[qtype][0]


def row_bytes(qtype: str, k: int) -> int:
    """Bytes of one row of k elements; k must be a multiple of the block size."""
    _check_type(qtype)
    n, size = _SIZES[qtype]
    if k % n:
        raise ValueError(f"{qtype} needs rows of a multiple of {n} elements, not {k}")
    return k // n * size


# --------------------------------------------------------------------------
# Shared pieces of the K-quant searches


def _seqsum(a: np.ndarray) -> np.ndarray:
    """Sum over the first axis one term after another, in float32, as the
    reference's C loops do (np.sum pairs terms up and would round otherwise)."""
    total = a[0] + F32(0)
    for row in a[1:]:
        total += row
    return total


def _nearest(v: np.ndarray) -> np.ndarray:
    # ggml's nearest_int rounds half to even, as rint does.
    return np.rint(v)


def _fp16(v: np.ndarray) -> np.ndarray:
    return v.astype(np.float16)


# The searches below take sub-blocks as columns: x has shape (n, B) for B
# sub-blocks of n values, so that each sum is n additions of whole rows.


def _best_scale_min(x: np.ndarray, w: np.ndarray, nmax: int, rmin: float, rdelta: float, nstep: int):
    """For each sub-block (column of x), the scale and min (x ~ scale*L - min,
    L in 0..nmax) with the least w-weighted squared error among nstep+1
    trial scales, each refined by a weighted least-squares fit (llama.cpp's
    make_qkx2_quants). Returns (scale, min, L), L as float32."""
    mn = np.minimum(x.min(axis=0), F32(0))
    mx = x.max(axis=0)
    sum_w = _seqsum(w)
    sum_x = _seqsum(w * x)
    flat = mx == mn
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        iscale = F32(nmax) / (mx - mn)
        scale = F32(1) / iscale
        L = np.clip(_nearest(iscale * (x - mn)), 0, nmax)
        best = _seqsum(w * np.square(scale * L + mn - x))
        for step in range(nstep + 1):
            # The search goes on from the best min so far, as the reference does.
            iscale = (F32(rmin) + F32(rdelta) * F32(step) + F32(nmax)) / (mx - mn)
            trial = np.clip(_nearest(iscale * (x - mn)), 0, nmax)
            wl = w * trial
            sum_l = _seqsum(wl)
            sum_l2 = _seqsum(wl * trial)
            sum_xl = _seqsum(wl * x)
            det = sum_w * sum_l2 - sum_l * sum_l
            this_scale = (sum_w * sum_xl - sum_x * sum_l) / det
            this_min = (sum_l2 * sum_x - sum_l * sum_xl) / det
            clamp = this_min > 0
            this_min = np.where(clamp, F32(0), this_min)
            this_scale = np.where(clamp, sum_xl / sum_l2, this_scale)
            err = _seqsum(w * np.square(this_scale * trial + this_min - x))
            better = (det > 0) & (err < best) & ~flat
            L = np.where(better, trial, L)
            best = np.where(better, err, best)
            scale = np.where(better, this_scale, scale)
            mn = np.where(better, this_min, mn)
    L = np.where(flat, F32(0), L)
    scale = np.where(flat, F32(0), scale)
    return scale.astype(F32), (-mn).astype(F32), L.astype(F32)


def _best_symmetric_scale(x: np.ndarray, nmax: int):
    """For each sub-block (column of x), a scale with x ~ scale*(L - nmax),
    L in 0..2*nmax-1, weighted by x^2, trying 19 scales around nmax/max|x|
    (llama.cpp's make_qx_quants, rmse_type 1). Returns (scale, L), L as float32."""
    mx = x[np.argmax(np.abs(x), axis=0), np.arange(x.shape[1])]
    zero = np.abs(mx) < _GROUP_MAX_EPS
    w = x * x
    wx = w * x

    def attempt(iscale):
        lv = np.clip(_nearest(iscale * x), -nmax, nmax - 1)
        return lv, _seqsum(wx * lv), _seqsum(w * lv * lv)

    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        lv, sumlx, suml2 = attempt(F32(-nmax) / mx)
        scale = np.where(suml2 != 0, sumlx / suml2, F32(0)).astype(F32)
        best = scale * sumlx
        L = lv + F32(nmax)
        for step in range(-9, 10):
            if step == 0:
                continue
            lv, sumlx, suml2 = attempt(-(F32(nmax) + F32(0.1) * F32(step)) / mx)
            better = (suml2 > 0) & (sumlx * sumlx > best * suml2)
            L = np.where(better, lv + F32(nmax), L)
            scale = np.where(better, sumlx / suml2, scale)
            best = np.where(better, scale * sumlx, best)
    L = np.where(zero, F32(0), L)
    scale = np.where(zero, F32(0), scale)
    return scale.astype(F32), L.astype(F32)


def _columns(x: np.ndarray, n: int) -> np.ndarray:
    """Super-blocks (nb, 256) as sub-blocks of n in columns: shape (n, nb*256/n)."""
    return np.ascontiguousarray(x.reshape(-1, n).T)


# --------------------------------------------------------------------------
# Q4_K and Q5_K: 8 sub-blocks of 32 with 6-bit scales and mins


def _scales_and_mins_k(x: np.ndarray, nmax: int, rmin: float, rdelta: float, nstep: int):
    """Super-blocks x (nb, 256) -> (d, dmin as f16, packed 12-byte scales, L)."""
    nb = x.shape[0]
    xs = _columns(x, 32)
    av_x = np.sqrt(_seqsum(xs * xs) / F32(32))
    weights = av_x + np.abs(xs)
    scale, the_min, L = _best_scale_min(xs, weights, nmax, rmin, rdelta, nstep)
    scale, the_min, L = scale.reshape(nb, 8), the_min.reshape(nb, 8), L.T.reshape(nb, 8, 32)

    max_scale = np.maximum(scale.max(axis=1), F32(0))
    max_min = np.maximum(the_min.max(axis=1), F32(0))
    with np.errstate(divide="ignore"):
        inv_scale = np.where(max_scale > 0, F32(63) / max_scale, F32(0))
        inv_min = np.where(max_min > 0, F32(63) / max_min, F32(0))
    # The reference stores the rounded value in a uint8 before capping it at 63.
    ls = np.minimum(_nearest(inv_scale[:, None] * scale).astype(np.int64) & 0xFF, 63).astype(np.uint8)
    lm = np.minimum(_nearest(inv_min[:, None] * the_min).astype(np.int64) & 0xFF, 63).astype(np.uint8)
    packed = np.empty((nb, 12), np.uint8)
    packed[:, 0:4] = ls[:, :4] | ((ls[:, 4:] >> 4) << 6)
    packed[:, 4:8] = lm[:, :4] | ((lm[:, 4:] >> 4) << 6)
    packed[:, 8:12] = (ls[:, 4:] & 0xF) | ((lm[:, 4:] & 0xF) << 4)

    d = _fp16(max_scale / F32(63))
    dmin = _fp16(max_min / F32(63))
    sub_d = d.astype(F32)[:, None] * ls.astype(F32)
    sub_m = dmin.astype(F32)[:, None] * lm.astype(F32)
    with np.errstate(divide="ignore", invalid="ignore"):
        requant = np.clip(_nearest((x.reshape(nb, 8, 32) + sub_m[..., None]) / sub_d[..., None]), 0, nmax)
    # A sub-block whose scale rounds to zero keeps the levels of its search.
    L = np.where(sub_d[..., None] == 0, L, requant).astype(np.uint8)
    return d, dmin, packed, L


def _head(d, dmin, packed) -> list:
    return [d.view(np.uint8).reshape(-1, 2), dmin.view(np.uint8).reshape(-1, 2), packed]


def _low_nibbles(L: np.ndarray) -> np.ndarray:
    # Each 64 values make 32 bytes: the first 32 in the low nibbles, the next in the high.
    pairs = (L & 0xF).reshape(L.shape[0], 4, 2, 32)
    return (pairs[:, :, 0] | (pairs[:, :, 1] << 4)).reshape(L.shape[0], 128)


def _q4_k(x: np.ndarray) -> np.ndarray:
    d, dmin, packed, L = _scales_and_mins_k(x, 15, -1.0, 0.1, 20)
    return np.concatenate(_head(d, dmin, packed) + [_low_nibbles(L)], axis=1)


def _q5_k(x: np.ndarray) -> np.ndarray:
    d, dmin, packed, L = _scales_and_mins_k(x, 31, -0.5, 0.1, 15)
    # Bit j of high-bit byte l is the fifth bit of value l of sub-block j.
    high = (L >> 4).reshape(L.shape[0], 8, 32)
    qh = np.zeros((L.shape[0], 32), np.uint8)
    for j in range(8):
        qh |= high[:, j] << j
    return np.concatenate(_head(d, dmin, packed) + [qh, _low_nibbles(L)], axis=1)


# --------------------------------------------------------------------------
# Q6_K: 16 sub-blocks of 16 with int8 scales


def _q6_k(x: np.ndarray) -> np.ndarray:
    nb = x.shape[0]
    scale, L = _best_symmetric_scale(_columns(x, 16), 32)
    scale, L = scale.reshape(nb, 16), L.T.reshape(nb, 16, 16)
    max_scale = scale[np.arange(nb), np.argmax(np.abs(scale), axis=1)]
    zero = np.abs(max_scale) < _GROUP_MAX_EPS
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        iscale = F32(-128) / max_scale
        d = _fp16(F32(1) / iscale)
        sc = np.minimum(_nearest(iscale[:, None] * scale), 127)
    sc = np.where(zero[:, None], 0, sc).astype(np.int64).astype(np.int8)
    d = np.where(zero, np.float16(0), d)
    sub_d = d.astype(F32)[:, None] * sc.astype(F32)
    with np.errstate(divide="ignore", invalid="ignore"):
        requant = np.clip(_nearest(x.reshape(nb, 16, 16) / sub_d[..., None]), -32, 31) + 32
    L = np.where(sub_d[..., None] == 0, L, requant)
    L = np.where(zero[:, None, None], 0, L).astype(np.uint8).reshape(nb, 2, 4, 32)
    lo, hi = L & 0xF, L >> 4
    ql = np.concatenate([lo[:, :, 0] | (lo[:, :, 2] << 4), lo[:, :, 1] | (lo[:, :, 3] << 4)], axis=2)
    qh = hi[:, :, 0] | (hi[:, :, 1] << 2) | (hi[:, :, 2] << 4) | (hi[:, :, 3] << 6)
    blocks = np.concatenate([ql.reshape(nb, 128), qh.reshape(nb, 64), sc.view(np.uint8),
                             d.view(np.uint8).reshape(nb, 2)], axis=1)
    return np.where(zero[:, None], np.uint8(0), blocks)


_K_QUANTS = {"q4_k": _q4_k, "q5_k": _q5_k, "q6_k": _q6_k}


# --------------------------------------------------------------------------
# Entry points


def quantize(w: np.ndarray, qtype: str) -> np.ndarray:
    """Rows of w (float32, shape (N, K)) as GGML blocks of qtype: a uint8
    array of shape (N, row_bytes(qtype, K)), laid out as in a GGUF file.
    Float types ("f32", "f16", "bf16") give the row's bytes in that type."""
    _check_type(qtype)
    w = np.asarray(w)
    if w.ndim != 2:
        raise ValueError(f"quantize takes a matrix (N, K), not shape {w.shape}")
    n, k = w.shape
    nbytes = row_bytes(qtype, k)
    w = np.ascontiguousarray(w, dtype=F32)
    if qtype == "f32":
        return w.view(np.uint8).reshape(n, nbytes)
    if qtype == "f16":
        return w.astype("<f2").view(np.uint8).reshape(n, nbytes)
    if qtype not in _K_QUANTS:
        return np.ascontiguousarray(_gguf().quants.quantize(w, ggml_type(qtype))).reshape(n, nbytes)
    out = np.empty((n, nbytes), np.uint8)
    rows = max(1, _CHUNK_ELEMENTS // max(k, 1))
    fn = _K_QUANTS[qtype]
    for start in range(0, n, rows):
        part = w[start:start + rows]
        out[start:start + len(part)] = fn(part.reshape(-1, QK_K)).reshape(len(part), nbytes)
    return out


def dequantize(blocks: np.ndarray, qtype: str, k: int) -> np.ndarray:
    """GGML rows of qtype (uint8, shape (N, row_bytes)) back to float32 (N, k)."""
    blocks = np.ascontiguousarray(blocks, dtype=np.uint8)
    nbytes = row_bytes(qtype, k)
    if blocks.ndim != 2 or blocks.shape[1] != nbytes:
        raise ValueError(f"{qtype} rows of {k} elements take {nbytes} bytes; got shape {blocks.shape}")
    out = _gguf().quants.dequantize(blocks, ggml_type(qtype))
    return np.ascontiguousarray(out, dtype=F32).reshape(blocks.shape[0], k)


# --------------------------------------------------------------------------
# Quantization mixes: which tensor gets which type


# mix -> (the type of most matrices, whether llama.cpp's per-tensor rules
# apply: the output in Q6_K, and for the _M mixes attn_v and ffn_down in
# Q6_K in some layers). Plain q4_k/q5_k put every matrix in that type.
MIXES = {
    "f32": ("f32", False), "f16": ("f16", False), "bf16": ("bf16", False),
    "q8_0": ("q8_0", True), "q4_0": ("q4_0", True), "q4_1": ("q4_1", True),
    "q5_0": ("q5_0", True), "q5_1": ("q5_1", True),
    "q4_k_m": ("q4_k", True), "q5_k_m": ("q5_k", True), "q6_k": ("q6_k", True),
    "q4_k": ("q4_k", False), "q5_k": ("q5_k", False),
}
# llama.cpp's general.file_type of each mix (gguf.LlamaFileType values).
FILE_TYPES = {"f32": 0, "f16": 1, "bf16": 32, "q8_0": 7, "q4_0": 2, "q4_1": 3, "q5_0": 8, "q5_1": 9,
              "q4_k_m": 15, "q5_k_m": 17, "q6_k": 18, "q4_k": 14, "q5_k": 16}

# Where a row does not fill whole super-blocks, llama.cpp takes these instead.
_FALLBACK = {"q4_k": "q5_0", "q5_k": "q5_1", "q6_k": "q8_0"}

_OUTPUT, _EMBED, _ATTN_V, _FFN_DOWN, _OTHER = "output", "embed", "attn_v", "ffn_down", "other"


def _role(name: str):
    """(role, layer) of a tensor named as in GGUF (blk.3.attn_v.weight) or
    in a HF checkpoint (model.layers.3.self_attn.v_proj.weight)."""
    layer = None
    for marker in ("blk.", "layers."):
        at = name.find(marker)
        if at >= 0 and (at == 0 or name[at - 1] == "."):
            digits = name[at + len(marker):].split(".", 1)[0]
            if digits.isdigit():
                layer = int(digits)
                break
    if name in ("output.weight", "lm_head.weight"):
        return _OUTPUT, layer
    if name == "token_embd.weight" or name.endswith("embed_tokens.weight"):
        return _EMBED, layer
    if name.endswith(("attn_v.weight", "v_proj.weight")):
        return _ATTN_V, layer
    if name.endswith(("ffn_down.weight", "down_proj.weight")):
        return _FFN_DOWN, layer
    return _OTHER, layer


def _more_bits(i: int, n: int) -> bool:
    # llama.cpp's use_more_bits: the first and last eighth of the layers and every third between.
    return i < n // 8 or i >= 7 * n // 8 or (i - n // 8) % 3 == 2


def _fits(qtype: str, k: int) -> bool:
    return k % _SIZES[qtype][0] == 0


def plan(tensors, mix: str) -> dict:
    """{name: type} for the tensors of a model under a quantization mix.

    tensors: (name, shape) pairs, or a {name: shape} dict, with shapes as
    in the checkpoint ((rows, row length) for a matrix) and names as in a
    GGUF file or a HF checkpoint. The types follow llama-quantize without an
    importance matrix: vectors (norms, biases) stay f32; the output matrix
    (the embedding where it is tied) gets Q6_K unless the mix is Q8_0; the
    _M mixes give attn_v and ffn_down Q6_K in the first and last eighth of
    the layers and every third layer between. A row length that is not a
    multiple of the type's block takes llama.cpp's fallback (Q4_K -> Q5_0,
    Q5_K -> Q5_1, Q6_K -> Q8_0), and f16 where even that does not fit.
    """
    if mix not in MIXES:
        raise ValueError(f"unknown quantization mix {mix!r} (known: {', '.join(MIXES)})")
    base, rules = MIXES[mix]
    items = list(tensors.items() if isinstance(tensors, dict) else tensors)
    roles = {name: _role(name) for name, _ in items}
    tied = not any(role == _OUTPUT for role, _ in roles.values())
    n_layers = 1 + max((layer for _, layer in roles.values() if layer is not None), default=-1)
    out = {}
    for name, shape in items:
        shape = tuple(int(s) for s in shape)
        if len(shape) != 2 or not name.endswith("weight") or name.endswith("norm.weight") or "conv1d" in name:
            out[name] = "f32"
            continue
        k = shape[-1]
        qtype = base
        role, layer = roles[name]
        if rules and base in QTYPES:
            if role == _OUTPUT or (tied and role == _EMBED):
                if not _fits(base, k):
                    qtype = "q8_0"
                elif base != "q8_0":
                    qtype = "q6_k"
            elif role in (_ATTN_V, _FFN_DOWN) and mix in ("q4_k_m", "q5_k_m") and layer is not None:
                if _more_bits(layer, n_layers):
                    qtype = "q6_k"
        if not _fits(qtype, k):
            qtype = _FALLBACK.get(qtype, qtype)
            if not _fits(qtype, k):
                qtype = "f16"
        out[name] = qtype
    return out
