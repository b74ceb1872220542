"""The `fastllm` command: run, chat, an interactive REPL, convert, info, bench."""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from .errors import FastLLMError

REPL_HELP = """commands:
  /temp X     sampling temperature (0 = greedy)
  /topp X     nucleus sampling mass
  /topk N     keep the N most likely tokens (0 = off)
  /seed N     seed for sampling (reproducible runs)
  /steps N    most tokens to generate per reply
  /chat on|off  use the chat template (multi-turn) or plain continuation
  /reset      forget the conversation
  /quit       leave (Ctrl-D works too)"""


def _model_args(p: argparse.ArgumentParser):
    p.add_argument("--model", "-m", default=None,
                   help="HF model folder or .gguf file (default: SmolLM2-135M-Instruct)")
    p.add_argument("--threads", "-t", type=int, default=None,
                   help="threads for the run loop (default: physical cores)")
    p.add_argument("--ctx", "-c", type=int, default=None,
                   help="context length (default: the model's max_position_embeddings)")
    p.add_argument("--dtype", choices=("f32", "bf16"), default="f32",
                   help="weight precision in memory (default: f32)")


def _sampling_args(p: argparse.ArgumentParser, steps: int):
    p.add_argument("--max-tokens", "-n", "--steps", dest="max_tokens", type=int, default=steps,
                   help=f"most tokens to generate (default: {steps})")
    p.add_argument("--temp", "--temperature", dest="temperature", type=float, default=0.0,
                   help="sampling temperature; 0 is greedy (default: 0)")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--min-p", type=float, default=0.0)
    p.add_argument("--repeat-penalty", dest="repetition_penalty", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--stop", action="append", default=None, help="stop string (repeatable)")
    p.add_argument("--verbose", "-v", action="store_true", help="print tokens/s to stderr")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="fastllm", description="CPU LLM inference. With no command: an interactive REPL.")
    from . import __version__
    parser.add_argument("--version", action="version", version=f"fastllm {__version__}")
    sub = parser.add_subparsers(dest="command")

    p = sub.add_parser("run", help="stream the continuation of a prompt")
    _model_args(p)
    _sampling_args(p, 256)
    p.add_argument("--chat", action="store_true", help="wrap the prompt in the chat template")
    p.add_argument("prompt", nargs="?", help="prompt text ('-' reads stdin; none opens the REPL)")

    p = sub.add_parser("repl", help="interactive prompt (the default command)")
    _model_args(p)
    _sampling_args(p, 256)
    p.add_argument("--chat", action="store_true", help="start in chat mode")

    p = sub.add_parser("chat", help="multi-turn chat using the model's chat template")
    _model_args(p)
    _sampling_args(p, 512)
    p.add_argument("--system", default=None, help="system message")

    p = sub.add_parser("convert", help="convert a GGUF file into a HF model folder")
    p.add_argument("input", help="the .gguf file")
    p.add_argument("output", help="folder to create")
    p.add_argument("--dtype", choices=("bf16", "f32"), default="bf16",
                   help="safetensors precision (default: bf16)")

    p = sub.add_parser("info", help="config, parameter count and memory of a model")
    _model_args(p)

    from .bench import add_bench_parser
    add_bench_parser(sub)
    return parser


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    commands = ("run", "repl", "chat", "convert", "info", "bench")
    if not argv or (argv[0].startswith("-") and argv[0] not in ("-h", "--help", "--version")):
        argv = ["repl"] + argv
    elif argv[0] not in commands and not argv[0].startswith("-"):
        argv = ["run"] + argv  # `fastllm "some prompt"` reads as `fastllm run "some prompt"`
    args = build_parser().parse_args(argv)
    try:
        if args.command == "convert":
            return cmd_convert(args)
        if args.command == "bench":
            from .bench import cmd_bench
            return cmd_bench(args)
        if args.command == "run" and args.prompt is None:
            args.command = "repl"
        return {"run": cmd_run, "repl": cmd_repl, "chat": cmd_chat, "info": cmd_info}[args.command](args)
    except (FastLLMError, ValueError, FileNotFoundError) as e:
        print(f"fastllm: error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(file=sys.stderr)
        return 130


def _load(args):
    from .model import Model
    return Model.from_pretrained(args.model, n_ctx=args.ctx, threads=args.threads, dtype=args.dtype)


def _sampling_kwargs(args) -> dict:
    return dict(max_new_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                top_k=args.top_k, min_p=args.min_p, repetition_penalty=args.repetition_penalty,
                seed=args.seed, stop=args.stop)


def _print_stream(pieces, model, verbose: bool):
    for piece in pieces:
        sys.stdout.write(piece)
        sys.stdout.flush()
    sys.stdout.write("\n")
    if verbose:
        s = model.last_stats
        print(f"[prompt: {s.prompt_tokens} tokens, {s.prompt_tps:.1f} tok/s | "
              f"generated: {s.generated_tokens} tokens, {s.generate_tps:.1f} tok/s | "
              f"{model.threads} threads, {model.dtype}, stop: {s.finish_reason}]", file=sys.stderr)


def cmd_run(args) -> int:
    prompt = sys.stdin.read() if args.prompt == "-" else args.prompt
    model = _load(args)
    if args.chat:
        pieces = model.chat([{"role": "user", "content": prompt}], stream=True, **_sampling_kwargs(args))
    else:
        pieces = model.stream(prompt, **_sampling_kwargs(args))
    _print_stream(pieces, model, args.verbose)
    return 0


def _setup_readline():
    try:
        import readline
    except ImportError:  # Windows without pyreadline: plain input() still works
        return
    from .hub import cache_dir
    history = Path(cache_dir()) / "history"
    try:
        history.parent.mkdir(parents=True, exist_ok=True)
        readline.read_history_file(history)
    except OSError:
        pass
    readline.set_history_length(1000)
    import atexit

    def save():
        try:
            readline.write_history_file(history)
        except OSError:
            pass
    atexit.register(save)


def _repl(model, args, chat: bool, system: str | None = None) -> int:
    _setup_readline()
    kw = _sampling_kwargs(args)
    messages = [{"role": "system", "content": system}] if system else []
    print(f"fastllm {'chat' if chat else 'REPL'} with {model.path.name} "
          f"({model.threads} threads). /help for commands, /quit to leave.", file=sys.stderr)
    while True:
        try:
            line = input("you> " if chat else "> ")
        except EOFError:
            print(file=sys.stderr)
            return 0
        except KeyboardInterrupt:
            print(file=sys.stderr)
            continue
        if not line.strip():
            continue
        if line.startswith("/"):
            cmd, _, value = line[1:].strip().partition(" ")
            value = value.strip()
            try:
                if cmd in ("quit", "exit", "q"):
                    return 0
                elif cmd == "help":
                    print(REPL_HELP, file=sys.stderr)
                elif cmd == "temp":
                    kw["temperature"] = float(value)
                elif cmd == "topp":
                    kw["top_p"] = float(value)
                elif cmd == "topk":
                    kw["top_k"] = int(value)
                elif cmd == "seed":
                    kw["seed"] = int(value)
                elif cmd == "steps":
                    kw["max_new_tokens"] = int(value)
                elif cmd == "chat" and value in ("on", "off"):
                    chat = value == "on"
                    messages = [m for m in messages if m["role"] == "system"]
                elif cmd == "reset":
                    messages = [m for m in messages if m["role"] == "system"]
                else:
                    print(f"unknown command {line!r}; /help lists them", file=sys.stderr)
                    continue
                print(f"[{cmd} {value}]".replace(" ]", "]"), file=sys.stderr)
            except ValueError:
                print(f"bad value for /{cmd}: {value!r}", file=sys.stderr)
            continue
        try:
            if chat:
                messages.append({"role": "user", "content": line})
                reply = []
                for piece in model.chat(messages, stream=True, **kw):
                    reply.append(piece)
                    sys.stdout.write(piece)
                    sys.stdout.flush()
                messages.append({"role": "assistant", "content": "".join(reply)})
                sys.stdout.write("\n")
            else:
                _print_stream(model.stream(line, **kw), model, False)
        except KeyboardInterrupt:
            print("\n[interrupted]", file=sys.stderr)
            continue
        except ValueError as e:
            print(f"error: {e}", file=sys.stderr)
            if chat and messages and messages[-1]["role"] == "user":
                messages.pop()
            continue
        if args.verbose:
            s = model.last_stats
            print(f"[{s.prompt_tokens} prompt tokens at {s.prompt_tps:.1f} tok/s, "
                  f"{s.generated_tokens} generated at {s.generate_tps:.1f} tok/s]", file=sys.stderr)


def cmd_repl(args) -> int:
    return _repl(_load(args), args, chat=bool(getattr(args, "chat", False)))


def cmd_chat(args) -> int:
    return _repl(_load(args), args, chat=True, system=args.system)


def cmd_convert(args) -> int:
    from .convert import convert_gguf
    out = convert_gguf(args.input, args.output, dtype=args.dtype)
    print(f"wrote {out}", file=sys.stderr)
    return 0


def cmd_info(args) -> int:
    model = _load(args)
    c = model.config
    weight_bytes = c.n_params() * (2 if model.dtype == "bf16" else 4)
    kv_bytes = 2 * c.num_hidden_layers * model.n_ctx * c.num_key_value_heads * c.head_dim * 4
    rows = [
        ("path", str(model.path)),
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
        ("weights in memory", f"{weight_bytes / 2**20:.1f} MiB ({model.dtype})"),
        ("KV cache at full context", f"{kv_bytes / 2**20:.1f} MiB (f32)"),
        ("threads", model.threads),
        ("SIMD path", __import__("fastllm._core", fromlist=["simd_path"]).simd_path()),
    ]
    width = max(len(k) for k, _ in rows)
    for k, v in rows:
        print(f"{k:<{width}}  {v}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
