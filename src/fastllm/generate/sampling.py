"""Choosing the next token from logits.

The steps and their order follow transformers' generate: repetition penalty,
then temperature, top-k, top-p and min-p, then a draw. Temperature 0 is
greedy decoding. A seed makes every draw reproducible: the uniform number
behind the token at position p of a sequence is a pure function of (seed,
p), SplitMix64's p-th output keyed by the seed, so a draw never depends on
how many draws came before (speculative decoding may verify a position
and throw it away; the text is the same as without it). OpenAI's frequency
and presence penalties and logit bias come after the repetition penalty,
then the caller's logits processors, then a constraint's mask (constrained
decoding), before temperature.

The repetition penalty works as transformers' does (a seen token's logit is
divided by the penalty when positive, multiplied when negative) over the
tokens the prompt and the reply hold so far: all of them by default, as
transformers does, or only the last repeat_last_n, as llama.cpp does.
"""
from __future__ import annotations

import dataclasses
import math
import numbers
import secrets
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Protocol, Sequence

import numpy as np

from ..spec.config import CONFIG_LIMIT, read_json
from ..spec.errors import ModelFileError

# A logits processor, as in mlx-lm: (tokens so far, logits) -> new logits.
LogitsProcessor = Callable[[Sequence[int], np.ndarray], np.ndarray]


def _number(v):
    """A finite real number (inf and nan are refused everywhere)."""
    return isinstance(v, numbers.Real) and not isinstance(v, bool) and math.isfinite(v)


def _whole(v):
    return isinstance(v, numbers.Integral) and not isinstance(v, bool)


# A penalty beyond this only flattens or inverts every seen logit further
# (1e308 turns them to 0 or -inf): it is never what a caller means.
MAX_REPETITION_PENALTY = 100.0
MAX_LOGIT_BIAS = 100.0

# What each setting must be, for SamplingParams and generation_config.json alike:
# key: (check, what the value must be)
_CHECKS = {
    "temperature": (lambda v: _number(v) and v >= 0, "a number >= 0"),
    "top_p": (lambda v: _number(v) and 0 < v <= 1, "a number in (0, 1]"),
    "top_k": (lambda v: _whole(v) and v >= 0, "a whole number >= 0"),
    "min_p": (lambda v: _number(v) and 0 <= v <= 1, "a number in [0, 1]"),
    "repetition_penalty": (lambda v: _number(v) and 0 < v <= MAX_REPETITION_PENALTY,
                           f"a number > 0 and <= {MAX_REPETITION_PENALTY:g}"),
    "repeat_last_n": (lambda v: _whole(v) and v >= -1,
                      "-1 (all tokens), 0 (none) or a positive count"),
    # a 64-bit word: what clients send (OpenAI's seed, llama.cpp's)
    "seed": (lambda v: v is None or (_whole(v) and 0 <= v < 2**64),
             "a whole number from 0 to 2**64-1, or None"),
    "frequency_penalty": (lambda v: _number(v) and -2 <= v <= 2, "a number in [-2, 2]"),
    "presence_penalty": (lambda v: _number(v) and -2 <= v <= 2, "a number in [-2, 2]"),
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
    # OpenAI's penalties, over the generated tokens: a token's logit less
    # frequency_penalty * its count, less presence_penalty if it came at all.
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    # Added to the logits of some tokens: {token id: bias in [-100, 100]},
    # held as sorted (id, bias) pairs. Ids are checked against the model's
    # vocabulary where it is known (check_vocabulary).
    logit_bias: tuple = ()

    def __post_init__(self):
        for key, (ok, want) in _CHECKS.items():
            value = getattr(self, key)
            if not ok(value):
                raise ValueError(f"{key} must be {want}, got {value!r}")
        object.__setattr__(self, "logit_bias", _logit_bias(self.logit_bias))

    def replace(self, **changes) -> "SamplingParams":
        """A copy with some settings changed (an unknown name is a TypeError)."""
        return dataclasses.replace(self, **changes)

    def check_vocabulary(self, vocab_size: int) -> "SamplingParams":
        """self, once every logit_bias id is a token of the vocabulary."""
        for token, _ in self.logit_bias:
            if token >= vocab_size:
                raise ValueError(f"logit_bias: token id {token} is outside the vocabulary "
                                 f"(0..{vocab_size - 1})")
        return self


def as_params(sampling) -> SamplingParams:
    """sampling, or the defaults for None; TypeError for anything but a
    SamplingParams (a dict of settings is SamplingParams(**settings))."""
    if sampling is None:
        return SamplingParams()
    if not isinstance(sampling, SamplingParams):
        raise TypeError(f"sampling must be a SamplingParams (SamplingParams(**settings) makes one), "
                        f"got {type(sampling).__name__} {sampling!r:.80}")
    return sampling


def _logit_bias(bias) -> tuple:
    """bias (a dict or (id, bias) pairs) as sorted pairs, each checked."""
    items = bias.items() if isinstance(bias, dict) else bias
    try:
        pairs = [(k, v) for k, v in items]
    except (TypeError, ValueError):
        raise ValueError(f"logit_bias must map token ids to numbers, got {bias!r}") from None
    for token, value in pairs:
        if not _whole(token) or token < 0:
            raise ValueError(f"logit_bias: token ids must be whole numbers >= 0, got {token!r}")
        if not _number(value) or abs(value) > MAX_LOGIT_BIAS:
            raise ValueError(f"logit_bias: the bias of token {token} must be a number in "
                             f"[-{MAX_LOGIT_BIAS:g}, {MAX_LOGIT_BIAS:g}], got {value!r}")
    return tuple(sorted((int(k), float(v)) for k, v in dict(pairs).items()))


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


def logit_bias(bias) -> LogitsProcessor:
    """OpenAI's logit_bias as a logits processor: (id, bias) pairs added."""
    ids = np.array([k for k, _ in bias], dtype=np.int64)
    values = np.array([v for _, v in bias], dtype=np.float32)

    def apply(tokens, logits):
        logits = logits.copy()
        logits[ids] += values
        return logits
    return apply


def openai_penalties(p: SamplingParams, counts: dict) -> LogitsProcessor:
    """OpenAI's frequency and presence penalties as a logits processor over
    counts ({token: times generated}, kept up to date by the caller)."""
    def apply(tokens, logits):
        if not counts:
            return logits
        ids = np.fromiter(counts.keys(), np.int64, len(counts))
        n = np.fromiter(counts.values(), np.float32, len(counts))
        logits = logits.copy()
        logits[ids] -= p.frequency_penalty * n + p.presence_penalty
        return logits
    return apply


def logits_processors(p: SamplingParams, counts: dict | None = None) -> list:
    """The processors that p asks for, in order: the repetition penalty,
    OpenAI's penalties (over counts, the generated tokens counted), the
    logit bias."""
    out = []
    if p.repetition_penalty != 1.0 and p.repeat_last_n != 0:
        out.append(repetition_penalty(p.repetition_penalty, p.repeat_last_n))
    if counts is not None and (p.frequency_penalty or p.presence_penalty):
        out.append(openai_penalties(p, counts))
    if p.logit_bias:
        out.append(logit_bias(p.logit_bias))
    return out


class Constraint(Protocol):
    """What constrained decoding gives a Sampler (one per request: it keeps
    the request's state, such as where a grammar has got to)."""

    def mask(self, logits: np.ndarray) -> np.ndarray:
        """logits with every token the constraint disallows now set to -inf."""

    def accept(self, token: int) -> None:
        """Note the token chosen (after mask)."""

    @property
    def done(self) -> bool:
        """True once the output is complete: generation ends ("stop")."""


_MASK64 = (1 << 64) - 1
_GOLDEN = 0x9E3779B97F4A7C15


def _mix64(z: int) -> int:
    """SplitMix64's finaliser: a bijection of 64-bit words that scatters
    every input bit over the output."""
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return z ^ (z >> 31)


def uniform_at(seed: int, position: int) -> float:
    """The uniform number in [0, 1) of the draw at position of a sequence
    under seed: output position of SplitMix64 started at mix(seed), so
    that nearby seeds give unrelated streams. 53 random bits, as numpy's
    doubles."""
    z = _mix64((_mix64(seed & _MASK64) + (position + 1) * _GOLDEN) & _MASK64)
    return (z >> 11) * 2.0 ** -53


class Sampler:
    """Picks tokens: the logits processors (those of the params, then the
    caller's own), a constraint's mask, then the argmax at temperature 0,
    else a draw after the warpers, with the uniform number uniform_at(seed,
    position) (params.seed, or one drawn at random for the Sampler).

    A Sampler serves one generation: it counts the tokens it chose (for the
    frequency and presence penalties) and tells its constraint of each."""

    def __init__(self, params: SamplingParams, processors: Sequence[LogitsProcessor] = (),
                 constraint: Constraint | None = None):
        self.params = params
        # token -> times chosen, kept only for a penalty that reads it
        self._counts = {} if params.frequency_penalty or params.presence_penalty else None
        self.processors = logits_processors(params, self._counts) + list(processors)
        self.constraint = constraint
        self.seed = secrets.randbits(64) if params.seed is None else params.seed

    def process(self, logits: np.ndarray, tokens: Sequence[int] = ()) -> np.ndarray:
        logits = np.asarray(logits, dtype=np.float32)
        for processor in self.processors:
            logits = processor(tokens, logits)
        return logits

    def __call__(self, logits: np.ndarray, tokens: Sequence[int] = (), position: int | None = None) -> int:
        """The token after tokens (the sequence so far, prompt included),
        at position len(tokens) unless given."""
        if not np.isfinite(np.max(logits)):
            raise FloatingPointError("the model's logits are NaN or infinite (its weights overflow: a scale "
                                     "or norm far out of range?); no token can be chosen from them")
        logits = self.process(logits, tokens)
        if self.constraint is not None:
            logits = self.constraint.mask(logits)
        best = np.max(logits)
        if not np.isfinite(best):   # NaN, +inf, or every token ruled out (-inf): nothing to draw from
            by = "the logits processors and the constraint" if self.constraint is not None else \
                "the logits processors"
            raise ValueError(f"no token can be chosen: after {by} the largest logit is {best}"
                             + (" (every token is ruled out)" if best == -np.inf else ""))
        if self.params.temperature == 0:
            token = int(np.argmax(logits))
        else:
            at = len(tokens) if position is None else position
            token = self._draw(apply_warpers(logits, self.params), uniform_at(self.seed, at))
        if self._counts is not None:
            self._counts[token] = self._counts.get(token, 0) + 1
        if self.constraint is not None:
            self.constraint.accept(token)
        return token

    @property
    def done(self) -> bool:
        """True when the constraint says the output is complete."""
        return self.constraint is not None and bool(self.constraint.done)

    @staticmethod
    def _draw(probs: np.ndarray, uniform: float) -> int:
        # Inverse-CDF draw in float64.
        cdf = np.cumsum(probs, dtype=np.float64)
        u = uniform * cdf[-1]
        return int(min(np.searchsorted(cdf, u, side="right"), len(probs) - 1))


def apply_warpers(logits: np.ndarray, p: SamplingParams) -> np.ndarray:
    """Probabilities after temperature, top-k, top-p and min-p filtering."""
    with np.errstate(over="ignore"):
        scores = logits.astype(np.float64) / p.temperature
    if not np.isfinite(scores.max()):
        # A temperature so small (5e-324) that the scores overflow: all the
        # mass goes to the best tokens, as it does in the limit.
        scores = np.where(logits == logits.max(), 0.0, -np.inf)
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
    return check_generation_config(data, path)


def check_generation_config(data, path) -> dict:
    """The keys fastllm uses (see _GEN_CHECKS) that data sets, checked: the
    settings of a generation_config.json, or of a GGUF file's metadata,
    path naming where they come from."""
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
