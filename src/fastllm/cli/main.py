"""The `fastllm` command: run, chat, an interactive REPL, convert, info, bench, serve, perplexity."""
from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path
import warnings
import atexit

from ..spec.config import KV_BYTES, KV_DTYPES
from ..spec.errors import FastLLMError
from ..generate.sampling import SamplingParams
from .args import whole_number
from ..formats.quants import MIXES
from ..generate.constrain import llguidance
from ..spec.version import __version__
from ..formats.gguf import DEFAULT_DTYPE, convert_gguf
from ..serve.server import DEFAULTS as SERVE, OPTION_NAMES, SLOT_CTX, ServeOptions, serve
from .bench import add_bench_parser, cmd_bench
from ..generate.model import ContextFullWarning, Model
from ..generate.speculative import check_same_vocabulary
from ..load.hub import cache_dir, locate
from ..formats.gguf_writer import export_gguf
from . import perplexity
from ..load import pack_cache

REPL_HELP = """Type a prompt and press Enter. Longer input:
  end a line with \\ to continue on the next line, or
  put the text between lines starting and ending with \"\"\" (pasted text works too).
commands:
  /temp X       sampling temperature (0 = greedy)
  /topp X       nucleus sampling: keep the most likely tokens up to mass X (1 = off)
  /topk N       keep the N most likely tokens (0 = off)
  /minp X       drop tokens less likely than X times the most likely one (0 = off)
  /repeat X     repetition penalty (1 = off)
  /lastn N      tokens the repetition penalty looks back on (-1 = all, 0 = none)
  /seed N       seed for sampling (reproducible runs); /seed alone: a random seed
  /steps N      most tokens to generate per reply
  /stop STR     also stop at STR (repeatable); /stop alone clears the stop strings
  /system TEXT  system message for chat mode; /system alone removes it
  /chat on|off  use the chat template (multi-turn) or plain continuation
  /reset        forget the conversation
  /show         print every current setting
  /help         this text
  /quit         leave (Ctrl-D works too)"""

# The commands generate with the Python API's defaults (SamplingParams'
# own: greedy, no repetition penalty, under the model's
# generation_config.json), so a prompt gets the same answer from the command
# line as from Model.chat/stream. Unless told, a reply ends at the model's
# own limit, which these are when generation_config.json sets none (shown by
# /show; Model.stream and Model.chat apply them).
DEFAULT_MAX_TOKENS = {"continuation": 128, "chat": 256}
_SAMPLING_KEYS = tuple(f.name for f in dataclasses.fields(SamplingParams))
_SETTINGS = ("max_new_tokens",) + _SAMPLING_KEYS
_GEN_SOURCE = "generation_config.json"


def _model_args(p: argparse.ArgumentParser, several: bool = False):
    p.add_argument("--model", "-m", default=None, action="append" if several else "store",
                   help="HF model folder, .gguf file, or Hugging Face repo id org/name[:QUANT or "
                        "FILE GLOB] (default: SmolLM2-135M-Instruct)"
                        + ("; repeat it to serve several models" if several else ""))
    p.add_argument("--threads", "-t", type=whole_number(1), default=None,
                   help="threads for the run loop (default: physical cores)")
    p.add_argument("--ctx", "-c", type=whole_number(1), default=None,
                   help="context length in tokens (default: the model's max_position_embeddings, "
                        "at most 131072)")
    p.add_argument("--dtype", choices=("f32", "bf16", "gguf") + tuple(m for m in MIXES if m.startswith("q")),
                   default=None,
                   help="weights in memory: a GGUF file's own types (gguf, the default for a .gguf), "
                        "dequantized to f32 (the default for a folder) or bf16, or quantized at load "
                        "under a llama.cpp mix (q8_0, q4_k_m, ...)")
    p.add_argument("--activations", choices=("int8", "f32"), default="int8",
                   help="what quantized weights multiply: int8 blocks of the activations (default), or "
                        "f32 activations with the exact dequantized weights (slower)")
    p.add_argument("--kv-dtype", choices=KV_DTYPES, default="f32",
                   help="KV cache precision: bf16/f16 halve what attention reads, q8_0 (int8 with a scale "
                        "per 32 values) nearly quarters it (default: f32)")
    p.add_argument("--no-cache", action="store_true",
                   help="pack the weights at every load instead of keeping them packed in a file under "
                        "FASTLLM_HOME that later loads map (as FASTLLM_PACK_CACHE=0)")


def _set_help(p: argparse.ArgumentParser, flag: str, text: str):
    """Give an option of a shared group (_model_args) its own help in one command."""
    next(a for a in p._actions if flag in a.option_strings).help = text


def _spec_args(p: argparse.ArgumentParser):
    p.add_argument("--spec", choices=("ngram", "mtp", "none"), default=None,
                   help="speculative decoding (the output is exactly the same): ngram guesses the next "
                        "tokens from earlier text (faster where the reply repeats its input), mtp with the "
                        "model's own multi-token-prediction block (Qwen3.5 GGUF files that have one)")
    p.add_argument("--draft", "-md", default=None, metavar="MODEL",
                   help="speculative decoding with a smaller draft model of the same vocabulary "
                        "(a folder, .gguf or repo id, as --model)")
    p.add_argument("--draft-max", type=whole_number(0, 64), default=16, metavar="N",
                   help="guesses checked in one pass at most (default: 16; fewer are chosen while "
                        "guesses fail)")


def _sampling_args(p: argparse.ArgumentParser):
    # Defaults are None so that a value the user did not give can come from
    # the model's generation_config.json before fastllm's own default.
    gen = "default: the model's generation_config.json, else"
    p.add_argument("--max-tokens", "-n", "--steps", dest="max_new_tokens", type=whole_number(1),
                   default=None, metavar="N",
                   help=f"most tokens to generate ({gen} {DEFAULT_MAX_TOKENS['chat']} for a chat reply, "
                        f"{DEFAULT_MAX_TOKENS['continuation']} for a continuation)")
    p.add_argument("--temp", "--temperature", dest="temperature", type=float, default=None,
                   metavar="T", help=f"sampling temperature; 0 is greedy ({gen} 0)")
    p.add_argument("--top-p", type=float, default=None, metavar="P",
                   help=f"nucleus sampling: keep the most likely tokens up to mass P; 1 is off ({gen} 1)")
    p.add_argument("--top-k", type=whole_number(0), default=None, metavar="K",
                   help=f"keep only the K most likely tokens; 0 is off ({gen} 0)")
    p.add_argument("--min-p", type=float, default=None, metavar="P",
                   help=f"drop tokens less likely than P times the most likely one; 0 is off ({gen} 0)")
    p.add_argument("--repeat-penalty", "--repetition-penalty", dest="repetition_penalty", type=float,
                   default=None, metavar="X",
                   help="penalise tokens already in the prompt or reply (positive logits divided by X, "
                        f"negative ones multiplied); 1 is off ({gen} 1)")
    p.add_argument("--repeat-last-n", dest="repeat_last_n", type=whole_number(-1), default=None, metavar="N",
                   help="tokens the repetition penalty looks back on; -1 is all of them, 0 none "
                        "(default: -1)")
    p.add_argument("--presence-penalty", dest="presence_penalty", type=float, default=None, metavar="X",
                   help="OpenAI's presence penalty: X off the logits of the tokens the reply already holds "
                        "(not the prompt's); 0.5 ends the default model's loops; 0 is off (default: 0)")
    p.add_argument("--frequency-penalty", dest="frequency_penalty", type=float, default=None, metavar="X",
                   help="OpenAI's frequency penalty: X times its count in the reply off each token's logit; "
                        "0 is off (default: 0)")
    p.add_argument("--seed", type=whole_number(0), default=None,
                   help="seed for sampling, for reproducible runs (default: random)")
    p.add_argument("--stop", action="append", default=None, metavar="STR",
                   help="also stop generating at STR (repeatable)")
    p.add_argument("--verbose", "-v", action="store_true",
                   help="print token counts, tokens/s and why generation stopped to stderr")


def _json_schema_arg(p: argparse.ArgumentParser):
    p.add_argument("--json-schema", default=None, metavar="FILE",
                   help="reply with JSON that follows the JSON Schema in FILE (constrained decoding; "
                        "needs fastllm-engine[structured])")


def _response_format(path) -> dict | None:
    """--json-schema FILE as Model.chat/stream's response_format."""
    if path is None:
        return None
    try:
        llguidance()
        schema = json.loads(Path(path).read_text(encoding="utf-8"))
    except (ImportError, OSError, ValueError) as e:
        raise ValueError(f"--json-schema {path}: {e}") from None
    return {"type": "json_schema", "json_schema": {"name": Path(path).stem, "schema": schema}}


def _mode_args(p: argparse.ArgumentParser, what: str):
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--chat", action="store_true",
                      help=f"{what} in the model's chat template (the default where the model has one)")
    mode.add_argument("--raw", action="store_true",
                      help="plain continuation of the text, without the chat template")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="fastllm", description="CPU LLM inference. With no command: an interactive REPL.")
    parser.add_argument("--version", action="version", version=f"fastllm {__version__}",
                        help="print the version and exit")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND",
                                help="what to do (default: repl; a prompt alone means run)")

    p = sub.add_parser("run", help="answer a prompt (as a chat message where the model has a chat "
                                   "template), streaming the reply")
    _model_args(p)
    _spec_args(p)
    _sampling_args(p)
    _mode_args(p, "put the prompt")
    _json_schema_arg(p)
    p.add_argument("prompt", nargs="?", help="prompt text ('-' reads stdin; none opens the REPL)")

    p = sub.add_parser("repl", help="interactive prompt (the default command)")
    _model_args(p)
    _spec_args(p)
    _sampling_args(p)
    _mode_args(p, "start with each prompt")
    p.add_argument("--system", default=None, help="system message for chat mode")

    p = sub.add_parser("chat", help="multi-turn chat using the model's chat template")
    _model_args(p)
    _spec_args(p)
    _sampling_args(p)
    p.add_argument("--system", default=None, help="system message")
    _json_schema_arg(p)

    p = sub.add_parser("convert", help="convert a GGUF file into a HF model folder, or a HF model "
                                       "folder into a GGUF file (the input decides)")
    p.add_argument("input", help="a .gguf file or a HF model folder, named as --model names them "
                                 "(a path, SmolLM2-135M-Instruct, or a Hugging Face repo id)")
    p.add_argument("output", help="the folder to create (from a .gguf), or the .gguf file to write "
                                  "(.gguf is added when missing)")
    p.add_argument("--dtype", choices=tuple(MIXES), default=DEFAULT_DTYPE, metavar="DTYPE",
                   help="from a .gguf: the safetensors precision, f32 (the dequantized values exactly) "
                        "or bf16; to a .gguf: f32, f16, bf16 or a llama.cpp quantization mix "
                        f"({', '.join(m for m in MIXES if m[0] == 'q')}) (default: {DEFAULT_DTYPE})")

    p = sub.add_parser("info", help="config, parameter count and memory of a model")
    _model_args(p)

    p = sub.add_parser("serve", help="an OpenAI-compatible HTTP server with continuous batching "
                                     "(needs the serve extra: starlette, uvicorn)")
    _model_args(p, several=True)
    _spec_args(p)
    # A server's slots hold long conversations: its cache defaults to f16
    # (half of f32's memory; how little it moves the logits: README).
    p.set_defaults(kv_dtype="f16")
    _set_help(p, "--ctx", f"context length of each slot in tokens (default: the model's "
                          f"max_position_embeddings, at most {SLOT_CTX})")
    _set_help(p, "--kv-dtype", "KV cache precision (default here: f16; f32 keeps attention exact)")
    p.add_argument("--host", default=SERVE.host, help=f"address to bind (default: {SERVE.host})")
    p.add_argument("--port", type=int, default=SERVE.port, help=f"port (default: {SERVE.port})")
    p.add_argument("--parallel", "-np", type=int, default=SERVE.parallel,
                   help=f"requests decoded together, each with a KV cache of --ctx tokens "
                        f"(default: {SERVE.parallel})")
    p.add_argument("--max-queue", type=int, default=SERVE.max_queue,
                   help=f"requests that may wait for a slot; more get 503 (default: {SERVE.max_queue})")
    p.add_argument("--api-key", default=SERVE.api_key,
                   help="require this key, as a bearer token or in an x-api-key header")
    p.add_argument("--model-name", default=SERVE.model_name, action="append",
                   help="the model's id in the API (default: folder or file name); one per --model, "
                        "in their order, where several are served")
    p.add_argument("--models-file", metavar="FILE",
                   help="models to serve, as JSON: a list of model names or of objects {\"model\": ..., "
                        "\"name\": ...} that may also set ctx, dtype, kv_dtype, activations, threads and "
                        "pooling; the request's \"model\" picks one (the first by default)")
    p.add_argument("--pooling", default=None,
                   help="how /v1/embeddings pools hidden states: mean, cls, last, max, ... (default: the "
                        "model's sentence-transformers or GGUF pooling, else its last token)")
    p.add_argument("--max-body", type=int, default=SERVE.max_body, metavar="BYTES",
                   help=f"largest request body; larger ones get 413 (default: {SERVE.max_body})")
    p.add_argument("--body-timeout", type=float, default=SERVE.body_timeout, metavar="S",
                   help=f"seconds to receive a request body; then 408 (default: {SERVE.body_timeout:g})")
    p.add_argument("--keep-alive", type=float, default=SERVE.keep_alive, metavar="S",
                   help=f"seconds an idle connection stays open (default: {SERVE.keep_alive:g})")
    p.add_argument("--max-connections", type=int, default=SERVE.max_connections,
                   help=f"requests in progress; more get 503 (default: {SERVE.max_connections})")
    p.add_argument("--head-timeout", type=float, default=SERVE.head_timeout, metavar="S",
                   help=f"seconds a connection may take to send a request head; then it is closed "
                        f"(default: {SERVE.head_timeout:g})")
    p.add_argument("--shutdown-timeout", type=float, default=SERVE.shutdown_timeout, metavar="S",
                   help=f"seconds answers in progress get to finish on SIGTERM or Ctrl-C; then they are "
                        f"cut (default: {SERVE.shutdown_timeout:g})")
    p.add_argument("--seed", type=whole_number(0, 2**64 - 1), default=SERVE.seed, metavar="N",
                   help="seed of the requests that give none, so that their sampling is reproducible, "
                        "as llama-server's --seed (default: a random one each); a request's seed -1 "
                        "still asks for a random one")
    p.add_argument("--request-timeout", type=float, default=SERVE.request_timeout, metavar="S",
                   help="seconds a generation may run; then it ends with finish_reason \"length\" "
                        "(default: no limit)")
    p.add_argument("--cors-origins", default=SERVE.cors_origins, metavar="ORIGINS",
                   help="web pages that may call the server from a browser (CORS), comma-separated "
                        "origins such as http://localhost:3000; '*' for any, 'localhost' for any port "
                        "of this machine (default: none)")
    p.add_argument("--cache-ram", type=whole_number(0), default=SERVE.cache_ram, metavar="MIB",
                   help="MiB of what slots held kept in RAM beyond them, so that a known prefix (system "
                        "prompt, tools, a conversation) is not run again when a request lands on another "
                        f"slot (default: {SERVE.cache_ram}; 0: off)")
    p.add_argument("--cache-dir", default=SERVE.cache_dir, metavar="DIR",
                   help="also keep what slots held in files in DIR (written in the background, and when "
                        "the server stops), so that a server started later skips a known prefix too; "
                        "files of another model, fastllm build or setting are not used (default: none)")
    p.add_argument("--cache-disk", type=whole_number(0), default=SERVE.cache_disk, metavar="MIB",
                   help=f"MiB of files in --cache-dir at most; the least recently used go first "
                        f"(default: {SERVE.cache_disk})")
    p.add_argument("--ctx-checkpoints", type=whole_number(0), default=SERVE.ctx_checkpoints, metavar="N",
                   help="recurrent-state checkpoints each slot keeps, for models with recurrent layers "
                        f"(Qwen3.5) to resume a conversation mid-way (default: {SERVE.ctx_checkpoints})")

    p = sub.add_parser("perplexity", help="perplexity on a text, and KL divergence from a base model, "
                                          "measured as llama.cpp's llama-perplexity measures them")
    p.add_argument("file", nargs="?", default=None,
                   help="UTF-8 text file (default: the Lee corpus of English news stories in gensim)")
    p.add_argument("--model", "-m", default=None,
                   help="HF model folder or .gguf file (default: SmolLM2-135M-Instruct)")
    p.add_argument("--ctx", "-c", type=whole_number(1), default=512,
                   help="tokens per chunk; the second half of each is scored (default: 512)")
    p.add_argument("--chunks", type=whole_number(1), default=None,
                   help="score only the first N chunks (default: all)")
    p.add_argument("--kl-divergence-base", default=None, metavar="BASE",
                   help="a second model (folder or .gguf, e.g. the f32 model) to compare the "
                        "next-token distributions with: KL divergence, top-1 agreement, PPL of both")
    p.add_argument("--threads", "-t", type=whole_number(1), default=None,
                   help="threads for the run loop (default: physical cores)")
    p.add_argument("--kv-dtype", choices=KV_DTYPES, default="f32",
                   help="the model's KV cache precision (the base's is f32): with --kl-divergence-base "
                        "the same file, what the cache's rounding costs (default: f32)")

    add_bench_parser(sub)
    return parser


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    commands = ("run", "repl", "chat", "convert", "info", "bench", "serve", "perplexity")
    if not argv or (argv[0].startswith("-") and argv[0] not in ("-h", "--help", "--version")):
        argv = ["repl"] + argv
    elif argv[0] not in commands and not argv[0].startswith("-"):
        argv = ["run"] + argv  # `fastllm "some prompt"` reads as `fastllm run "some prompt"`
    args = build_parser().parse_args(argv)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ContextFullWarning)  # the CLI prints its own notice
        warnings.showwarning = _print_warning
        return _dispatch(args)


def _print_warning(message, category, filename, lineno, file=None, line=None):
    """Warnings as a command's messages: what is wrong, not the source line that said so."""
    print(f"fastllm: warning: {message}", file=sys.stderr)


def _dispatch(args) -> int:
    try:
        if args.command == "convert":
            return cmd_convert(args)
        if args.command == "bench":
            return cmd_bench(args)
        if args.command == "run" and args.prompt is None:
            args.command = "repl"
        return {"run": cmd_run, "repl": cmd_repl, "chat": cmd_chat, "info": cmd_info,
                "serve": cmd_serve, "perplexity": cmd_perplexity}[args.command](args)
    except (FastLLMError, ValueError, FileNotFoundError) as e:
        print(f"fastllm: error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(file=sys.stderr)
        return 130


def _check_settings(args):
    """The sampling flags and --json-schema, checked before the model is
    loaded (a typo should not cost a load); the model's defaults are applied
    over them later, by Settings."""
    given = {k: getattr(args, k) for k in _SAMPLING_KEYS if getattr(args, k, None) is not None}
    SamplingParams().replace(**given)
    _response_format(getattr(args, "json_schema", None))


def _load(args, max_n_ctx: int | None = None):
    _check_settings(args)
    model = Model.from_pretrained(args.model, n_ctx=args.ctx, threads=args.threads, dtype=args.dtype,
                                  kv_dtype=args.kv_dtype, activations=args.activations, max_n_ctx=max_n_ctx,
                                  pack_cache=False if getattr(args, "no_cache", False) else None)
    _check_ctx(model, args.ctx)
    if getattr(args, "draft", None) is not None:
        if args.spec == "none":
            raise FastLLMError("--draft and --spec none ask for opposite things: give one")
        draft = Model.from_pretrained(args.draft, n_ctx=model.n_ctx, threads=model.threads,
                                      kv_dtype=args.kv_dtype, activations=args.activations)
        check_same_vocabulary(draft, model)
        model.speculative = draft
    elif getattr(args, "spec", None) in ("ngram", "mtp"):
        if args.spec == "mtp" and not model.has_mtp:
            raise FastLLMError(f"--spec mtp: {model.name} has no multi-token-prediction block (a Qwen3.5 GGUF "
                               "file converted with it, without --no-mtp, has one)")
        model.speculative = args.spec
    model.draft_max = getattr(args, "draft_max", model.draft_max)
    return model


def _check_ctx(model, ctx):
    """Warn when --ctx reaches past the positions the model was trained on."""
    trained = model.config.max_position_embeddings
    if ctx is not None and ctx > trained:
        print(f"fastllm: warning: --ctx {ctx} is more than the {trained} positions the model was trained "
              f"on (max_position_embeddings): text past position {trained} is likely to be garbage",
              file=sys.stderr)


class Settings:
    """The generation settings of a command: one SamplingParams that the
    flags and REPL commands edit, made of what the user set over the
    model's defaults (SamplingParams' own under its generation_config.json,
    as the Python API has them), and the most tokens per reply (None: the
    model's default, per prompt)."""

    def __init__(self, model, args):
        self.model = model
        self.given = set()   # the settings the user set
        self.params = model.default_sampling
        self.max_new_tokens = None
        for key in _SETTINGS:
            if getattr(args, key, None) is not None:
                self.set(key, getattr(args, key))
        self.stop = list(getattr(args, "stop", None) or [])
        self.response_format = _response_format(getattr(args, "json_schema", None))

    def set(self, key, value):
        """Change one setting; a bad value raises ValueError and changes nothing."""
        if key == "max_new_tokens":
            if value < 1:
                raise ValueError(f"max tokens must be at least 1, got {value}")
            self.max_new_tokens = value
        else:
            self.params = self.params.replace(**{key: value})
        self.given.add(key)

    def value(self, key, chat: bool):
        """(value, where it comes from) of one setting, for a chat reply or a continuation."""
        value = self.max_new_tokens if key == "max_new_tokens" else getattr(self.params, key)
        if key in self.given:
            return value, "set"
        if key in self.model.generation_defaults:
            return self.model.generation_defaults[key], _GEN_SOURCE
        if key == "max_new_tokens":
            if "max_length" in self.model.generation_config:
                return None, f"max_length {self.model.generation_config['max_length']} in {_GEN_SOURCE}"
            return DEFAULT_MAX_TOKENS["chat" if chat else "continuation"], "default"
        return value, "default"

    def kwargs(self) -> dict:
        """Keywords for Model.stream/chat."""
        kw = dict(max_new_tokens=self.max_new_tokens, sampling=self.params, stop=list(self.stop) or None)
        if self.response_format is not None:
            kw["response_format"] = self.response_format
        return kw


def has_chat_template(model) -> bool:
    return model.tokenizer is not None and bool(model.tokenizer.chat_template)


def _chat_mode(model, args) -> bool:
    """Chat where the model has a chat template, unless --raw asks for a
    plain continuation (as ollama and llama-cli's conversation mode do)."""
    if getattr(args, "raw", False):
        return False
    if getattr(args, "chat", False):
        _need_chat_template(model, "leave out --chat")
        return True
    return has_chat_template(model)


def _need_chat_template(model, instead: str):
    if not has_chat_template(model):
        raise FastLLMError(f"{model.name} has no chat template (its tokenizer_config.json has no "
                           f"'chat_template'): {instead} for a plain continuation")


def _why_empty(model, chat: bool, repl: bool) -> str:
    """Why a reply holds no text, and what to try instead."""
    s = model.last_stats
    if s.generated_tokens == 0 and s.finish_reason == "stop":
        why = "the model's end-of-sequence token came first"
        if chat:
            return f"{why}; rephrase, or try {'/chat off' if repl else '--raw'} for a plain continuation"
        if has_chat_template(model):
            return (f"{why}: this model often ends a plain continuation at once; "
                    f"{'/chat on' if repl else 'leave out --raw'} to chat with it")
        return f"{why}; try a longer prompt"
    if s.generated_tokens == 0:
        return (f"no room for new tokens (max_length in {_GEN_SOURCE} counts the prompt); "
                f"{'use /steps N' if repl else 'use -n N'}")
    return (f"the {s.generated_tokens} tokens generated hold only whitespace, special tokens or a "
            "stop string")


def _print_reply(pieces, model, chat: bool, repl: bool, verbose: bool) -> str:
    """Write a reply's pieces to stdout as they come, then on stderr why it
    ended where that is not plain to see (nothing generated, a chat reply cut
    at the token limit, the context full); returns the text."""
    text = []
    for piece in pieces:
        text.append(piece)
        sys.stdout.write(piece)
        sys.stdout.flush()
    sys.stdout.write("\n")
    sys.stdout.flush()
    s = model.last_stats
    if s.finish_reason == "context":
        print(f"[context full: {model.n_ctx} tokens; use --ctx N{' or /reset' if repl else ''}]",
              file=sys.stderr)
    elif not "".join(text).strip():
        print(f"[no text: {_why_empty(model, chat, repl)}]", file=sys.stderr)
    elif chat and s.finish_reason == "length":
        print(f"[... cut at {s.generated_tokens} tokens: {'/steps N' if repl else '-n N'} "
              "for longer replies]", file=sys.stderr)
    if verbose:
        spec = (f" | guesses: {s.accepted_tokens} of {s.drafted_tokens} kept"
                if model.speculative is not None else "")
        print(f"[prompt: {s.prompt_tokens} tokens, {s.prompt_tps:.1f} tok/s | "
              f"generated: {s.generated_tokens} tokens, {s.generate_tps:.1f} tok/s{spec} | "
              f"{model.threads} threads, {model.dtype}, stop: {s.finish_reason}]", file=sys.stderr)
    return "".join(text)


def _context_error(e: ValueError, model) -> bool:
    """Whether e says that the prompt does not fit the context."""
    return f"context of {model.n_ctx}" in str(e)


def _too_long(model, repl: bool) -> str:
    trained = model.config.max_position_embeddings
    more = f"a larger --ctx (up to the model's {trained})" if model.n_ctx < trained else "a shorter prompt"
    if repl:
        return (f"the conversation does not fit the context of {model.n_ctx} tokens: /reset to forget it, "
                f"or start fastllm with {more}")
    return f"the prompt does not fit the context of {model.n_ctx} tokens: use {more}"


def cmd_run(args) -> int:
    prompt = sys.stdin.read() if args.prompt == "-" else args.prompt
    if not prompt.strip():
        raise ValueError("the prompt is empty: give the text to answer"
                         + (" on stdin" if args.prompt == "-" else ", or - to read it from stdin"))
    model = _load(args)
    chat = _chat_mode(model, args)
    kw = Settings(model, args).kwargs()
    try:
        if chat:
            pieces = model.chat([{"role": "user", "content": prompt}], stream=True, **kw)
        else:
            pieces = model.stream(prompt, **kw)
        _print_reply(pieces, model, chat, repl=False, verbose=args.verbose)
    except ValueError as e:
        if not _context_error(e, model):
            raise
        print(f"fastllm: error: {_too_long(model, repl=False)}", file=sys.stderr)
        return 1
    return 0


def _setup_readline():
    try:
        import readline
    except ImportError:  # Windows without pyreadline: plain input() still works
        return
    if "libedit" not in (readline.__doc__ or ""):
        # Python turns bracketed paste off; on, a pasted block of lines
        # arrives as one input (GNU readline 8 and later).
        readline.parse_and_bind("set enable-bracketed-paste on")
    history = Path(cache_dir()) / "history"
    try:
        history.parent.mkdir(parents=True, exist_ok=True)
        readline.read_history_file(history)
    except OSError:
        pass
    readline.set_history_length(1000)

    def save():
        try:
            readline.write_history_file(history)
        except OSError:
            pass
    atexit.register(save)


def read_message(read, prompt: str, more: str = "... "):
    """One message from the user: (text, quoted), where quoted says it was a
    \"\"\" block (never a command). A line ending in \\ continues on the next
    line; a line starting with \"\"\" opens a block that a line ending in \"\"\"
    closes; text pasted as several lines at once arrives in one read. read is
    input(); EOFError before any text propagates."""
    line = read(prompt)
    if line.lstrip().startswith('"""'):
        rest = line.lstrip()[3:]
        lines = []
        while True:
            if rest.rstrip().endswith('"""'):
                last = rest.rstrip()[:-3]
                if last:
                    lines.append(last)
                break
            if rest or lines:  # text may begin on the line after the opening quotes
                lines.append(rest)
            try:
                rest = read(more)
            except EOFError:
                break
        return "\n".join(lines), True
    lines = []
    while line.endswith("\\"):
        lines.append(line[:-1])
        try:
            line = read(more)
        except EOFError:
            line = ""
            break
    lines.append(line)
    return "\n".join(lines), False


def _show(model, settings: Settings, chat: bool, system, history: list):
    names = {"max_new_tokens": "max tokens (/steps)", "temperature": "temperature (/temp)",
             "top_p": "top_p (/topp)", "top_k": "top_k (/topk)", "min_p": "min_p (/minp)",
             "repetition_penalty": "repeat penalty (/repeat)", "repeat_last_n": "repeat last n (/lastn)",
             "seed": "seed (/seed)"}
    rows = [("model", f"{model.source} ({model.config.model_type})"),
            ("threads", model.threads),
            ("context (--ctx)", f"{model.n_ctx} tokens"),
            ("dtype", model.dtype),
            ("kv_dtype", model.kv_dtype),
            ("mode (/chat)", "chat" if chat else "plain continuation"),
            ("system (/system)", repr(system) if system else "none"),
            ("conversation", f"{len(history) // 2} turns" if chat else "-")]
    for key in _SETTINGS:
        v, src = settings.value(key, chat)
        shown = ("random" if key == "seed" else "-") if v is None else v
        rows.append((names.get(key, key), f"{shown} ({src})"))
    rows.append(("stop (/stop)", ", ".join(repr(s) for s in settings.stop) or "none"))
    rows.append(("end-of-sequence ids", ", ".join(str(i) for i in sorted(model.eos_token_ids)) or "none"))
    width = max(len(k) for k, _ in rows)
    for k, v in rows:
        print(f"  {k:<{width}}  {v}", file=sys.stderr)


# REPL command: (settings key, type) for the commands that set one value
_SETTERS = {"temp": ("temperature", float), "topp": ("top_p", float), "topk": ("top_k", int),
            "minp": ("min_p", float), "repeat": ("repetition_penalty", float),
            "lastn": ("repeat_last_n", int), "seed": ("seed", int), "steps": ("max_new_tokens", int)}


def _repl(model, args, chat: bool, system: str | None = None, read=None) -> int:
    interactive = read is None and sys.stdin.isatty()
    if interactive:
        _setup_readline()
    read = read or input
    settings = Settings(model, args)
    history = []   # the conversation in chat mode, without the system message
    print(f"fastllm {'chat' if chat else 'REPL'} with {model.name} "
          f"({model.threads} threads, context {model.n_ctx}). /help for commands, /quit to leave.",
          file=sys.stderr)
    while True:
        try:
            # Prompts only at a terminal: piped output stays the model's text.
            text, quoted = read_message(read, ("you> " if chat else "> ") if interactive else "",
                                        "... " if interactive else "")
        except EOFError:
            print(file=sys.stderr)
            return 0
        except KeyboardInterrupt:
            print(file=sys.stderr)
            continue
        if not text.strip():
            continue
        if text.startswith("/") and not quoted:
            cmd, value = (text[1:].split(None, 1) + ["", ""])[:2]
            value = value.strip()
            if cmd in ("quit", "exit", "q"):
                return 0
            elif cmd == "help":
                print(REPL_HELP, file=sys.stderr)
                continue
            elif cmd == "show":
                _show(model, settings, chat, system, history)
                continue
            elif cmd in _SETTERS:
                key, kind = _SETTERS[cmd]
                try:
                    if value:
                        settings.set(key, kind(value))
                    elif cmd == "seed":
                        settings.set(key, None)
                        settings.given.discard(key)
                    else:
                        raise ValueError(f"/{cmd} needs a value")
                except ValueError as e:
                    print(f"bad value for /{cmd}: {value!r} ({e})", file=sys.stderr)
                    continue
            elif cmd == "stop":
                if value:
                    settings.stop.append(value)
                else:
                    settings.stop.clear()
            elif cmd == "system":
                system = value or None
            elif cmd == "chat" and value in ("on", "off"):
                if value == "on" and not has_chat_template(model):
                    print(f"{model.name} has no chat template: it continues plain text only", file=sys.stderr)
                    continue
                chat = value == "on"
                history = []
            elif cmd == "reset":
                history = []
            else:
                print(f"unknown command {text.splitlines()[0]!r}; /help lists them", file=sys.stderr)
                continue
            shown = {"stop": f"stop strings: {settings.stop!r}" if settings.stop else "stop strings cleared",
                     "system": "system message set" if system else "system message removed",
                     "seed": "seed random" if not value else None}.get(cmd)
            if cmd == "system" and not chat and system:
                shown += " (used in chat mode: /chat on)"
            print(f"[{shown or (cmd + ' ' + value).strip()}]", file=sys.stderr)
            continue
        kw = settings.kwargs()
        try:
            if chat:
                messages = ([{"role": "system", "content": system}] if system else []) + history
                messages.append({"role": "user", "content": text})
                reply = _print_reply(model.chat(messages, stream=True, **kw), model, chat, True, args.verbose)
                history += [messages[-1], {"role": "assistant", "content": reply}]
            else:
                _print_reply(model.stream(text, **kw), model, chat, True, args.verbose)
        except KeyboardInterrupt:
            print("\n[interrupted]", file=sys.stderr)
        except ValueError as e:
            print(_too_long(model, repl=True) if _context_error(e, model) else f"error: {e}", file=sys.stderr)


def cmd_repl(args) -> int:
    model = _load(args)
    return _repl(model, args, chat=_chat_mode(model, args), system=getattr(args, "system", None))


def cmd_chat(args) -> int:
    model = _load(args)
    _need_chat_template(model, "use `fastllm repl`")
    return _repl(model, args, chat=True, system=args.system)


def cmd_serve(args) -> int:
    try:
        import starlette  # noqa: F401
        import uvicorn  # noqa: F401
    except ImportError as e:
        raise FastLLMError(f"fastllm serve needs starlette and uvicorn: pip install 'fastllm-engine[serve]' "
                           f"({e})") from None
    names = args.model_name or []
    try:
        options = ServeOptions(**{k: getattr(args, k) for k in OPTION_NAMES if k != "model_name"},
                               model_name=names[0] if len(names) == 1 and len(args.model or [None]) == 1 else None)
    except ValueError as e:
        raise FastLLMError(f"fastllm serve: {e}") from None
    entries = _served_entries(args)
    models = []
    for entry in entries:
        model = _load(argparse.Namespace(**{**vars(args), **entry}), SLOT_CTX)
        pooling = entry.get("pooling")
        if pooling is not None:
            try:
                model.pooling = pooling
            except ValueError as e:
                raise FastLLMError(f"fastllm serve: {e}") from None
        models.append((entry.get("name") or model.name, model))
    serve(models if len(models) > 1 else models[0][1], options)
    return 0


# What an entry of --models-file may set, and its command-line option.
_MODEL_FILE_KEYS = {"model": "model", "name": "name", "ctx": "ctx", "dtype": "dtype", "kv_dtype": "kv_dtype",
                    "activations": "activations", "threads": "threads", "pooling": "pooling"}


def _served_entries(args) -> list:
    """The models `fastllm serve` loads, as dicts of _load's arguments (and
    name, pooling): from --models-file, or one per --model (each named by
    the --model-name in its place)."""
    if args.models_file:
        if args.model:
            raise FastLLMError("fastllm serve: give models with --model or with --models-file, not both")
        return [{"pooling": args.pooling, **e} for e in _models_file(Path(args.models_file))]
    paths = args.model or [None]
    names = args.model_name or []
    if len(names) > 1 and len(names) != len(paths):
        raise FastLLMError(f"fastllm serve: {len(names)} --model-name for {len(paths)} --model: give one "
                           "per model, in their order")
    if len(paths) == 1:
        names = names[:1]
    return [{"model": p, "name": names[i] if i < len(names) else None, "pooling": args.pooling}
            for i, p in enumerate(paths)]


def _models_file(path: Path) -> list:
    try:
        listed = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError, RecursionError) as e:
        raise FastLLMError(f"fastllm serve: --models-file {path}: {e}") from None
    if isinstance(listed, dict):
        listed = listed.get("models")
    if not isinstance(listed, list) or not listed:
        raise FastLLMError(f"fastllm serve: --models-file {path} must hold a non-empty list of models "
                           "(or {\"models\": [...]})")
    entries = []
    for i, entry in enumerate(listed):
        if isinstance(entry, str):
            entry = {"model": entry}
        if not isinstance(entry, dict) or not isinstance(entry.get("model"), str):
            raise FastLLMError(f"fastllm serve: --models-file {path}: entry {i} must be a model name or an "
                               "object with a \"model\"")
        unknown = [k for k in entry if k not in _MODEL_FILE_KEYS]
        if unknown:
            raise FastLLMError(f"fastllm serve: --models-file {path}: entry {i} sets {unknown[0]!r}; an entry "
                               f"may set {', '.join(_MODEL_FILE_KEYS)}")
        entries.append(dict(entry))
    return entries


def cmd_convert(args) -> int:
    source = locate(args.input)   # a missing input is named before anything about the output
    out = Path(args.output)
    if source.is_dir():
        if out.is_dir():
            raise ValueError(f"{out} is a folder; give the name of the .gguf file to write")
        if out.suffix.lower() != ".gguf":
            out = out.with_name(out.name + ".gguf")
            print(f"fastllm: writing {out}: the .gguf extension was added to {args.output}", file=sys.stderr)
        out = export_gguf(source, out, mix=args.dtype)
    else:
        if args.dtype not in ("f32", "bf16"):
            raise ValueError(f"a GGUF file converts to a f32 or bf16 folder, not {args.dtype}")
        if out.suffix.lower() == ".gguf":
            raise ValueError(f"{source.name} is a GGUF file, which converts into a model folder; "
                             f"{args.output} reads as a GGUF file name, so name the folder otherwise")
        out = convert_gguf(source, out, dtype=args.dtype)
    print(f"wrote {out}", file=sys.stderr)
    return 0


def cmd_perplexity(args) -> int:
    text = perplexity.corpus_text() if args.file is None else perplexity.read_text(args.file)
    model = Model.from_pretrained(args.model, n_ctx=args.ctx, threads=args.threads, kv_dtype=args.kv_dtype)
    _check_ctx(model, args.ctx)
    base = (None if args.kl_divergence_base is None else
            Model.from_pretrained(args.kl_divergence_base, n_ctx=args.ctx, threads=args.threads))
    ids = perplexity.tokenize(model, text)

    def progress(i, n, ppl):
        print(f"[{i}/{n}] {ppl:.4f}", file=sys.stderr, flush=True)
    result = perplexity.evaluate(model, ids, args.ctx, base=base, chunks=args.chunks,
                                 bos=perplexity.chunk_bos(model), progress=progress)
    print(perplexity.report(result))
    return 0


def _pack_cache_line(model, args) -> str:
    """Where the packed weights are kept (fastllm.load.pack_cache), and the disk that takes."""
    n, total = pack_cache.disk_use()
    folder = f"{pack_cache.folder()}: {n} file{'s' if n != 1 else ''}, {total / 2**20:.1f} MiB"
    if model.pack_cache_file is None:
        off = args.no_cache or not pack_cache.enabled(None)
        return f"{'off' if off else 'could not be written'} ({folder})"
    return f"{model.pack_cache_file} ({model.pack_cache_file.stat().st_size / 2**20:.1f} MiB; {folder})"


def _prefetch_line() -> str:
    """How the kernels ask for the weights they stream (FASTLLM_PREFETCH sets it)."""
    prefetch = __import__("fastllm.core._core", fromlist=["stream_prefetch"]).stream_prefetch()
    if prefetch is None:
        return "left to the CPU"
    return f"{prefetch[0]} bytes ahead, into L{prefetch[1]}"


def cmd_info(args) -> int:
    model = _load(args)
    c = model.config
    weight_bytes = model.weight_bytes
    types = ", ".join(f"{t} {n / model.config.n_params():.0%}" for t, n in model.weight_types.items())
    kv_bytes = (2 * c.num_hidden_layers * model.n_ctx * c.num_key_value_heads * c.head_dim
                * KV_BYTES[model.kv_dtype])
    rows = [
        ("path", str(model.source)),
        *([("cache folder", str(model.path))] if model.path != model.source else []),
        *([("tokenizer cache", str(model.tokenizer_cache))] if model.tokenizer_cache else []),
        ("model_type", c.model_type),
        ("parameters", f"{c.n_params():,}"),
        ("layers", c.num_hidden_layers),
        ("hidden_size", c.hidden_size),
        ("intermediate_size", c.intermediate_size),
        ("heads / kv heads / head_dim", f"{c.num_attention_heads} / {c.num_key_value_heads} / {c.head_dim}"),
        ("vocab_size", c.vocab_size),
        ("rope_theta", c.rope_theta),
        ("rope_scaling", c.rope_scaling),
        ("tie_word_embeddings", c.tie_word_embeddings),
        ("context (n_ctx)", f"{model.n_ctx} (max_position_embeddings {c.max_position_embeddings})"),
        *([("sliding window", f"{c.sliding_window} positions, in {sliding} of {c.num_hidden_layers} layers")]
          if (sliding := sum(c.attention_window(i) > 0 for i in range(c.num_hidden_layers))) else []),
        *([("layers without RoPE", ", ".join(str(i) for i in range(c.num_hidden_layers) if not c.layer_rope(i))
            or "none")] if c.no_rope_layers is not None else []),
        *([("multipliers", f"embedding {c.embedding_multiplier}, residual {c.residual_multiplier}, "
                           f"attention {c.attention_multiplier}, logits / {c.logits_scaling}")]
          if (c.embedding_multiplier, c.residual_multiplier, c.attention_multiplier, c.logits_scaling)
          != (1.0, 1.0, None, 1.0) else []),
        *([("experts", f"{c.num_experts_per_tok} of {c.num_experts} per token, {c.moe_intermediate_size} wide"
                       f"{', renormalised' if c.norm_topk_prob else ''}, in {sum(c.moe_layers)} of "
                       f"{c.num_hidden_layers} layers"
                       + (f", a shared expert {c.shared_expert_intermediate_size} wide" if c.shared_expert else ""))]
          if c.num_experts else []),
        *([("MLP activation", c.hidden_act)] if c.hidden_act != "silu" else []),
        *([("soft-caps", f"attention scores {c.attn_logit_softcapping}, logits {c.final_logit_softcapping}")]
          if c.attn_logit_softcapping or c.final_logit_softcapping else []),
        *([("sliding layers' RoPE", f"rope_theta {c.local_rope_theta}, rope_scaling {c.local_rope_scaling}")]
          if c.local_rope_theta is not None else []),
        *([("query scaling", f"1 + {c.query_scale_beta} * log(1 + floor(position / {c.query_scale_period}))")]
          if c.query_scale_beta else []),
        ("weights in memory", f"{weight_bytes / 2**20:.1f} MiB ({types})"),
        ("packed weights cache", _pack_cache_line(model, args)),
        ("KV cache at full context", f"{kv_bytes / 2**20:.1f} MiB ({model.kv_dtype})"),
        ("threads", model.threads),
        ("SIMD path", __import__("fastllm.core._core", fromlist=["simd_path"]).simd_path()),
        ("int8 kernels", __import__("fastllm.core._core", fromlist=["int8_path"]).int8_path()
         + ("" if model.activations == "int8" else " (not used: f32 activations)")),
        ("weight prefetch", _prefetch_line()),
        ("OpenMP wait", __import__("fastllm.core._openmp", fromlist=["wait_policy"]).wait_policy()),
    ]
    width = max(len(k) for k, _ in rows)
    for k, v in rows:
        print(f"{k:<{width}}  {v}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
