"""Load on an OpenAI-compatible server: N clients at once, each streaming
chat completions one after another, for N in --clients. Reports aggregate
generated tokens/s and the p50/p99 time to first token per N.

    python benchmarks/serve.py                         # starts fastllm serve itself
    python benchmarks/serve.py --url http://127.0.0.1:8080/v1 --model-name M
                                                       # any other server, e.g. llama-server

Drive two servers with the same flags, one after the other, to compare them.
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
    from fastllm.server import create_app
    from fastllm.serving import BatchEngine
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
        yield f"http://127.0.0.1:{sock.getsockname()[1]}/v1", "fastllm"
    finally:
        server.should_exit = True
        thread.join()
        engine.close()


def one_request(client, model_name, i, max_tokens):
    """(time to first token, tokens generated) of one streamed chat reply."""
    t0 = time.perf_counter()
    first, n = None, 0
    stream = client.chat.completions.create(
        model=model_name, max_tokens=max_tokens, temperature=0.7, seed=i, stream=True,
        stream_options={"include_usage": True},
        messages=[{"role": "user", "content": f"Write a short story about a robot, number {i}."}])
    for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content and first is None:
            first = time.perf_counter() - t0
        if chunk.usage:
            n = chunk.usage.completion_tokens
    return first if first is not None else time.perf_counter() - t0, n


def load(url, model_name, clients, per_client, max_tokens):
    client = openai.OpenAI(base_url=url, api_key="none", max_retries=0, timeout=600)
    t0 = time.perf_counter()
    with ThreadPoolExecutor(clients) as pool:
        results = list(pool.map(lambda i: one_request(client, model_name, i, max_tokens),
                                range(clients * per_client)))
    wall = time.perf_counter() - t0
    ttft = sorted(r[0] for r in results)
    return {"clients": clients, "tokens_per_s": sum(r[1] for r in results) / wall,
            "ttft_p50": statistics.median(ttft), "ttft_p99": ttft[min(len(ttft) - 1, int(0.99 * len(ttft)))],
            "requests": len(results)}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--url", help="an OpenAI-compatible server (default: start fastllm serve here)")
    ap.add_argument("--model-name", default="fastllm")
    ap.add_argument("--model", default=None, help="for the fastllm server: model folder or GGUF")
    ap.add_argument("--ctx", type=int, default=1024)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--parallel", type=int, default=8)
    ap.add_argument("--clients", default="1,4,8,16")
    ap.add_argument("--requests-per-client", type=int, default=2)
    ap.add_argument("--max-tokens", type=int, default=64)
    args = ap.parse_args()
    levels = [int(x) for x in args.clients.split(",")]

    @contextmanager
    def given():
        yield args.url, args.model_name
    with (given() if args.url else fastllm_server(args)) as (url, name):
        print("| clients | tokens/s | vs 1 client | TTFT p50 s | TTFT p99 s | requests |")
        print("|---:|---:|---:|---:|---:|---:|")
        base = None
        for n in levels:
            r = load(url, name, n, args.requests_per_client, args.max_tokens)
            base = base or r["tokens_per_s"]
            print(f"| {n} | {r['tokens_per_s']:.1f} | {r['tokens_per_s'] / base:.2f}x | "
                  f"{r['ttft_p50']:.3f} | {r['ttft_p99']:.3f} | {r['requests']} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
