"""The command line: every option documented, the REPL (multi-line input,
settings commands, bad values), generation_config.json and its precedence,
the context-full notice and the default conversion dtype.

Most tests run a tiny random llama with a byte-level tokenizer: fast, and
its text is noise, so they check what the CLI does, not what the model says.
"""
import argparse
import inspect
import json
import os
import shutil
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

from fastllm import FastLLMError, Model, SamplingParams
from fastllm.cli import main as cli
from fastllm.core import _core
from fastllm.generate.model import ContextFullWarning
from fastllm.generate.sampling import GenerationConfigError
from fastllm.tokenizer import _bytes_to_unicode  # GPT-2's byte -> character table

CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def write_byte_tokenizer(folder: Path, vocab_size: int):
    """A byte-level BPE tokenizer without merges (one token per byte), three
    ChatML specials (<|im_end|> = 2 is eos) and filler tokens up to vocab_size."""
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    vocab = {t: i for i, t in enumerate(specials)}
    for ch in _bytes_to_unicode():
        vocab[ch] = len(vocab)
    while len(vocab) < vocab_size:
        vocab[f"<x{len(vocab)}>"] = len(vocab)
    tok = {"version": "1.0", "truncation": None, "padding": None,
           "added_tokens": [{"id": i, "content": t, "single_word": False, "lstrip": False, "rstrip": False,
                             "normalized": False, "special": True} for i, t in enumerate(specials)],
           "normalizer": None,
           "pre_tokenizer": {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True,
                             "use_regex": True},
           "post_processor": {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": False,
                              "use_regex": True},
           "decoder": {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True, "use_regex": True},
           "model": {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": None,
                     "end_of_word_suffix": None, "fuse_unk": False, "byte_fallback": False,
                     "ignore_merges": False, "vocab": vocab, "merges": []}}
    (folder / "tokenizer.json").write_text(json.dumps(tok))
    (folder / "tokenizer_config.json").write_text(json.dumps(
        {"chat_template": CHATML, "eos_token": "<|im_end|>", "bos_token": None, "add_bos_token": False}))


@pytest.fixture(scope="module")
def tiny_dir(tiny_model_dir, tmp_path_factory):
    """A tiny llama with a tokenizer and no generation_config.json."""
    d = tmp_path_factory.mktemp("cli") / "tiny"
    shutil.copytree(tiny_model_dir("llama-gqa"), d)
    (d / "generation_config.json").unlink(missing_ok=True)
    write_byte_tokenizer(d, json.loads((d / "config.json").read_text())["vocab_size"])
    return d


@pytest.fixture(scope="module")
def tiny(tiny_dir):
    return Model.from_pretrained(tiny_dir, n_ctx=128, threads=1)


def with_gen_config(src: Path, dst: Path, gen: dict) -> Path:
    shutil.copytree(src, dst)
    (dst / "generation_config.json").write_text(json.dumps(gen))
    return dst


def _cli(args, stdin=None):
    return subprocess.run([sys.executable, "-m", "fastllm", *args], input=stdin, capture_output=True,
                          text=True, timeout=300, env=dict(os.environ))


# ------------------------------------------------------------------ options

def _parsers(parser):
    yield parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                yield from _parsers(sub)


def test_every_option_of_every_command_has_help():
    parsers = list(_parsers(cli.build_parser()))
    assert {p.prog.split()[-1] for p in parsers} >= {"run", "repl", "chat", "convert", "info", "bench"}
    missing = [f"{p.prog}: {a.option_strings or a.dest}" for p in parsers for a in p._actions
               if not (a.help and a.help.strip()) or a.help == argparse.SUPPRESS]
    assert missing == []


def test_cli_defaults():
    p = cli.build_parser()
    args = p.parse_args(["run", "hi"])
    # unset flags stay None so generation_config.json can fill them
    assert args.max_new_tokens is None and args.repetition_penalty is None and args.temperature is None
    assert "--repeat-last-n" in p._subparsers._group_actions[0].choices["run"].format_help()
    args = p.parse_args(["run", "--presence-penalty", "0.5", "--frequency-penalty", "0.25", "hi"])
    assert (args.presence_penalty, args.frequency_penalty) == (0.5, 0.25)


def test_convert_defaults_to_f32():
    from fastllm.load import hub
    from fastllm.formats import gguf as convert
    assert convert.DEFAULT_DTYPE == "f32"
    assert inspect.signature(convert.convert_gguf).parameters["dtype"].default == "f32"
    assert "dtype" not in inspect.signature(hub.resolve_model).parameters   # always DEFAULT_DTYPE
    assert cli.build_parser().parse_args(["convert", "a.gguf", "out"]).dtype == "f32"


# ------------------------------------------------------------- multi-line input

def _reader(lines):
    it = iter(lines)

    def read(prompt=""):
        try:
            return next(it)
        except StopIteration:
            raise EOFError from None
    return read


@pytest.mark.parametrize("lines, text, quoted", [
    (["hello"], "hello", False),
    (["first \\", "second\\", "third"], "first \nsecond\nthird", False),
    (['"""', "a", "", "b", '"""'], "a\n\nb", True),
    (['"""a', 'b"""'], "a\nb", True),
    (['"""/temp 5"""'], "/temp 5", True),
    (['"""', "never closed"], "never closed", True),
    (["pasted\nat once"], "pasted\nat once", False),   # what bracketed paste delivers
])
def test_read_message(lines, text, quoted):
    assert cli.read_message(_reader(lines), "> ") == (text, quoted)


def test_read_message_eof():
    with pytest.raises(EOFError):
        cli.read_message(_reader([]), "> ")


# ------------------------------------------------------------------- the REPL

class Recorder:
    """Wraps a model, recording the prompts and keywords each turn gets."""

    def __init__(self, model):
        self._model = model
        self.calls = []

    def __getattr__(self, name):
        return getattr(self._model, name)

    def stream(self, prompt, **kw):
        self.calls.append(("stream", prompt, kw))
        return self._model.stream(prompt, **kw)

    def chat(self, messages, **kw):
        self.calls.append(("chat", [dict(m) for m in messages], kw))
        return self._model.chat(messages, **kw)


def run_repl(model, lines, argv=(), chat=False, system=None, capsys=None):
    args = cli.build_parser().parse_args(["repl", *argv])
    rec = Recorder(model)
    rc = cli._repl(rec, args, chat=chat, system=system, read=_reader(lines))
    out = capsys.readouterr() if capsys else None
    return rc, rec, out


def test_multiline_input_is_one_turn(tiny, capsys):
    rc, rec, out = run_repl(tiny, ["line one\\", "line two\\", "line three",
                                   '"""', "block one", "block two", "block three", '"""',
                                   "/quit"], ["-n", "3"], capsys=capsys)
    assert rc == 0
    prompts = [c[1] for c in rec.calls]
    assert prompts == ["line one\nline two\nline three", "block one\nblock two\nblock three"]


def test_settings_commands_change_what_generation_gets(tiny, capsys):
    rc, rec, out = run_repl(tiny, ["/minp 0.05", "/repeat 1.3", "/lastn 16", "/topk 7", "/topp 0.9",
                                   "/temp 0.8", "/seed 5", "/steps 4", "/stop zz", "/stop yy", "hello",
                                   "/stop", "/seed", "again"], capsys=capsys)
    assert rc == 0
    (_, _, kw1), (_, _, kw2) = rec.calls
    assert kw1 == dict(max_new_tokens=4, stop=["zz", "yy"], sampling=SamplingParams(
        temperature=0.8, top_p=0.9, top_k=7, min_p=0.05, repetition_penalty=1.3, repeat_last_n=16, seed=5))
    assert kw2["stop"] is None and kw2["sampling"] == kw1["sampling"].replace(seed=None)
    for shown in ("[minp 0.05]", "[repeat 1.3]", "[lastn 16]", "[steps 4]", "stop strings cleared"):
        assert shown in out.err


def test_show_prints_every_setting(tiny, tiny_dir, capsys):
    rc, rec, out = run_repl(tiny, ["/minp 0.1", "/system Be terse.", "/stop END", "/show"],
                            ["--top-k", "3"], capsys=capsys)
    err = out.err
    for text in (str(tiny_dir), "threads", "128 tokens", "f32", "plain continuation", "'Be terse.'",
                 "min_p (/minp)             0.1 (set)", "top_k (/topk)             3 (set)",
                 "temperature (/temp)       0.0 (default)", "repeat penalty (/repeat)  1.0 (default)",
                 "repeat last n (/lastn)    -1 (default)", "max tokens (/steps)       128 (default)",
                 "'END'", "end-of-sequence ids"):
        assert text in err, text


def test_bad_values_are_refused_and_the_repl_goes_on(tiny, capsys):
    rc, rec, out = run_repl(tiny, ["/temp -1", "/temp warm", "/topk 2.5", "/topp 0", "/minp 2",
                                   "/repeat 0", "/lastn -2", "/steps 0", "/steps", "/chat maybe",
                                   "/nonsense", "hi"], ["-n", "2"], capsys=capsys)
    assert rc == 0
    assert out.err.count("bad value for /") == 9
    assert "unknown command '/chat maybe'" in out.err and "unknown command '/nonsense'" in out.err
    assert "Traceback" not in out.err
    (_, _, kw), = rec.calls   # the settings are as before the bad values
    assert kw["sampling"] == tiny.default_sampling and kw["max_new_tokens"] == 2


def test_chat_mode_system_message_and_reset(tiny, capsys):
    rc, rec, out = run_repl(tiny, ["/system You are a cat.", "/chat on", "one", "two\\", "lines",
                                   "/reset", "three", "/system", "four"], ["-n", "2"], capsys=capsys)
    assert rc == 0
    msgs = [c[1] for c in rec.calls]
    assert [m["role"] for m in msgs[0]] == ["system", "user"]
    assert msgs[0][0]["content"] == "You are a cat."
    assert [m["role"] for m in msgs[1]] == ["system", "user", "assistant", "user"]
    assert msgs[1][-1]["content"] == "two\nlines"
    assert [m["role"] for m in msgs[2]] == ["system", "user"]          # after /reset
    assert [m["role"] for m in msgs[3]] == ["user", "assistant", "user"]  # system removed


def test_repl_through_stdin(tiny_dir):
    script = '/steps 3\n/show\n"""\nmany\nlines\n"""\nsome\\\nmore\n/minp 7\n/help\n/quit\n'
    out = _cli(["--model", str(tiny_dir), "--ctx", "64", "-t", "1"], stdin=script)
    assert out.returncode == 0, out.stderr
    assert "Traceback" not in out.stderr
    assert "max tokens (/steps)       3 (set)" in out.stderr
    assert "bad value for /minp" in out.stderr and "/system TEXT" in out.stderr
    assert not out.stdout.startswith(">")   # no prompts when stdin is not a terminal


# ------------------------------------------------------------ context full

def test_context_full_python_api(tiny_dir):
    small = Model.from_pretrained(tiny_dir, n_ctx=16, threads=1)
    with pytest.warns(ContextFullWarning, match="16 tokens"):
        small.generate("abcdef", max_new_tokens=100, stop=None)
    assert small.last_stats.finish_reason == "context"
    assert small.last_stats.prompt_tokens + small.last_stats.generated_tokens == 16
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        small.generate("abcdef", max_new_tokens=3)   # no warning when it fits
    assert small.last_stats.finish_reason == "length"


def test_context_full_cli_notice(tiny_dir):
    out = _cli(["run", "--raw", "--model", str(tiny_dir), "--ctx", "16", "-t", "1", "-n", "100", "abcdef"])
    assert out.returncode == 0, out.stderr
    assert "[context full: 16 tokens; use --ctx N]" in out.stderr
    assert "ContextFullWarning" not in out.stderr
    out = _cli(["run", "--raw", "--model", str(tiny_dir), "--ctx", "16", "-t", "1", "-n", "5", "abcdef"])
    assert "context full" not in out.stderr
    out = _cli(["run", "--raw", "--model", str(tiny_dir), "--ctx", "4", "-t", "1", "abcdef"])
    assert out.returncode == 1 and "does not fit the context of 4 tokens" in out.stderr
    assert "Traceback" not in out.stderr


@pytest.mark.filterwarnings("ignore::fastllm.generate.model.ContextFullWarning")  # main() silences it
def test_context_full_repl_notice(tiny_dir, capsys):
    model = Model.from_pretrained(tiny_dir, n_ctx=40, threads=1)
    rc, rec, out = run_repl(model, ["/chat on", "hello", "again", "/reset", "hi"], ["-n", "100"],
                            capsys=capsys)
    assert rc == 0
    assert "[context full: 40 tokens; use --ctx N or /reset]" in out.err
    # the second turn no longer fits: one message, naming the way out
    assert "the conversation does not fit the context of 40 tokens: /reset to forget it" in out.err
    assert "n_ctx" not in out.err
    assert len(rec.calls) == 3


# ----------------------------------------------------- generation_config.json

SAMPLED = dict(do_sample=True, temperature=0.7, top_p=0.9, top_k=5, min_p=0.01, repetition_penalty=1.2,
               max_new_tokens=7)


def test_generation_config_is_the_python_default(tiny_dir, tmp_path):
    d = with_gen_config(tiny_dir, tmp_path / "m", dict(SAMPLED, eos_token_id=[7, 8]))
    m = Model.from_pretrained(d, n_ctx=128, threads=1)
    assert m.generation_defaults == dict(temperature=0.7, top_p=0.9, top_k=5, min_p=0.01,
                                         repetition_penalty=1.2, max_new_tokens=7)
    # The file's ids replace config.json's, as in transformers; the end-marking
    # tokens of the vocabulary (<|endoftext|> = 0, <|im_end|> = 2) end a
    # generation too, as in llama.cpp.
    assert m.eos_token_ids == {0, 2, 7, 8}
    assert m.default_max_new_tokens(3) == 7
    assert m.default_sampling == SamplingParams(temperature=0.7, top_p=0.9, top_k=5, min_p=0.01,
                                                repetition_penalty=1.2)
    # generation really uses the file's values: same text as passing them by hand
    plain = Model.from_pretrained(tiny_dir, n_ctx=128, threads=1)
    by_file = m.generate("abc", seed=3)
    by_hand = plain.generate("abc", seed=3, temperature=0.7, top_p=0.9, top_k=5, min_p=0.01,
                             repetition_penalty=1.2, max_new_tokens=7)
    assert m.last_stats.generated_tokens <= 7
    assert by_file == by_hand
    # a keyword passed wins over the file
    assert m.generate("abc", max_new_tokens=9, temperature=0.0) == plain.generate(
        "abc", max_new_tokens=9, top_p=0.9, top_k=5, min_p=0.01, repetition_penalty=1.2)
    assert m.last_stats.generated_tokens == 9
    chat = m.chat([{"role": "user", "content": "hi"}], seed=3)
    assert m.last_stats.generated_tokens <= 7 and isinstance(chat, str)


@pytest.mark.parametrize("gen, temperature", [
    (dict(do_sample=False, temperature=0.9), 0.0),   # greedy, as transformers
    (dict(temperature=0.9), 0.0),                    # no do_sample: transformers ignores temperature
    (dict(do_sample=True), 1.0),                     # sampling at transformers' default temperature
])
def test_do_sample(tiny_dir, tmp_path, gen, temperature):
    m = Model.from_pretrained(with_gen_config(tiny_dir, tmp_path / "m", gen), n_ctx=64, threads=1)
    assert m.default_sampling.temperature == temperature


def test_max_length_counts_the_prompt(tiny_dir, tmp_path):
    m = Model.from_pretrained(with_gen_config(tiny_dir, tmp_path / "m", {"max_length": 10}), n_ctx=64,
                              threads=1)
    assert m.default_max_new_tokens(4) == 6
    m.generate("abcd", stop=None)
    assert m.last_stats.prompt_tokens + m.last_stats.generated_tokens <= 10


@pytest.mark.filterwarnings("ignore::fastllm.generate.model.ContextFullWarning")  # main() silences it
def test_cli_precedence_flag_over_file_over_default(tiny_dir, tmp_path, capsys):
    d = with_gen_config(tiny_dir, tmp_path / "m", dict(SAMPLED))
    m = Model.from_pretrained(d, n_ctx=64, threads=1)
    rc, rec, out = run_repl(m, ["/show", "hi"], ["--top-k", "3"], capsys=capsys)
    (_, _, kw), = rec.calls
    assert kw["sampling"].top_k == 3                          # flag
    assert kw["sampling"].temperature == 0.7                  # the file
    assert kw["max_new_tokens"] is None                       # left to the file, per prompt
    assert kw["sampling"].repeat_last_n == -1                 # fastllm default
    assert "temperature (/temp)       0.7 (generation_config.json)" in out.err
    assert "top_k (/topk)             3 (set)" in out.err
    assert m.last_stats.generated_tokens <= 7
    # without a file the CLI defaults apply
    rc, rec, out = run_repl(Model.from_pretrained(tiny_dir, n_ctx=64, threads=1), ["hi"], capsys=capsys)
    (_, _, kw), = rec.calls
    assert kw["sampling"] == SamplingParams() and kw["max_new_tokens"] is None


@pytest.mark.parametrize("gen, problem", [
    ({"temperature": "hot"}, "temperature must be a number >= 0"),
    ({"top_p": 1.5}, "top_p must be a number in"),
    ({"top_k": -1}, "top_k must be a whole number"),
    ({"min_p": 2}, "min_p must be"),
    ({"repetition_penalty": 0}, "repetition_penalty must be a number > 0"),
    ({"do_sample": "yes"}, "do_sample must be true or false"),
    ({"max_new_tokens": 0}, "max_new_tokens must be"),
    ({"eos_token_id": "2"}, "eos_token_id must be"),
    ([1, 2], "expected a JSON object"),
])
def test_invalid_generation_config(tiny_dir, tmp_path, gen, problem):
    d = with_gen_config(tiny_dir, tmp_path / "m", gen)
    with pytest.raises(GenerationConfigError, match="generation_config.json") as e:
        Model.from_pretrained(d)
    assert problem in str(e.value) and isinstance(e.value, FastLLMError)


def test_invalid_generation_config_cli(tiny_dir, tmp_path):
    d = with_gen_config(tiny_dir, tmp_path / "m", {})
    (d / "generation_config.json").write_text("{not json")
    out = _cli(["run", "--model", str(d), "hi"])
    assert out.returncode == 1 and "generation_config.json: not valid JSON" in out.stderr
    assert "Traceback" not in out.stderr


def test_null_values_count_as_unset(tiny_dir, tmp_path):
    d = with_gen_config(tiny_dir, tmp_path / "m", {"temperature": None, "top_k": None, "eos_token_id": None})
    assert Model.from_pretrained(d, n_ctx=32).generation_defaults == {}


def _gnu_readline():
    try:
        import readline
    except ImportError:
        return False
    return "libedit" not in (readline.__doc__ or "")


@pytest.mark.skipif(not sys.platform.startswith("linux") or not _gnu_readline(),
                    reason="needs a pty and GNU readline")
def test_pasted_lines_are_one_turn_at_a_terminal(tiny_dir, tmp_path):
    # A terminal with bracketed paste wraps pasted text in ESC[200~ ... ESC[201~;
    # readline then returns all of it from one input().
    import pty
    import select
    import time
    pid, fd = pty.fork()
    if pid == 0:  # the child: the REPL on a terminal (its history file under tmp_path)
        os.environ["FASTLLM_HOME"] = str(tmp_path)
        os.execv(sys.executable, [sys.executable, "-m", "fastllm", "--model", str(tiny_dir),
                                  "--ctx", "64", "-t", "1", "-n", "2"])
    out = b""

    def read_until(marker: bytes, count: int):
        nonlocal out
        deadline = time.time() + 120
        while out.count(marker) < count and time.time() < deadline:
            if select.select([fd], [], [], 0.5)[0]:
                try:
                    out += os.read(fd, 65536)
                except OSError:
                    break
    try:
        read_until(b"> ", 1)
        os.write(fd, b"\x1b[200~first line\nsecond line\nthird line\x1b[201~\r")
        read_until(b"> ", 2)
        os.write(fd, b"/quit\r")
        _, status = os.waitpid(pid, 0)
    finally:
        os.close(fd)
    assert b"Traceback" not in out
    assert out.count(b"> ") == 2, out   # one reply, then the next prompt
    assert os.WEXITSTATUS(status) == 0


# ------------------------------------------------- chat by default, and why a reply ends

def main_with(model, argv, capsys, monkeypatch, stdin=None):
    """cli.main(argv) on an already loaded model (recorded): (rc, recorder, stdout, stderr)."""
    import io
    rec = Recorder(model)
    monkeypatch.setattr(cli, "_load", lambda args: cli._check_ctx(model, args.ctx) or rec)
    if stdin is not None:
        monkeypatch.setattr(sys, "stdin", io.StringIO(stdin))
    rc = cli.main(argv)
    out = capsys.readouterr()
    return rc, rec, out.out, out.err


@pytest.fixture
def fresh(tiny_dir):
    """A model of its own, for tests that change its end-of-sequence ids."""
    return Model.from_pretrained(tiny_dir, n_ctx=128, threads=1)


@pytest.fixture(scope="module")
def no_template_dir(tiny_dir, tmp_path_factory):
    d = tmp_path_factory.mktemp("plain") / "tiny"
    shutil.copytree(tiny_dir, d)
    config = json.loads((d / "tokenizer_config.json").read_text())
    del config["chat_template"]
    (d / "tokenizer_config.json").write_text(json.dumps(config))
    return d


@pytest.mark.parametrize("flags, how", [([], "chat"), (["--chat"], "chat"), (["--raw"], "stream")])
def test_run_chats_where_the_model_has_a_template(tiny, capsys, monkeypatch, flags, how):
    rc, rec, out, err = main_with(tiny, ["run", *flags, "-n", "3", "hello"], capsys, monkeypatch)
    assert rc == 0, err
    (called, prompt, kw), = rec.calls
    assert called == how
    assert prompt == ([{"role": "user", "content": "hello"}] if how == "chat" else "hello")


def test_repl_chats_where_the_model_has_a_template(tiny, capsys, monkeypatch):
    rc, rec, out, err = main_with(tiny, ["-n", "2"], capsys, monkeypatch, stdin="hello\n/chat off\nhi\n")
    assert rc == 0, err
    assert [c[0] for c in rec.calls] == ["chat", "stream"]
    rc, rec, out, err = main_with(tiny, ["--raw", "-n", "2"], capsys, monkeypatch, stdin="hello\n")
    assert [c[0] for c in rec.calls] == ["stream"]


def test_without_a_template_run_continues_and_chat_says_why_not(no_template_dir, capsys, monkeypatch):
    plain = Model.from_pretrained(no_template_dir, n_ctx=64, threads=1)
    rc, rec, out, err = main_with(plain, ["run", "-n", "2", "hello"], capsys, monkeypatch)
    assert rc == 0 and [c[0] for c in rec.calls] == ["stream"]
    for argv in (["run", "--chat", "hello"], ["chat"]):
        rc, rec, out, err = main_with(plain, argv, capsys, monkeypatch, stdin="hello\n")
        assert rc == 1 and rec.calls == []
        assert "has no chat template" in err and "for a plain continuation" in err
    rc, rec, out, err = main_with(plain, ["-n", "2"], capsys, monkeypatch, stdin="/chat on\nhello\n")
    assert "has no chat template" in err and [c[0] for c in rec.calls] == ["stream"]


def test_cli_answers_as_the_python_api_does(tiny, capsys, monkeypatch):
    # one set of defaults: the same reply from `fastllm run` as from Model.chat
    rc, rec, out, err = main_with(tiny, ["run", "-n", "12", "hello"], capsys, monkeypatch)
    assert rc == 0, err
    (_, _, kw), = rec.calls
    assert kw["sampling"] == tiny.default_sampling == SamplingParams()
    assert out == tiny.chat([{"role": "user", "content": "hello"}], max_new_tokens=12) + "\n"


@pytest.mark.parametrize("chat", [False, True])
def test_default_max_tokens_are_the_models(tiny_dir, chat):
    # what /show reports as the default is what the Python API does
    fresh = Model.from_pretrained(tiny_dir, n_ctx=400, threads=1)
    fresh.eos_token_ids = set()   # nothing ends a reply early
    if chat:
        fresh.chat([{"role": "user", "content": "hi"}])
    else:
        fresh.generate("hi")
    assert fresh.last_stats.generated_tokens == cli.DEFAULT_MAX_TOKENS["chat" if chat else "continuation"]
    settings = cli.Settings(fresh, cli.build_parser().parse_args(["repl"]))
    assert settings.value("max_new_tokens", chat) == (fresh.last_stats.generated_tokens, "default")


@pytest.mark.parametrize("argv, why", [
    (["run", "hello"], "end-of-sequence token came first; rephrase, or try --raw for a plain continuation"),
    (["run", "--raw", "hello"], "end-of-sequence token came first: this model often ends a plain "
                                "continuation at once; leave out --raw to chat with it"),
])
def test_an_empty_reply_says_why(fresh, capsys, monkeypatch, argv, why):
    fresh.eos_token_ids = set(range(fresh.config.vocab_size))   # every token ends the reply
    rc, rec, out, err = main_with(fresh, argv, capsys, monkeypatch)
    assert rc == 0 and out == "\n"
    assert f"[no text: the model's {why}]" in err


def test_an_empty_reply_in_the_repl_names_the_repl_command(fresh, capsys, monkeypatch):
    fresh.eos_token_ids = set(range(fresh.config.vocab_size))
    rc, rec, out, err = main_with(fresh, [], capsys, monkeypatch, stdin="hello\n/chat off\nhello\n")
    assert "try /chat off for a plain continuation" in err and "/chat on to chat with it" in err


def test_a_cut_chat_reply_carries_a_marker(fresh, capsys, monkeypatch):
    fresh.eos_token_ids = set()
    rc, rec, out, err = main_with(fresh, ["run", "-n", "5", "hello"], capsys, monkeypatch)
    assert rc == 0 and out.strip()
    assert "[... cut at 5 tokens: -n N for longer replies]" in err
    rc, rec, out, err = main_with(fresh, ["chat", "-n", "5"], capsys, monkeypatch, stdin="hello\n")
    assert "[... cut at 5 tokens: /steps N for longer replies]" in err
    rc, rec, out, err = main_with(fresh, ["run", "--raw", "-n", "5", "hello"], capsys, monkeypatch)
    assert "cut at" not in err   # a continuation always ends at a limit


# ------------------------------------------------------------ messages

def test_empty_prompt_is_refused_plainly(capsys, monkeypatch):
    assert cli.main(["run", ""]) == 1
    assert capsys.readouterr().err == ("fastllm: error: the prompt is empty: give the text to answer, "
                                       "or - to read it from stdin\n")
    import io
    monkeypatch.setattr(sys, "stdin", io.StringIO(" \n"))
    assert cli.main(["run", "-"]) == 1
    assert "the prompt is empty: give the text to answer on stdin" in capsys.readouterr().err


@pytest.mark.parametrize("prompt", ["abcdefghijklmnopqrstuvwxyz",   # more tokens than the context
                                    "x" * 100_000])                   # refused before tokenizing
def test_a_prompt_too_long_gives_one_message_naming_ctx(tiny_dir, capsys, monkeypatch, prompt):
    small = Model.from_pretrained(tiny_dir, n_ctx=16, threads=1)
    rc, rec, out, err = main_with(small, ["run", prompt], capsys, monkeypatch)
    assert rc == 1
    trained = small.config.max_position_embeddings
    assert err == ("fastllm: error: the prompt does not fit the context of 16 tokens: use a larger --ctx "
                   f"(up to the model's {trained})\n")


def test_ctx_beyond_the_models_maximum_warns(tiny_dir, capsys):
    trained = json.loads((tiny_dir / "config.json").read_text())["max_position_embeddings"]
    common = ["run", "--raw", "--model", str(tiny_dir), "-t", "1", "-n", "1", "hi"]
    assert cli.main(common + ["--ctx", str(trained)]) == 0
    assert "warning" not in capsys.readouterr().err
    assert cli.main(common + ["--ctx", str(trained + 1)]) == 0
    err = capsys.readouterr().err
    assert (f"fastllm: warning: --ctx {trained + 1} is more than the {trained} positions the model was "
            "trained on (max_position_embeddings)") in err


def test_warnings_print_without_a_source_line(tiny_dir, capsys):
    from fastllm.generate.model import available_cpus
    cpus = available_cpus()
    assert cli.main(["run", "--raw", "--model", str(tiny_dir), "--ctx", "32", "-t", str(cpus + 1),
                     "-n", "1", "hi"]) == 0
    err = capsys.readouterr().err.splitlines()
    assert err[0] == (f"fastllm: warning: {cpus + 1} threads asked for, but this process may use "
                      f"{cpus} CPUs: {cpus} threads are used")
    assert not any("warnings.warn" in line or line.startswith(" ") for line in err)


def test_bench_prints_a_plain_markdown_table(tiny_dir, capsys):
    assert cli.main(["bench", "--model", str(tiny_dir), "-p", "4", "-n", "2", "-r", "1", "-t", "1"]) == 0
    lines = capsys.readouterr().out.splitlines()
    from fastllm.core._core import simd_path
    assert lines[:4] == [f"SIMD: {simd_path()}", "", "| model | dtype | threads | test | t/s (mean ± sd) | median |",
                         "|---|---|---|---|---|---|"]
    assert len(lines) == 6 and all(line.startswith("| tiny | f32 | 1 | ") for line in lines[4:])


def test_bench_at_depth_starts_each_test_after_that_much_context(tiny_dir, capsys, tiny_model_dir):
    """-d as llama-bench's: each test after D tokens (run once, untimed); a
    hybrid model's recurrent layers start each run from a checkpoint there."""
    for model in (tiny_dir, tiny_model_dir("qwen3_5-text")):
        assert cli.main(["bench", "--model", str(model), "-p", "4", "-n", "2", "-r", "1", "-t", "1",
                         "-d", "0,20", "--json"]) == 0
        tests = [(r["test"], r["depth"]) for r in json.loads(capsys.readouterr().out)["results"]]
        assert tests == [("pp4", 0), ("tg2", 0), ("pp4 @ d20", 20), ("tg2 @ d20", 20)]


QUANTIZED = Path(__file__).parent / "data" / "llama-family" / "llama2-256-Q4_K_M.gguf"


@pytest.mark.skipif(_core.stream_prefetch() is None, reason="this CPU's kernels leave prefetching to the hardware")
def test_bench_times_each_prefetch_setting_in_turn(monkeypatch, capsys):
    """--prefetch: every test under each setting, the settings taking turns in
    each repetition (reversed every other one); the CPU's own one back after."""
    from fastllm.cli import bench
    own, applied = _core.stream_prefetch(), []

    def recording(ahead, level):
        applied.append((ahead, level))
        _core.set_stream_prefetch(ahead, level)
    monkeypatch.setattr(bench, "set_stream_prefetch", recording)
    assert cli.main(["bench", "--model", str(QUANTIZED), "-p", "4", "-n", "2", "-r", "2", "-t", "1",
                     "--prefetch", "default,512:2,4096,512:2", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)["results"]
    settings = list(dict.fromkeys([own, (512, 2), (4096, 1)]))   # the CPU's own may be one of the others
    names = [f"{ahead}:{level}" for ahead, level in settings]
    assert [(r["test"], r["prefetch"]) for r in rows] == [(t, n) for t in ("pp4", "tg2") for n in names]
    assert all(len(r["runs"]) == 2 and min(r["runs"]) > 0 for r in rows)
    assert applied == (settings + settings[::-1] + settings) * 2 + [own]
    assert _core.stream_prefetch() == own


@pytest.mark.skipif(_core.stream_prefetch() is None, reason="this CPU's kernels leave prefetching to the hardware")
def test_bench_shows_the_prefetch_only_when_asked(capsys):
    argv = ["bench", "--model", str(QUANTIZED), "-p", "0", "-n", "2", "-r", "1", "-t", "1"]
    assert cli.main(argv + ["--prefetch", "0:1"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[2:4] == ["| model | dtype | threads | prefetch | test | t/s (mean ± sd) | median |",
                          "|---|---|---|---|---|---|---|"]
    assert len(lines) == 5 and " | 0:1 | tg2 | " in lines[4]
    assert cli.main(argv + ["--json"]) == 0
    ahead, level = _core.stream_prefetch()
    assert [r["prefetch"] for r in json.loads(capsys.readouterr().out)["results"]] == [f"{ahead}:{level}"]


def test_bench_prefetch_is_refused_where_the_kernels_do_not_prefetch(tmp_path):
    """The portable path leaves prefetching to the hardware on every CPU."""
    env = dict(os.environ, FASTLLM_SIMD="generic")
    env.pop("FASTLLM_PREFETCH", None)
    out = subprocess.run([sys.executable, "-m", "fastllm", "bench", "--model", str(tmp_path / "absent.gguf"),
                          "--prefetch", "512:2"], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 1
    assert out.stderr.strip() == ("fastllm: error: --prefetch: the generic kernels of this CPU leave "
                                  "prefetching to the hardware")


@pytest.mark.parametrize("argv, message", [
    (["run", "-n", "-5", "hi"], "argument --max-tokens/-n/--steps: must be at least 1, got -5"),
    (["run", "--ctx", "0", "hi"], "argument --ctx/-c: must be at least 1, got 0"),
    (["run", "-t", "-5", "hi"], "argument --threads/-t: must be at least 1, got -5"),
    (["run", "--top-k", "-5", "hi"], "argument --top-k: must be at least 0, got -5"),
    (["run", "--seed", "-5", "hi"], "argument --seed: must be at least 0, got -5"),
    (["run", "--repeat-last-n", "-5", "hi"], "argument --repeat-last-n: must be at least -1, got -5"),
    (["run", "--ctx", "2k", "hi"], "argument --ctx/-c: expected a whole number, got '2k'"),
    (["bench", "-p", "-5"], "argument -p/--n-prompt: must be at least 0, got -5"),
    (["bench", "-t", "1,-5"], "argument -t/--threads: must be at least 1, got -5"),
    (["bench", "-d", "8,-1"], "argument -d/--n-depth: must be at least 0, got -1"),
    (["bench", "-r", "0"], "argument -r/--repetitions: must be at least 1, got 0"),
    *[(["bench", "--prefetch", value], "argument --prefetch: expected BYTES:LEVEL (a multiple of 64 from 0 to "
       f"65536, level 1 or 2) or default, got {bad!r}")
      for value, bad in [("100:2", "100:2"), ("default,1024:3", "1024:3"), ("64:-1", "64:-1"), ("65600", "65600"),
                         ("fast", "fast"), ("1024:2:1", "1024:2:1"), ("1024:", "1024:")]],
    (["bench", "--prefetch", " , "], "argument --prefetch: expected settings such as default,512:2, got ' , '"),
    (["perplexity", "--chunks", "-5"], "argument --chunks: must be at least 1, got -5"),
])
def test_bad_numbers_are_refused_naming_the_flag(capsys, argv, message):
    with pytest.raises(SystemExit) as e:
        cli.main(argv)
    assert e.value.code == 2
    assert capsys.readouterr().err.splitlines()[-1] == f"fastllm {argv[0]}: error: {message}"


def test_a_negative_seed_is_refused_at_the_call():
    # numpy's generators take none: refused with the other settings, not at the first draw
    with pytest.raises(ValueError, match=r"seed must be a whole number from 0 to 2\*\*64-1, or None, got -5"):
        SamplingParams(seed=-5)


@pytest.mark.parametrize("flag", [["--temp", "-1"], ["--top-p", "2"], ["--min-p", "1.5"],
                                  ["--json-schema", "/nonexistent/schema.json"]])
def test_bad_settings_are_refused_before_the_model_loads(flag, monkeypatch, capsys):
    def no_load(*args, **kwargs):
        raise AssertionError("the model was loaded before the settings were checked")
    monkeypatch.setattr(Model, "from_pretrained", no_load)
    assert cli.main(["run"] + flag + ["hi"]) == 1
    assert "fastllm: error:" in capsys.readouterr().err
