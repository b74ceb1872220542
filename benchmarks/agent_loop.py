"""An agent's conversation against OpenAI-compatible servers: time to first
token per turn.

An agent (Claude Code, opencode, aider) sends a long system prompt with tool
definitions, then turn after turn that extends the conversation: the model's
tool call, the tool's result, the model's next step. A server that re-reads
the conversation every turn answers the tenth turn as slowly as the first.

The script plays the same scripted conversation against each server: a
system prompt of about --system-tokens tokens (the Python standard library's
documentation strings) with four tools, then --turns turns. Each turn sends
the conversation so far and streams a reply of at most --reply tokens; the
conversation then goes on with a scripted assistant tool call and a tool
result, not with the reply (so both servers see the same conversation, and
their own reply never matches what comes back: the server must resume
where the conversation parted from what it ran, as with a chat template that
re-renders an earlier reply). Time to first token (TTFT) is measured by the
client from sending a request to the first streamed content.

    fastllm serve --model M.gguf --threads 2 --parallel 1 --port 8090 &
    llama-server -m M.gguf -t 2 --parallel 1 -c 32768 --port 8089 --jinja &
    python benchmarks/agent_loop.py --url http://127.0.0.1:8090/v1 --url http://127.0.0.1:8089/v1

With several URLs the servers take turns: each turn goes to every server,
in alternating order, before the next turn. Prints per turn each server's
TTFT and its ratio to that server's first turn.
"""
from __future__ import annotations

import argparse
import json
import time
import urllib.request

TOOLS = [
    {"type": "function", "function": {"name": name, "description": desc, "parameters": {
        "type": "object", "properties": props, "required": list(props)}}}
    for name, desc, props in [
        ("read_file", "Read a file of the repository.", {"path": {"type": "string"}}),
        ("search", "Search the repository for a regular expression.", {"pattern": {"type": "string"}}),
        ("run_tests", "Run the test suite, or one test file.", {"target": {"type": "string"}}),
        ("edit_file", "Replace text in a file.", {"path": {"type": "string"}, "old": {"type": "string"},
                                                  "new": {"type": "string"}}),
    ]]


def system_prompt(tokens: int) -> str:
    """About tokens tokens of reference text (4 characters a token): the
    docstrings of standard library modules, as an agent's instructions and
    repository notes would read."""
    import pydoc
    import sys
    parts = ["You are a coding agent. Use the tools to inspect and change the repository. "
             "Reference notes follow.\n"]
    size = 0
    for name in sorted(sys.stdlib_module_names):
        if size > tokens * 4:
            break
        try:
            module = __import__(name)
        except Exception:
            continue
        doc = pydoc.getdoc(module)
        if doc:
            parts.append(f"\n## {name}\n{doc}\n")
            size += len(doc)
    return "".join(parts)[:tokens * 4]


def turn_messages(system: str, turns: int) -> list:
    """The conversation after each turn's scripted assistant step and tool result."""
    conversation = [{"role": "system", "content": system},
                    {"role": "user", "content": "The test test_parse_dates fails. Find out why and fix it."}]
    out = [list(conversation)]
    for i in range(1, turns):
        call = {"id": f"call_{i}", "type": "function",
                "function": {"name": "read_file", "arguments": json.dumps({"path": f"src/module_{i}.py"})}}
        conversation += [{"role": "assistant", "content": None, "tool_calls": [call]},
                         {"role": "tool", "tool_call_id": f"call_{i}",
                          "content": f"def parse_{i}(text):\n    return text.split(',')[{i}]\n" * 3}]
        out.append(list(conversation))
    return out


def ttft(url: str, messages: list, reply: int, model: str | None) -> float:
    body = {"messages": messages, "tools": TOOLS, "max_tokens": reply, "temperature": 0, "stream": True,
            "cache_prompt": True}
    if model:
        body["model"] = model
    req = urllib.request.Request(url.rstrip("/") + "/chat/completions", json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})
    t0 = time.perf_counter()
    first = None
    with urllib.request.urlopen(req, timeout=3600) as r:
        for line in r:
            line = line.strip()
            if not line.startswith(b"data:") or line == b"data: [DONE]":
                continue
            chunk = json.loads(line[5:])
            delta = (chunk.get("choices") or [{}])[0].get("delta", {})
            if first is None and (delta.get("content") or delta.get("tool_calls") or
                                  delta.get("reasoning_content")):
                first = time.perf_counter() - t0
    return first if first is not None else time.perf_counter() - t0


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--url", action="append", required=True, help="a server's /v1 URL (repeat to compare)")
    p.add_argument("--model", default=None, help="the model field of the requests")
    p.add_argument("--system-tokens", type=int, default=16000)
    p.add_argument("--turns", type=int, default=10)
    p.add_argument("--reply", type=int, default=16, help="tokens each reply streams at most")
    args = p.parse_args()
    system = system_prompt(args.system_tokens)
    turns = turn_messages(system, args.turns)
    times = {u: [] for u in args.url}
    for i, messages in enumerate(turns):
        order = args.url if i % 2 == 0 else args.url[::-1]
        for url in order:
            times[url].append(ttft(url, messages, args.reply, args.model))
        print(f"turn {i + 1}: " + ", ".join(f"{u}: {times[u][-1]:.2f} s" for u in args.url), flush=True)
    print(f"\n{len(system)} characters of system prompt, {len(TOOLS)} tools, {args.turns} turns\n")
    print("| turn | " + " | ".join(f"{u} TTFT s (÷ turn 1)" for u in args.url) + " |")
    print("|---:|" + "---|" * len(args.url))
    for i in range(args.turns):
        print(f"| {i + 1} | " + " | ".join(f"{times[u][i]:.2f} ({times[u][i] / times[u][0]:.3f})"
                                           for u in args.url) + " |")


if __name__ == "__main__":
    main()
