"""Choosing the next token from logits.

The steps and their order follow transformers' generate: repetition penalty,
then temperature, top-k, top-p and min-p, then a draw. Temperature 0 is
greedy decoding. A seed makes every draw reproducible.

The repetition penalty works as transformers' does (a seen token's logit is
divided by the penalty when positive, multiplied when negative) over the
tokens the prompt and the reply hold so far: all of them by default, as
transformers does, or only the last repeat_last_n, as llama.cpp does.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from .errors import ModelFileError


@dataclass
class SamplingParams:
    temperature: float = 0.0
    top_k: int = 0            # 0: off
    top_p: float = 1.0        # 1.0: off
    min_p: float = 0.0        # 0.0: off
    repetition_penalty: float = 1.0
    seed: int | None = None
    repeat_last_n: int = -1   # tokens the penalty looks back on: -1 all, 0 none, N the last N

    def validate(self):
        if not (self.temperature >= 0):
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")
        if not (0 < self.top_p <= 1):
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if not (0 <= self.min_p <= 1):
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        if not (self.repetition_penalty > 0):
            raise ValueError(f"repetition_penalty must be > 0, got {self.repetition_penalty}")
        if isinstance(self.repeat_last_n, bool) or int(self.repeat_last_n) != self.repeat_last_n \
                or self.repeat_last_n < -1:
            raise ValueError(f"repeat_last_n must be -1 (all tokens), 0 (none) or a positive count, "
                             f"got {self.repeat_last_n}")
        return self


class Sampler:
    def __init__(self, params: SamplingParams):
        self.params = params.validate()
        self.rng = np.random.default_rng(params.seed)

    def __call__(self, logits: np.ndarray, previous_tokens=()) -> int:
        p = self.params
        logits = np.asarray(logits, dtype=np.float32)
        n = len(previous_tokens) if p.repeat_last_n == -1 else int(p.repeat_last_n)
        if p.repetition_penalty != 1.0 and n and len(previous_tokens):
            logits = logits.copy()
            seen = np.unique(np.asarray(previous_tokens[-n:], dtype=np.int64))
            vals = logits[seen]
            logits[seen] = np.where(vals < 0, vals * p.repetition_penalty, vals / p.repetition_penalty)
        if p.temperature == 0:
            return int(np.argmax(logits))
        return int(self._draw(apply_warpers(logits, p)))

    def _draw(self, probs: np.ndarray) -> int:
        # Inverse-CDF draw in float64: one uniform number per token.
        cdf = np.cumsum(probs, dtype=np.float64)
        u = self.rng.random() * cdf[-1]
        return int(min(np.searchsorted(cdf, u, side="right"), len(probs) - 1))


def apply_warpers(logits: np.ndarray, p: SamplingParams) -> np.ndarray:
    """Probabilities after temperature, top-k, top-p and min-p filtering."""
    scores = logits.astype(np.float64) / p.temperature
    if p.top_k and p.top_k < scores.size:
        kth = np.partition(scores, -p.top_k)[-p.top_k]
        scores = np.where(scores < kth, -np.inf, scores)
    probs = _softmax(scores)
    if p.top_p < 1.0:
        order = np.argsort(-probs, kind="stable")
        cum = np.cumsum(probs[order])
        # Keep the smallest set whose mass reaches top_p (always the top token).
        cut = int(np.searchsorted(cum, p.top_p, side="left")) + 1
        mask = np.zeros_like(probs, dtype=bool)
        mask[order[:cut]] = True
        probs = np.where(mask, probs, 0.0)
        probs /= probs.sum()
    if p.min_p > 0.0:
        probs = np.where(probs < p.min_p * probs.max(), 0.0, probs)
        probs /= probs.sum()
    return probs


def _softmax(x: np.ndarray) -> np.ndarray:
    e = np.exp(x - np.max(x))
    return e / e.sum()


# ------------------------------------------------------ generation_config.json

class GenerationConfigError(ModelFileError):
    """generation_config.json holds a value fastllm cannot use."""


def _number(v):
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _whole(v):
    return isinstance(v, int) and not isinstance(v, bool)


# key: (check, what the value must be)
_GEN_CHECKS = {
    "temperature": (lambda v: _number(v) and v >= 0, "a number >= 0"),
    "top_p": (lambda v: _number(v) and 0 < v <= 1, "a number in (0, 1]"),
    "top_k": (lambda v: _whole(v) and v >= 0, "a whole number >= 0"),
    "min_p": (lambda v: _number(v) and 0 <= v <= 1, "a number in [0, 1]"),
    "repetition_penalty": (lambda v: _number(v) and v > 0, "a number > 0"),
    "do_sample": (lambda v: isinstance(v, bool), "true or false"),
    "max_new_tokens": (lambda v: _whole(v) and v >= 1, "a whole number >= 1"),
    "max_length": (lambda v: _whole(v) and v >= 1, "a whole number >= 1"),
    "eos_token_id": (lambda v: (_whole(v) and v >= 0) or (isinstance(v, list) and all(
        _whole(i) and i >= 0 for i in v)), "a token id or a list of token ids"),
}


def read_generation_config(path) -> dict:
    """The generation settings of a generation_config.json, checked.

    Returns the keys fastllm uses (see _GEN_CHECKS) that the file sets;
    null values count as unset. A missing file gives {}.
    """
    path = Path(path)
    if not path.exists():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise GenerationConfigError(path, f"not valid JSON: {e}") from None
    if not isinstance(data, dict):
        raise GenerationConfigError(path, "expected a JSON object")
    out = {}
    for key, (ok, want) in _GEN_CHECKS.items():
        v = data.get(key)
        if v is None:
            continue
        if not ok(v):
            raise GenerationConfigError(path, f"{key} must be {want}, got {v!r}")
        out[key] = v
    return out


def generation_defaults(gen: dict) -> dict:
    """Keyword defaults of Model.generate/stream/chat that a checked
    generation_config (read_generation_config) sets, as transformers reads it:
    do_sample false means greedy, do_sample true samples at its temperature
    (1.0 when the file has none), and without do_sample a temperature in the
    file is ignored (transformers' do_sample defaults to false)."""
    out = {k: gen[k] for k in ("top_p", "top_k", "min_p", "repetition_penalty", "max_new_tokens")
           if k in gen}
    if gen.get("do_sample") is True:
        out["temperature"] = float(gen.get("temperature", 1.0))
    elif gen.get("do_sample") is False:
        out["temperature"] = 0.0
    return out
