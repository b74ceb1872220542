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

import dataclasses
import numbers
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence

import numpy as np

from .config import CONFIG_LIMIT, read_json
from .errors import ModelFileError

# A logits processor, as in mlx-lm: (tokens so far, logits) -> new logits.
LogitsProcessor = Callable[[Sequence[int], np.ndarray], np.ndarray]


def _number(v):
    return isinstance(v, numbers.Real) and not isinstance(v, bool)


def _whole(v):
    return isinstance(v, numbers.Integral) and not isinstance(v, bool)


# What each setting must be, for SamplingParams and generation_config.json alike:
# key: (check, what the value must be)
_CHECKS = {
    "temperature": (lambda v: _number(v) and v >= 0, "a number >= 0"),
    "top_p": (lambda v: _number(v) and 0 < v <= 1, "a number in (0, 1]"),
    "top_k": (lambda v: _whole(v) and v >= 0, "a whole number >= 0"),
    "min_p": (lambda v: _number(v) and 0 <= v <= 1, "a number in [0, 1]"),
    "repetition_penalty": (lambda v: _number(v) and v > 0, "a number > 0"),
    "repeat_last_n": (lambda v: _whole(v) and v >= -1,
                      "-1 (all tokens), 0 (none) or a positive count"),
    # numpy's generators take no negative seed
    "seed": (lambda v: v is None or (_whole(v) and v >= 0), "a whole number >= 0 or None"),
}


@dataclass(frozen=True)
class SamplingParams:
    """How the next token is chosen. The defaults are fastllm's (greedy, no
    penalty); every value is checked here, so a bad one raises at once.
    Change settings with replace(), which checks again."""
    temperature: float = 0.0
    top_k: int = 0            # 0: off
    top_p: float = 1.0        # 1.0: off
    min_p: float = 0.0        # 0.0: off
    repetition_penalty: float = 1.0
    seed: int | None = None
    repeat_last_n: int = -1   # tokens the penalty looks back on: -1 all, 0 none, N the last N

    def __post_init__(self):
        for key, (ok, want) in _CHECKS.items():
            value = getattr(self, key)
            if not ok(value):
                raise ValueError(f"{key} must be {want}, got {value!r}")

    def replace(self, **changes) -> "SamplingParams":
        """A copy with some settings changed (an unknown name is a TypeError)."""
        return dataclasses.replace(self, **changes)


def repetition_penalty(penalty: float, last_n: int = -1) -> LogitsProcessor:
    """transformers' repetition penalty as a logits processor: the logit of a
    token among the last last_n (-1: all) is divided by penalty when
    positive, multiplied when negative."""
    def apply(tokens, logits):
        window = tokens[-last_n:] if last_n > 0 else tokens if last_n == -1 else ()
        if not len(window):
            return logits
        logits = logits.copy()
        seen = np.unique(np.asarray(window, dtype=np.int64))
        vals = logits[seen]
        logits[seen] = np.where(vals < 0, vals * penalty, vals / penalty)
        return logits
    return apply


def logits_processors(p: SamplingParams) -> list:
    """The processors that p asks for, in order."""
    if p.repetition_penalty != 1.0 and p.repeat_last_n != 0:
        return [repetition_penalty(p.repetition_penalty, p.repeat_last_n)]
    return []


class Sampler:
    """Picks tokens: the logits processors (those of the params, then the
    caller's own), then the argmax at temperature 0, else a draw after the
    warpers, from a generator seeded with params.seed."""

    def __init__(self, params: SamplingParams, processors: Sequence[LogitsProcessor] = ()):
        self.params = params
        self.processors = logits_processors(params) + list(processors)
        self.rng = np.random.default_rng(params.seed)

    def process(self, logits: np.ndarray, tokens: Sequence[int] = ()) -> np.ndarray:
        logits = np.asarray(logits, dtype=np.float32)
        for processor in self.processors:
            logits = processor(tokens, logits)
        return logits

    def __call__(self, logits: np.ndarray, tokens: Sequence[int] = ()) -> int:
        logits = self.process(logits, tokens)
        if self.params.temperature == 0:
            return int(np.argmax(logits))
        return self._draw(apply_warpers(logits, self.params))

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


# What fastllm reads of generation_config.json: key: (check, what the value must be)
_GEN_CHECKS = {k: _CHECKS[k] for k in ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")}
_GEN_CHECKS.update({
    "do_sample": (lambda v: isinstance(v, bool), "true or false"),
    "max_new_tokens": (lambda v: _whole(v) and v >= 1, "a whole number >= 1"),
    "max_length": (lambda v: _whole(v) and v >= 1, "a whole number >= 1"),
    "eos_token_id": (lambda v: (_whole(v) and v >= 0) or (isinstance(v, list) and all(
        _whole(i) and i >= 0 for i in v)), "a token id or a list of token ids"),
})


def read_generation_config(path) -> dict:
    """The generation settings of a generation_config.json, checked.

    Returns the keys fastllm uses (see _GEN_CHECKS) that the file sets;
    null values count as unset. A missing file gives {}.
    """
    path = Path(path)
    if not path.exists():
        return {}
    try:
        data = read_json(path, CONFIG_LIMIT, "generation_config.json")
    except ModelFileError as e:
        raise GenerationConfigError(path, e.problem) from None
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
