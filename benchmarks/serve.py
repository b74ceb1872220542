"""Load on OpenAI-compatible servers: N clients at once, each streaming chat
completions one after another, for N in --clients. Reports aggregate
generated tokens/s, the p50/p99 time to first token, and the mean prompt
and completion tokens per request (from the servers' usage figures).

    python benchmarks/serve.py                          # starts fastllm serve in this process
    python benchmarks/serve.py --url http://127.0.0.1:8090/v1
    python benchmarks/serve.py --url http://127.0.0.1:8090/v1 --url http://127.0.0.1:8089/v1 --rounds 4
                                                        # two servers, e.g. fastllm serve and llama-server

Every server gets the same work: the same prompts, greedy decoding (or,
with --temperature above 0, the same explicit top_k, top_p, min_p and a
seed per request, so that no server's own sampler defaults apply), and
ignore_eos, so that every reply runs to --max-tokens. A reply that ends
short of it is counted and reported: that server did not honour
ignore_eos, and its tokens/s is not comparable.

With two URLs the servers take turns: each round runs every client count
on both, and the server that goes first alternates from one round to the
next, so that load elsewhere on the machine and the state one server
leaves behind hit both alike. The summary gives each server's tokens/s in
every round, their medians and the ratio of the medians (first URL over
second).
"""
import argparse
import socket
import statistics
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager

import openai


@contextmanager
def fastllm_server(args):
    import uvicorn
    from fastllm import Model
    from fastllm.serve.server import create_app
    from fastllm.serve.serving import BatchEngine
    model = Model.from_pretrained(args.model, n_ctx=args.ctx, threads=args.threads)
    engine = BatchEngine(model, parallel=args.parallel, max_queue=256)
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(create_app(model, engine, "fastllm"), log_level="warning"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.01)
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}/v1"
    finally:
        server.should_exit = True
        thread.join()
        engine.close()


class Server:
    """One OpenAI-compatible server and the model name it answers to."""

    def __init__(self, url: str, model_name: str | None):
        self.url = url
        self.client = openai.OpenAI(base_url=url, api_key="none", max_retries=0, timeout=600)
        self.model = model_name or self.client.models.list().data[0].id

    def __str__(self):
        return f"{self.model} at {self.url}"


def sampling(args, i: int) -> tuple:
    """The request fields that fix the sampler, the same for every server:
    (fields of OpenAI's client, fields beyond OpenAI's API)."""
    if args.temperature == 0:
        return {"temperature": 0.0}, {}
    return ({"temperature": args.temperature, "top_p": args.top_p, "seed": i},
            {"top_k": args.top_k, "min_p": args.min_p})


def one_request(server: Server, i: int, args) -> dict:
    """Time to first token and usage of one streamed chat reply."""
    fields, extra = sampling(args, i)
    t0 = time.perf_counter()
    first, usage = None, None
    stream = server.client.chat.completions.create(
        model=server.model, max_tokens=args.max_tokens, stream=True, stream_options={"include_usage": True},
        messages=[{"role": "user", "content": f"Write a short story about a robot, number {i}."}],
        extra_body={"ignore_eos": True, **extra}, **fields)
    for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            if first is None:
                first = time.perf_counter() - t0
        if chunk.usage:
            usage = chunk.usage
    if usage is None:
        raise RuntimeError(f"{server} sent no usage figures (stream_options.include_usage)")
    return {"ttft": first if first is not None else time.perf_counter() - t0,
            "prompt": usage.prompt_tokens, "completion": usage.completion_tokens}


def load(server: Server, clients: int, args) -> dict:
    """clients at once, each sending --requests-per-client requests in turn."""
    t0 = time.perf_counter()
    with ThreadPoolExecutor(clients) as pool:
        results = list(pool.map(lambda i: one_request(server, i, args), range(clients * args.requests_per_client)))
    wall = time.perf_counter() - t0
    ttft = sorted(r["ttft"] for r in results)
    return {"clients": clients, "tokens_per_s": sum(r["completion"] for r in results) / wall,
            "ttft_p50": statistics.median(ttft), "ttft_p99": ttft[min(len(ttft) - 1, int(0.99 * len(ttft)))],
            "prompt": statistics.mean(r["prompt"] for r in results),
            "completion": statistics.mean(r["completion"] for r in results),
            "short": sum(r["completion"] < args.max_tokens for r in results), "requests": len(results)}


def summary(servers: list, levels: list, runs: dict, max_tokens: int) -> None:
    """Per client count: every round's tokens/s per server, medians, their
    ratio, median TTFT and the mean tokens per request."""
    names = [f"server {k + 1}" for k in range(len(servers))]
    for name, server in zip(names, servers):
        print(f"{name}: {server}")
    head = "| clients | " + " | ".join(f"tok/s, {n} (rounds)" for n in names)
    head += " | ratio of medians" if len(servers) == 2 else ""
    head += " | " + " | ".join(f"TTFT p50 / p99 s, {n}" for n in names)
    head += " | " + " | ".join(f"prompt / completion tokens, {n}" for n in names) + " |"
    print(head)
    print("|---:" * (head.count("|") - 1) + "|")
    shorts = []
    for n in levels:
        cells, medians = [], []
        for k in range(len(servers)):
            rows = runs[(k, n)]
            medians.append(statistics.median(r["tokens_per_s"] for r in rows))
            cells.append(", ".join(f"{r['tokens_per_s']:.1f}" for r in rows))
            shorts += [f"server {k + 1} at {n} clients: {r['short']} of {r['requests']} replies"
                       for r in rows if r["short"]]
        if len(servers) == 2:
            cells.append(f"{medians[0] / medians[1]:.2f}")
        for k in range(len(servers)):
            rows = runs[(k, n)]
            cells.append(f"{statistics.median(r['ttft_p50'] for r in rows):.3f} / "
                         f"{statistics.median(r['ttft_p99'] for r in rows):.3f}")
        for k in range(len(servers)):
            rows = runs[(k, n)]
            cells.append(f"{statistics.mean(r['prompt'] for r in rows):.1f} / "
                         f"{statistics.mean(r['completion'] for r in rows):.1f}")
        print(f"| {n} | " + " | ".join(cells) + " |")
    print("(TTFT: medians over the rounds of each round's p50 and p99; tokens: means per request)")
    if shorts:
        print(f"replies that ended before {max_tokens} tokens despite ignore_eos (tokens/s not comparable): "
              + "; ".join(shorts))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--url", action="append", default=[],
                    help="an OpenAI-compatible server; twice to compare two (default: start fastllm serve here)")
    ap.add_argument("--model-name", action="append", default=[],
                    help="the model name to send, per --url (default: the first of the server's /v1/models)")
    ap.add_argument("--model", default=None, help="for the fastllm server started here: model folder or GGUF")
    ap.add_argument("--ctx", type=int, default=1024)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--parallel", type=int, default=8)
    ap.add_argument("--clients", default="1,4,8,16")
    ap.add_argument("--requests-per-client", type=int, default=2)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=1, help="rounds over every client count and server")
    ap.add_argument("--temperature", type=float, default=0.0, help="0: greedy (the default)")
    ap.add_argument("--top-k", type=int, default=40, help="sent with --temperature above 0")
    ap.add_argument("--top-p", type=float, default=0.95, help="sent with --temperature above 0")
    ap.add_argument("--min-p", type=float, default=0.05, help="sent with --temperature above 0")
    args = ap.parse_args()
    levels = [int(x) for x in args.clients.split(",")]
    if len(args.url) > 2:
        ap.error("--url: one or two servers")
    if len(args.model_name) > max(len(args.url), 1):
        ap.error("--model-name: at most one per --url")
    if args.rounds < 1 or args.requests_per_client < 1 or args.max_tokens < 1 or min(levels) < 1:
        ap.error("--rounds, --requests-per-client, --max-tokens and --clients must be positive")

    @contextmanager
    def given():
        yield args.url
    with (given() if args.url else fastllm_server(args)) as urls:
        urls = [urls] if isinstance(urls, str) else urls
        names = args.model_name + [None] * (len(urls) - len(args.model_name))
        servers = [Server(u, m) for u, m in zip(urls, names)]
        for server in servers:   # a first request, so that no round pays for a cold start
            load(server, 1, argparse.Namespace(**{**vars(args), "requests_per_client": 1, "max_tokens": 8}))
        runs = {}
        for r in range(args.rounds):
            order = list(range(len(servers)))
            if r % 2:
                order.reverse()
            for n in levels:
                for k in order:
                    result = load(servers[k], n, args)
                    runs.setdefault((k, n), []).append(result)
                    print(f"round {r + 1}/{args.rounds}, server {k + 1}, {n} clients: "
                          f"{result['tokens_per_s']:.1f} tok/s, TTFT p50 {result['ttft_p50']:.3f} s",
                          file=sys.stderr, flush=True)
        summary(servers, levels, runs, args.max_tokens)
    return 0


if __name__ == "__main__":
    sys.exit(main())
