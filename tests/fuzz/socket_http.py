"""`fastllm serve` over real sockets against hostile clients: what the
in-process HTTP target (fuzz_http.py) cannot send, because uvicorn reads it
before the app does (request heads a byte at a time, garbage heads,
connections that open and close) or because it takes time (a stream its
client never reads, a body that trickles in, a shutdown while that
happens), beside the bodies that cost the most to refuse (unterminated
strings of escapes, deep nesting, schema bombs).

The server runs in a process of its own (`python -m fastllm serve`) on the
tiny model in tests/data. While hostile clients run, /health is asked every
20 ms on a fresh connection and a well-behaved client streams completions;
what is measured is /health's latency, the well-behaved client's longest
wait for a token, the statuses everyone got and the server's RSS.

    python tests/fuzz/socket_http.py each [SECONDS]    # each shape alone, SECONDS each (default 10): a table
    python tests/fuzz/socket_http.py mix ROUNDS         # ROUNDS of 3 random shapes at once for 5 s each,
                                                        # a SIGTERM with stalled readers every 10th round

A finding (printed, exit status 1): a 5xx or a 503 to the well-behaved
client, a slow head not cut within head_timeout + 2 s, a shutdown that
takes longer than shutdown_timeout + 5 s, or (mix) /health over HEALTH_MS.
Latencies are reported, not judged, in `each`: on a loaded machine they
say as much about the machine as about the server.
"""
import json
import os
import random
import signal
import socket
import subprocess
import sys
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TINY = os.path.join(ROOT, "tests", "data", "tiny-llama")
HEAD_TIMEOUT, SHUTDOWN_TIMEOUT, BODY_TIMEOUT = 2.0, 2.0, 5.0
HEALTH_MS = float(os.environ.get("FASTLLM_FUZZ_HEALTH_MS", "100"))
BOMBS = [{"$ref": "#"}, {"type": "string", "pattern": "^a{1000000}$"}, {"const": "x" * 1_000_000},
         {"type": "object", "required": ["k"], "properties": {"k": {"type": "string", "pattern": "^b{1000000}$"}}}]


# ------------------------------------------------------------- the server

class Server:
    def __init__(self):
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        self.port = sock.getsockname()[1]
        sock.close()
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "fastllm", "serve", "--model", TINY, "--ctx", "4096", "--threads", "1",
             "--port", str(self.port), "--parallel", "4", "--max-queue", "16", "--max-connections", "64",
             "--head-timeout", str(HEAD_TIMEOUT), "--shutdown-timeout", str(SHUTDOWN_TIMEOUT),
             "--body-timeout", str(BODY_TIMEOUT)],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=dict(os.environ, PYTHONPATH=os.path.join(ROOT, "src")))
        end = time.monotonic() + 120
        while True:
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=1).close()
                return
            except OSError:
                if time.monotonic() > end or self.proc.poll() is not None:
                    raise RuntimeError("the server did not start")
                time.sleep(0.1)

    def rss_mb(self) -> float:
        with open(f"/proc/{self.proc.pid}/status") as f:
            return next(int(line.split()[1]) for line in f if line.startswith("VmRSS")) / 1024

    def stop(self) -> float:
        """SIGTERM; the seconds it took to exit."""
        start = time.monotonic()
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(SHUTDOWN_TIMEOUT + 30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        return time.monotonic() - start


def request(port, method, path, body=b"", headers=(), timeout=60, read=True):
    """(status, body) of one request on a connection of its own."""
    head = [f"{method} {path} HTTP/1.1", "Host: x", "Connection: close", f"Content-Length: {len(body)}",
            "Content-Type: application/json", *headers]
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as s:
        s.sendall(("\r\n".join(head) + "\r\n\r\n").encode() + body)
        if not read:
            return None, b""
        reply = b""
        while chunk := s.recv(1 << 16):
            reply += chunk
    top, _, data = reply.partition(b"\r\n\r\n")
    try:
        return int(top.split()[1]), data
    except (IndexError, ValueError):
        return None, reply


# ------------------------------------------------------- hostile clients
# Each runs until stop is set, counting what it got in seen.

def _post(port, path, obj_or_bytes, seen, **kw):
    body = obj_or_bytes if isinstance(obj_or_bytes, bytes) else json.dumps(obj_or_bytes).encode()
    try:
        status, _ = request(port, "POST", path, body, **kw)
    except OSError as e:
        status = type(e).__name__
    seen[status] = seen.get(status, 0) + 1
    return status


def unterminated_escapes(port, stop, seen):
    body = b'{"prompt":"' + b'\\"' * ((4 << 20) // 2 - 16)   # just under --max-body
    while not stop.is_set():
        _post(port, "/v1/completions", body, seen)


def escape_runs_with_brackets(port, stop, seen):
    body = b'{"messages":[{"role":"user","content":"' + b'[\\\\\\"{' * ((4 << 20) // 6 - 16)
    while not stop.is_set():
        _post(port, "/v1/chat/completions", body, seen)


def deep_nesting(port, stop, seen):
    body = b'{"prompt": ' + b"[" * ((4 << 20) - 20)
    while not stop.is_set():
        _post(port, "/v1/completions", body, seen)


def schema_bombs(port, stop, seen):
    while not stop.is_set():
        for bomb in BOMBS:
            _post(port, "/v1/chat/completions", {
                "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 16,
                "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": bomb}}}, seen)


def tool_bomb(port, stop, seen):
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"$ref": "#"}}}]
    while not stop.is_set():
        _post(port, "/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 16,
                                             "tools": tools, "tool_choice": "required"}, seen)


def huge_prompt(port, stop, seen):
    body = {"prompt": "ab " * (1 << 20), "max_tokens": 1}
    while not stop.is_set():
        _post(port, "/v1/completions", body, seen)


def long_generation(port, stop, seen):
    while not stop.is_set():
        _post(port, "/v1/completions", {"prompt": "Hi", "max_tokens": 4000, "ignore_eos": True, "n": 2}, seen)


def slow_head(port, stop, seen, cut=None):
    """A request head a byte every 0.3 s; notes how long until the server cut it."""
    while not stop.is_set():
        started = time.monotonic()
        with socket.create_connection(("127.0.0.1", port)) as s:
            s.settimeout(0.3)
            for byte in b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nX-Slow: " + b"a" * 10_000:
                if stop.is_set():
                    return
                try:
                    s.sendall(bytes([byte]))
                    if s.recv(1024) == b"":
                        break
                except socket.timeout:
                    continue
                except OSError:
                    break
        took = time.monotonic() - started
        seen["cut after s"] = max(seen.get("cut after s", 0), round(took, 1))
        if cut is not None:
            cut.append(took)


def slow_body(port, stop, seen):
    while not stop.is_set():
        with socket.create_connection(("127.0.0.1", port)) as s:
            s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 100000\r\n\r\n{")
            s.settimeout(0.5)
            reply = b""
            while not stop.is_set() and not reply:
                try:
                    s.sendall(b" ")
                    reply = s.recv(1024)
                except socket.timeout:
                    continue
                except OSError:
                    break
            status = reply.split(b" ")[1].decode() if reply.count(b" ") else "closed"
            seen[status] = seen.get(status, 0) + 1


def stalled_reader(port, stop, seen, socks=None):
    """A stream of four choices with 20 logprobs each (~40 MB), never read."""
    body = json.dumps({"messages": [{"role": "user", "content": "Hi"}], "stream": True, "max_tokens": 4000,
                       "ignore_eos": True, "logprobs": True, "top_logprobs": 20, "n": 4}).encode()
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1024)
    s.connect(("127.0.0.1", port))
    s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
              b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
    seen["held"] = seen.get("held", 0) + 1
    if socks is not None:
        socks.append(s)
    stop.wait()
    s.close()


def garbage_heads(port, stop, seen):
    rng = random.Random(1)
    while not stop.is_set():
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
                s.sendall(rng.randbytes(rng.choice([1, 64, 4096, 70_000])) + b"\r\n\r\n")
                reply = s.recv(64)
            status = reply.split(b" ")[1].decode() if reply.count(b" ") else "closed"
        except OSError as e:
            status = type(e).__name__
        seen[status] = seen.get(status, 0) + 1


def connection_churn(port, stop, seen):
    while not stop.is_set():
        try:
            socket.create_connection(("127.0.0.1", port), timeout=5).close()
            seen["opened"] = seen.get("opened", 0) + 1
        except OSError as e:
            seen[type(e).__name__] = seen.get(type(e).__name__, 0) + 1


SHAPES = {f.__name__: f for f in (unterminated_escapes, escape_runs_with_brackets, deep_nesting, schema_bombs,
                                  tool_bomb, huge_prompt, long_generation, slow_head, slow_body, stalled_reader,
                                  garbage_heads, connection_churn)}


# ---------------------------------------------------------- the watchers

def watch_health(port, stop, latencies, statuses):
    while not stop.is_set():
        start = time.monotonic()
        try:
            status, _ = request(port, "GET", "/health", timeout=30)
        except OSError as e:
            status = type(e).__name__
        latencies.append(time.monotonic() - start)
        statuses[status] = statuses.get(status, 0) + 1
        time.sleep(0.02)


def well_behaved(port, stop, gaps, statuses):
    """Streams 64-token completions; gaps: the longest wait between two
    tokens of each (the wait for the first, in the queue, is not a gap)."""
    body = json.dumps({"prompt": "Once upon a time", "max_tokens": 64, "ignore_eos": True, "stream": True}).encode()
    while not stop.is_set():
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=60) as s:
                s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nConnection: close\r\n"
                          b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body))
                reply = s.recv(1 << 16)
                status = int(reply.split()[1])
                while b"data:" not in reply and (chunk := s.recv(1 << 16)):
                    reply += chunk
                last, worst = time.monotonic(), 0.0
                while chunk := s.recv(1 << 16):
                    now = time.monotonic()
                    worst, last = max(worst, now - last), now
                gaps.append(worst)
        except (OSError, IndexError, ValueError) as e:
            status = type(e).__name__
        statuses[status] = statuses.get(status, 0) + 1


def measure(server, shapes, seconds):
    """Run shapes at once for seconds beside the watchers; what they saw."""
    stop = threading.Event()
    latencies, health, gaps, normal, seen, cuts = [], {}, [], {}, {name: {} for name in shapes}, []
    threads = [threading.Thread(target=watch_health, args=(server.port, stop, latencies, health)),
               threading.Thread(target=well_behaved, args=(server.port, stop, gaps, normal))]
    for name in shapes:
        extra = (cuts,) if name == "slow_head" else ()
        threads.append(threading.Thread(target=SHAPES[name], args=(server.port, stop, seen[name], *extra)))
    for t in threads:
        t.daemon = True
        t.start()
    time.sleep(seconds)
    stop.set()
    for t in threads:
        t.join(60)
    latencies.sort()
    pct = (lambda q: 1000 * latencies[min(len(latencies) - 1, int(q * len(latencies)))]) if latencies else \
        (lambda q: float("nan"))
    return {"health_ms": {"p50": round(pct(0.5), 1), "p99": round(pct(0.99), 1), "max": round(pct(1.0), 1),
                          "n": len(latencies)},
            "health": health, "client_gap_s": round(max(gaps, default=float("nan")), 2), "client": normal,
            "hostile": seen, "slow_head_cut_s": max(cuts, default=None)}


def findings_of(result, judge_health: bool) -> list:
    out = []
    bad = {k: v for k, v in result["client"].items() if k != 200}
    if bad:
        out.append(f"the well-behaved client got {bad}")
    if any(isinstance(k, int) and k >= 500 for h in result["hostile"].values() for k in h):
        out.append(f"a 5xx to a hostile client: {result['hostile']}")
    if result["slow_head_cut_s"] is not None and result["slow_head_cut_s"] > HEAD_TIMEOUT + 2:
        out.append(f"a slow head was cut after {result['slow_head_cut_s']:.1f} s")
    if judge_health and result["health_ms"]["max"] > HEALTH_MS:
        out.append(f"/health took {result['health_ms']['max']} ms")
    if any(k != 200 for k in result["health"]):
        out.append(f"/health answered {result['health']}")
    return out


def each(seconds: float) -> int:
    server = Server()
    findings = 0
    try:
        base = measure(server, [], seconds)
        print(f"{'shape':28} {'/health p50':>11} {'p99':>7} {'max ms':>7} {'client gap s':>12} {'RSS MB':>7}  hostile got")
        print(f"{'(none)':28} {base['health_ms']['p50']:>11} {base['health_ms']['p99']:>7} "
              f"{base['health_ms']['max']:>7} {base['client_gap_s']:>12} {server.rss_mb():>7.0f}")
        for name in SHAPES:
            result = measure(server, [name], seconds)
            problems = findings_of(result, judge_health=False)
            findings += len(problems)
            print(f"{name:28} {result['health_ms']['p50']:>11} {result['health_ms']['p99']:>7} "
                  f"{result['health_ms']['max']:>7} {result['client_gap_s']:>12} {server.rss_mb():>7.0f}  "
                  f"{result['hostile'][name]}" + "".join(f"\n  FINDING: {p}" for p in problems), flush=True)
    finally:
        took = server.stop()
    print(f"SIGTERM to exit: {took:.1f} s")
    return 1 if findings else 0


def mix(rounds: int) -> int:
    rng = random.Random(int(os.environ.get("FASTLLM_FUZZ_SEED", "0")))
    server, findings = Server(), 0
    try:
        for i in range(rounds):
            shapes = rng.sample(sorted(SHAPES), 3)
            result = measure(server, shapes, 5)
            problems = findings_of(result, judge_health=True)
            findings += len(problems)
            print(f"round {i}: {shapes} health max {result['health_ms']['max']} ms, client gap "
                  f"{result['client_gap_s']} s, RSS {server.rss_mb():.0f} MB"
                  + "".join(f"\n  FINDING: {p}" for p in problems), flush=True)
            if i % 10 == 9:   # a shutdown while streams go unread
                stop, socks = threading.Event(), []
                held = [threading.Thread(target=stalled_reader, args=(server.port, stop, {}, socks), daemon=True)
                        for _ in range(3)]
                for t in held:
                    t.start()
                time.sleep(2)
                took = server.stop()
                stop.set()
                if took > SHUTDOWN_TIMEOUT + 5:
                    findings += 1
                    print(f"  FINDING: SIGTERM took {took:.1f} s with streams unread", flush=True)
                else:
                    print(f"  SIGTERM with 3 streams unread: exited in {took:.1f} s", flush=True)
                server = Server()
    finally:
        server.stop()
    print(f"{rounds} rounds: {findings} findings")
    return 1 if findings else 0


if __name__ == "__main__":
    mode = sys.argv[1] if len(sys.argv) > 1 else "each"
    if mode == "each":
        sys.exit(each(float(sys.argv[2]) if len(sys.argv) > 2 else 10))
    sys.exit(mix(int(sys.argv[2]) if len(sys.argv) > 2 else 20))
