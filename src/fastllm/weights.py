"""HF checkpoint tensors -> the arrays the C run loop reads.

Weight matrices are packed once, tensor by tensor, into panels of 16 rows
(see csrc/gemm.c), in fp32 or bf16. Every tensor is read into memory of its
own rather than mapped, so the C loop never reads pages of a file that may
be truncated or rewritten while the model is loaded (that would be SIGBUS),
and the checkpoint is never held twice: each read copy is dropped once
packed. Every tensor is checked for NaN and infinity once, as it is read:
such weights only ever give garbage, so they are refused. Q
and K rows (and their biases and norms) are permuted inside each head so
that RoPE rotates adjacent pairs: HF rotates dims (i, i + rope_dim/2)
together, the C loop rotates (2i, 2i+1).
"""
from __future__ import annotations

import warnings
from collections import Counter
from pathlib import Path

import numpy as np

from . import _core, schema
from .config import ModelConfig
from .errors import ModelFileError
from .formats import gguf_tensors
from .formats.gguf_file import read_tensor_bytes
from .formats.safetensors import Checkpoint, SafetensorsFile, f32_to_bf16


def rope_permutation(head_dim: int, rope_dim: int) -> np.ndarray:
    """Index map within one head: new row 2i is old row i, new row 2i+1 is
    old row i + rope_dim/2; dims past rope_dim stay where they are."""
    half = rope_dim // 2
    perm = np.arange(head_dim)
    perm[0:rope_dim:2] = np.arange(half)
    perm[1:rope_dim:2] = np.arange(half) + half
    return perm


def _permuted_heads(rows: np.ndarray, perm: np.ndarray, heads: int) -> np.ndarray:
    """rows (or vector entries) with each head's permuted by perm."""
    return np.take(rows.reshape(heads, len(perm), *rows.shape[1:]), perm, axis=1).reshape(rows.shape)


def _not_finite(path, name: str, where: str = "") -> ModelFileError:
    """What loading a tensor that holds NaN or infinite values raises."""
    return ModelFileError(path, f"tensor {name!r} holds NaN or infinite values{where}; such weights only "
                                f"give garbage: re-download or re-convert it")


def _head_rows(n: int, heads: int, perm: np.ndarray, interleaved: bool):
    """Which of a GGUF query or key tensor's n rows each row of the run
    loop's order is, or None where the two orders are the same: llama.cpp
    stores a llama-family head's RoPE pairs side by side, as the run loop
    reads them, so undoing its order and applying the run loop's would copy
    every such tensor twice for nothing."""
    rows = np.arange(n)
    if interleaved:
        rows = gguf_tensors.unpermute(rows, heads)
    rows = _permuted_heads(rows, perm, heads)
    return None if np.array_equal(rows, np.arange(n)) else rows


def _as_compute_dtype(f: SafetensorsFile, name: str, bf16: bool, perm=None, heads=None):
    """A tensor in the compute dtype, in memory of its own (never a view of
    the file), rows permuted per head if perm is given."""
    raw = f.read(name)
    if perm is not None:
        raw = _permuted_heads(raw, perm, heads)
    if bf16 and f.dtype(name) == "BF16":
        return raw
    arr = f.float32(name, raw)
    return f32_to_bf16(arr) if bf16 else arr


def _all_finite(a: np.ndarray) -> bool:
    """No NaN or infinity in a float32 array or in bf16 bit patterns."""
    if a.dtype == np.uint16:
        # bf16: exponent bits all ones is infinity or NaN.
        return a.size == 0 or int(np.max(a & np.uint16(0x7FFF))) < 0x7F80
    # A sum is NaN or infinite if any term is; it can also overflow on
    # finite terms, so only then is every element looked at.
    return bool(np.isfinite(np.sum(a, dtype=np.float32))) or bool(np.isfinite(a).all())


def _row_length(blocks: np.ndarray, qtype: str) -> int:
    n, size = _core.block_size(qtype)
    return blocks.shape[1] // size * n


def _vector(t: schema.Tensor, arr: np.ndarray, cfg: ModelConfig, gguf: bool = False) -> np.ndarray:
    """A float32 vector tensor as the run loop reads it. gguf: as llama.cpp's
    converter stored it, (1 + w) and -exp(A_log) already formed."""
    arr = np.asarray(arr, np.float32)
    if gguf:
        pass
    elif t.norm and cfg.norm_plus_one:
        # (1 + w) is formed once here, in float32 as the reference forms it.
        arr = (np.float32(1.0) + arr).astype(np.float32)
    elif t.field == "lin_A":
        arr = (-np.exp(arr)).astype(np.float32)
    return np.ascontiguousarray(arr.reshape(t.shape(cfg)))


def model_tensors(cfg: ModelConfig) -> tuple:
    """The model's own tensors beside the embedding, final norm and head: Gemma 4's per-layer inputs."""
    return tuple(t for t in schema.PER_LAYER_MODEL if getattr(cfg, t.switch))


def load_weights(cfg: ModelConfig, folder, bf16: bool = False, mix: str | None = None) -> dict:
    """The arrays for fastllm._core.Weights: embed, norm, lm_head and a dict
    per layer (its kind and its tensors by FlmLayer field), each checked
    against the shape the config implies. mix: quantize the matrices at load
    under a llama.cpp quantization mix ("q8_0", "q4_k_m", ...: see
    formats.quants.plan), one tensor at a time."""
    ck = Checkpoint(folder)
    views = cfg.layer_configs()
    types = {}
    if mix is not None:
        from .formats import quants
        matrices = {}
        for i in range(cfg.num_hidden_layers):
            for t in schema.layer_tensors(views[i], cfg.layer_kind(i), cfg.layer_ffn(i)):
                if t.matrix and t.field != "w_router":   # llama.cpp keeps the router in float
                    matrices.update(schema.hf_entries(t, views[i], i))
        for t in (schema.EMBED, schema.LM_HEAD) + model_tensors(cfg):
            name = schema.hf_name(t, cfg)
            if name in ck:
                matrices[name] = schema.hf_shape(t, cfg)
        types = quants.plan(matrices, mix)

    def packed(arr: np.ndarray, name: str, embed: bool):
        """A float32 matrix in the type the mix gives it (as plain rows for an embedding)."""
        qtype = types.get(name, "bf16" if arr.dtype == np.uint16 else "f32")
        if qtype in ("f32", "bf16"):
            return _core.rows(arr) if embed else _core.pack(arr)
        if qtype == "f16":
            arr = arr.astype(np.float16)
        else:
            from .formats import quants
            arr = quants.quantize(np.ascontiguousarray(arr, np.float32), qtype)
        return (_core.rows if embed else _core.pack)(arr, dtype=qtype, K=arr.shape[1] if qtype == "f16" else
                                                     _row_length(arr, qtype))

    def get(t: schema.Tensor, name: str, lc: ModelConfig = cfg):
        """Tensor t (of a layer whose view of the config is lc) as the run loop reads it."""
        perm = rope_permutation(lc.head_dim, lc.rope_dim)
        heads = {"q": lc.num_attention_heads, "k": lc.num_key_value_heads, "head": -1}   # -1: as many as it holds
        f = ck.file_of(name)

        def check_finite(arr):
            if not _all_finite(arr):
                raise _not_finite(f.path, name, " (in the file, or after conversion to the compute dtype)")

        shape = schema.hf_shape(t, lc)
        if f.shape(name) != shape:
            raise ModelFileError(f.path, f"tensor {name!r} has shape {list(f.shape(name))}, "
                                         f"config.json implies {list(shape)}")
        if t.parts:
            # A fused tensor: each part's rows, permuted as that part's own.
            fused = _as_compute_dtype(f, name, bf16)
            check_finite(fused)
            out = {}
            for field, rows in schema.split_rows(t, fused, lc).items():
                part = schema.BY_FIELD[field]
                if part.rope:
                    rows = _permuted_heads(rows, perm, heads[part.rope])
                out[field] = packed(np.ascontiguousarray(rows), name.replace(t.hf, part.hf), False)
            return out
        if t.field == "wq" and cfg.attn_output_gate:
            # q_proj holds [q_h | gate_h] for each head h: split, then permute q.
            qd, h = t.shape(lc)
            both = _as_compute_dtype(f, name, bf16).reshape(heads["q"], 2, lc.head_dim, h)
            check_finite(both)
            q = packed(np.ascontiguousarray(both[:, 0][:, perm]).reshape(qd, h), name, False)
            gate = packed(np.ascontiguousarray(both[:, 1]).reshape(qd, h), name, False)
            return {"wq": q, "w_attn_gate": gate}
        arr = _as_compute_dtype(f, name, bf16 and t.matrix, perm if t.rope else None, heads.get(t.rope))
        if not t.matrix:
            arr = _vector(t, arr, lc)
        check_finite(arr)
        if t.matrix:
            arr = packed(arr, name, t in (schema.EMBED, schema.PER_LAYER_MODEL[0]))
        return {t.field: arr}

    def get_experts(t: schema.Tensor, layer: int) -> dict:
        """A mixture's expert matrices, one expert's tensor read at a time."""
        E, N, K = t.shape(cfg)
        names = [name for name, _ in schema.hf_entries(t, cfg, layer)]
        for name in names:
            f = ck.file_of(name)
            if f.shape(name) != (N, K):
                raise ModelFileError(f.path, f"tensor {name!r} has shape {list(f.shape(name))}, "
                                             f"config.json implies {[N, K]}")
        qtype = types.get(names[0], "bf16" if bf16 else "f32")

        def expert(e):
            f = ck.file_of(names[e])
            arr = _as_compute_dtype(f, names[e], qtype == "bf16")
            if not _all_finite(arr):
                raise _not_finite(f.path, names[e])
            if qtype == "f16":
                return arr.astype(np.float16)
            if qtype not in ("f32", "bf16"):
                from .formats import quants
                return quants.quantize(np.ascontiguousarray(arr, np.float32), qtype)
            return arr
        return {t.field: _core.pack_experts(expert, E, qtype, N, K)}

    layers = []
    for i in range(cfg.num_hidden_layers):
        kind = cfg.layer_kind(i)
        layer = {"kind": kind}
        for t in schema.file_tensors(views[i], kind, cfg.layer_ffn(i)):
            if t.experts:
                layer.update(get_experts(t, i))
            elif t.field not in layer:   # w_attn_gate comes with wq
                layer.update(get(t, schema.hf_name(t, cfg, i), views[i]))
        layers.append(layer)
    # transformers ties the head to the embedding when asked to, except in
    # families that keep an lm_head the file does carry.
    has_head = schema.hf_name(schema.LM_HEAD, cfg) in ck
    tied = (cfg.tie_word_embeddings and not (cfg.family.untie_with_head and has_head)) or not has_head
    if tied and not cfg.tie_word_embeddings:
        raise ModelFileError(folder, "lm_head.weight is missing and tie_word_embeddings is false")
    embed_name = schema.hf_name(schema.EMBED, cfg)
    out = get(schema.NORM, schema.hf_name(schema.NORM, cfg))
    for t in model_tensors(cfg):
        out.update(get(t, schema.hf_name(t, cfg)))
    if tied:
        # One copy serves both: the packed head, whose rows the C loop reads
        # for the embedding lookup.
        out.update(embed=None, lm_head=get(schema.LM_HEAD, embed_name)["lm_head"])
    else:
        out.update(get(schema.EMBED, embed_name), **get(schema.LM_HEAD, schema.hf_name(schema.LM_HEAD, cfg)))
    return dict(out, layers=layers)


# GGML tensor types the run loop multiplies as they are: gguf's type names
# are the upper-case names of the C core's types.
NATIVE_GGML_TYPES = {name.upper(): name for name in _core.TYPES}
# Byte offsets of the f16 scales in one GGML block of each quantized type.
_F16_SCALES = {"q8_0": (0,), "q4_0": (0,), "q5_0": (0,), "q4_1": (0, 2), "q5_1": (0, 2),
               "q4_k": (0, 2), "q5_k": (0, 2), "q6_k": (208,)}


class DequantizedTypeWarning(UserWarning):
    """A GGUF file holds tensors of a type without native kernels; they are
    dequantized to float32 at load."""


def _finite_blocks(blocks: np.ndarray, dtype: str) -> bool:
    """No NaN or infinity among the f16 scales of rows of GGML blocks (the
    quants themselves are integers)."""
    n, size = _core.block_size(dtype)
    flat = blocks.reshape(-1, size)
    for at in _F16_SCALES[dtype]:
        scales = flat[:, at:at + 2].copy().view(np.float16)
        if not np.isfinite(scales).all():
            return False
    return True


# The LM head of a GGUF file is read and packed this many bytes of rows at a time.
_HEAD_CHUNK_BYTES = 16 << 20


# The families whose multi-token-prediction block fastllm runs (as a drafter).
MTP_FAMILIES = ("qwen3_5_text",)


def load_gguf_weights(gguf, mtp: bool = False) -> tuple:
    """The arrays for fastllm._core.Weights from a GGUF file's own tensors
    (gguf: the file's header as formats.gguf.read_gguf_model read it),
    each matrix in its own type (quantized ones stay quantized; types
    without native kernels are dequantized to float32, with one warning per
    file), and a count of the matrices' parameters by type. Rows are put in
    the run loop's order; Qwen3.5's value heads in HF's, whole blocks at a
    time, or where an ssm_out's heads split its blocks, all left in
    llama.cpp's order, which "v_heads_tiled" then tells the run loop.
    Vectors are read as stored, llama.cpp's converter having formed (1 + w)
    and -exp(A_log) already. mtp: where the file has a multi-token-prediction
    block (Qwen3.5's), its arrays too, under "mtp", for Weights of
    cfg.mtp_config() (sharing the embedding and the head); else it is left
    out with a warning."""
    path, cfg = gguf.path, gguf.config
    tensors = gguf.tensors   # the rope factors and frequencies are in the config
    arch = gguf.metadata.get("general.architecture")
    shapes = gguf.shapes
    n_mtp = int(gguf.metadata.get(f"{arch}.nextn_predict_layers", 0))
    block = {}   # the multi-token-prediction block's tensors, as blk.0 of mtp_config()
    if mtp and n_mtp == 1 and cfg.model_type in MTP_FAMILIES:
        first = f"blk.{cfg.num_hidden_layers}."
        block = {"blk.0." + n[len(first):]: tensors.pop(n) for n in list(tensors) if n.startswith(first)}
        n_mtp = 0
    planned = gguf_tensors.plan_tensors(tensors, shapes, cfg, path, n_mtp=n_mtp, notify=True)
    by_hf = {hf: g for hf, g, _, _ in planned}
    views = {hf: lc for hf, _, _, lc in planned}   # the config each tensor's layer sees
    interleaved = cfg.family.gguf_qk_interleaved
    types, dequantized = Counter(), set()

    def native_type(hf: str) -> str | None:
        """The type fastllm runs the file's tensor for hf in, or None: dequantized."""
        g = by_hf[hf]
        return NATIVE_GGML_TYPES.get(getattr(g.tensor_type, "name", str(g.tensor_type)))

    def splits_blocks(t: schema.Tensor, hf: str) -> bool:
        """Whether t's columns hold value heads in llama.cpp's order that
        split blocks of its type, so cannot be put in HF's order in it."""
        if t.v_heads != "columns" or gguf_tensors.v_head_index(t, cfg) is None:
            return False
        dtype = native_type(hf)
        return dtype not in (None, "f32", "f16", "bf16") and cfg.linear_value_head_dim % _core.block_size(dtype)[0] != 0

    # Where some ssm_out's value heads split its blocks (K-quants, heads of
    # 128), every Gated DeltaNet tensor stays in llama.cpp's order and the
    # run loop pairs the heads as llama.cpp does: the same math, nothing
    # dequantized. Elsewhere they are put in HF's order, which sums ssm_out's
    # columns in the order a folder's model does.
    linear = [i for i in range(cfg.num_hidden_layers) if cfg.layer_kind(i) == schema.LINEAR]
    tiled = any(splits_blocks(t, schema.hf_name(t, cfg, i))
                for i in linear for t in schema.file_tensors(cfg, schema.LINEAR, cfg.layer_ffn(i)))

    def rows_in_order(arr: np.ndarray, t: schema.Tensor, dtype: str, lc: ModelConfig) -> np.ndarray:
        """Rows (or vector entries, or a matrix's columns of dtype) in the order the run loop reads."""
        perm = rope_permutation(lc.head_dim, lc.rope_dim)
        heads = {"q": lc.num_attention_heads, "k": lc.num_key_value_heads}
        index = None if tiled else gguf_tensors.v_head_index(t, cfg)
        if index is not None and t.v_heads == "columns":
            n = _core.block_size(dtype)[0]
            blocks = arr.reshape(arr.shape[0], len(index) // n, -1)
            arr = blocks[:, index[::n] // n].reshape(arr.shape)
        elif index is not None:
            arr = arr[index]
        if t.rope in heads:
            order = _head_rows(arr.shape[0], heads[t.rope], perm, interleaved)
            if order is not None:
                arr = arr[order]
        elif t.rope == "head":
            arr = np.take(arr.reshape(-1, len(perm)), perm, axis=1).reshape(arr.shape)
        return np.ascontiguousarray(arr)

    def read(t: schema.Tensor, hf: str) -> tuple:
        """(rows as stored, in their own type where the run loop has kernels for it, that dtype)."""
        g = by_hf[hf]
        dtype = native_type(hf) if t.matrix else None
        if dtype is None and t.matrix:
            dequantized.add(getattr(g.tensor_type, "name", str(g.tensor_type)))
        if dtype is None:
            arr = gguf_tensors.dequantize(g, path)
            dtype = "f32"
        else:
            raw = read_tensor_bytes(path, g)
            N, K = g.shape
            arr = {"f32": lambda: raw.view("<f4"), "f16": lambda: raw.view("<f2"),
                   "bf16": lambda: raw.view("<u2")}.get(dtype, lambda: raw)().reshape(N, -1)
        finite = _finite_blocks(arr, dtype) if dtype not in ("f32", "f16", "bf16") else _all_finite(
            arr.astype(np.float32) if dtype == "f16" else arr)
        if not finite:
            raise _not_finite(path, g.name)
        return arr, dtype

    def pack(arr: np.ndarray, dtype: str, t: schema.Tensor, hf: str):
        K = by_hf[hf].shape[-1]
        types[dtype] += arr.shape[0] * K
        try:
            if t in (schema.EMBED, schema.PER_LAYER_MODEL[0]):
                return _core.rows(arr, dtype=dtype, K=K)
            return _core.pack(arr, dtype=dtype, K=K)
        except (TypeError, ValueError) as e:
            raise ModelFileError(path, f"tensor {by_hf[hf].name!r}: {e}") from None

    def head_in_chunks(hf: str):
        """The LM head in the file's quantized type, read and packed a chunk
        of rows at a time: with a vocabulary of 200k-262k rows it is the
        largest matrix (300-500 MB at Q8_0/Q6_K), which read whole would
        be in memory twice while packed. None where its type is not one of
        those, or its rows are not read in the file's order."""
        g = by_hf[hf]
        dtype = NATIVE_GGML_TYPES.get(getattr(g.tensor_type, "name", str(g.tensor_type)))
        if (dtype in (None, "f32", "f16", "bf16") or schema.LM_HEAD.rope is not None
                or gguf_tensors.v_head_index(schema.LM_HEAD, cfg) is not None):
            return None
        N, K = g.shape
        row = g.n_bytes // N

        def read_rows(first: int, n: int) -> np.ndarray:
            blocks = read_tensor_bytes(path, g, first * row, n * row).reshape(n, row)
            if not _finite_blocks(blocks, dtype):
                raise _not_finite(path, g.name)
            return blocks

        types[dtype] += N * K
        chunk_rows = max(16, (_HEAD_CHUNK_BYTES // row) // 16 * 16)
        try:
            return _core.pack_in_chunks(read_rows, N, K, dtype, chunk_rows)
        except (TypeError, ValueError) as e:
            raise ModelFileError(path, f"tensor {g.name!r}: {e}") from None

    def get(t: schema.Tensor, hf: str):
        if t is schema.LM_HEAD and (packed := head_in_chunks(hf)) is not None:
            return packed
        arr, dtype = read(t, hf)
        arr = rows_in_order(arr, t, dtype, views[hf])
        if not t.matrix:
            gguf_tensors.check_decay(arr, t, by_hf[hf].name, path)
            return _vector(t, arr, views[hf], gguf=True)
        return pack(arr, dtype, t, hf)

    def get_fused(t: schema.Tensor, hf: str) -> dict:
        """A fused tensor's parts, split on row boundaries (so on whole
        blocks), each in the file's type."""
        arr, dtype = read(t, hf)
        parts = schema.split_rows(t, arr, cfg).items()
        return {field: pack(rows_in_order(rows, schema.BY_FIELD[field], dtype, views[hf]), dtype, t, hf)
                for field, rows in parts}

    def query_and_gate(t: schema.Tensor, hf: str) -> dict:
        """attn_q holds [q_h | gate_h] for each head h, as HF's q_proj does: split by rows."""
        both, dtype = read(t, hf)
        rows = both.reshape(cfg.num_attention_heads, 2, cfg.head_dim, *both.shape[1:])
        q = rows_in_order(np.ascontiguousarray(rows[:, 0]).reshape(-1, *both.shape[1:]), t, dtype, views[hf])
        gate = np.ascontiguousarray(rows[:, 1]).reshape(-1, *both.shape[1:])
        return {"wq": pack(q, dtype, t, hf), "w_attn_gate": pack(gate, dtype, t, hf)}

    def experts(t: schema.Tensor, hf: str) -> dict:
        """A merged expert tensor, each expert's rows read and packed in
        turn (a fused one split into gate and up rows): one expert's rows of
        the file are held beside the packed experts, not the whole tensor."""
        g = by_hf[hf]
        kind = getattr(g.tensor_type, "name", str(g.tensor_type))
        dtype = NATIVE_GGML_TYPES.get(kind)
        E, N, K = g.shape
        native = dtype is not None
        if not native:
            dequantized.add(kind)
            whole, dtype = gguf_tensors.dequantize(g, path).reshape(E, N, K), "f32"
        view = {"f32": "<f4", "f16": "<f2", "bf16": "<u2"}.get(dtype)

        def expert_rows(e: int) -> np.ndarray:
            if not native:
                return whole[e]
            per = g.n_bytes // E
            raw = read_tensor_bytes(path, g, e * per, per)
            rows = (raw.view(view) if view else raw).reshape(N, -1)
            finite = _all_finite(rows.astype(np.float32) if dtype == "f16" else rows) if view else \
                _finite_blocks(rows, dtype)
            if not finite:
                raise _not_finite(path, g.name)
            return rows

        types[dtype] += E * N * K
        parts = t.parts or (t.field,)
        n = N // len(parts)
        try:
            return {field: _core.pack_experts(lambda e: expert_rows(e)[j * n:(j + 1) * n], E, dtype, n, K)
                    for j, field in enumerate(parts)}
        except (TypeError, ValueError) as e:
            raise ModelFileError(path, f"tensor {g.name!r}: {e}") from None

    def load_layer(c: ModelConfig, i: int, lc: ModelConfig, key=lambda hf: hf) -> dict:
        """Layer i of c, its tensors found under key(their HF name)."""
        kind = c.layer_kind(i)
        layer = {"kind": kind}
        fused_experts = key(schema.hf_name(schema.FUSED_GATE_UP_EXPERTS, c, i))
        for t in schema.file_tensors(lc, kind, c.layer_ffn(i)):
            hf = key(schema.hf_name(t, c, i))
            if t.field in schema.FUSED_GATE_UP_EXPERTS.parts and fused_experts in by_hf:
                if t.field not in layer:
                    layer.update(experts(schema.FUSED_GATE_UP_EXPERTS, fused_experts))
            elif t.experts:
                layer.update(experts(t, hf))
            elif t.parts:
                layer.update(get_fused(t, hf))
            elif t.field == "wq" and c.attn_output_gate:
                layer.update(query_and_gate(t, hf))
            elif t.field not in layer:
                layer[t.field] = get(t, hf)
        return layer

    layers = [load_layer(cfg, i, lc) for i, lc in enumerate(cfg.layer_configs())]
    out = {"layers": layers, "norm": get(schema.NORM, schema.hf_name(schema.NORM, cfg)), "v_heads_tiled": tiled}
    out.update({t.field: get(t, schema.hf_name(t, cfg)) for t in model_tensors(cfg)})
    embed_hf = schema.hf_name(schema.EMBED, cfg)
    head_hf = schema.hf_name(schema.LM_HEAD, cfg)
    if head_hf in by_hf:
        out.update(embed=get(schema.EMBED, embed_hf), lm_head=get(schema.LM_HEAD, head_hf))
    else:   # tied: the packed head's rows serve as the embedding
        out.update(embed=None, lm_head=get(schema.LM_HEAD, embed_hf))
    if block:
        # The block's own tensors go by the names they have under mtp. (its
        # layer's under mtp.model.layers.0.), the same plan and checks as the model's.
        mc = cfg.mtp_config()
        plan = {n: v for n, v in gguf_tensors.gguf_names(mc).items() if n.startswith("blk.0.")}
        plan.update({f"blk.0.{t.gguf}": (t.hf, t, mc) for t in schema.NEXTN})
        missing, unexpected = sorted(plan.keys() - block.keys()), sorted(block.keys() - plan.keys())
        if missing or unexpected:
            raise ModelFileError(path, f"its multi-token-prediction block blk.{cfg.num_hidden_layers} does not "
                                       f"fit the model: " + "; ".join(
                                           f"{what} {', '.join(n.replace('blk.0.', '') for n in names[:6])}"
                                           for what, names in (("missing", missing), ("unexpected", unexpected))
                                           if names))
        for name, (hf, t, lc) in plan.items():
            if shapes[block[name].name] != schema.gguf_shape(t, lc):
                raise ModelFileError(path, f"tensor {block[name].name} has shape {list(shapes[block[name].name])}, "
                                           f"the metadata implies {list(schema.gguf_shape(t, lc))}")
            by_hf["mtp." + hf], views["mtp." + hf] = block[name], lc
        own = {t.field: get(t, "mtp." + t.hf) for t in schema.NEXTN}
        out["mtp"] = dict(own, layers=[load_layer(mc, 0, mc.layer_config(0), lambda hf: "mtp." + hf)],
                          embed=out["embed"], lm_head=out["lm_head"], v_heads_tiled=False)
    if dequantized:
        warnings.warn(f"{path.name}: tensors of type {', '.join(sorted(dequantized))} have no native kernels "
                      f"in fastllm and were dequantized to float32", DequantizedTypeWarning, stacklevel=3)
    return out, types
