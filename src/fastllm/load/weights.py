"""Checkpoint tensors -> the arrays the C run loop reads.

One walk over the model's tensors (_Walker) reads them through a
TensorSource: a folder's safetensors (SafetensorsSource) or a GGUF file's
own tensors (GgufSource). The walker knows the model: which tensors each
layer has, fused ones split, Qwen3.5's query split from its gate, experts
packed one at a time, the tied head. A source knows its file: types, row
orders, what a vector holds.

Weight matrices are packed once, tensor by tensor, into panels of 16 rows
(see csrc/gemm.c). Every tensor is read into memory of its own rather than
mapped, so the C loop never reads pages of a file that may be truncated or
rewritten while the model is loaded (that would be SIGBUS), and the
checkpoint is never held twice: each read copy is dropped once packed.
Every tensor is checked for NaN and infinity once, as it is read: such
weights only ever give garbage, so they are refused. Q and K rows (and
their biases and norms) are permuted inside each head so that RoPE rotates
adjacent pairs: HF rotates dims (i, i + rope_dim/2) together, the C loop
rotates (2i, 2i+1).
"""
from __future__ import annotations

import warnings
from collections import Counter
from pathlib import Path

import numpy as np

from ..core import _core
from ..spec import schema
from ..spec.config import ModelConfig
from ..spec.errors import ModelFileError
from ..formats import gguf_tensors, quants
from ..formats.gguf_file import read_tensor_bytes
from ..formats.safetensors import Checkpoint, SafetensorsFile, f32_to_bf16


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


def _all_finite(a: np.ndarray) -> bool:
    """No NaN or infinity in a float32 array or in bf16 bit patterns."""
    return _core.finite(a, "bf16" if a.dtype == np.uint16 else "f32")


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


# GGML tensor types the run loop multiplies as they are: gguf's type names
# are the upper-case names of the C core's types.
NATIVE_GGML_TYPES = {name.upper(): name for name in _core.TYPES}
class DequantizedTypeWarning(UserWarning):
    """A GGUF file holds tensors of a type without native kernels; they are
    dequantized to float32 at load."""


# The LM head of a GGUF file is read and packed this many bytes of rows at a time.
_HEAD_CHUNK_BYTES = 16 << 20


def _in_run_order(arr: np.ndarray, t: schema.Tensor, lc: ModelConfig, interleaved: bool) -> np.ndarray:
    """arr's rows (or a head vector's entries) with each query or key head's
    RoPE pairs side by side, as the run loop rotates them; interleaved: the
    source stores them so already (llama.cpp's llama-family files)."""
    perm = rope_permutation(lc.head_dim, lc.rope_dim)
    heads = {"q": lc.num_attention_heads, "k": lc.num_key_value_heads}
    if t.rope in heads:
        order = _head_rows(arr.shape[0], heads[t.rope], perm, interleaved)
        if order is not None:
            arr = arr[order]
    elif t.rope == "head":
        arr = np.take(arr.reshape(-1, len(perm)), perm, axis=1).reshape(arr.shape)
    return arr


# The tensors packed as plain rows, read one row per token: embeddings.
_ROW_TABLES = (schema.EMBED, schema.PER_LAYER_MODEL[0])


class TensorSource:
    """A checkpoint's tensors as the one weight walker (_Walker) asks for
    them, by HF name: a safetensors folder (SafetensorsSource) or a GGUF
    file (GgufSource). A source knows how its file stores a tensor (types,
    row orders, what a vector holds); the walker knows the model (which
    tensors, fused ones split, heads, experts, the tied head)."""

    path: Path            # named in errors
    interleaved = False   # query/key heads' RoPE pairs stored side by side

    def __contains__(self, hf: str) -> bool:
        raise NotImplementedError

    def read(self, t: schema.Tensor, hf: str, lc: ModelConfig) -> tuple:
        """(the tensor's rows as stored, in the type it is packed in before
        a mix's quantization; that type), checked finite."""
        raise NotImplementedError

    def in_order(self, arr: np.ndarray, t: schema.Tensor, dtype: str, lc: ModelConfig) -> np.ndarray:
        """Rows read by read(), in the order the run loop reads them."""
        return np.ascontiguousarray(_in_run_order(arr, t, lc, self.interleaved))

    def vector(self, t: schema.Tensor, arr: np.ndarray, hf: str, lc: ModelConfig) -> np.ndarray:
        """A vector tensor's values as the run loop reads them."""
        raise NotImplementedError

    def packable(self, arr: np.ndarray, dtype: str, hf: str, name: str) -> tuple:
        """(rows, their type, values per row) as packed, of tensor hf (or
        of its part name): a mix may quantize a float checkpoint's matrix here."""
        return arr, dtype, arr.shape[1]

    def experts(self, t: schema.Tensor, hf: str, layer: int) -> tuple:
        """(rows(e): expert e's rows in their packed type, E, type, N, K)."""
        raise NotImplementedError

    def head_in_chunks(self, hf: str):
        """(the LM head packed a chunk of rows at a time, its type) where
        the source reads it so; else None."""
        return None

    def name(self, hf: str) -> str:
        """The tensor's name in the file (for errors)."""
        return hf


class SafetensorsSource(TensorSource):
    """A folder's safetensors checkpoint: float32 or bf16 values in HF's
    order, each tensor read into memory of its own; bf16: matrices kept in
    bf16; mix: float matrices quantized at load under a llama.cpp mix."""

    def __init__(self, cfg: ModelConfig, ck: Checkpoint, folder: Path, bf16: bool, mix: str | None):
        self.cfg, self.ck, self.path, self.bf16 = cfg, ck, Path(folder), bf16
        self.types = {}
        if mix is not None:
            views = cfg.layer_configs()
            matrices = {}
            for i in range(cfg.num_hidden_layers):
                for t in schema.layer_tensors(views[i], cfg.layer_kind(i), cfg.layer_ffn(i)):
                    if t.matrix and t.field != "w_router":   # llama.cpp keeps the router in float
                        matrices.update(schema.hf_entries(t, views[i], i))
            for t in (schema.EMBED, schema.LM_HEAD) + model_tensors(cfg):
                name = schema.hf_name(t, cfg)
                if name in ck:
                    matrices[name] = schema.hf_shape(t, cfg)
            self.types = quants.plan(matrices, mix)

    def __contains__(self, hf: str) -> bool:
        return hf in self.ck

    def _file(self, hf: str, shape: tuple) -> SafetensorsFile:
        f = self.ck.file_of(hf)
        if f.shape(hf) != shape:
            raise ModelFileError(f.path, f"tensor {hf!r} has shape {list(f.shape(hf))}, "
                                         f"config.json implies {list(shape)}")
        return f

    def _compute(self, f: SafetensorsFile, hf: str, bf16: bool) -> np.ndarray:
        """The tensor in float32, or in bf16 bits where bf16, in memory of its own, checked finite."""
        raw = f.read(hf)
        if not (bf16 and f.dtype(hf) == "BF16"):
            raw = f.float32(hf, raw)
            raw = f32_to_bf16(raw) if bf16 else raw
        if not _all_finite(raw):
            raise _not_finite(f.path, hf, " (in the file, or after conversion to the compute dtype)")
        return raw

    def read(self, t: schema.Tensor, hf: str, lc: ModelConfig) -> tuple:
        arr = self._compute(self._file(hf, schema.hf_shape(t, lc)), hf, self.bf16 and t.matrix)
        return arr, "bf16" if arr.dtype == np.uint16 else "f32"

    def vector(self, t: schema.Tensor, arr: np.ndarray, hf: str, lc: ModelConfig) -> np.ndarray:
        arr = _vector(t, arr, lc)
        if not _all_finite(arr):
            raise _not_finite(self.ck.file_of(hf).path, hf, " (in the file, or after conversion to the "
                                                            "compute dtype)")
        return arr

    def packable(self, arr: np.ndarray, dtype: str, hf: str, name: str) -> tuple:
        qtype = self.types.get(name, dtype)
        if qtype in ("f32", "bf16"):
            return arr, dtype, arr.shape[1]
        if qtype == "f16":
            return arr.astype(np.float16), "f16", arr.shape[1]
        blocks = quants.quantize(np.ascontiguousarray(arr, np.float32), qtype)
        return blocks, qtype, _row_length(blocks, qtype)

    def experts(self, t: schema.Tensor, hf: str, layer: int) -> tuple:
        # HF stores one tensor per expert.
        E, N, K = t.shape(self.cfg)
        names = [name for name, _ in schema.hf_entries(t, self.cfg, layer)]
        files = [self._file(name, (N, K)) for name in names]
        qtype = self.types.get(names[0], "bf16" if self.bf16 else "f32")

        def rows(e):
            arr = self._compute(files[e], names[e], qtype == "bf16")
            return self.packable(arr, "bf16" if arr.dtype == np.uint16 else "f32", names[e], names[0])[0]
        return rows, E, qtype, N, K


class GgufSource(TensorSource):
    """A GGUF file's own tensors, each in its own type (those without
    native kernels dequantized to float32), in llama.cpp's row orders, read
    with ordinary reads into memory of their own."""

    def __init__(self, gguf, tensors: dict, cfg: ModelConfig, n_mtp: int):
        self.path, self.cfg = gguf.path, cfg
        planned = gguf_tensors.plan_tensors(tensors, gguf.shapes, cfg, self.path, n_mtp=n_mtp, notify=True)
        self.by_hf = {hf: g for hf, g, _, _ in planned}
        self.interleaved = cfg.family.gguf_qk_interleaved
        self.dequantized = set()
        # Where some ssm_out's value heads split its blocks (K-quants, heads
        # of 128), every Gated DeltaNet tensor stays in llama.cpp's order and
        # the run loop pairs the heads as llama.cpp does: the same math,
        # nothing dequantized. Elsewhere they are put in HF's order, which
        # sums ssm_out's columns in the order a folder's model does.
        linear = [i for i in range(cfg.num_hidden_layers) if cfg.layer_kind(i) == schema.LINEAR]
        self.tiled = any(self._splits_blocks(t, schema.hf_name(t, cfg, i))
                         for i in linear for t in schema.file_tensors(cfg, schema.LINEAR, cfg.layer_ffn(i)))

    def __contains__(self, hf: str) -> bool:
        return hf in self.by_hf

    def name(self, hf: str) -> str:
        return self.by_hf[hf].name if hf in self.by_hf else hf

    def _kind(self, hf: str) -> str:
        g = self.by_hf[hf]
        return getattr(g.tensor_type, "name", str(g.tensor_type))

    def _native_type(self, hf: str) -> str | None:
        """The type fastllm runs the file's tensor for hf in, or None: dequantized."""
        return NATIVE_GGML_TYPES.get(self._kind(hf))

    def _splits_blocks(self, t: schema.Tensor, hf: str) -> bool:
        """Whether t's columns hold value heads in llama.cpp's order that
        split blocks of its type, so cannot be put in HF's order in it."""
        if t.v_heads != "columns" or gguf_tensors.v_head_index(t, self.cfg) is None:
            return False
        dtype = self._native_type(hf)
        return (dtype not in (None, "f32", "f16", "bf16")
                and self.cfg.linear_value_head_dim % _core.block_size(dtype)[0] != 0)

    def read(self, t: schema.Tensor, hf: str, lc: ModelConfig) -> tuple:
        g = self.by_hf[hf]
        dtype = self._native_type(hf) if t.matrix else None
        if dtype is None and t.matrix:
            self.dequantized.add(self._kind(hf))
        if dtype is None:
            arr = gguf_tensors.dequantize(g, self.path)
            dtype = "f32"
        else:
            raw = read_tensor_bytes(self.path, g)
            N, K = g.shape
            arr = {"f32": lambda: raw.view("<f4"), "f16": lambda: raw.view("<f2"),
                   "bf16": lambda: raw.view("<u2")}.get(dtype, lambda: raw)().reshape(N, -1)
        if not _core.finite(arr, dtype):
            raise _not_finite(self.path, g.name)
        return arr, dtype

    def in_order(self, arr: np.ndarray, t: schema.Tensor, dtype: str, lc: ModelConfig) -> np.ndarray:
        # Qwen3.5's value heads go in HF's order, whole blocks at a time.
        index = None if self.tiled else gguf_tensors.v_head_index(t, self.cfg)
        if index is not None and t.v_heads == "columns":
            n = _core.block_size(dtype)[0]
            blocks = arr.reshape(arr.shape[0], len(index) // n, -1)
            arr = blocks[:, index[::n] // n].reshape(arr.shape)
        elif index is not None:
            arr = arr[index]
        return super().in_order(arr, t, dtype, lc)

    def vector(self, t: schema.Tensor, arr: np.ndarray, hf: str, lc: ModelConfig) -> np.ndarray:
        # llama.cpp's converter has formed (1 + w) and -exp(A_log) already.
        gguf_tensors.check_decay(arr, t, self.by_hf[hf].name, self.path)
        return _vector(t, arr, lc, gguf=True)

    def packable(self, arr: np.ndarray, dtype: str, hf: str, name: str) -> tuple:
        return arr, dtype, self.by_hf[hf].shape[-1]

    def experts(self, t: schema.Tensor, hf: str, layer: int) -> tuple:
        # One merged tensor of all experts: each expert's rows are read in
        # turn, so one expert's rows of the file are held beside the packed
        # experts, not the whole tensor.
        g = self.by_hf[hf]
        dtype = self._native_type(hf)
        E, N, K = g.shape
        native = dtype is not None
        if not native:
            self.dequantized.add(self._kind(hf))
            whole, dtype = gguf_tensors.dequantize(g, self.path).reshape(E, N, K), "f32"
        view = {"f32": "<f4", "f16": "<f2", "bf16": "<u2"}.get(dtype)

        def rows(e: int) -> np.ndarray:
            if not native:
                return whole[e]
            per = g.n_bytes // E
            raw = read_tensor_bytes(self.path, g, e * per, per)
            out = (raw.view(view) if view else raw).reshape(N, -1)
            if not _core.finite(out, dtype):
                raise _not_finite(self.path, g.name)
            return out
        return rows, E, dtype, N, K

    def head_in_chunks(self, hf: str):
        # With a vocabulary of 200k-262k rows the head is the largest matrix
        # (300-500 MB at Q8_0/Q6_K): read whole it would be in memory twice
        # while packed. Only where it is quantized and its rows stay in order.
        g = self.by_hf[hf]
        dtype = self._native_type(hf)
        if (dtype in (None, "f32", "f16", "bf16") or schema.LM_HEAD.rope is not None
                or gguf_tensors.v_head_index(schema.LM_HEAD, self.cfg) is not None):
            return None
        N, K = g.shape
        row = g.n_bytes // N

        def read_rows(first: int, n: int) -> np.ndarray:
            blocks = read_tensor_bytes(self.path, g, first * row, n * row).reshape(n, row)
            if not _core.finite(blocks, dtype):
                raise _not_finite(self.path, g.name)
            return blocks

        chunk_rows = max(16, (_HEAD_CHUNK_BYTES // row) // 16 * 16)
        return _core.pack_in_chunks(read_rows, N, K, dtype, chunk_rows), dtype


class _Walker:
    """The one walk over a model's tensors, whatever the source: each layer's
    tensors by FlmLayer field (fused ones split, Qwen3.5's query split from
    its gate, experts packed one at a time), the final norm, the model's own
    tensors, the embedding and the head (or one packed head serving both)."""

    def __init__(self, cfg: ModelConfig, source: TensorSource):
        self.cfg, self.source = cfg, source
        self.types = Counter()   # the matrices' parameters by packed type

    def _packed(self, make, dtype: str, n: int, hf: str):
        self.types[dtype] += n
        try:
            return make()
        except (TypeError, ValueError) as e:
            raise ModelFileError(self.source.path, f"tensor {self.source.name(hf)!r}: {e}") from None

    def _pack(self, arr: np.ndarray, dtype: str, t: schema.Tensor, hf: str, name: str | None = None):
        arr, dtype, K = self.source.packable(arr, dtype, hf, name or hf)
        to = _core.rows if t in _ROW_TABLES else _core.pack
        return self._packed(lambda: to(arr, dtype=dtype, K=K), dtype, arr.shape[0] * K, hf)

    def tensor(self, t: schema.Tensor, hf: str, lc: ModelConfig):
        """One tensor as the run loop reads it: packed, or a float32 vector."""
        s = self.source
        if t is schema.LM_HEAD and (chunked := s.head_in_chunks(hf)) is not None:
            packed, dtype = chunked
            self.types[dtype] += packed.N * packed.K
            return packed
        arr, dtype = s.read(t, hf, lc)
        arr = s.in_order(arr, t, dtype, lc)
        if not t.matrix:
            return s.vector(t, arr, hf, lc)
        return self._pack(arr, dtype, t, hf)

    def fused(self, t: schema.Tensor, hf: str, lc: ModelConfig) -> dict:
        """A fused tensor's parts, split on row boundaries (so on whole
        blocks), each in the order of its own kind."""
        arr, dtype = self.source.read(t, hf, lc)
        return {field: self._pack(self.source.in_order(rows, schema.BY_FIELD[field], dtype, lc), dtype,
                                  schema.BY_FIELD[field], hf, hf.replace(t.hf, schema.BY_FIELD[field].hf))
                for field, rows in schema.split_rows(t, arr, lc).items()}

    def query_and_gate(self, t: schema.Tensor, hf: str, lc: ModelConfig) -> dict:
        """q_proj holds [q_h | gate_h] for each head h: split by rows."""
        both, dtype = self.source.read(t, hf, lc)
        rows = both.reshape(lc.num_attention_heads, 2, lc.head_dim, *both.shape[1:])
        q = self.source.in_order(np.ascontiguousarray(rows[:, 0]).reshape(-1, *both.shape[1:]), t, dtype, lc)
        gate = np.ascontiguousarray(rows[:, 1]).reshape(-1, *both.shape[1:])
        return {"wq": self._pack(q, dtype, t, hf), "w_attn_gate": self._pack(gate, dtype, t, hf)}

    def experts(self, t: schema.Tensor, hf: str, layer: int) -> dict:
        """A mixture's expert matrices, one expert's rows read at a time (a
        fused tensor's split into gate and up rows)."""
        rows, E, dtype, N, K = self.source.experts(t, hf, layer)
        parts = t.parts or (t.field,)
        n = N // len(parts)
        return {field: self._packed(lambda j=j: _core.pack_experts(lambda e: rows(e)[j * n:(j + 1) * n],
                                                                    E, dtype, n, K), dtype, E * n * K, hf)
                for j, field in enumerate(parts)}

    def layer(self, c: ModelConfig, i: int, lc: ModelConfig, key=lambda hf: hf) -> dict:
        """Layer i of c (lc its view of the config), its tensors found under key(their HF name)."""
        kind = c.layer_kind(i)
        layer = {"kind": kind}
        fused_experts = key(schema.hf_name(schema.FUSED_GATE_UP_EXPERTS, c, i))
        for t in schema.file_tensors(lc, kind, c.layer_ffn(i)):
            hf = key(schema.hf_name(t, c, i))
            if t.field in schema.FUSED_GATE_UP_EXPERTS.parts and fused_experts in self.source:
                if t.field not in layer:
                    layer.update(self.experts(schema.FUSED_GATE_UP_EXPERTS, fused_experts, i))
            elif t.experts:
                layer.update(self.experts(t, hf, i))
            elif t.parts:
                layer.update(self.fused(t, hf, lc))
            elif t.field == "wq" and c.attn_output_gate:
                layer.update(self.query_and_gate(t, hf, lc))
            elif t.field not in layer:
                layer[t.field] = self.tensor(t, hf, lc)
        return layer

    def model(self) -> dict:
        cfg = self.cfg
        layers = [self.layer(cfg, i, lc) for i, lc in enumerate(cfg.layer_configs())]
        out = {"layers": layers, "norm": self.tensor(schema.NORM, schema.hf_name(schema.NORM, cfg), cfg)}
        out.update({t.field: self.tensor(t, schema.hf_name(t, cfg), cfg) for t in model_tensors(cfg)})
        # transformers ties the head to the embedding when asked to, except
        # in families that keep an lm_head the file does carry.
        embed_hf, head_hf = schema.hf_name(schema.EMBED, cfg), schema.hf_name(schema.LM_HEAD, cfg)
        has_head = head_hf in self.source
        tied = (cfg.tie_word_embeddings and not (cfg.family.untie_with_head and has_head)) or not has_head
        if tied and not cfg.tie_word_embeddings:
            raise ModelFileError(self.source.path, "lm_head.weight is missing and tie_word_embeddings is false")
        if tied:
            # One copy serves both: the packed head, whose rows the C loop
            # reads for the embedding lookup.
            out.update(embed=None, lm_head=self.tensor(schema.LM_HEAD, embed_hf, cfg))
        else:
            out.update(embed=self.tensor(schema.EMBED, embed_hf, cfg),
                       lm_head=self.tensor(schema.LM_HEAD, head_hf, cfg))
        return out


def load_weights(cfg: ModelConfig, folder, bf16: bool = False, mix: str | None = None) -> dict:
    """The arrays for fastllm.core._core.Weights from a folder's safetensors:
    embed, norm, lm_head and a dict per layer (its kind and its tensors by
    FlmLayer field), each checked against the shape the config implies.
    Float32, or bf16 matrices where bf16. mix: quantize the matrices at
    load under a llama.cpp quantization mix ("q8_0", "q4_k_m", ...: see
    formats.quants.plan), one tensor at a time."""
    with Checkpoint(folder) as ck:
        return _Walker(cfg, SafetensorsSource(cfg, ck, folder, bf16, mix)).model()


def load_gguf_weights(gguf, mtp: bool = False) -> tuple:
    """The arrays for fastllm.core._core.Weights from a GGUF file's own tensors
    (gguf: the file's header as formats.gguf.read_gguf_model read it),
    each matrix in its own type (quantized ones stay quantized; types
    without native kernels are dequantized to float32, with one warning per
    file), and a count of the matrices' parameters by type. Rows are put in
    the run loop's order; Qwen3.5's value heads in HF's, whole blocks at a
    time, or where an ssm_out's heads split its blocks, all left in
    llama.cpp's order, which "v_heads_tiled" then tells the run loop.
    mtp: where the file has a multi-token-prediction block (Qwen3.5's), its
    arrays too, under "mtp", for Weights of cfg.mtp_config() (sharing the
    embedding and the head); else it is left out with a warning."""
    path, cfg = gguf.path, gguf.config
    tensors = gguf.tensors   # the rope factors and frequencies are in the config
    arch = gguf.metadata.get("general.architecture")
    n_mtp = int(gguf.metadata.get(f"{arch}.nextn_predict_layers", 0))
    block = {}   # the multi-token-prediction block's tensors, as blk.0 of mtp_config()
    if mtp and n_mtp == 1 and cfg.family.mtp:
        first = f"blk.{cfg.num_hidden_layers}."
        block = {"blk.0." + n[len(first):]: tensors.pop(n) for n in list(tensors) if n.startswith(first)}
        n_mtp = 0
    source = GgufSource(gguf, tensors, cfg, n_mtp)
    walker = _Walker(cfg, source)
    out = dict(walker.model(), v_heads_tiled=source.tiled)
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
        shapes = gguf.shapes
        for name, (hf, t, lc) in plan.items():
            if shapes[block[name].name] != schema.gguf_shape(t, lc):
                raise ModelFileError(path, f"tensor {block[name].name} has shape {list(shapes[block[name].name])}, "
                                           f"the metadata implies {list(schema.gguf_shape(t, lc))}")
            source.by_hf["mtp." + hf] = block[name]
        own = {t.field: walker.tensor(t, "mtp." + t.hf, mc) for t in schema.NEXTN}
        out["mtp"] = dict(own, layers=[walker.layer(mc, 0, mc.layer_config(0), lambda hf: "mtp." + hf)],
                          embed=out["embed"], lm_head=out["lm_head"], v_heads_tiled=False)
    if source.dequantized:
        warnings.warn(f"{path.name}: tensors of type {', '.join(sorted(source.dequantized))} have no native "
                      f"kernels in fastllm and were dequantized to float32", DequantizedTypeWarning, stacklevel=3)
    return out, walker.types
