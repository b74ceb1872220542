"""Tiny random chat models with a real Qwen vocabulary and chat template:
the tokenizer of oracles.qwen_tokenizers next to a tiny random checkpoint
of the same vocabulary size, for what needs real chat text (templates,
tool calls, reasoning) more than a sensible model."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

from . import qwen_tokenizers as qt
from .tiny_models import SHAPES, _make_qwen35

# kind: (tokenizer kind, tiny shape, vocabulary size of the checkpoint)
CHAT_MODELS = {
    "qwen3": ("qwen3", "qwen3", 151936),
    # Qwen2.5 has Qwen3's vocabulary (the same 151,643 ranks and specials).
    "qwen2.5": ("qwen3", "qwen2-tied", 151936),
    "qwen3.5": ("qwen3.5", "qwen3_5-text", 248320),
}


def make_tiny_chat_model(kind: str, folder, tokenizer_cache, seed: int = 0) -> Path:
    """A folder with a tiny random model of kind and its Qwen tokenizer;
    <|im_end|> ends a reply."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    tok_kind, shape, vocab = CHAT_MODELS[kind]
    tok_dir = qt.build(tok_kind, tokenizer_cache)
    config = json.loads((tok_dir / "tokenizer_config.json").read_text())
    im_end = next(int(i) for i, t in config["added_tokens_decoder"].items() if t["content"] == "<|im_end|>")
    folder = Path(folder)
    spec = dict(SHAPES[shape], vocab_size=vocab)
    if shape.startswith("qwen3_5"):
        model = _make_qwen35(spec, seed=seed, scale=0.12)
    else:
        model_type = spec.pop("model_type")
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(
            AutoConfig.for_model(model_type, initializer_range=0.2, max_position_embeddings=2048, **spec),
            dtype=torch.float32)
    model.config.eos_token_id = im_end
    model.save_pretrained(folder, safe_serialization=True)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tok_dir / name, folder / name)
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": im_end}))
    return folder
