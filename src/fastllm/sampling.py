"""Choosing the next token from logits.

The steps and their order follow transformers' generate: repetition penalty,
then temperature, top-k, top-p and min-p, then a draw. Temperature 0 is
greedy decoding. A seed makes every draw reproducible.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass
class SamplingParams:
    temperature: float = 0.0
    top_k: int = 0            # 0: off
    top_p: float = 1.0        # 1.0: off
    min_p: float = 0.0        # 0.0: off
    repetition_penalty: float = 1.0
    seed: int | None = None

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
        return self


class Sampler:
    def __init__(self, params: SamplingParams):
        self.params = params.validate()
        self.rng = np.random.default_rng(params.seed)

    def __call__(self, logits: np.ndarray, previous_tokens=()) -> int:
        p = self.params
        logits = np.asarray(logits, dtype=np.float32)
        if p.repetition_penalty != 1.0 and len(previous_tokens):
            logits = logits.copy()
            seen = np.unique(np.asarray(previous_tokens, dtype=np.int64))
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
