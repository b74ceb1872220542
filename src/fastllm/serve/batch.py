"""Several prompts decoded together by the batch engine (continuous batching):
each result is exactly what Model.generate(_tokens) gives for that prompt alone.
Functions of a Model (they were its methods; the engine is a floor above it).
"""
from __future__ import annotations

from ..generate.model import Model, _stop_strings, _token_limit
from ..generate.sampling import SamplingParams
from ..generate.textstream import TextStream
from .serving import BatchEngine


def generate_tokens_batch(model: Model, prompts_ids, max_new_tokens: int = 128,
                          sampling: SamplingParams | None = None, stop_token_ids=None,
                          speculative=None) -> list:
    """New token ids for several prompts, decoded together (continuous
    batching, fastllm.serve.serving.BatchEngine): each step runs one token of
    every unfinished prompt in a single pass over the weights, on
    sessions of their own. Each list is exactly what generate_tokens
    gives for that prompt alone, whatever the others are (greedy, or
    sampled: every prompt draws from its own generator seeded with
    sampling.seed). speculative: as for generate_tokens ("ngram" or a
    draft Model; None: the model's setting, False: none)."""
    n = len(prompts_ids)
    if n == 0:
        return []
    chunk = min(max(len(p) for p in prompts_ids), model.max_batch)
    # (the model's "mtp" setting is Model.generate's alone: the engine drafts otherwise)
    spec = (None if model.speculative == "mtp" else model.speculative) if speculative is None \
        else speculative or None
    engine = BatchEngine(model, parallel=n, max_queue=n, prefill_chunk=max(chunk, model.draft_max + 1, 1),
                         speculative=spec, draft_max=model.draft_max)
    try:
        requests = [engine.submit(ids, max_new_tokens, sampling, stop_token_ids) for ids in prompts_ids]
        return [list(r) for r in requests]
    finally:
        engine.close()


def generate_batch(model: Model, prompts, max_new_tokens: int | None = None, *,
                   sampling: SamplingParams | None = None, stop=None,
                   add_special_tokens: bool = True, **overrides) -> list:
    """The continuations of several prompts (a list of str), decoded
    together (see generate_tokens_batch): each is exactly what generate
    gives for that prompt alone. Settings as for stream."""
    max_new_tokens = _token_limit(max_new_tokens, overrides)
    params = model._sampling(sampling, overrides)
    stops = _stop_strings(stop)
    tok = model._need_tokenizer()
    ids = [model._encode(p, add_special_tokens) for p in prompts]
    n = max((model.default_max_new_tokens(len(i)) for i in ids), default=0) \
        if max_new_tokens is None else max_new_tokens
    outs = generate_tokens_batch(model, ids, n, params)
    texts = []
    for i, out in zip(ids, outs):
        limit = model.default_max_new_tokens(len(i)) if max_new_tokens is None else n
        text = TextStream(tok, stops)
        texts.append("".join(text.feed(t) for t in out[:limit] + [None]))
    return texts
