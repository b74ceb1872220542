"""fastllm serve: an OpenAI-compatible HTTP server over the continuous-
batching engine (Starlette on uvicorn: `pip install fastllm-engine[serve]`).

    fastllm serve --model M --port 8000 --parallel 4

GET /v1/models, POST /v1/completions and /v1/chat/completions (JSON, or
server-sent events with "stream": true), GET /health, GET /metrics
(Prometheus). The app only routes: fastllm.serve.openai_api reads requests and
shapes responses. Every error comes in OpenAI's JSON shape. A client that
goes away frees its slot at the engine's next step.

What one request may cost is bounded: its body (max_body bytes, read
within body_timeout seconds), the nesting of its JSON, the prompt (refused
before tokenizing when it cannot fit the context; tokenized off the event
loop), and optionally its time (request_timeout). A connection must send
a whole request head within head_timeout seconds, and at most
max_connections requests are in progress at once (fastllm.serve.http_limits).
On SIGTERM or Ctrl-C, answers in progress get shutdown_timeout seconds to
finish; then they are cut, a stream its client stopped reading included.
"""
from __future__ import annotations

import asyncio
import collections
import hmac
import json
import os
import re
import sys
import time
import uuid
from dataclasses import dataclass, fields
import threading

from . import anthropic_api, embeddings_api, openai_api as api, responses_api
from .http_limits import RequestLimit, with_head_deadline
from .openai_api import APIError, engine_error
from ..generate.textstream import TextStream
from .serving import BatchEngine, QueueFull
from .served import ModelSet, ServedModel


@dataclass(frozen=True)
class ServeOptions:
    """The server's settings and their defaults, which `fastllm serve` and
    fastllm.serve.ray_serve read from here."""
    host: str = "127.0.0.1"
    port: int = 8000
    parallel: int = 4                   # requests decoded together
    max_queue: int = 64                 # requests that may wait for a slot (more: 503)
    api_key: str | None = None          # require this bearer token
    model_name: str | None = None       # the model's id in the API (default: its name)
    max_body: int = 4 * 2**20           # bytes of a request body (more: 413)
    body_timeout: float = 30.0          # seconds to receive a request body (then 408)
    keep_alive: float = 5.0             # seconds an idle connection stays open
    max_connections: int = 512          # requests in progress (more: 503)
    head_timeout: float = 10.0          # seconds to receive a request head (then the connection is closed)
    shutdown_timeout: float = 10.0      # seconds answers may take to finish once shutting down
    request_timeout: float | None = None   # seconds a generation may run (then "length")
    seed: int | None = None             # the seed of requests that give none (None: random each)
    # Origins whose web pages may call the server (CORS), comma-separated:
    # "*" for any, "localhost" for any port of this machine's own names.
    cors_origins: str | None = None
    cache_ram: int = 2048               # MiB of slots' sequences kept beyond the slots (0: none)
    cache_dir: str | None = None        # a folder where they are kept in files too (None: RAM only)
    cache_disk: int = 8192              # MiB of those files at most (the least recently used go first)
    ctx_checkpoints: int = 8            # recurrent-state checkpoints a slot keeps

    def __post_init__(self):
        for name in ("parallel", "max_queue", "max_body", "max_connections"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)!r}")
        if self.seed is not None and (not isinstance(self.seed, int) or isinstance(self.seed, bool)
                                      or not 0 <= self.seed < 2**64):
            raise ValueError(f"seed must be from 0 to 2**64 - 1, got {self.seed!r}")
        for name in ("cache_ram", "cache_disk", "ctx_checkpoints"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be 0 or more, got {getattr(self, name)!r}")
        for name in ("body_timeout", "keep_alive", "request_timeout", "head_timeout", "shutdown_timeout"):
            value = getattr(self, name)
            if value is not None and not value > 0:
                raise ValueError(f"{name} must be a number of seconds > 0, got {value!r}")
        if self.cors_origins is not None:
            cors_origins(self.cors_origins)   # refused now, not at the first request


DEFAULTS = ServeOptions()
# Each slot's context without --ctx: the model's max_position_embeddings up
# to this many positions. Agents' prompts (a 10-20k-token system prompt and
# tools, then the turns) fit; a model's full window (262,144 for Qwen3.5)
# in every slot would let one conversation take gigabytes of KV cache.
SLOT_CTX = 32768
OPTION_NAMES = tuple(f.name for f in fields(ServeOptions))


class Metrics:
    """Counters for GET /metrics, in Prometheus' text format."""

    def __init__(self):
        self.requests = {}          # (endpoint, status) -> count
        self.prompt_tokens = self.generated_tokens = 0
        self.ttft_sum, self.ttft_count = 0.0, 0
        self.recent = collections.deque()   # (time, tokens) of the last 10 s

    def request(self, endpoint: str, status: int):
        key = (endpoint, status)
        self.requests[key] = self.requests.get(key, 0) + 1

    def tokens(self, n: int):
        self.generated_tokens += n
        now = time.monotonic()
        self.recent.append((now, n))
        while now - self.recent[0][0] >= 10:
            self.recent.popleft()

    def first_token(self, request):
        if request.first_token is not None:
            self.ttft_sum += request.first_token - request.submitted
            self.ttft_count += 1

    def text(self, engine) -> str:
        now = time.monotonic()
        rate = sum(k for t, k in self.recent if now - t < 10) / 10
        disk = engine.cache.disk if engine.cache is not None else None
        lines = ["# TYPE fastllm_requests_total counter"]
        lines += [f'fastllm_requests_total{{endpoint="{e}",status="{s}"}} {n}'
                  for (e, s), n in sorted(self.requests.items())]
        lines += ["# TYPE fastllm_queue_depth gauge", f"fastllm_queue_depth {engine.queue_depth}",
                  "# TYPE fastllm_active_requests gauge", f"fastllm_active_requests {engine.active}",
                  "# TYPE fastllm_prompt_tokens_total counter", f"fastllm_prompt_tokens_total {self.prompt_tokens}",
                  "# TYPE fastllm_generated_tokens_total counter",
                  f"fastllm_generated_tokens_total {self.generated_tokens}",
                  "# TYPE fastllm_tokens_per_second gauge", f"fastllm_tokens_per_second {rate:.3f}",
                  "# TYPE fastllm_prompt_cache_bytes gauge",
                  f"fastllm_prompt_cache_bytes {engine.cache.nbytes if engine.cache is not None else 0}",
                  "# TYPE fastllm_prompt_cache_hits_total counter",
                  f"fastllm_prompt_cache_hits_total {engine.cache.hits if engine.cache is not None else 0}",
                  "# TYPE fastllm_prompt_cache_files gauge",
                  f"fastllm_prompt_cache_files {disk.files if disk is not None else 0}",
                  "# TYPE fastllm_prompt_cache_files_loaded_total counter",
                  f"fastllm_prompt_cache_files_loaded_total {disk.loaded if disk is not None else 0}",
                  "# TYPE fastllm_draft_tokens_total counter", f"fastllm_draft_tokens_total {engine.drafted}",
                  "# TYPE fastllm_draft_accepted_tokens_total counter",
                  f"fastllm_draft_accepted_tokens_total {engine.accepted}",
                  "# TYPE fastllm_time_to_first_token_seconds summary",
                  f"fastllm_time_to_first_token_seconds_sum {self.ttft_sum:.6f}",
                  f"fastllm_time_to_first_token_seconds_count {self.ttft_count}"]
        return "\n".join(lines) + "\n"


# An origin is scheme://host[:port], nothing after (a browser's Origin header).
_ORIGIN = re.compile(r"[a-z][a-z0-9+.-]*://[^/?#\s]+")
# "localhost": http(s) pages of this machine, on any port.
_LOCAL_ORIGINS = r"https?://(localhost|127\.0\.0\.1|\[::1\])(:[0-9]+)?"
# The methods a page may use (DELETE: for routes that remove what a client stored).
CORS_METHODS = ("GET", "POST", "DELETE", "OPTIONS")


def cors_origins(text: str) -> tuple:
    """(exact origins, a regular expression of origins or None) of
    --cors-origins; ValueError names an entry that is not an origin."""
    exact, pattern = [], None
    for entry in (e.strip() for e in text.split(",")):
        if entry == "localhost":
            pattern = _LOCAL_ORIGINS
        elif entry == "*" or _ORIGIN.fullmatch(entry):
            exact.append(entry)
        else:
            raise ValueError(f"cors_origins: {entry!r} is not an origin (scheme://host[:port], with no "
                             "path or trailing slash), '*' or 'localhost'")
    return tuple(exact), pattern


def error_shape(path: str):
    """The error body maker of the API a path belongs to: Anthropic's for
    /v1/messages and below, OpenAI's elsewhere."""
    if path == "/v1/messages" or path.startswith("/v1/messages/"):
        return anthropic_api.error_body
    return api.error_body


def cors_middleware(options: ServeOptions):
    """The Starlette middleware that lets the pages of options.cors_origins
    call the server (None when no origin may): preflight requests answered
    without the API key, which the real request still needs, and every
    response, streams included, marked for the origin that asked."""
    if options.cors_origins is None:
        return None
    from starlette.middleware import Middleware
    from starlette.middleware.cors import CORSMiddleware
    from starlette.responses import Response

    from starlette.datastructures import Headers

    class CORS(CORSMiddleware):
        async def __call__(self, scope, receive, send):
            # A preflight as Starlette tells one apart, answered here so that
            # a refusal takes the error shape of the API its path belongs to.
            if scope["type"] == "http" and scope["method"] == "OPTIONS":
                headers = Headers(scope=scope)
                if "origin" in headers and "access-control-request-method" in headers:
                    answer = self.preflight_response(request_headers=headers)
                    if answer.status_code >= 400:
                        answer = refusal(answer, headers, error_shape(scope["path"]))
                    await answer(scope, receive, send)
                    return
            await super().__call__(scope, receive, send)

    def refusal(answer, request_headers, shape):
        # Starlette says why in plain text; this server's errors are JSON.
        what = answer.body.decode().removeprefix("Disallowed CORS ")
        asked = {"origin": f"origin {request_headers.get('origin')!r} (allowed: {options.cors_origins})",
                 "method": f"method {request_headers.get('access-control-request-method')!r}",
                 "headers": "headers " + repr(request_headers.get("access-control-request-headers")),
                 "private-network": "private network access"}
        reasons = ", ".join(asked[w.strip()] for w in what.split(",") if w.strip() in asked)
        e = APIError(403, f"cross-origin request refused: {reasons or what}")
        return Response(json.dumps(shape(e)), status_code=403, media_type="application/json")

    exact, pattern = cors_origins(options.cors_origins)
    # Every header may be asked for: the preflight names them back (the
    # Fetch standard does not let a "*" cover Authorization).
    return Middleware(CORS, allow_origins=exact, allow_origin_regex=pattern, allow_methods=CORS_METHODS,
                      allow_headers=["*"], allow_credentials=True, expose_headers=["Retry-After"])


# A body over max_body is still read, and thrown away, up to this many more
# bytes while it keeps coming: a client sends its whole body before it reads
# the answer, and a connection closed on unread data reaches it as a reset,
# not as the 413.
DISCARD_LIMIT = 16 * 2**20
DISCARD_IDLE = 0.5   # seconds without more of it: the answer goes out


async def read_body(request, options: ServeOptions) -> bytes:
    """The body, at most options.max_body bytes (413), received within
    options.body_timeout seconds (408)."""
    from starlette.requests import ClientDisconnect
    declared = request.headers.get("content-length", "")
    too_large = declared.isdigit() and int(declared) > options.max_body

    async def receive():
        pieces = request.stream().__aiter__()
        if too_large:
            if int(declared) <= options.max_body + DISCARD_LIMIT:
                await _discard(pieces, int(declared))
            raise _too_large(options)
        chunks, size = [], 0
        async for piece in pieces:
            size += len(piece)
            if size > options.max_body:
                await _discard(pieces, DISCARD_LIMIT)
                raise _too_large(options)
            chunks.append(piece)
        return b"".join(chunks)
    try:
        return await asyncio.wait_for(receive(), options.body_timeout)
    except asyncio.TimeoutError:
        raise APIError(408, f"the request body did not arrive within {options.body_timeout:g} s") from None
    except ClientDisconnect:
        raise APIError(400, "the client went away while sending the body") from None


async def _discard(pieces, limit: int):
    """Read and drop what more of a refused body comes: at most limit
    bytes, while pieces keep coming."""
    from starlette.requests import ClientDisconnect
    while limit > 0:
        try:
            limit -= len(await asyncio.wait_for(pieces.__anext__(), DISCARD_IDLE))
        except (StopAsyncIteration, asyncio.TimeoutError, ClientDisconnect):
            return


def _too_large(options: ServeOptions) -> APIError:
    return APIError(413, f"the request body is larger than {options.max_body} bytes")


class Completions:
    """Runs checked requests (openai_api.Generation) on the engine and
    answers them: one engine request per choice, text cut at stop strings,
    the slot freed when the client goes away or the time limit passes."""

    def __init__(self, model, engine, model_name: str, metrics: Metrics, options: ServeOptions):
        self.model, self.engine, self.model_name = model, engine, model_name
        self.metrics, self.options = metrics, options

    def submit(self, g: api.Generation) -> list:
        """One engine request per choice of every prompt, in the order of
        the choices' indexes, all queued or none."""
        prompts = g.prompts
        if len(g.samplings) > self.engine.max_queue:
            raise APIError(400, f"'n' must be at most {self.engine.max_queue} on this server "
                                "(its --max-queue)", param="n")
        if len(prompts) * len(g.samplings) > self.engine.max_queue:
            raise APIError(400, f"{len(prompts)} prompts of n={len(g.samplings)} choices each are more "
                                f"than the {self.engine.max_queue} this server queues (its --max-queue)",
                           param="prompt")
        prompt_logprobs = g.top_logprobs if g.echo is not None else None
        try:
            requests = self.engine.submit_prompts(prompts, g.max_tokens, g.samplings, g.stop_ids,
                                                  g.top_logprobs, g.constraints, g.draft_max, prompt_logprobs)
        except QueueFull as e:
            raise APIError(503, str(e), type="server_error", code="overloaded",
                           headers={"Retry-After": "1"}) from None
        except ValueError as e:
            raise APIError(400, str(e)) from None
        self.metrics.prompt_tokens += g.prompt_tokens
        return requests

    async def _watch(self, requests, http_request, state):
        """Cancel the requests when the client goes away or time runs out
        (checked ten times a second)."""
        deadline = None if self.options.request_timeout is None else \
            time.monotonic() + self.options.request_timeout
        while not all(r.finish_reason for r in requests):
            if deadline is not None and time.monotonic() > deadline:
                state["timed_out"] = True
                break
            if await http_request.is_disconnected():
                break
            await asyncio.sleep(0.1)
        for r in requests:
            r.cancel()

    async def _pieces(self, g, index, request, out: asyncio.Queue, state: dict):
        """Put (index, text, [(token, logprob entry)]) on out as tokens come,
        then (index, None, error or None)."""
        text = TextStream(self.model.tokenizer, g.stops, keep=api.kept_specials(g))
        got, error, echoed = 0, None, g.echo is None
        try:
            async for token in _then_none(request):
                if not echoed:   # the prompt's logprobs are whole once its first token, or its end, came
                    echoed = True
                    await out.put((index, g.echo[index // len(g.samplings)], _prompt_entries(g, request)))
                entry = None
                if token is not None:
                    if got == 0:
                        self.metrics.first_token(request)
                    entry = request.logprobs[got] if g.top_logprobs is not None else None
                    got += 1
                    self.metrics.tokens(1)
                piece = text.feed(token)
                if piece or entry is not None:
                    await out.put((index, piece, [(token, entry)] if token is not None and
                                   entry is not None else []))
                if text.ended:
                    break
        except Exception as e:   # the engine failed this request
            error = e
        finally:
            request.cancel()   # a no-op once it has ended; else frees the slot
        if text.stopped:
            state["stopped"][index] = text.stop
        elif not g.chat and request.stop_logprobs is not None:
            # a completion's logprobs end with the token that stopped it, as
            # OpenAI's do (lm-evaluation-harness counts on that token)
            await out.put((index, "", [request.stop_logprobs]))
        await out.put((index, None, error))

    async def run(self, g, requests, http_request, state: dict):
        """(index, text, entries) of every choice as it comes, choices
        interleaved; then, per choice, (index, None, error or None).
        Afterwards state (new_state()) says why they ended (finish)."""
        out = asyncio.Queue()
        tasks = [asyncio.ensure_future(self._pieces(g, i, r, out, state)) for i, r in enumerate(requests)]
        watcher = asyncio.ensure_future(self._watch(requests, http_request, state))
        try:
            for _ in range(len(requests)):
                while (item := await out.get())[1] is not None:
                    yield item
                    # A send that need not wait and a queue that holds more
                    # never suspend: without this a fast stream (one whose
                    # client reads slowly, its pieces piling up) would run
                    # through all it holds while no other client is served.
                    await asyncio.sleep(0)
                yield item
        finally:
            watcher.cancel()
            for t in tasks:
                t.cancel()
            for r in requests:
                r.cancel()

    @staticmethod
    def new_state() -> dict:
        return {"timed_out": False, "stopped": {}}   # stopped: choice -> the stop string that ended it

    @staticmethod
    def finish(index: int, request, state: dict) -> str:
        if index in state["stopped"]:
            return "stop"
        if state["timed_out"] and request.finish_reason == "cancelled":
            return "length"   # the time limit, as llama-server's t_max_predict_ms
        return api.finish_reason(request.finish_reason)

    async def whole(self, g, requests, http_request) -> dict:
        texts = [[] for _ in requests]
        entries = [[] for _ in requests]
        state = self.new_state()
        async for index, piece, extra in self.run(g, requests, http_request, state):
            if piece is None:
                if extra is not None:
                    raise engine_error(extra)
                continue
            texts[index].append(piece)
            entries[index] += extra
        tokenizer = self.model.tokenizer
        choices = [api.choice(g, i, "".join(texts[i]), self.finish(i, r, state),
                              api.logprobs_of(g, tokenizer, entries[i]))
                   for i, r in enumerate(requests)]
        return api.response(g, _id(g), int(time.time()), self.model_name, choices,
                            sum(r.generated for r in requests), _cached(g, requests))

    async def reply(self, g, requests, http_request) -> tuple:
        """(text, state) of a one-choice request, run to its end."""
        texts, state = [], self.new_state()
        async for _, piece, extra in self.run(g, requests, http_request, state):
            if piece is None:
                if extra is not None:
                    raise engine_error(extra)
                continue
            texts.append(piece)
        return "".join(texts), state

    async def events(self, g, requests, http_request):
        rid, created, name = _id(g), int(time.time()), self.model_name
        tokenizer = self.model.tokenizer
        offsets = [0] * len(requests)
        readers = [api.reply_stream(g) for _ in requests]   # tool calls and reasoning, per choice
        state = self.new_state()
        try:
            if g.chat:
                yield api.chunk(g, rid, created, name,
                                [api.chunk_choice(g, i, role=True) for i in range(len(requests))])
            async for index, piece, extra in self.run(g, requests, http_request, state):
                reader = readers[index]
                if piece is None:
                    if extra is not None:
                        yield api.error_event(engine_error(extra))
                        continue
                    reason = self.finish(index, requests[index], state)
                    if reader is not None:
                        for c in api.delta_choices(g, index, reader.close()):
                            yield api.chunk(g, rid, created, name, [c])
                        reason = api.finish_with_calls(reason, reader.called)
                    yield api.chunk(g, rid, created, name, [api.chunk_choice(g, index, reason=reason)])
                    continue
                logprobs = api.logprobs_of(g, tokenizer, extra, offsets[index]) if extra else None
                offsets[index] += len(piece)
                if reader is None:
                    yield api.chunk(g, rid, created, name, [api.chunk_choice(g, index, piece, logprobs=logprobs)])
                    continue
                for c in api.delta_choices(g, index, reader.feed(piece), logprobs):
                    yield api.chunk(g, rid, created, name, [c])
            if g.include_usage:
                yield api.chunk(g, rid, created, name, [],
                                usage=api.usage(g.prompt_tokens, sum(r.generated for r in requests),
                                                _cached(g, requests)))
            yield "data: [DONE]\n\n"
        finally:
            for r in requests:
                r.cancel()   # a client gone mid-stream frees its slot at the next step


def _prompt_entries(g, request) -> list:
    """[(token, logprob entry)] of the prompt a choice echoes: None for
    its first token, which nothing predicts; none without logprobs."""
    if g.top_logprobs is None:
        return []
    return list(zip(request.prompt_ids, [None, *request.prompt_logprob_entries]))


def _cached(g, requests) -> int:
    """Prompt tokens the server already held: those of each prompt's first
    choice (the others copy its prompt)."""
    return sum(r.prompt_reused for r in requests[::len(g.samplings)])


async def _cancellable(work, job, served, http_request, options: ServeOptions):
    """work(job, served, cancelled) on a worker thread: cancelled (a
    threading.Event, which work looks at between its steps) is set when the
    client goes away or the request's time (options.request_timeout) runs
    out, which answers 408."""
    cancelled = threading.Event()
    task = asyncio.ensure_future(asyncio.to_thread(work, job, served, cancelled))
    deadline = None if options.request_timeout is None else time.monotonic() + options.request_timeout
    try:
        while not (await asyncio.wait({task}, timeout=0.1))[0]:
            if (deadline is not None and time.monotonic() > deadline) or await http_request.is_disconnected():
                cancelled.set()
        result = task.result()
    finally:
        cancelled.set()
    if result is None:
        raise APIError(408, f"the request did not finish within {options.request_timeout:g} s"
                       if options.request_timeout else "the client went away")
    return result


async def _then_none(request):
    """request's tokens, then None."""
    async for token in request:
        yield token
    yield None


def _id(g) -> str:
    return ("chatcmpl-" if g.chat else "cmpl-") + uuid.uuid4().hex[:24]


def create_app(model, engine, model_name: str | None = None, api_key: str | None = None,
               options: ServeOptions = DEFAULTS, models=None):
    """The Starlette application serving model through engine (a
    serving.BatchEngine). model_name and api_key override options'.
    models: several models instead, as [(name, model, engine), ...], the
    request's `model` choosing (the first where it names none)."""
    from starlette.applications import Starlette
    from starlette.exceptions import HTTPException
    from starlette.middleware import Middleware
    from starlette.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
    from starlette.routing import Route


    api_key = options.api_key if api_key is None else api_key
    if models is None:
        models = [(model_name or options.model_name or model.name, model, engine)]
    models = ModelSet([ServedModel(*m) for m in models])
    engine = models   # /health and /metrics report the engines together
    metrics = Metrics()
    for served in models.served:
        served.completions = Completions(served.model, served.engine, served.name, metrics, options)
    stored = responses_api.ResponseStore()

    def error(e: APIError, endpoint: str | None = None, shape=api.error_body):
        if endpoint is not None:
            metrics.request(endpoint, e.status)
        # ASCII JSON: a message may quote the client's text, lone surrogates included
        return Response(json.dumps(shape(e)), status_code=e.status, headers=e.headers,
                        media_type="application/json")

    def ascii_json(body):
        # a reply that repeats the request's fields may hold its lone surrogates
        return Response(json.dumps(body), media_type="application/json")

    def check_key(request):
        if api_key is not None and not has_key(request.headers, api_key):
            raise APIError(401, "invalid or missing API key", code="invalid_api_key")

    def parse(raw: bytes, chat: bool):
        body = api.parse_json(raw)
        served = models.pick(body.get("model"))
        return served, api.parse_request(body, chat, served.model, max_prompts=served.engine.max_queue,
                                         seed=options.seed)

    async def generate(http_request, endpoint):
        check_key(http_request)
        raw = await read_body(http_request, options)
        # JSON, the chat template and the tokenizer run off the event loop.
        served, g = await asyncio.to_thread(parse, raw, endpoint == "chat")
        completions = served.completions
        requests = completions.submit(g)
        if g.stream:
            metrics.request(endpoint, 200)
            return StreamingResponse(completions.events(g, requests, http_request),
                                     media_type="text/event-stream")
        body = await completions.whole(g, requests, http_request)
        metrics.request(endpoint, 200)
        return JSONResponse(body)

    def endpoint(name, handler, shape=api.error_body):
        async def handle(request):
            try:
                return await handler(request, name)
            except APIError as e:
                return error(e, name, shape)
            except Exception as e:   # a fault of the server's own: the answer keeps the API's shape
                return error(api.server_error(f"internal error: {type(e).__name__}: {e}"), name, shape)
        return handle

    async def listing(request, name):
        check_key(request)
        return JSONResponse({"object": "list", "data": models.listing()})

    async def body_of(http_request) -> dict:
        check_key(http_request)
        return await asyncio.to_thread(api.parse_json, await read_body(http_request, options))

    def generation(module, store=None):
        """A handler that runs module's requests (module.read_request, whole
        and events: anthropic_api, responses_api) on the model they name."""
        async def handle(http_request, endpoint):
            body = await body_of(http_request)
            served = models.pick(body.get("model"))
            extra = () if store is None else (store,)
            job = await asyncio.to_thread(module.read_request, body, served.model, served.name, *extra,
                                         seed=options.seed)
            requests = served.completions.submit(job.g)
            if job.g.stream:
                metrics.request(endpoint, 200)
                return StreamingResponse(module.events(job, served.completions, requests, http_request),
                                         media_type="text/event-stream")
            reply = await module.whole(job, served.completions, requests, http_request)
            metrics.request(endpoint, 200)
            return ascii_json(reply)
        return handle

    async def count_tokens(http_request, endpoint):
        body = await body_of(http_request)
        served = models.pick(body.get("model"))
        reply = await asyncio.to_thread(anthropic_api.count_tokens, body, served.model)
        metrics.request(endpoint, 200)
        return JSONResponse(reply)

    async def stored_response(http_request, endpoint):
        check_key(http_request)
        rid = http_request.path_params["rid"]
        if http_request.method == "DELETE":
            return ascii_json(stored.delete(rid))
        return ascii_json(stored.get(rid))

    async def embed(http_request, endpoint):
        body = await body_of(http_request)
        served = models.pick(body.get("model"))
        job = await asyncio.to_thread(embeddings_api.read_request, body, served.model)
        async with served.embed_lock:
            vectors = await _cancellable(embeddings_api.run, job, served, http_request, options)
        metrics.request(endpoint, 200)
        return JSONResponse(embeddings_api.response(job, vectors, served.name))

    def tokens(work):
        async def handle(http_request, endpoint):
            body = await body_of(http_request)
            served = models.pick(body.get("model"))
            reply = await asyncio.to_thread(work, body, served.model)
            metrics.request(endpoint, 200)
            return JSONResponse(reply)
        return handle

    async def health(request):
        # The process id tells replicas apart behind a load balancer; the
        # load and the pid are for those who hold the key.
        alive = engine.alive
        body = {"status": "ok" if alive else "unhealthy"}
        if api_key is None or has_key(request.headers, api_key):
            body.update(active=engine.active, queue=engine.queue_depth, pid=os.getpid())
        return JSONResponse(body, status_code=200 if alive else 503)

    async def prometheus(request, name):
        check_key(request)
        return PlainTextResponse(metrics.text(engine), media_type="text/plain; version=0.0.4")

    async def http_error(request, exc):
        kind = {404: "not_found_error", 405: "invalid_request_error"}.get(exc.status_code,
                                                                        "invalid_request_error")
        message = {404: f"no route {request.url.path}",
                   405: f"{request.method} is not allowed on {request.url.path}"}.get(
            exc.status_code, str(exc.detail))
        return error(APIError(exc.status_code, message, type=kind), shape=shape_of(request))

    async def internal_error(request, exc):
        return error(api.server_error(f"internal error: {type(exc).__name__}"), shape=shape_of(request))

    def shape_of(request):
        return error_shape(request.url.path)

    anthropic = anthropic_api.error_body

    cors = cors_middleware(options)
    return Starlette(routes=[
        Route("/v1/models", endpoint("models", listing), methods=["GET"]),
        Route("/v1/completions", endpoint("completions", generate), methods=["POST"]),
        Route("/v1/chat/completions", endpoint("chat", generate), methods=["POST"]),
        Route("/v1/messages", endpoint("messages", generation(anthropic_api), anthropic), methods=["POST"]),
        Route("/v1/messages/count_tokens", endpoint("count_tokens", count_tokens, anthropic),
              methods=["POST"]),
        Route("/v1/responses", endpoint("responses", generation(responses_api, stored)), methods=["POST"]),
        Route("/v1/responses/{rid}", endpoint("responses", stored_response), methods=["GET", "DELETE"]),
        Route("/v1/embeddings", endpoint("embeddings", embed), methods=["POST"]),
        Route("/tokenize", endpoint("tokenize", tokens(embeddings_api.tokenize)), methods=["POST"]),
        Route("/detokenize", endpoint("detokenize", tokens(embeddings_api.detokenize)), methods=["POST"]),
        # the same without /v1, as llama-server serves them, for clients given a base URL without it
        Route("/models", endpoint("models", listing), methods=["GET"]),
        Route("/completions", endpoint("completions", generate), methods=["POST"]),
        Route("/chat/completions", endpoint("chat", generate), methods=["POST"]),
        Route("/health", health, methods=["GET"]),
        Route("/metrics", endpoint("metrics", prometheus), methods=["GET"]),
    ], exception_handlers={HTTPException: http_error, Exception: internal_error},
        # CORS outermost, so that a refusal for too many requests reaches a
        # web page as the 503 it is, not as a CORS failure
        middleware=([cors] if cors else []) + [Middleware(RequestLimit, limit=options.max_connections)])


def has_key(headers, api_key: str) -> bool:
    """Whether a request's headers carry api_key: as a bearer token in
    Authorization (OpenAI's clients; the scheme in any case, RFC 7235), or
    in x-api-key (Anthropic's), compared in constant time."""
    key = api_key.encode()
    scheme, _, token = headers.get("authorization", "").partition(" ")
    bearer = scheme.lower() == "bearer" and hmac.compare_digest(token.strip(" ").encode("latin-1", "replace"), key)
    return bearer or hmac.compare_digest(headers.get("x-api-key", "").encode("latin-1", "replace"), key)


def startup_line(model, options: ServeOptions, name: str | None = None) -> str:
    """What `fastllm serve` prints as it starts: model file, weight types,
    slots, context, URL and whether a key is needed (and the name a model
    is served under, where there are several)."""
    types = ", ".join(model.weight_types) or model.dtype
    key = "an API key is required" if options.api_key else "no API key"
    served = f" as {name!r}" if name is not None else ""
    return (f"fastllm serve: {model.source}{served} ({types} weights, {model.activations} activations), "
            f"{options.parallel} slots of {model.n_ctx} tokens of context ({model.kv_dtype} KV cache), "
            f"http://{options.host}:{options.port}/v1, {key}")


def serve(model, options: ServeOptions = DEFAULTS):
    """Run the server until interrupted. model: a Model, or [(name, Model),
    ...] to serve several, each with an engine of its own."""
    import uvicorn
    several = isinstance(model, list)
    entries = model if several else [(options.model_name or model.name, model)]
    engines = []
    try:
        for _, m in entries:
            engines.append(BatchEngine(m, parallel=options.parallel, max_queue=options.max_queue,
                                       speculative=m.speculative, draft_max=m.draft_max,
                                       cache_bytes=options.cache_ram << 20, checkpoints=options.ctx_checkpoints,
                                       cache_dir=options.cache_dir, cache_disk_bytes=options.cache_disk << 20))
        app = create_app(None, None, options=options,
                         models=[(name, m, e) for (name, m), e in zip(entries, engines)])
        for name, m in entries:
            print(startup_line(m, options, name if several else None), file=sys.stderr, flush=True)
        uvicorn.run(app, host=options.host, port=options.port, log_level="info", **uvicorn_config(options))
    finally:
        for e in engines:
            e.close()


def uvicorn_config(options: ServeOptions) -> dict:
    """uvicorn's settings for options: its HTTP protocol with a deadline on
    request heads, the keep-alive and the shutdown's deadline. (The limit
    on requests in progress is the app's own: uvicorn's would count
    connections that never sent a whole head.)"""
    from uvicorn.protocols.http.auto import AutoHTTPProtocol
    return {"http": with_head_deadline(AutoHTTPProtocol, options.head_timeout),
            "timeout_keep_alive": options.keep_alive, "timeout_graceful_shutdown": options.shutdown_timeout}
