"""Replicas of `fastllm serve` behind Ray Serve: one OpenAI-compatible
endpoint in front of several processes, on one machine or across a Ray
cluster (`pip install "fastllm-engine[ray]"`).

    serve run fastllm.serve.ray_serve:build model=/models/m.gguf replicas=4 threads=4 parallel=8

Each replica is a Ray actor process that loads the model and runs the same
Starlette app and continuous-batching engine as `fastllm serve`; Ray's proxy
sends each request to a replica with room for it (`max_ongoing_requests`:
the replica's slots plus as many waiting, so the rest wait at the proxy
for whichever replica frees up first), and Ray places replicas on the
cluster's nodes by the cores each asks for (`threads`). The model path must
exist on every node, or be left out for the default model.
"""
from __future__ import annotations

import inspect

from .server import DEFAULTS, ServeOptions, create_app
from ..generate.model import Model
from .serving import BatchEngine


def deployment(model: str | None = None, *, replicas: int = 1, threads: int = 1,
               parallel: int = DEFAULTS.parallel, ctx: int = 2048, max_queue: int = DEFAULTS.max_queue,
               dtype: str | None = None, api_key: str | None = DEFAULTS.api_key,
               model_name: str | None = DEFAULTS.model_name, max_body: int = DEFAULTS.max_body,
               body_timeout: float = DEFAULTS.body_timeout,
               request_timeout: float | None = DEFAULTS.request_timeout, seed: int | None = DEFAULTS.seed):
    """A Ray Serve application of `replicas` copies of fastllm's server, for
    serve.run(); each replica loads model with `threads` threads and serves
    `parallel` requests at once with a KV cache of `ctx` tokens each. The
    other settings are those of fastllm.serve.server.ServeOptions (Ray's proxy
    keeps the connections, so their settings are Ray's)."""
    from ray import serve

    if replicas < 1 or threads < 1 or ctx < 2:
        raise ValueError("replicas and threads must be positive and ctx at least 2")
    options = ServeOptions(parallel=parallel, max_queue=max_queue, api_key=api_key, model_name=model_name,
                           max_body=max_body, body_timeout=body_timeout, request_timeout=request_timeout,
                           seed=seed)

    def build_app():
        # Runs in each replica's process, when Ray starts it.
        m = Model.from_pretrained(model, n_ctx=ctx, threads=threads, dtype=dtype)
        engine = BatchEngine(m, parallel=options.parallel, max_queue=options.max_queue)
        return create_app(m, engine, options=options)

    @serve.deployment(num_replicas=replicas, ray_actor_options={"num_cpus": threads},
                      max_ongoing_requests=2 * parallel)
    @serve.ingress(build_app)
    class FastllmServer:
        pass

    return FastllmServer.bind()


def build(args: dict):
    """The application builder for Ray's CLI: `serve run
    fastllm.serve.ray_serve:build key=value ...`, with deployment()'s arguments
    as keys (values come as strings: numbers are read as the setting's
    type, int or float)."""
    params = inspect.signature(deployment).parameters
    unknown = set(args) - set(params)
    if unknown:
        raise ValueError(f"unknown setting(s) {', '.join(sorted(unknown))}; "
                         f"fastllm.serve.ray_serve takes {', '.join(params)}")
    kw = {}
    for key, value in args.items():
        kind = next((k for k in (int, float) if k.__name__ in str(params[key].annotation).split(" | ")),
                    None)
        if kind is not None and isinstance(value, str):
            try:
                value = kind(value)
            except ValueError:
                raise ValueError(f"{key}={value!r} is not {'an int' if kind is int else 'a number'}") from None
        kw[key] = value
    return deployment(**kw)
