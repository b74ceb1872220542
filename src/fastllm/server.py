"""fastllm serve: an OpenAI-compatible HTTP server over the continuous-
batching engine (Starlette on uvicorn: `pip install fastllm-engine[serve]`).

    fastllm serve --model M --port 8000 --parallel 4

GET /v1/models, POST /v1/completions and /v1/chat/completions (JSON, or
server-sent events with "stream": true), GET /health, GET /metrics
(Prometheus). Errors come in OpenAI's JSON shape. A client that goes away
frees its slot at the engine's next step.
"""
from __future__ import annotations

import asyncio
import collections
import json
import os
import time
import uuid

from .sampling import SamplingParams
from .serving import BatchEngine, QueueFull
from .textstream import TextStream


class APIError(Exception):
    def __init__(self, status: int, message: str, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None, headers: dict | None = None):
        super().__init__(message)
        self.status, self.type, self.param, self.code, self.headers = status, type, param, code, headers


def _field(body: dict, name: str, kind, default=None, lo=None, hi=None):
    """body[name] checked: of kind (int, float, bool, str, list), within [lo, hi]."""
    value = body.get(name, default)
    if value is None:
        return default
    ok = isinstance(value, kind) and not (kind in (int, float) and isinstance(value, bool))
    if kind is float and isinstance(value, int) and not isinstance(value, bool):
        value, ok = float(value), True
    if not ok or (lo is not None and value < lo) or (hi is not None and value > hi):
        bounds = f" in [{lo}, {hi}]" if lo is not None and hi is not None else ""
        raise APIError(400, f"'{name}' must be a {kind.__name__}{bounds}, got {value!r}", param=name)
    return value


def _sampling(body: dict) -> SamplingParams:
    for name in ("frequency_penalty", "presence_penalty"):
        if _field(body, name, float, 0.0):
            raise APIError(400, f"'{name}' is not supported (use repetition_penalty)", param=name)
    if _field(body, "n", int, 1) != 1:
        raise APIError(400, "only n=1 is supported", param="n")
    top_k = _field(body, "top_k", int, 0, -1)
    try:
        return SamplingParams(temperature=_field(body, "temperature", float, 1.0, 0.0, 2.0),
                              top_p=_field(body, "top_p", float, 1.0, 0.0, 1.0),
                              top_k=max(top_k, 0), min_p=_field(body, "min_p", float, 0.0, 0.0, 1.0),
                              repetition_penalty=_field(body, "repetition_penalty", float, 1.0),
                              seed=_field(body, "seed", int))
    except ValueError as e:
        raise APIError(400, str(e)) from None


def _stops(body: dict) -> list:
    stop = body.get("stop")
    if stop is None:
        return []
    stops = [stop] if isinstance(stop, str) else stop
    if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
        raise APIError(400, "'stop' must be a string or a list of strings", param="stop")
    return stops


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

    def text(self, engine: BatchEngine) -> str:
        now = time.monotonic()
        rate = sum(k for t, k in self.recent if now - t < 10) / 10
        lines = ["# TYPE fastllm_requests_total counter"]
        lines += [f'fastllm_requests_total{{endpoint="{e}",status="{s}"}} {n}'
                  for (e, s), n in sorted(self.requests.items())]
        lines += ["# TYPE fastllm_queue_depth gauge", f"fastllm_queue_depth {engine.queue_depth}",
                  "# TYPE fastllm_active_requests gauge", f"fastllm_active_requests {engine.active}",
                  "# TYPE fastllm_prompt_tokens_total counter", f"fastllm_prompt_tokens_total {self.prompt_tokens}",
                  "# TYPE fastllm_generated_tokens_total counter",
                  f"fastllm_generated_tokens_total {self.generated_tokens}",
                  "# TYPE fastllm_tokens_per_second gauge", f"fastllm_tokens_per_second {rate:.3f}",
                  "# TYPE fastllm_time_to_first_token_seconds summary",
                  f"fastllm_time_to_first_token_seconds_sum {self.ttft_sum:.6f}",
                  f"fastllm_time_to_first_token_seconds_count {self.ttft_count}"]
        return "\n".join(lines) + "\n"


def create_app(model, engine: BatchEngine, model_name: str, api_key: str | None = None):
    """The Starlette application serving model through engine."""
    from starlette.applications import Starlette
    from starlette.responses import JSONResponse, PlainTextResponse, StreamingResponse
    from starlette.routing import Route

    metrics = Metrics()
    tokenizer = model.tokenizer

    def error(e: APIError, endpoint: str):
        metrics.request(endpoint, e.status)
        body = {"error": {"message": str(e), "type": e.type, "param": e.param, "code": e.code}}
        return JSONResponse(body, status_code=e.status, headers=e.headers)

    async def read_body(request):
        if api_key is not None and request.headers.get("authorization", "") != f"Bearer {api_key}":
            raise APIError(401, "invalid or missing API key", code="invalid_api_key")
        try:
            body = json.loads(await request.body())
        except (ValueError, UnicodeDecodeError):
            raise APIError(400, "the request body is not valid JSON") from None
        if not isinstance(body, dict):
            raise APIError(400, "the request body must be a JSON object")
        return body

    def submit(ids, body, max_tokens, top_logprobs):
        if len(ids) >= model.n_ctx:
            raise APIError(400, f"the prompt has {len(ids)} tokens: the context holds {model.n_ctx}",
                           param="messages" if "messages" in body else "prompt",
                           code="context_length_exceeded")
        max_tokens = min(max_tokens, model.n_ctx - len(ids)) if max_tokens else model.n_ctx - len(ids)
        sampling = _sampling(body)
        try:
            req = engine.submit(ids, max_tokens, sampling, top_logprobs=top_logprobs)
        except QueueFull as e:
            raise APIError(503, str(e), type="server_error", code="overloaded",
                           headers={"Retry-After": "1"}) from None
        metrics.prompt_tokens += len(ids)
        return req

    async def watch(req, http_request):
        """Cancel req when the client goes away (checked ten times a second)."""
        while not req.finish_reason:
            if await http_request.is_disconnected():
                req.cancel()
                return
            await asyncio.sleep(0.1)

    async def pieces(req, stops, http_request):
        """(text, [(token, logprob entry)]) as tokens come; cancels req when
        a stop string appears or the client goes away."""
        text = TextStream(tokenizer, stops)
        got = 0
        watcher = asyncio.ensure_future(watch(req, http_request))
        try:
            async for token in req:
                if got == 0 and req.first_token is not None:
                    metrics.ttft_sum += req.first_token - req.submitted
                    metrics.ttft_count += 1
                entry = req.logprobs[got] if req.top_logprobs is not None else None
                got += 1
                metrics.tokens(1)
                piece = text.add(token)
                if piece or entry is not None:
                    yield piece, [(token, entry)] if entry is not None else []
                if text.stopped:
                    req.finish_reason = "stop"
                    return
            tail = text.flush()
            if tail:
                yield tail, []
        finally:
            watcher.cancel()
            req.cancel()   # a no-op once it has ended; else frees the slot

    def finish(req):
        return {"stop": "stop", "cancelled": "stop"}.get(req.finish_reason, "length")

    def usage(req, n_prompt):
        n = req.generated
        return {"prompt_tokens": n_prompt, "completion_tokens": n, "total_tokens": n_prompt + n}

    def chat_logprobs(entries, top):
        out = []
        for token, (lp, best) in entries:
            s = tokenizer.decode([token])
            out.append({"token": s, "logprob": lp, "bytes": list(s.encode()),
                        "top_logprobs": [{"token": (t := tokenizer.decode([i])), "logprob": v,
                                          "bytes": list(t.encode())} for i, v in best[:top]]})
        return {"content": out}

    def completion_logprobs(entries, offset):
        tokens, lps, tops, offsets = [], [], [], []
        for token, (lp, best) in entries:
            s = tokenizer.decode([token])
            tokens.append(s), lps.append(lp), offsets.append(offset)
            tops.append({tokenizer.decode([i]): v for i, v in best})
            offset += len(s)
        return {"tokens": tokens, "token_logprobs": lps, "top_logprobs": tops, "text_offset": offsets}

    async def generate(http_request, endpoint):
        body = await read_body(http_request)
        chat = endpoint == "chat"
        if chat:
            messages = body.get("messages")
            if not isinstance(messages, list) or not messages or not all(
                    isinstance(m, dict) and "role" in m for m in messages):
                raise APIError(400, "'messages' must be a non-empty list of messages", param="messages")
            tools = body.get("tools")
            try:
                prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tools=tools)
            except Exception as e:   # the model's own template refuses these messages
                raise APIError(400, f"the chat template cannot render these messages: {e}",
                               param="messages") from None
            ids = tokenizer.encode(prompt, add_special_tokens=False)
            max_tokens = _field(body, "max_completion_tokens", int, None, 1) or \
                _field(body, "max_tokens", int, None, 1)
            want_lp = _field(body, "logprobs", bool, False)
            top = _field(body, "top_logprobs", int, 0, 0, 20)
            top_logprobs = top if want_lp else None
        else:
            prompt = body.get("prompt")
            if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
                prompt = prompt[0]
            if isinstance(prompt, str):
                ids = tokenizer.encode(prompt)
            elif isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
                ids = prompt
            else:
                raise APIError(400, "'prompt' must be a string or a list of token ids", param="prompt")
            if _field(body, "echo", bool, False):
                raise APIError(400, "'echo' is not supported", param="echo")
            max_tokens = _field(body, "max_tokens", int, 16, 0)
            top_logprobs = _field(body, "logprobs", int, None, 0, 5)
        try:
            ids = list(ids)
            req = submit(ids, body, max_tokens, top_logprobs)
        except ValueError as e:
            raise APIError(400, str(e)) from None
        stops = _stops(body)
        stream = _field(body, "stream", bool, False)
        include_usage = bool((body.get("stream_options") or {}).get("include_usage")) if stream else False
        rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
        created = int(time.time())
        kind = "chat.completion" if chat else "text_completion"
        metrics.request(endpoint, 200)

        if not stream:
            texts, entries = [], []
            async for piece, e in pieces(req, stops, http_request):
                texts.append(piece)
                entries += e
            text = "".join(texts)
            choice = {"index": 0, "finish_reason": finish(req), "logprobs": None}
            if top_logprobs is not None:
                choice["logprobs"] = chat_logprobs(entries, top_logprobs) if chat else \
                    completion_logprobs(entries, 0)
            if chat:
                choice["message"] = {"role": "assistant", "content": text}
            else:
                choice["text"] = text
            return JSONResponse({"id": rid, "object": kind, "created": created, "model": model_name,
                                 "choices": [choice], "usage": usage(req, len(ids))})

        def chunk(choices, **extra):
            body = {"id": rid, "object": kind + (".chunk" if chat else ""), "created": created,
                    "model": model_name, "choices": choices, **extra}
            return f"data: {json.dumps(body)}\n\n"

        async def events():
            try:
                if chat:
                    yield chunk([{"index": 0, "delta": {"role": "assistant", "content": ""},
                                  "logprobs": None, "finish_reason": None}])
                offset = 0
                async for piece, e in pieces(req, stops, http_request):
                    choice = {"index": 0, "logprobs": None, "finish_reason": None}
                    if top_logprobs is not None and e:
                        choice["logprobs"] = chat_logprobs(e, top_logprobs) if chat else \
                            completion_logprobs(e, offset)
                    choice.update({"delta": {"content": piece}} if chat else {"text": piece})
                    offset += len(piece)
                    yield chunk([choice])
                last = {"index": 0, "logprobs": None, "finish_reason": finish(req)}
                last.update({"delta": {}} if chat else {"text": ""})
                yield chunk([last])
                if include_usage:
                    yield chunk([], usage=usage(req, len(ids)))
                yield "data: [DONE]\n\n"
            finally:
                req.cancel()   # a client gone mid-stream frees its slot at the next step
        return StreamingResponse(events(), media_type="text/event-stream")

    def endpoint(name):
        async def handle(request):
            try:
                return await generate(request, name)
            except APIError as e:
                return error(e, name)
        return handle

    async def models(request):
        if api_key is not None and request.headers.get("authorization", "") != f"Bearer {api_key}":
            return error(APIError(401, "invalid or missing API key", code="invalid_api_key"), "models")
        return JSONResponse({"object": "list", "data": [
            {"id": model_name, "object": "model", "created": 0, "owned_by": "fastllm"}]})

    async def health(request):
        # The process id tells replicas apart behind a load balancer.
        return JSONResponse({"status": "ok", "active": engine.active, "queue": engine.queue_depth,
                             "pid": os.getpid()})

    async def prometheus(request):
        return PlainTextResponse(metrics.text(engine), media_type="text/plain; version=0.0.4")

    return Starlette(routes=[
        Route("/v1/models", models, methods=["GET"]),
        Route("/v1/completions", endpoint("completions"), methods=["POST"]),
        Route("/v1/chat/completions", endpoint("chat"), methods=["POST"]),
        Route("/health", health, methods=["GET"]),
        Route("/metrics", prometheus, methods=["GET"]),
    ])


def serve(model, host: str = "127.0.0.1", port: int = 8000, parallel: int = 4, max_queue: int = 64,
          api_key: str | None = None, model_name: str | None = None):
    """Run the server until interrupted."""
    import uvicorn
    engine = BatchEngine(model, parallel=parallel, max_queue=max_queue)
    try:
        app = create_app(model, engine, model_name or model.name, api_key)
        uvicorn.run(app, host=host, port=port, log_level="info")
    finally:
        engine.close()
