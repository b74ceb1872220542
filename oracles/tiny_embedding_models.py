"""Tiny random embedding models laid out as sentence-transformers saves
them, for what sentence-transformers itself can check: a Qwen3-Embedding-
like folder (a tiny random Qwen3 with Qwen3's vocabulary, a tokenizer that
appends <|endoftext|> to every text as Qwen3-Embedding's does, and
modules.json naming Transformer, Pooling and Normalize modules)."""
from __future__ import annotations

import json
from pathlib import Path

from .tiny_chat_models import make_tiny_chat_model

# The Pooling module's config.json: the current form (one pooling_mode) or
# the older one (a switch per mode), as models on the hub carry either.
POOLING_CONFIGS = {
    "lasttoken": {"embedding_dimension": 64, "pooling_mode": "lasttoken", "include_prompt": True},
    "mean": {"word_embedding_dimension": 64, "pooling_mode_cls_token": False,
             "pooling_mode_mean_tokens": True, "pooling_mode_max_tokens": False,
             "pooling_mode_mean_sqrt_len_tokens": False, "pooling_mode_weightedmean_tokens": False,
             "pooling_mode_lasttoken": False, "include_prompt": True},
    "cls": {"embedding_dimension": 64, "pooling_mode": "cls", "include_prompt": True},
    "mean+max": {"embedding_dimension": 64, "pooling_mode": ["max", "mean"], "include_prompt": True},
}


def make_tiny_qwen3_embedding(folder, tokenizer_cache, pooling: str = "lasttoken", seed: int = 0) -> Path:
    """A Qwen3-Embedding-like folder at folder, pooled as POOLING_CONFIGS[pooling]."""
    folder = make_tiny_chat_model("qwen3", folder, tokenizer_cache, seed=seed)
    tok_file = folder / "tokenizer.json"
    tok = json.loads(tok_file.read_text(encoding="utf-8"))
    eos = next(t for t in tok["added_tokens"] if t["content"] == "<|endoftext|>")
    tok["post_processor"] = {
        "type": "TemplateProcessing",
        "single": [{"Sequence": {"id": "A", "type_id": 0}},
                   {"SpecialToken": {"id": "<|endoftext|>", "type_id": 0}}],
        "pair": [{"Sequence": {"id": "A", "type_id": 0}}, {"Sequence": {"id": "B", "type_id": 1}},
                 {"SpecialToken": {"id": "<|endoftext|>", "type_id": 1}}],
        "special_tokens": {"<|endoftext|>": {"id": "<|endoftext|>", "ids": [eos["id"]],
                                             "tokens": ["<|endoftext|>"]}}}
    tok_file.write_text(json.dumps(tok, ensure_ascii=False), encoding="utf-8")
    modules = [{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
               {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
               {"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"}]
    (folder / "modules.json").write_text(json.dumps(modules))
    (folder / "1_Pooling").mkdir()
    (folder / "1_Pooling" / "config.json").write_text(json.dumps(POOLING_CONFIGS[pooling]))
    (folder / "2_Normalize").mkdir()
    (folder / "sentence_bert_config.json").write_text(json.dumps({"max_seq_length": 512,
                                                                  "do_lower_case": False}))
    return folder
