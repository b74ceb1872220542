"""The layer schema and the family table against what they describe: the C
struct, the checkpoints, and a family added by one entry."""
import json
import math
import re
import shutil
from pathlib import Path

import numpy as np
import pytest

from fastllm import Model
from fastllm.spec import families, schema
from fastllm.spec.config import ModelConfig
from fastllm.formats.safetensors import SafetensorsFile

ROOT = Path(__file__).resolve().parents[1]


def test_schema_lists_flmlayer_fields_in_struct_order():
    header = (ROOT / "csrc" / "fastllm.h").read_text()
    body = re.search(r"typedef struct \{((?:(?!typedef).)*?)\} FlmLayer;", header, re.S).group(1)
    body = re.sub(r"/\*.*?\*/", "", body, flags=re.S)
    fields = [name for decl in body.split(";") if "*" in decl for name in re.findall(r"\*\s*(\w+)", decl)]
    # The layer's RoPE tables (and LongRoPE's long ones), its per-position
    # query scale and its value norm come first; then one pointer per tensor.
    assert fields[:6] == ["rope_cos", "rope_sin", "rope_cos_long", "rope_sin_long", "q_pos_scale", "v_norm"]
    assert fields[6:] == [t.field for t in schema.LAYER]


@pytest.mark.parametrize("kind", ["llama-headdim-bias", "qwen2", "qwen3-untied", "qwen3_5-text",
                                  "qwen3_5-interval", "smollm3", "granite", "olmo2", "gemma2", "gemma3-text",
                                  "gemma4-text"])
def test_schema_names_and_shapes_are_the_checkpoints(kind, tiny_model_dir):
    folder = tiny_model_dir(kind)
    cfg = ModelConfig.from_file(folder / "config.json")
    f = SafetensorsFile(folder / "model.safetensors")
    want = {}
    for i, lc in enumerate(cfg.layer_configs()):   # each layer's own sizes
        for t in schema.layer_tensors(lc, cfg.layer_kind(i)):
            want.setdefault(schema.hf_name(t, cfg, i), schema.hf_shape(t, lc))  # the gate is in q_proj
    for t in schema.MODEL + schema.PER_LAYER_MODEL[:len(schema.PER_LAYER_MODEL) * cfg.per_layer_inputs]:
        if t is not schema.LM_HEAD or not cfg.tie_word_embeddings:
            want[schema.hf_name(t, cfg)] = t.shape(cfg)
    assert {name: tuple(f.shape(name)) for name in f.keys()} == want
    assert cfg.n_params() == sum(math.prod(s) for name, s in want.items())


def test_a_llama_like_family_is_one_table_entry(tiny_model_dir, tmp_path, monkeypatch):
    folder = tmp_path / "renamed"
    shutil.copytree(tiny_model_dir("llama-gqa"), folder)
    raw = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps(dict(raw, model_type="llama-alike")))
    with pytest.raises(ValueError, match="model_type 'llama-alike' is not supported"):
        Model.from_pretrained(folder)
    monkeypatch.setitem(families.FAMILIES, "llama-alike", families.FAMILIES["llama"])
    ids = list(range(3, 30))
    want = Model.from_pretrained(tiny_model_dir("llama-gqa"), threads=1).logits(ids)
    assert np.array_equal(Model.from_pretrained(folder, threads=1).logits(ids), want)


def test_only_the_family_table_compares_model_types():
    src = ROOT / "src" / "fastllm"
    offenders = [str(p.relative_to(src)) for p in src.rglob("*.py") if p.parent.name != "families"
                 and re.search(r"""model_type\s*(==|!=|in)\s*[("']|arch\s*(==|!=|in)\s*[("']""", p.read_text())]
    assert offenders == []
