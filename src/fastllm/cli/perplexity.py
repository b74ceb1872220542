"""Perplexity of a model on a text, and its KL divergence from a base model,
scored the way llama.cpp's llama-perplexity scores them, so that the figures
of the two engines can be set side by side.

The method: the whole text is tokenized once, cut into non-overlapping
chunks of ctx tokens, and each chunk is run from position 0. Only the second
half of a chunk is scored (positions ctx/2 .. ctx-2 predict the next token),
so every scored token sees at least ctx/2 tokens of context. Where the
tokenizer starts a text with BOS, every chunk starts with BOS in place of
its first token, as llama.cpp does.

Everything is computed in float64 from each chunk's logits and then
dropped: what is kept is a handful of numbers per scored token (20k tokens
of a 49k vocabulary would be gigabytes of logits).
"""
from __future__ import annotations

import dataclasses
import importlib.util
import math
from pathlib import Path
from typing import Callable

import numpy as np

from ..spec.errors import FastLLMError

# No package on PyPI ships the wikitext-2 test set that llama.cpp's published
# figures use; gensim ships the Lee background corpus (300 ABC news stories,
# ~75k SmolLM2 tokens of plain English prose) in its wheel, so pip brings it.
CORPUS_PACKAGE = "gensim"
CORPUS_FILE = "test/test_data/lee_background.cor"
DEFAULT_CTX = 512
_ROWS = 64   # logits rows turned into float64 at a time (64 x 49k x 8 B = 25 MB)


class CorpusMissingError(FastLLMError):
    pass


def corpus_path() -> Path:
    """The bundled English corpus: the Lee background corpus in gensim."""
    # find_spec on a top-level name locates the package without importing it
    # (gensim's import pulls scipy, which reading one text file does not need).
    spec = importlib.util.find_spec(CORPUS_PACKAGE)
    folders = list(spec.submodule_search_locations or []) if spec is not None else []
    for folder in folders:
        path = Path(folder) / CORPUS_FILE
        if path.is_file():
            return path
    where = f"gensim at {folders[0]} lacks {CORPUS_FILE}" if folders else "gensim is not installed"
    raise CorpusMissingError(f"the default perplexity text comes from the gensim package ({where}): "
                             f"pip install gensim (or fastllm-engine[test]), or give a text file")


def corpus_text() -> str:
    return corpus_path().read_text(encoding="utf-8")


def read_text(path) -> str:
    path = Path(path)
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise ValueError(f"{path}: not UTF-8 text ({e.reason} at byte {e.start})") from None


def tokenize(model, text: str) -> list:
    """The token ids of text as the model's tokenizer encodes a whole text
    (with the BOS it adds, if any)."""
    return model._need_tokenizer().encode(text, add_special_tokens=True)


def chunk_bos(model) -> int | None:
    """The BOS id that every chunk starts with, where the tokenizer starts a
    text with BOS (llama.cpp's add_bos); else None."""
    tokenizer = model._need_tokenizer()
    bos = tokenizer.bos_token_id
    starts = tokenizer.encode("", add_special_tokens=True)[:1]
    return bos if bos is not None and starts == [bos] else None


# ------------------------------------------------------------------ figures

@dataclasses.dataclass(frozen=True)
class Estimate:
    """A mean and its standard error, as llama.cpp prints `value ± error`."""
    value: float
    error: float

    def __format__(self, spec):
        return f"{format(self.value, spec)} ± {format(self.error, spec)}"


@dataclasses.dataclass(frozen=True)
class Divergence:
    """How a model's next-token distributions differ from a base model's."""
    ppl_base: Estimate
    ln_ppl_ratio: Estimate        # ln(PPL(model) / PPL(base))
    ln_ppl_correlation: float     # of the per-token NLLs of the two models
    kld: Estimate                 # mean KL(base || model), nats per token
    kld_median: float
    kld_99: float                 # 99th percentile
    kld_max: float
    same_top: Estimate            # fraction of tokens where both argmaxes agree
    rms_dp: Estimate              # RMS of p_model(next) - p_base(next)


@dataclasses.dataclass(frozen=True)
class Perplexity:
    ctx: int
    chunks: int
    tokens: int                   # tokens scored
    ppl: Estimate
    kl: Divergence | None = None


def _mean(x: np.ndarray) -> Estimate:
    """Mean and standard error the way llama.cpp reckons them: the spread of
    the values over sqrt(n - 1); no error below 11 values."""
    n = x.size
    spread = float(np.var(x)) if n > 10 else 0.0
    return Estimate(float(np.mean(x)), math.sqrt(spread / (n - 1)) if spread > 0 else 0.0)


def _ppl(nll: np.ndarray) -> Estimate:
    log_ppl = _mean(nll)
    ppl = math.exp(log_ppl.value)
    return Estimate(ppl, ppl * log_ppl.error)   # d exp(x) = exp(x) dx


def _divergence(nll, nll_base, kld, same, p_diff) -> Divergence:
    n = nll.size
    a, b = _mean(nll), _mean(nll_base)
    cov = float(np.mean(nll * nll_base) - a.value * b.value) / (n - 1) if n >= 10 else 0.0
    ratio_error = math.sqrt(max(a.error ** 2 + b.error ** 2 - 2 * cov, 0.0))
    correlation = cov / (a.error * b.error) if a.error > 0 and b.error > 0 else float("nan")
    mse = _mean(p_diff ** 2)
    rms = math.sqrt(mse.value)
    top = float(np.mean(same))
    return Divergence(
        ppl_base=_ppl(nll_base),
        ln_ppl_ratio=Estimate(a.value - b.value, ratio_error),
        ln_ppl_correlation=correlation,
        kld=_mean(kld),
        kld_median=float(np.median(kld)),
        kld_99=float(np.percentile(kld, 99)),
        kld_max=float(np.max(kld)),
        same_top=Estimate(top, math.sqrt(top * (1 - top) / (n - 1)) if n > 1 else 0.0),
        rms_dp=Estimate(rms, 0.5 / rms * mse.error if rms > 0 else 0.0),
    )


# ------------------------------------------------------------------ scoring

def _log_softmax(rows: np.ndarray) -> np.ndarray:
    x = rows.astype(np.float64)
    x -= x.max(axis=1, keepdims=True)
    x -= np.log(np.exp(x).sum(axis=1, keepdims=True))
    return x


def _score_chunk(logits, targets, base_logits=None):
    """Per scored token: NLL, and against a base also its NLL, KL(base ||
    model), whether the top tokens agree and p(next) - p_base(next)."""
    out = {k: [] for k in ("nll", "nll_base", "kld", "same", "p_diff")}
    for start in range(0, len(targets), _ROWS):
        rows = slice(start, start + _ROWS)
        want = targets[rows]
        picked = np.arange(len(want))
        logp = _log_softmax(logits[rows])
        nll = -logp[picked, want]
        out["nll"].append(nll)
        if base_logits is None:
            continue
        logp_base = _log_softmax(base_logits[rows])
        nll_base = -logp_base[picked, want]
        out["nll_base"].append(nll_base)
        out["kld"].append(np.sum(np.exp(logp_base) * (logp_base - logp), axis=1))
        out["same"].append(np.argmax(logits[rows], axis=1) == np.argmax(base_logits[rows], axis=1))
        out["p_diff"].append(np.exp(-nll) - np.exp(-nll_base))
    return {k: np.concatenate(v) for k, v in out.items() if v}


def chunk_count(n_tokens: int, ctx: int, chunks: int | None = None) -> int:
    """Whole chunks of ctx tokens in n_tokens, at most chunks."""
    n = n_tokens // ctx
    return n if chunks is None else min(n, chunks)


def evaluate(model, ids, ctx: int = DEFAULT_CTX, base=None, chunks: int | None = None,
             bos: int | None = None, progress: Callable[[int, int, float], None] | None = None) -> Perplexity:
    """Perplexity of model on the token ids (and with base, a second Model on
    the same vocabulary, its divergence from base), over the first `chunks`
    whole chunks of ctx tokens (all of them by default). bos, when given,
    starts every chunk (see chunk_bos). progress(i, n, ppl) is called after
    each chunk with the running perplexity."""
    return evaluate_many([model], ids, ctx, base, chunks, bos, progress)[0]


def evaluate_many(models, ids, ctx: int = DEFAULT_CTX, base=None, chunks: int | None = None,
                  bos: int | None = None, progress: Callable[[int, int, float], None] | None = None) -> list:
    """evaluate() for several models on the same chunks, each against the
    same base: the base runs once per chunk however many models it is
    compared with. progress gets the running perplexity of the first model."""
    if isinstance(ctx, bool) or not isinstance(ctx, int) or ctx < 4:
        raise ValueError(f"ctx must be a whole number of at least 4 tokens, got {ctx!r}")
    if chunks is not None and (isinstance(chunks, bool) or not isinstance(chunks, int) or chunks < 1):
        raise ValueError(f"chunks must be a positive whole number, got {chunks!r}")
    models = list(models)
    ids = np.asarray(ids, dtype=np.int64)
    n_chunks = chunk_count(ids.size, ctx, chunks)
    if n_chunks == 0:
        raise ValueError(f"the text has {ids.size} tokens: at least one chunk of ctx={ctx} is needed")
    for m in models + ([] if base is None else [base]):
        if m.n_ctx < ctx:
            raise ValueError(f"{m.path}: loaded with a context of {m.n_ctx} tokens, less than ctx={ctx}")
        if base is not None and base.config.vocab_size != m.config.vocab_size:
            raise ValueError(f"the base model's vocabulary ({base.config.vocab_size} tokens) differs from "
                             f"{m.path}'s ({m.config.vocab_size}): their distributions cannot be compared")
    sessions = [m.new_session() for m in models]
    base_session = None if base is None else base.new_session()

    first = ctx // 2
    scored = [{} for _ in models]
    for i in range(n_chunks):
        chunk = ids[i * ctx:(i + 1) * ctx].copy()
        if bos is not None:
            chunk[0] = bos
        # The logits at positions first .. ctx-2 predict tokens first+1 .. ctx-1.
        base_logits = () if base is None else (base_session.logits(chunk)[first:ctx - 1],)
        for session, kept in zip(sessions, scored):
            logits = session.logits(chunk)[first:ctx - 1]
            for k, v in _score_chunk(logits, chunk[first + 1:], *base_logits).items():
                kept.setdefault(k, []).append(v)
            del logits
        if progress is not None:
            progress(i + 1, n_chunks, math.exp(float(np.mean(np.concatenate(scored[0]["nll"])))))
    return [_figures(ctx, n_chunks, {k: np.concatenate(v) for k, v in kept.items()}) for kept in scored]


def _figures(ctx: int, n_chunks: int, per_token: dict) -> Perplexity:
    nll = per_token["nll"]
    kl = None if "kld" not in per_token else _divergence(
        nll, per_token["nll_base"], per_token["kld"], per_token["same"], per_token["p_diff"])
    return Perplexity(ctx=ctx, chunks=n_chunks, tokens=nll.size, ppl=_ppl(nll), kl=kl)


# ------------------------------------------------------------------ report

def report(result: Perplexity) -> str:
    """The figures, worded and laid out like llama-perplexity's summary."""
    head = f"{result.chunks} chunks of {result.ctx} tokens, {result.tokens} tokens scored"
    if result.kl is None:
        return f"{head}\nFinal estimate: PPL = {result.ppl.value:.4f} +/- {result.ppl.error:.5f}"
    kl = result.kl
    ratio = math.exp(kl.ln_ppl_ratio.value)
    pct = Estimate(100 * kl.same_top.value, 100 * kl.same_top.error)
    rms = Estimate(100 * kl.rms_dp.value, 100 * kl.rms_dp.error)
    return "\n".join([
        head,
        "====== Perplexity statistics ======",
        f"Mean PPL(Q)                   : {result.ppl:10.6f}",
        f"Mean PPL(base)                : {kl.ppl_base:10.6f}",
        f"Cor(ln(PPL(Q)), ln(PPL(base))): {100 * kl.ln_ppl_correlation:6.2f}%",
        f"Mean ln(PPL(Q)/PPL(base))     : {kl.ln_ppl_ratio:10.6f}",
        f"Mean PPL(Q)/PPL(base)         : {ratio:10.6f} ± {ratio * kl.ln_ppl_ratio.error:10.6f}",
        "",
        "====== KL divergence statistics ======",
        f"Mean    KLD: {kl.kld:10.6f}",
        f"Maximum KLD: {kl.kld_max:10.6f}",
        f"99.0%   KLD: {kl.kld_99:10.6f}",
        f"Median  KLD: {kl.kld_median:10.6f}",
        "",
        "====== Token probability statistics ======",
        f"RMS Δp    : {rms:6.3f} %",
        f"Same top p: {pct:6.3f} %",
    ])
