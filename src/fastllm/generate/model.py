"""Model: a loaded checkpoint with its tokenizer, and text generation."""
from __future__ import annotations

import itertools
import numbers
import os
import threading
import time
import warnings
from contextlib import contextmanager
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Iterator

import numpy as np

from ..core import _core
from ..spec import schema
from ..spec.config import KV_DTYPES, ModelConfig
from ..spec.end_of_generation import end_of_generation_ids, finish_reason
from ..spec.errors import ModelFileError
from ..formats.gguf import read_gguf_model
from ..formats.safetensors import Checkpoint
from .sampling import (Constraint, Sampler, SamplingParams, as_params, check_generation_config,
                       generation_defaults, read_generation_config)
from .session import Session
from .speculative import Speculation, speculation
from .textstream import TextStream
from ..formats.quants import MIXES
from ..load.weights import load_gguf_weights, load_weights
from ..load import pack_cache
from ..load.hub import gguf_tokenizer_dir, locate, model_name, resolve_model
from ..tokenizer import Tokenizer
from .constrain import reply_grammar
from .toolcalls import reasoning_mode
from .embeddings import Pooling, embed_ids, gguf_pooling, read_pooling
from ..formats.gguf_tensors import read_contents

# Weights as stored: f32 and bf16 for any model; "gguf" (the default for a
# GGUF file) keeps every tensor of a GGUF file in its own type; a
# quantization mix quantizes a folder's matrices at load, as llama-quantize
# would (see formats.quants.plan).
QUANT_MIXES = tuple(m for m in MIXES if m.startswith("q"))
DTYPES = ("f32", "bf16", "gguf") + QUANT_MIXES
# Activations of quantized matmuls: int8 blocks (as llama.cpp), or fp32
# with the exact dequantized weights (slower: for checking the weights).
ACTIVATIONS = ("int8", "f32")
# The KV cache: f32 keeps attention exact; bf16 and f16 halve what it reads
# (keys and values rounded once when stored, nearest-even).


# A State's work buffers hold every intermediate of a pass for each of its
# tokens: a long prompt runs in passes of as many tokens as fit in this many
# bytes of them, not all at once. On a 2B shape a pass of 256 tokens costs
# the same CPU time per token as one of 512, one of 128 about 3% more
# (benchmarks/forward_speed.c). Passes of 512 gain little more (a 512-token
# prompt 3.5% faster on Gemma-3-1B, 1.4% on SmolLM2-135M, 2 threads), so
# they are taken only where their buffers need half of this: Gemma-3-1B's
# need 52 MiB, 22 MiB of peak memory more than passes of 256.
WORK_BUFFER_BYTES = 64 << 20


def pass_tokens(weights: _core.Weights) -> int:
    """Tokens per pass: 512 where their work buffers take at most half of
    WORK_BUFFER_BYTES, else the most of 256 and 128 whose buffers fit it
    (64 at least)."""
    if weights.work_bytes(512) <= WORK_BUFFER_BYTES // 2:
        return 512
    for n in (256, 128):
        if weights.work_bytes(n) <= WORK_BUFFER_BYTES:
            return n
    return 64


class ContextFullWarning(UserWarning):
    """Generation stopped because the context (n_ctx tokens) is full."""


class ResourceLimitWarning(UserWarning):
    """A setting asked for more than this machine has and was capped."""


def _whole(v) -> bool:
    return isinstance(v, numbers.Integral) and not isinstance(v, bool)


def available_cpus() -> int:
    """CPUs this process may run on."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:
        return os.cpu_count() or 1


def usable_threads(n) -> int:
    """n as a thread count: a whole number >= 1, capped (with a warning) at
    the CPUs available, since more threads than CPUs only contend and
    OpenMP may fail to create them."""
    if not _whole(n) or n < 1:
        raise ValueError(f"threads must be a whole number >= 1, got {n!r}")
    cpus = available_cpus()
    if n > cpus:
        warnings.warn(f"{n} threads asked for, but this process may use {cpus} CPUs: "
                      f"{cpus} threads are used", ResourceLimitWarning, stacklevel=3)
        return cpus
    return int(n)


def physical_memory() -> int:
    """Bytes of RAM on this machine (a large number where unknown)."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return 1 << 50


def check_sizes(config: ModelConfig, folder: Path):
    """ModelFileError unless the checkpoint's tensors (read from the file
    headers alone) have the shapes config.json implies: a config whose
    sizes are absurd is refused before anything is allocated from them."""
    with Checkpoint(folder) as ck:
        # Every layer has tensors of its own: a count past them is refused
        # before anything is worked out per layer.
        if config.num_hidden_layers > len(ck.where):
            raise ModelFileError(config.path or folder, f"num_hidden_layers is {config.num_hidden_layers}, but the "
                                                        f"checkpoint beside it holds only {len(ck.where)} tensors")
        wanted = [(schema.hf_name(schema.EMBED, config), schema.hf_shape(schema.EMBED, config))]
        wanted += [(schema.hf_name(t, config), schema.hf_shape(t, config))
                   for t in schema.PER_LAYER_MODEL if getattr(config, t.switch)]
        for i, lc in enumerate(config.layer_configs()):
            wanted += [entry for t in schema.file_tensors(lc, config.layer_kind(i), config.layer_ffn(i))
                       for entry in schema.hf_entries(t, lc, i)]
        seen = set()
        for name, shape in wanted:
            if name in seen:   # the attention gate is read from q_proj, checked with it
                continue
            seen.add(name)
            f = ck.file_of(name)
            if f.shape(name) != shape:
                raise ModelFileError(f.path, f"tensor {name!r} has shape {list(f.shape(name))}, "
                                             f"config.json implies {list(shape)}")


# The default context is the model's max_position_embeddings up to this many
# positions: the RoPE tables and each session's attention rows are made for
# the whole context when the model loads, whatever a config claims. A
# longer one is asked for with n_ctx.
DEFAULT_MAX_CTX = 1 << 17


def context_size(config: ModelConfig, n_ctx, kv_dtype: str, threads: int, max_n_ctx: int | None = None,
                 max_pass: int = 512) -> int:
    """The context length to load with, checked before anything is allocated.

    n_ctx None means the model's max_position_embeddings (at most
    max_n_ctx, where given), capped with a warning at DEFAULT_MAX_CTX, and
    where that context (RoPE tables, a full KV cache) would need more than
    half the RAM, at what fits. An n_ctx asked for explicitly that needs
    more than the RAM is refused. (Passes of max_pass tokens size the
    sliding-window layers' rings.)"""
    memory = physical_memory()

    def needs(n):
        return config.context_bytes(n, kv_dtype, threads, max_pass, _core.KEY_BLOCK)

    if n_ctx is None:
        n_ctx = config.max_position_embeddings if max_n_ctx is None else \
            min(config.max_position_embeddings, max_n_ctx)
        cap, why = min(n_ctx, DEFAULT_MAX_CTX), "the default's bound"
        if needs(cap) > memory // 2:
            fits, over = 1, cap   # the most that fits, by bisection (what a context needs only grows)
            while over - fits > 1:
                mid = (fits + over) // 2
                fits, over = (mid, over) if needs(mid) <= memory // 2 else (fits, mid)
            cap, why = fits, "half this machine's RAM"
        if cap < n_ctx:
            warnings.warn(f"{config.path}: max_position_embeddings is {n_ctx}, a context of "
                          f"{needs(n_ctx) / 2**30:.1f} GiB; loaded with n_ctx={cap}, capped at {why} "
                          f"(choose with n_ctx=, or --ctx N)", ResourceLimitWarning, stacklevel=3)
            n_ctx = cap
        return n_ctx
    if not _whole(n_ctx) or not 1 <= n_ctx < 2**31:
        raise ValueError(f"n_ctx must be a whole number from 1 to 2**31-1, got {n_ctx!r}")
    if needs(n_ctx) > memory:
        raise ValueError(f"n_ctx={n_ctx} needs {needs(n_ctx) / 2**30:.1f} GiB for the context "
                         f"(RoPE tables and KV cache), more than this machine's "
                         f"{memory / 2**30:.1f} GiB of RAM: choose a smaller n_ctx")
    return int(n_ctx)


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
    # speculative decoding: tokens guessed, and guesses kept (0 without it)
    drafted_tokens: int = 0
    accepted_tokens: int = 0

    @property
    def prompt_tps(self) -> float:
        return self.prompt_tokens / self.prompt_seconds if self.prompt_seconds else 0.0

    @property
    def generate_tps(self) -> float:
        return self.generated_tokens / self.generate_seconds if self.generate_seconds else 0.0


def _packed_weights(config: ModelConfig, source, dtype: str, use_cache: bool | None) -> tuple:
    """(the arrays for _core.Weights, parameters by weight type or None,
    the cache file they are mapped from or None, (the files they were read
    from, the options they were read with)) of a GGUF file's own tensors
    (dtype "gguf", source the file's GgufModel) or of a folder's."""

    if dtype == "gguf":
        def build():
            arrays, types = load_gguf_weights(source, mtp=True)
            return arrays, {"types": dict(types)}
        sources = [source.path]
    else:
        def build():
            return load_weights(config, source, bf16=(dtype == "bf16"),
                                mix=dtype if dtype in QUANT_MIXES else None), {}
        sources = sorted(p for p in source.iterdir()
                         if p.name == "config.json" or p.name.endswith((".safetensors", ".safetensors.index.json")))
    def check(arrays):   # what Weights refuses is rebuilt, never loaded
        _core.Weights(config, {k: v for k, v in arrays.items() if k != "mtp"}, 1)
        if "mtp" in arrays:
            _core.Weights(config.mtp_config(), arrays["mtp"], 1)
    arrays, extra, cached = pack_cache.load(sources, {"dtype": dtype}, build, pack_cache.enabled(use_cache), check)
    return arrays, extra.get("types"), cached, (sources, {"dtype": dtype})


class Model:
    """A model ready to generate: Model.from_pretrained(path, ...), or
    Model(path, ...), which is the same.

    generate/stream/chat/generate_tokens/logits run on the model's default
    Session, one call at a time: a thread that calls while another generates
    waits for it, unless that generation is a stream waiting for its reader
    (read partly, perhaps never finished): the call then runs on a Session
    of its own. Threads that should generate at the same time each use a
    Session of their own (new_session(), passed as session=); they share
    the weights."""

    def __new__(cls, *args, **kwargs):
        # Model("model.gguf", n_ctx=...) loads it, as llama-cpp-python's
        # Llama("model.gguf") does; from_pretrained builds it from its parts.
        if args and isinstance(args[0], _core.Weights):
            return super().__new__(cls)
        return cls.from_pretrained(*args, **kwargs)

    def __init__(self, weights: _core.Weights | None = None, *args, **kwargs):
        if isinstance(weights, _core.Weights):
            self._build(weights, *args, **kwargs)
        # else: Model(path, ...), which __new__ loaded

    def _build(self, weights: _core.Weights, config: ModelConfig, tokenizer, path: Path, dtype: str,
               eos_token_ids: set, generation_config: dict | None = None, max_batch: int = 512,
               name: str | None = None, source: Path | None = None, mtp: _core.Weights | None = None):
        self._weights = weights
        # The multi-token-prediction block, where the file has one (speculative="mtp").
        self._mtp = mtp
        self.config = config
        self.tokenizer = tokenizer
        # What the weights were read from: the GGUF file or the folder, or
        # the folder a GGUF file was converted into (dtype "f32", "bf16").
        self.path = path
        # What the model is called (the server's model id): the folder's
        # name, or the GGUF file's, not that of a converted folder.
        self.name = name or path.name
        # What the model was loaded from (a GGUF file, or a folder).
        self.source = source or path
        self.dtype = dtype
        self.kv_dtype = weights.kv_dtype
        self.eos_token_ids = eos_token_ids
        self.max_batch = max_batch
        # The checked settings of generation_config.json, what they set of
        # generate/stream/chat's defaults, and the sampling those calls
        # start from: SamplingParams' defaults under the file's values.
        self.generation_config = dict(generation_config or {})
        self.generation_defaults = generation_defaults(self.generation_config)
        self.default_sampling = SamplingParams().replace(
            **{k: v for k, v in self.generation_defaults.items() if k != "max_new_tokens"})
        self.last_stats = GenerationStats()
        # The file the packed weights are mapped from (fastllm.load.pack_cache), or None.
        self.pack_cache_file = None
        # (the files the weights were read from, the options they were read
        # with): what a saved session's keys and values were computed from
        # (fastllm.generate.session_file); None for weights built in memory.
        self.weight_files = None
        # The folder a GGUF file's tokenizer files were built into, or None.
        self.tokenizer_cache = None
        # What generate/stream/chat speculate with when a call says nothing:
        # None, "ngram", or a draft Model (see fastllm.generate.speculative), with
        # at most draft_max guesses a pass.
        self.speculative = None
        self.draft_max = 16
        self._drafters = {}   # the default session's drafters, kept from call to call
        self._session = Session(self)
        # The default session is taken by setting _owner under _guard, a
        # lock held only inside a `with` of a few lines: a Ctrl-C (any
        # signal's exception) can land right after a lock's acquire()
        # returns and leave a lock taken for good, not a `with` block.
        self._guard = threading.Lock()
        self._owner = None              # the token of the call using the default session
        self._holder = None             # the thread of that call
        self._parked = False            # the owner is a generator waiting for its reader

    # ------------------------------------------------------------- loading

    @classmethod
    def from_pretrained(cls, path=None, n_ctx: int | None = None, threads: int | None = None,
                        dtype: str | None = None, max_batch: int | None = None, kv_dtype: str = "f32",
                        activations: str = "int8", filename: str | None = None,
                        max_n_ctx: int | None = None, pack_cache: bool | None = None) -> "Model":
        """Load a HF model folder (config.json, model.safetensors, tokenizer.json),
        a .gguf file, a Hugging Face repo ("org/name", fetched into the
        Hugging Face cache with huggingface_hub), or with no path the default
        model, SmolLM2-135M-Instruct (a GGUF file).

        filename: which GGUF file of a repo or folder: a file name, a glob
        ("*Q4_1.gguf") or a quantization tag ("Q4_K_M"); "org/name:Q4_K_M"
        says the same. Without it a repo with config.json and safetensors
        loads as a folder, else its one GGUF file (or its Q4_K_M one).

        dtype: how the weights are held. A GGUF file runs by default at its
        own precision ("gguf"), as llama.cpp runs it: every tensor in its own
        type, quantized ones quantized. "f32" or "bf16" dequantize it instead
        (converted once into the cache). A folder defaults to "f32".
        A quantization mix ("q8_0", "q4_0", "q4_k_m", ... as llama-quantize
        names them) quantizes the matrices of a folder (or of a GGUF file
        dequantized first) at load.
        activations: what quantized weights multiply: "int8" blocks of the
        activations (fast), or "f32" activations with the exact dequantized
        weights (the results of the dequantized float32 model, bit for bit).
        max_n_ctx: without n_ctx, the context is the model's
        max_position_embeddings, or this many positions where fewer.
        max_batch: tokens per forward pass (a longer prompt runs in several);
        None: as many as pass_tokens allows for the work buffers, at most 512.
        pack_cache: keep the packed weights in a file under $FASTLLM_HOME
        and map it on later loads (see fastllm.load.pack_cache); None: unless
        FASTLLM_PACK_CACHE=0."""

        if dtype is not None and dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {DTYPES}, got {dtype!r}")
        if kv_dtype not in KV_DTYPES:
            raise ValueError(f"kv_dtype must be one of {KV_DTYPES}, got {kv_dtype!r}")
        if activations not in ACTIVATIONS:
            raise ValueError(f"activations must be one of {ACTIVATIONS}, got {activations!r}")
        source = locate(path, filename)
        gguf = source if source.is_file() else None
        if dtype is None:
            dtype = "gguf" if gguf is not None else "f32"
        native = dtype == "gguf"
        if native and gguf is None:
            raise ValueError(f"dtype 'gguf' runs a GGUF file's own tensors, and {path} is a model folder")
        if native:
            # The config comes from the file's header, read once; only the
            # tokenizer, slow to rebuild from its vocabulary, is cached.
            header = read_gguf_model(gguf)
            config, gen_config = header.config, check_generation_config(header.generation_config, gguf)
            folder, tokenizer_folder = gguf, Path(gguf_tokenizer_dir(gguf, header))
        else:
            folder = Path(resolve_model(source))
            if not folder.is_dir():
                raise ModelFileError(folder, "not a model folder")
            config = ModelConfig.from_file(folder / "config.json")
            gen_config = read_generation_config(folder / "generation_config.json")
            tokenizer_folder = folder
        threads = physical_cores() if threads is None else usable_threads(threads)
        if not native:
            check_sizes(config, folder)
        if max_batch is not None and (not _whole(max_batch) or not 1 <= max_batch <= 1 << 16):
            raise ValueError(f"max_batch must be a whole number from 1 to 65536, got {max_batch!r}")
        # Without max_batch the pass is chosen from the work buffers, once
        # the weights are there, at most 512 tokens: the cache is sized for that.
        max_pass = 512 if max_batch is None else max_batch
        seq_len = context_size(config, n_ctx, kv_dtype, threads, max_n_ctx, max_pass)

        # A folder without tokenizer.json still runs on token ids (logits,
        # generate_tokens); the text methods then say what is missing. The
        # tokenizer is read first: parsing tokenizer.json takes a few times
        # the memory it leaves in use, which is then free again before the
        # weights come in.
        tokenizer = None
        if (tokenizer_folder / "tokenizer.json").exists():
            tokenizer = Tokenizer.from_pretrained(tokenizer_folder)
        arrays, types, cached, read_from = _packed_weights(config, header if native else folder, dtype, pack_cache)
        if native:   # named by the type that holds most of the parameters
            dtype = max(types, key=types.get)
        mtp = arrays.pop("mtp", None)
        if mtp is not None:
            mtp = _core.Weights(config.mtp_config(), mtp, seq_len, threads, kv_dtype, activations == "f32",
                                max_pass)
        weights = _core.Weights(config, arrays, seq_len, threads, kv_dtype, activations == "f32", max_pass)
        if max_batch is None:
            max_batch = pass_tokens(weights)
        model = cls(weights, config, tokenizer, folder, dtype, end_of_generation_ids(gen_config, config, tokenizer),
                    gen_config, max_batch, name=model_name(source), source=source, mtp=mtp)
        model.pack_cache_file = cached
        model.weight_files = read_from
        model.tokenizer_cache = tokenizer_folder if native else None
        return model

    # ------------------------------------------------------------ settings

    @property
    def weight_types(self) -> dict:
        """Parameters of the weight matrices by type, most first (a GGUF file
        such as Q4_K_M mixes several)."""
        return self._weights.weight_types

    @property
    def weight_bytes(self) -> int:
        """Bytes of the weights in memory."""
        return self._weights.nbytes

    @property
    def activations(self) -> str:
        """What quantized weights multiply: "int8" or "f32" activations."""
        return "f32" if self._weights.float_acts else "int8"

    @property
    def n_ctx(self) -> int:
        return self._weights.seq_len

    @property
    def threads(self) -> int:
        return self._weights.n_threads

    @threads.setter
    def threads(self, n: int):
        self._weights.n_threads = usable_threads(n)
        if self._mtp is not None:
            self._mtp.n_threads = self._weights.n_threads

    @property
    def has_mtp(self) -> bool:
        """Whether the model has a multi-token-prediction block to draft with
        (speculative="mtp")."""
        return self._mtp is not None

    def new_session(self, max_batch: int | None = None) -> Session:
        """A Session of its own (KV cache and recurrent state) on these weights."""
        return Session(self, max_batch)

    @contextmanager
    def _use(self, session: Session | None):
        """session, else the default session, held until the block ends.
        The default session held by another thread's generator that waits
        for its reader (a stream read partly), the block runs on a session
        of its own rather than wait for that reader."""
        if session is not None:
            if session._weights is not self._weights:
                raise ValueError("this session belongs to another model: a session runs the model it was made "
                                 "by (model.new_session())")
            with session.held():
                yield session
            return
        me = threading.get_ident()
        if self._holder == me:
            raise RuntimeError("this thread is already generating on the model's default session: "
                               "finish or close that generator first, or pass session=model.new_session()")
        token = object()
        try:
            while True:
                with self._guard:
                    if self._owner is None:
                        self._owner, self._holder = token, me
                    parked = self._parked
                if self._owner is token or parked:
                    break
                # a poll: threading.Event and Condition hold locks of their
                # own outside a `with`, which an interrupt can leave taken
                time.sleep(0.001)
            if self._owner is token:
                yield self._session
                return
        finally:
            if self._owner is token:
                with self._guard:
                    self._owner = self._holder = None
                    self._parked = False
        with self.new_session().held() as own:
            yield own

    def logits(self, token_ids, session: Session | None = None) -> np.ndarray:
        """Logits of every position of token_ids run from position 0,
        shape (len(token_ids), vocab_size), float32."""
        with self._use(session) as s:
            return s.logits(token_ids)

    def generate_tokens(self, prompt_ids, max_new_tokens: int = 128, sampling: SamplingParams | None = None,
                        stop_token_ids=None, *, session: Session | None = None,
                        logits_processors=(), constraint: Constraint | None = None,
                        speculative=None) -> Iterator[int]:
        """Yield new token ids one by one. Stops at an end-of-sequence token
        (not yielded), after max_new_tokens, when the context is full, or
        once constraint is done. Runs on session, else on the default
        session (see Model).
        logits_processors: more (tokens, logits) -> logits functions, run
        after the penalties and logit bias of sampling.
        constraint: constrained decoding (see sampling.Constraint): its mask
        comes after every processor.
        speculative: "ngram", a draft Model (same vocabulary) or a
        fastllm.generate.speculative.Speculation: guesses checked several at a pass
        (the tokens are exactly those without it); None: the model's
        speculative setting; False: none."""
        if not _whole(max_new_tokens) or max_new_tokens < 0:
            raise ValueError(f"max_new_tokens must be a whole number >= 0, got {max_new_tokens!r}")
        sampling = as_params(sampling).check_vocabulary(self.config.vocab_size)
        sampler = Sampler(sampling, logits_processors, constraint)
        stop_ids = self.eos_token_ids if stop_token_ids is None else set(stop_token_ids)
        if len(prompt_ids) >= self.n_ctx:
            raise ValueError(f"the prompt has {len(prompt_ids)} tokens: no room left in the context of "
                             f"{self.n_ctx} (load the model with a larger n_ctx)")
        spec = speculation(self.speculative if speculative is None else speculative, self, self.draft_max,
                           self._drafters if session is None else None)
        return self._generate(prompt_ids, max_new_tokens, sampler, stop_ids, session, spec)

    def _generate(self, prompt_ids, max_new_tokens, sampler, stop_ids, session,
                  spec: Speculation | None = None) -> Iterator[int]:
        """The tokens after prompt_ids, one step a token; with spec, after
        each token it drafts the next few, one pass runs the token and the
        guesses (Session.verify), and the sampler picks from those logits,
        position by position, as from plain steps; the pass keeps the
        guesses up to the first the sampler did not pick (Session.keep)."""
        hidden = spec is not None and getattr(spec.drafter, "wants_hidden", False)   # it reads hidden states
        with self._use(session) as s:
            stats = self.last_stats = GenerationStats(prompt_tokens=len(prompt_ids), finish_reason="length")
            t0 = time.perf_counter()
            logits = s.prefill(prompt_ids, hidden)
            if hidden:
                logits, states = logits
                spec.drafter.observe(s.position - len(states), states)
            stats.prompt_seconds = time.perf_counter() - t0
            ids = list(s.tokens)
            rows, guesses = [], []   # the open pass: logits not yet used, guesses not yet checked
            open_pass = False
            drafted = taken = 0      # its guesses, and those the sampler took
            seconds = 0.0            # what it cost

            def close_pass(checked):
                # hold its first token and the guesses taken, as if only they had run
                s.keep(1 + taken)
                if hidden:
                    spec.drafter.observe(s.position - 1 - taken, states[:1 + taken])
                spec.verified(checked, taken, seconds)

            try:
                for i in range(max_new_tokens):
                    t0 = time.perf_counter()
                    token = sampler(logits, ids)
                    stats.generate_seconds += time.perf_counter() - t0
                    if token in stop_ids:
                        stats.finish_reason = "stop"
                        return
                    stats.generated_tokens += 1
                    yield from self._handed_out(token, s)
                    ids.append(token)
                    # (after the last token, its logits would go unused)
                    reason = finish_reason(len(ids), self.n_ctx, sampler, i + 1, max_new_tokens)
                    if reason is not None:
                        stats.finish_reason = reason
                        return
                    if guesses and token == guesses[0]:   # its logits are in the pass
                        guesses.pop(0)
                        logits = rows.pop(0)
                        taken += 1
                        continue
                    t0 = time.perf_counter()
                    if open_pass:
                        open_pass = False
                        close_pass(drafted)
                    room = min(max_new_tokens - i - 2, self.n_ctx - len(ids), s.pass_room() - 1)
                    guesses = spec.draft(ids, room) if spec is not None else []
                    t1 = time.perf_counter()
                    if guesses:
                        rows = s.verify([token] + guesses, hidden)
                        if hidden:
                            rows, states = rows
                        rows = list(rows)
                        open_pass, drafted, taken = True, len(guesses), 0
                        logits = rows.pop(0)
                        seconds = time.perf_counter() - t1
                    else:
                        logits = s.step(token, hidden)
                        if hidden:
                            logits, states = logits
                            spec.drafter.observe(s.position - 1, states)
                        if spec is not None:
                            spec.plain_step(time.perf_counter() - t1)
                    stats.generate_seconds += time.perf_counter() - t0
            finally:
                if open_pass:
                    close_pass(taken)
                s.checkpoint()   # where the reply ends: the next turn resumes there
                if spec is not None:
                    stats.drafted_tokens = spec.stats.drafted
                    stats.accepted_tokens = spec.stats.accepted

    def _handed_out(self, token: int, s: Session):
        """Yield token; while its reader has it, the default session (s)
        is marked as waiting for that reader, so that other threads need
        not wait with it (see _use)."""
        if s is not self._session:
            yield token
            return
        self._parked = True
        yield token
        self._parked = False

    # ---------------------------------------------------------------- text

    def stream(self, prompt: str, max_new_tokens: int | None = None, *, sampling: SamplingParams | None = None,
               stop=None, add_special_tokens: bool = True, session: Session | None = None,
               constraint: Constraint | None = None, response_format: dict | None = None,
               speculative=None, **overrides) -> Iterator[str]:
        """Yield the continuation of prompt as text pieces, each a whole
        number of characters, as tokens are generated.

        sampling: the SamplingParams to use, else default_sampling (fastllm's
        defaults under the model's generation_config.json); keyword overrides
        (temperature=..., seed=..., any SamplingParams field; None leaves a
        setting as it is) are applied on top, and checked here, at the call.
        max_new_tokens: else default_max_new_tokens(). session: where to
        run (see generate_tokens). constraint: constrained decoding (see
        generate_tokens). response_format: OpenAI's {"type": "json_object"}
        or {"type": "json_schema", "json_schema": {"name": ..., "schema":
        {...}}}: the text is JSON (that follows the schema), by constrained
        decoding (needs llguidance). speculative: see generate_tokens (the
        text is the same with it). stop: a string or a list of strings that
        end the text (not included); an empty one is refused. Afterwards
        last_stats.finish_reason says why generation ended; "context" (the
        context is full) also gives a ContextFullWarning. max_tokens=N, as
        OpenAI's API names it, is max_new_tokens."""
        max_new_tokens = _token_limit(max_new_tokens, overrides)
        params = self._sampling(sampling, overrides)
        constraint = self._constraint(constraint, response_format)
        ids = self._encode(prompt, add_special_tokens)
        n = self.default_max_new_tokens(len(ids)) if max_new_tokens is None else max_new_tokens
        return self._stream_ids(ids, n, params, _stop_strings(stop), session, constraint, speculative)

    def _constraint(self, constraint, response_format, prompt: str | None = None):
        """constraint, or the one response_format asks for; prompt: the
        rendered chat, whose template may have the reply reason first."""
        if response_format is None:
            return constraint
        if constraint is not None:
            raise ValueError("pass constraint or response_format, not both")
        reasoning = None if prompt is None else reasoning_mode(self.tokenizer.chat_template, prompt)
        grammar = reply_grammar(self, response_format=response_format, reasoning=reasoning)
        return None if grammar is None else grammar.start()

    def _sampling(self, sampling: SamplingParams | None, overrides: dict) -> SamplingParams:
        base = self.default_sampling if sampling is None else as_params(sampling)
        unknown = [k for k in overrides if k not in _SETTINGS]
        if unknown:
            hint = " (the token limit is max_new_tokens)" if unknown[0] in ("max_tokens", "n_predict") else ""
            raise TypeError(f"unknown setting {unknown[0]!r}{hint}; the settings are max_new_tokens, stop, "
                            f"{', '.join(_SETTINGS)}")
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
             session: Session | None = None, constraint: Constraint | None = None,
             response_format: dict | None = None, speculative=None, **overrides):
        """Render messages with the model's chat template (as transformers
        does) and generate the assistant's reply. Settings as for stream;
        max_new_tokens falls back to 256. With response_format, a model
        that reasons first (<think>...</think>) does so freely, then the
        JSON follows. stream=True: the reply's text pieces as they come
        (an iterator), as stream() gives them."""
        max_new_tokens = _token_limit(max_new_tokens, overrides)
        params = self._sampling(sampling, overrides)
        text = self._need_tokenizer().apply_chat_template(messages, add_generation_prompt=True,
                                                          **(template_kwargs or {}))
        constraint = self._constraint(constraint, response_format, text)
        ids = self._encode(text, False)
        n = self.default_max_new_tokens(len(ids), 256) if max_new_tokens is None else max_new_tokens
        pieces = self._stream_ids(ids, n, params, _stop_strings(stop), session, constraint, speculative)
        return pieces if stream else "".join(pieces)

    def _encode(self, text: str, add_special_tokens: bool) -> list:
        """The ids of a prompt, refused before it is tokenized when it is
        too long for the context whatever its tokens (each token stands for
        at most tokenizer.max_chars_per_token characters)."""
        tokenizer = self._need_tokenizer()
        per_token = tokenizer.max_chars_per_token
        if isinstance(text, str) and per_token is not None and len(text) > self.n_ctx * per_token:
            raise ValueError(f"the prompt has {len(text)} characters: more tokens than the context of "
                             f"{self.n_ctx} holds (load the model with a larger n_ctx)")
        return tokenizer.encode(text, add_special_tokens=add_special_tokens)

    def _need_tokenizer(self):
        if self.tokenizer is None:
            raise ModelFileError(self.path if self.path.is_file() else self.path / "tokenizer.json",
                                 "file not found: text in and out needs the model's tokenizer")
        return self.tokenizer

    def _stream_ids(self, ids, max_new_tokens, sampling, stops, session, constraint=None,
                    speculative=None) -> Iterator[str]:
        text = TextStream(self.tokenizer, stops)
        tokens = self.generate_tokens(ids, max_new_tokens, sampling, session=session, constraint=constraint,
                                      speculative=speculative)
        try:
            for token in itertools.chain(tokens, [None]):
                piece = text.feed(token)
                if piece:
                    yield piece
                if text.ended:
                    break
            if text.stopped:
                self.last_stats.finish_reason = "stop"
            elif self.last_stats.finish_reason == "context":
                warnings.warn(f"the context is full ({self.n_ctx} tokens): generation stopped early; "
                              "load the model with a larger n_ctx", ContextFullWarning, stacklevel=3)
        finally:
            tokens.close()

    # ---------------------------------------------------------- embeddings

    @property
    def pooling(self):
        """How embed() pools hidden states (an embeddings.Pooling): read on
        first use from the model's sentence-transformers files, or a GGUF
        file's pooling_type; settable with a mode name ("mean", "cls",
        "last", ...)."""
        if self._pooling is None:
            if self.source.is_file():
                self._pooling = gguf_pooling(read_contents(self.source, string_arrays=False).metadata)
            else:
                self._pooling = read_pooling(self.source)
        return self._pooling

    @pooling.setter
    def pooling(self, mode):
        self._pooling = mode if isinstance(mode, Pooling) else Pooling.of(mode)

    _pooling = None

    def embed(self, texts, *, pooling=None, normalize: bool = True, dimensions: int | None = None,
              session: Session | None = None) -> np.ndarray:
        """Embeddings of texts (a string, or a list of them): float32, (dim,)
        for a string, (len(texts), dim) for a list. Each text is encoded with
        its special tokens, run alone, and its final-normed hidden states
        pooled (pooling: a mode such as "mean", "cls", "last"; else the
        model's own, see pooling), cut to the first dimensions values where
        given, then scaled to length 1 unless normalize is False."""
        one = isinstance(texts, str)
        items = [texts] if one else texts
        if not isinstance(items, (list, tuple)) or not all(isinstance(t, str) for t in items):
            raise TypeError(f"texts must be a string or a list of strings, got {type(texts).__name__}")
        ids = [self._encode(t, True) for t in items]
        with self._use(session) as s:
            out = [embed_ids(self, s, i, pooling, normalize, dimensions) for i in ids]
        if one:
            return out[0]
        if not out:
            chosen = self.pooling if pooling is None else pooling if isinstance(pooling, Pooling) else \
                Pooling.of(pooling)
            return np.zeros((0, dimensions or self.config.hidden_size * len(chosen.modes)), np.float32)
        return np.stack(out)

    def __repr__(self):
        return (f"Model({str(self.path)!r}, model_type={self.config.model_type!r}, "
                f"dtype={self.dtype!r}, n_ctx={self.n_ctx}, threads={self.threads})")


# The keyword settings of generate/stream/chat (SamplingParams' fields).
_SETTINGS = tuple(f.name for f in fields(SamplingParams))


def _token_limit(max_new_tokens, overrides: dict):
    """max_new_tokens, or OpenAI's name for it, max_tokens (taken out of
    overrides)."""
    if "max_tokens" not in overrides:
        return max_new_tokens
    max_tokens = overrides.pop("max_tokens")
    if max_new_tokens is not None and max_tokens is not None:
        raise TypeError("give max_new_tokens or max_tokens (the same limit), not both")
    return max_tokens if max_new_tokens is None else max_new_tokens


def _stop_strings(stop) -> list:
    """stop (None, a string or a list of strings) as a list. An empty
    string would match before any text, so it is refused, alone or in a list."""
    stops = [] if stop is None else [stop] if isinstance(stop, str) else stop
    if not isinstance(stops, (list, tuple)) or not all(isinstance(s, str) for s in stops):
        raise TypeError(f"stop must be a string or a list of strings, got {stop!r}")
    if "" in stops:
        raise ValueError("stop strings must not be empty (an empty one would match before any text)")
    return list(stops)
