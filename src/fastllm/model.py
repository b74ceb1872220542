"""Model: a loaded checkpoint with its tokenizer, and text generation."""
from __future__ import annotations

import os
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import numpy as np

from . import _core
from .config import ModelConfig
from .errors import ModelFileError
from .sampling import Sampler, SamplingParams, generation_defaults, read_generation_config
from .weights import load_weights

DTYPES = ("f32", "bf16")


class ContextFullWarning(UserWarning):
    """Generation stopped because the context (n_ctx tokens) is full."""


def physical_cores() -> int:
    """Cores available to this process, counting SMT siblings once: a second
    hyperthread adds no memory bandwidth or FMA units to a matmul."""
    try:
        allowed = os.sched_getaffinity(0)
    except AttributeError:
        allowed = set(range(os.cpu_count() or 1))
    cores = set()
    try:
        for cpu in allowed:
            siblings = Path(f"/sys/devices/system/cpu/cpu{cpu}/topology/thread_siblings_list")
            cores.add(siblings.read_text().strip())
    except OSError:
        return max(1, len(allowed))
    return max(1, len(cores))


@dataclass
class GenerationStats:
    prompt_tokens: int = 0
    prompt_seconds: float = 0.0
    generated_tokens: int = 0
    generate_seconds: float = 0.0
    finish_reason: str = ""   # "stop" (eos or stop string), "length" (max_new_tokens), "context" (n_ctx full)

    @property
    def prompt_tps(self) -> float:
        return self.prompt_tokens / self.prompt_seconds if self.prompt_seconds else 0.0

    @property
    def generate_tps(self) -> float:
        return self.generated_tokens / self.generate_seconds if self.generate_seconds else 0.0


class Model:
    """A model ready to generate. Build it with Model.from_pretrained."""

    def __init__(self, engine, config: ModelConfig, tokenizer, path: Path, dtype: str,
                 eos_token_ids: set, generation_config: dict | None = None):
        self._engine = engine
        self.config = config
        self.tokenizer = tokenizer
        self.path = path
        self.dtype = dtype
        self.eos_token_ids = eos_token_ids
        # The checked settings of generation_config.json, what they set of
        # generate/stream/chat's defaults, and the sampling those calls
        # start from: SamplingParams' defaults under the file's values.
        self.generation_config = dict(generation_config or {})
        self.generation_defaults = generation_defaults(self.generation_config)
        self.default_sampling = SamplingParams().replace(
            **{k: v for k, v in self.generation_defaults.items() if k != "max_new_tokens"})
        self.last_stats = GenerationStats()
        self._cached = []   # tokens whose keys/values are in the cache, in order

    # ------------------------------------------------------------- loading

    @classmethod
    def from_pretrained(cls, path=None, n_ctx: int | None = None, threads: int | None = None,
                        dtype: str = "f32", max_batch: int = 512) -> "Model":
        """Load a HF model folder (config.json, model.safetensors, tokenizer.json),
        a .gguf file (converted once into the cache), or with no path the
        default model, SmolLM2-135M-Instruct."""
        from .hub import resolve_model

        if dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {DTYPES}, got {dtype!r}")
        folder = Path(resolve_model(path))
        if not folder.is_dir():
            raise ModelFileError(folder, "not a model folder")
        config = ModelConfig.from_file(folder / "config.json")
        gen_config = read_generation_config(folder / "generation_config.json")
        seq_len = config.max_position_embeddings if n_ctx is None else int(n_ctx)
        if seq_len < 1:
            raise ValueError(f"n_ctx must be positive, got {n_ctx}")
        threads = physical_cores() if threads is None else int(threads)
        if threads < 1:
            raise ValueError(f"threads must be positive, got {threads}")

        weights = load_weights(config, folder, bf16=(dtype == "bf16"))
        cos, sin = config.rope_tables(seq_len)
        engine_config = {
            "dim": config.hidden_size, "hidden_dim": config.intermediate_size,
            "n_layers": config.num_hidden_layers, "n_heads": config.num_attention_heads,
            "n_kv_heads": config.num_key_value_heads, "head_dim": config.head_dim,
            "vocab_size": config.vocab_size, "seq_len": seq_len, "rope_dim": config.rope_dim,
            "norm_eps": config.rms_norm_eps, "attn_scale": config.head_dim ** -0.5,
            "wtype": np.uint16 if dtype == "bf16" else np.float32,
            "lin_k_heads": config.linear_num_key_heads, "lin_v_heads": config.linear_num_value_heads,
            "lin_k_dim": config.linear_key_head_dim, "lin_v_dim": config.linear_value_head_dim,
            "conv_kernel": config.linear_conv_kernel_dim,
        }
        engine = _core.Engine(engine_config, weights["layers"], weights["embed"], weights["norm"],
                              weights["lm_head"], cos, sin, max_batch=max_batch, n_threads=threads)
        # A folder without tokenizer.json still runs on token ids (logits,
        # generate_tokens); the text methods then say what is missing.
        tokenizer = None
        if (folder / "tokenizer.json").exists():
            from .tokenizer import Tokenizer
            tokenizer = Tokenizer.from_pretrained(folder)
        return cls(engine, config, tokenizer, folder, dtype, _eos_ids(gen_config, config, tokenizer),
                   gen_config)

    # ------------------------------------------------------------ settings

    @property
    def n_ctx(self) -> int:
        return self._engine.seq_len

    @property
    def threads(self) -> int:
        return self._engine.n_threads

    @threads.setter
    def threads(self, n: int):
        if int(n) < 1:
            raise ValueError(f"threads must be positive, got {n}")
        self._engine.n_threads = int(n)

    # ---------------------------------------------------------------- core

    def logits(self, token_ids) -> np.ndarray:
        """Logits of every position of token_ids run from position 0,
        shape (len(token_ids), vocab_size), float32."""
        ids = self._check_ids(token_ids)
        out = self._engine.forward(ids, 0, True)
        self._cached = list(ids)
        return out

    def _check_ids(self, token_ids) -> np.ndarray:
        ids = _core.check_token_ids(token_ids, self.config.vocab_size)
        if ids.size > self.n_ctx:
            raise ValueError(f"{ids.size} tokens do not fit the context of {self.n_ctx} "
                             "(load the model with a larger n_ctx)")
        return ids

    def _prefill(self, ids: list) -> np.ndarray:
        """Logits after ids, reusing the cached keys/values of a common prefix."""
        common = 0
        for a, b in zip(self._cached, ids):
            if a != b:
                break
            common += 1
        if self.config.layer_types and "linear_attention" in self.config.layer_types:
            # A recurrent state cannot be rewound: it is reused only when the
            # new prompt extends everything it has seen.
            if common < len(self._cached) or common == len(ids):
                common = 0
        common = min(common, len(ids) - 1)  # run at least one token to get logits
        logits = self._engine.forward(np.asarray(ids[common:], np.int32), common, False)
        self._cached = list(ids)
        return logits

    def generate_tokens(self, prompt_ids, max_new_tokens: int = 128, sampling: SamplingParams | None = None,
                        stop_token_ids=None) -> Iterator[int]:
        """Yield new token ids one by one. Stops at an end-of-sequence token
        (not yielded), after max_new_tokens, or when the context is full."""
        ids = list(self._check_ids(prompt_ids).tolist())
        if len(ids) >= self.n_ctx:
            raise ValueError(f"the prompt has {len(ids)} tokens: no room left in the context of "
                             f"{self.n_ctx} (load the model with a larger n_ctx)")
        sampler = Sampler(sampling or SamplingParams())
        stop_ids = self.eos_token_ids if stop_token_ids is None else set(stop_token_ids)
        stats = self.last_stats = GenerationStats(prompt_tokens=len(ids), finish_reason="length")
        t0 = time.perf_counter()
        logits = self._prefill(ids)
        stats.prompt_seconds = time.perf_counter() - t0
        for i in range(max_new_tokens):
            t0 = time.perf_counter()
            token = sampler(logits, ids)
            stats.generate_seconds += time.perf_counter() - t0
            if token in stop_ids:
                stats.finish_reason = "stop"
                return
            stats.generated_tokens += 1
            yield token
            ids.append(token)
            if len(ids) >= self.n_ctx:
                stats.finish_reason = "context"
                return
            if i + 1 < max_new_tokens:  # the last token's logits would go unused
                t0 = time.perf_counter()
                logits = self._engine.forward(np.asarray([token], np.int32), len(ids) - 1, False)
                stats.generate_seconds += time.perf_counter() - t0
                self._cached.append(token)

    # ---------------------------------------------------------------- text

    def stream(self, prompt: str, max_new_tokens: int | None = None, *, sampling: SamplingParams | None = None,
               stop=None, add_special_tokens: bool = True, **overrides) -> Iterator[str]:
        """Yield the continuation of prompt as text pieces, each a whole
        number of characters, as tokens are generated.

        sampling: the SamplingParams to use, else default_sampling (fastllm's
        defaults under the model's generation_config.json); keyword overrides
        (temperature=..., seed=..., any SamplingParams field; None leaves a
        setting as it is) are applied on top, and checked here, at the call.
        max_new_tokens: else default_max_new_tokens(). Afterwards
        last_stats.finish_reason says why generation ended; "context" (the
        context is full) also gives a ContextFullWarning."""
        params = self._sampling(sampling, overrides)
        ids = self._need_tokenizer().encode(prompt, add_special_tokens=add_special_tokens)
        n = self.default_max_new_tokens(len(ids)) if max_new_tokens is None else max_new_tokens
        return self._stream_ids(ids, n, params, stop)

    def _sampling(self, sampling: SamplingParams | None, overrides: dict) -> SamplingParams:
        base = self.default_sampling if sampling is None else sampling
        return base.replace(**{k: v for k, v in overrides.items() if v is not None})

    def default_max_new_tokens(self, n_prompt: int, fallback: int = 128) -> int:
        """generation_config.json's max_new_tokens, else what its max_length
        (which counts the prompt too, as in transformers) leaves, else fallback."""
        if "max_new_tokens" in self.generation_defaults:
            return self.generation_defaults["max_new_tokens"]
        limit = self.generation_config.get("max_length")
        return fallback if limit is None else max(limit - n_prompt, 0)

    def generate(self, prompt: str, max_new_tokens: int | None = None, **kwargs) -> str:
        """The continuation of prompt as one string (arguments as for stream)."""
        return "".join(self.stream(prompt, max_new_tokens, **kwargs))

    def chat(self, messages, max_new_tokens: int | None = None, stream: bool = False, *,
             sampling: SamplingParams | None = None, stop=None, template_kwargs: dict | None = None,
             **overrides):
        """Render messages with the model's chat template (as transformers
        does) and generate the assistant's reply. Settings as for stream;
        max_new_tokens falls back to 256."""
        params = self._sampling(sampling, overrides)
        text = self._need_tokenizer().apply_chat_template(messages, add_generation_prompt=True,
                                                          **(template_kwargs or {}))
        ids = self.tokenizer.encode(text, add_special_tokens=False)
        n = self.default_max_new_tokens(len(ids), 256) if max_new_tokens is None else max_new_tokens
        pieces = self._stream_ids(ids, n, params, stop)
        return pieces if stream else "".join(pieces)

    def _need_tokenizer(self):
        if self.tokenizer is None:
            raise ModelFileError(self.path / "tokenizer.json",
                                 "file not found: text in and out needs the model's tokenizer")
        return self.tokenizer

    def _stream_ids(self, ids, max_new_tokens, sampling, stop) -> Iterator[str]:
        stops = [stop] if isinstance(stop, str) else [s for s in (stop or []) if s]
        decoder = self.tokenizer.incremental_decoder(skip_special_tokens=True)
        held = ""   # text that may still turn out to begin a stop string
        tokens = self.generate_tokens(ids, max_new_tokens, sampling)
        try:
            for token in tokens:
                held += decoder.add(token)
                if not stops:
                    if held:
                        yield held
                        held = ""
                    continue
                hit = min((i for i in (held.find(s) for s in stops) if i >= 0), default=-1)
                if hit >= 0:
                    if held[:hit]:
                        yield held[:hit]
                    self.last_stats.finish_reason = "stop"
                    return
                keep = _partial_stop_suffix(held, stops)
                if len(held) > keep:
                    yield held[:len(held) - keep]
                    held = held[len(held) - keep:]
            held += decoder.flush()
            if stops:
                hit = min((i for i in (held.find(s) for s in stops) if i >= 0), default=-1)
                if hit >= 0:
                    held = held[:hit]
                    self.last_stats.finish_reason = "stop"
            if held:
                yield held
            if self.last_stats.finish_reason == "context":
                warnings.warn(f"the context is full ({self.n_ctx} tokens): generation stopped early; "
                              "load the model with a larger n_ctx", ContextFullWarning, stacklevel=3)
        finally:
            tokens.close()

    def __repr__(self):
        return (f"Model({str(self.path)!r}, model_type={self.config.model_type!r}, "
                f"dtype={self.dtype!r}, n_ctx={self.n_ctx}, threads={self.threads})")


def _partial_stop_suffix(text: str, stops) -> int:
    """Length of the longest end of text that is a proper prefix of a stop string."""
    best = 0
    for s in stops:
        for n in range(min(len(s) - 1, len(text)), best, -1):
            if text.endswith(s[:n]):
                best = n
                break
    return best


def _eos_ids(gen_config: dict, config: ModelConfig, tokenizer) -> set:
    """End-of-sequence ids as transformers' generate uses them: those of
    generation_config.json (an id or a list), else config.json's, else the
    tokenizer's eos token."""
    eos = gen_config.get("eos_token_id")
    ids = [] if eos is None else list(eos) if isinstance(eos, list) else [eos]
    if not ids:
        ids = list(config.eos_token_id)
    if not ids and tokenizer is not None and tokenizer.eos_token_id is not None:
        ids = [tokenizer.eos_token_id]
    return {int(i) for i in ids}
