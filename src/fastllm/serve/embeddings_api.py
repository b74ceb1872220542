"""OpenAI's /v1/embeddings, and llama-server's /tokenize and /detokenize,
as plain functions: a request body read and checked into what runs, and
the results shaped as those APIs return them. Nothing here speaks HTTP.

An embedding input is a string, an array of token ids, or an array of
either (llama-server also takes {"content": [text parts]} and
{"prompt_string": ...} entries, and an array mixing strings and ids as one
prompt). Each is tokenized with the model's special tokens, run alone, and
pooled as the model pools (fastllm.generate.embeddings); the vectors are
normalized unless "normalize": false asks otherwise, and cut to
"dimensions" first where it is given, as OpenAI's shortened embeddings are.
"""
from __future__ import annotations

import base64
import numbers
from dataclasses import dataclass

import numpy as np

from . import openai_api as api
from ..generate.embeddings import embed_ids
from .openai_api import APIError
from ..tokenizer.errors import TokenizerError
from ..tokenizer import decoders

MAX_INPUTS = 2048           # inputs in one request, as OpenAI's
MAX_TOKENS = 300_000        # tokens summed over them, as OpenAI's


def _whole(v) -> bool:
    return isinstance(v, numbers.Integral) and not isinstance(v, bool)


@dataclass
class EmbeddingJob:
    ids: list               # token ids of each input
    normalize: bool
    dimensions: int | None
    base64: bool

    @property
    def tokens(self) -> int:
        return sum(len(i) for i in self.ids)


def read_request(body: dict, model) -> EmbeddingJob:
    """A /v1/embeddings body as an EmbeddingJob, every field checked before
    anything is tokenized past what the context holds."""
    fmt = api.field_of(body, "encoding_format", str, "float")
    if fmt not in ("float", "base64"):
        raise APIError(400, f"'encoding_format' must be 'float' or 'base64', got {fmt[:40]!r}",
                       param="encoding_format")
    normalize = api.field_of(body, "normalize", bool, True)
    pooling = model.pooling
    if pooling.unsupported:
        raise APIError(400, f"{model.name} cannot give embeddings: {pooling.unsupported}", param="model")
    size = model.config.hidden_size * len(pooling.modes)
    dimensions = api.field_of(body, "dimensions", int, None, 1, size)
    items = _inputs(body.get("input"))
    ids, total = [], 0
    for i, item in enumerate(items):
        got = _input_ids(item, model, f"input[{i}]" if isinstance(body.get("input"), list) and
                         len(items) > 1 else "input")
        total += len(got)
        if total > MAX_TOKENS:
            raise APIError(400, f"the inputs have more than {MAX_TOKENS} tokens together", param="input")
        ids.append(got)
    return EmbeddingJob(ids, normalize, dimensions, fmt == "base64")


def _inputs(value) -> list:
    """The inputs of `input`: one, or each of an array of them."""
    what = ("'input' must be a string, an array of token ids, or a non-empty array of strings or "
            "token id arrays")
    if isinstance(value, (str, dict)):
        return [value]
    if not isinstance(value, list) or not value:
        raise APIError(400, what, param="input")
    if all(_whole(t) for t in value):
        return [value]
    if any(_whole(t) for t in value):
        if all(_whole(t) or isinstance(t, str) for t in value):
            return [value]   # strings and ids, one prompt (llama-server's mixed form)
        raise APIError(400, what, param="input")
    if len(value) > MAX_INPUTS:
        raise APIError(400, f"'input' has {len(value)} entries: at most {MAX_INPUTS} are taken", param="input")
    return value


def _input_ids(item, model, where: str) -> list:
    if isinstance(item, dict):
        item = _entry_text(item, where)
    if isinstance(item, str):
        ids = _encode(model, item, True, where)
    elif isinstance(item, list) and all(_whole(t) or isinstance(t, str) for t in item):
        ids = []
        for k, part in enumerate(item):   # strings among ids: the first alone has special tokens
            ids += _encode(model, part, k == 0, where) if isinstance(part, str) else [part]
    else:
        raise APIError(400, f"'{where}' must be a string or an array of token ids", param="input")
    if not ids:
        raise APIError(400, f"'{where}' has no tokens to embed", param="input")
    vocab = model.config.vocab_size
    bad = next((t for t in ids if not 0 <= t < vocab), None)
    if bad is not None:
        raise APIError(400, f"'{where}' token id {bad} is outside the vocabulary (0..{vocab - 1})",
                       param="input")
    if len(ids) > model.n_ctx:
        raise APIError(400, f"'{where}' is too large: {len(ids)} tokens, the context holds {model.n_ctx}",
                       param="input", code="context_length_exceeded")
    return [int(t) for t in ids]


def _entry_text(entry: dict, where: str) -> str:
    """llama-server's object entries: {"prompt_string": ...} or {"content": [text parts]}."""
    if isinstance(entry.get("prompt_string"), str):
        return entry["prompt_string"]
    content = entry.get("content")
    if isinstance(content, list) and content:
        return "".join(_text_part(p, f"{where}.content[{k}]") for k, p in enumerate(content))
    raise APIError(400, f"'{where}' must be a string, token ids, {{\"prompt_string\": ...}} or "
                        "{\"content\": [text parts]}", param="input")


def _text_part(part, where: str) -> str:
    kind = part.get("type") if isinstance(part, dict) else None
    if kind == "text" and isinstance(part.get("text"), str):
        return part["text"]
    if kind in ("image_url", "input_audio", "input_video", "input_image", "image", "file"):
        raise APIError(400, f"'{where}' is of type {kind!r}: this model reads text only", param="input")
    raise APIError(400, f"'{where}' must be a text part ({{\"type\": \"text\", \"text\": ...}})", param="input")


def _encode(model, text: str, add_special_tokens: bool, where: str) -> list:
    try:
        return api.encode(model, text, add_special_tokens, where)
    except APIError as e:
        if e.code == "context_length_exceeded":
            raise APIError(400, f"'{where}' is too large: {e}", param="input",
                           code="context_length_exceeded") from None
        raise


def run(job: EmbeddingJob, served, cancelled):
    """The vectors of job, computed on served's embedding session; None
    once cancelled (a threading.Event, looked at between inputs)."""
    out = []
    for ids in job.ids:
        if cancelled.is_set():
            return None
        out.append(embed_ids(served.model, served.embed_session, ids, None, job.normalize, job.dimensions))
    return out


def response(job: EmbeddingJob, vectors, model_name: str) -> dict:
    def encoded(v):
        return base64.b64encode(np.asarray(v, "<f4").tobytes()).decode() if job.base64 else v.tolist()
    return {"object": "list", "model": model_name,
            "data": [{"object": "embedding", "index": i, "embedding": encoded(v)} for i, v in enumerate(vectors)],
            "usage": {"prompt_tokens": job.tokens, "total_tokens": job.tokens}}


# ---------------------------------------------------------------- tokens

def tokenize(body: dict, model) -> dict:
    """llama-server's /tokenize: {"content": text, or strings and ids,
    "add_special": false, "with_pieces": false} -> {"tokens": [...]},
    with pieces [{"id", "piece"}], a piece that is not whole UTF-8 given
    as its bytes."""
    add_special = api.field_of(body, "add_special", bool, False)
    with_pieces = api.field_of(body, "with_pieces", bool, False)
    if api.field_of(body, "parse_special", bool, True) is False:
        raise APIError(400, "'parse_special': false is not supported: special tokens in the text are "
                            "always read as such", param="parse_special")
    content = body.get("content")
    if content is None:
        return {"tokens": []}
    tokenizer = model.tokenizer
    if isinstance(content, str):
        ids = _plain_encode(tokenizer, content, add_special)
    elif isinstance(content, list) and all(_whole(t) or isinstance(t, str) for t in content):
        ids = []
        for k, part in enumerate(content):
            ids += _plain_encode(tokenizer, part, add_special and k == 0) if isinstance(part, str) else [part]
        _check_ids(ids, model, "content")
    else:
        raise APIError(400, "'content' must be a string, or an array of strings and token ids",
                       param="content")
    if not with_pieces:
        return {"tokens": [int(t) for t in ids]}
    pieces = {}   # a text repeats its tokens: each is decoded once
    for t in ids:
        if t not in pieces:
            pieces[t] = piece(tokenizer, int(t))
    return {"tokens": [{"id": int(t), "piece": pieces[t]} for t in ids]}


def _plain_encode(tokenizer, text: str, add_special: bool) -> list:
    try:
        return tokenizer.encode(text, add_special_tokens=add_special)
    except TokenizerError as e:
        raise APIError(400, f"the content cannot be tokenized: {e}", param="content") from None


def detokenize(body: dict, model) -> dict:
    """llama-server's /detokenize: {"tokens": [ids]} -> {"content": text},
    special tokens written out."""
    tokens = body.get("tokens")
    if tokens is None:
        return {"content": ""}
    if not isinstance(tokens, list) or not all(_whole(t) for t in tokens):
        raise APIError(400, "'tokens' must be an array of token ids", param="tokens")
    _check_ids(tokens, model, "tokens")
    return {"content": model.tokenizer.decode([int(t) for t in tokens])}


def _check_ids(ids, model, param: str):
    vocab = model.config.vocab_size
    bad = next((t for t in ids if not 0 <= t < vocab), None)
    if bad is not None:
        raise APIError(400, f"'{param}' holds token id {bad}, outside the vocabulary (0..{vocab - 1})",
                       param=param)


def piece(tokenizer, token: int):
    """A token's text, or its bytes where they are not whole UTF-8 (part
    of a character), as llama-server gives them."""
    text = tokenizer.decode([token])
    if "\ufffd" not in text:
        return text
    name = tokenizer.id_to_token(token)
    if name is None:
        return text
    value = decoders.byte_token_value(name)
    if value is not None:
        return [value]
    if decoders.uses(tokenizer.decoder, decoders.ByteLevel):
        raw = decoders.token_bytes(name)
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError:
            return list(raw)
    return text
