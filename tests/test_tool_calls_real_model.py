"""Tool calls as a real model writes them under tool_choice "auto", through
fastllm serve and OpenAI's client: Qwen2.5-Coder-0.5B-Instruct answers with
a bare JSON call, or one in a ```json fence, rather than in <tool_call>
tags; both come back as tool_calls, whole and streamed as argument deltas.
The model (a 491 MB GGUF) is not part of the repository nor of CI's run:
FASTLLM_QWEN25_CODER_GGUF names the file."""
import json
import os

import pytest

pytest.importorskip("openai")
GGUF = os.environ.get("FASTLLM_QWEN25_CODER_GGUF")
pytestmark = pytest.mark.skipif(not GGUF, reason="FASTLLM_QWEN25_CODER_GGUF names no Qwen2.5-Coder GGUF")

from fastllm import Model  # noqa: E402
from test_server import client, running  # noqa: E402

TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "The current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]


@pytest.mark.slow
@pytest.mark.parametrize("question, city", [("What is the weather in Paris?", "Paris"),
                                            ("What's the weather like in Istanbul right now?", "Istanbul")])
def test_bare_and_fenced_json_calls_are_tool_calls(question, city):
    model = Model.from_pretrained(GGUF, n_ctx=1024, threads=2)
    with running(model, parallel=1) as (url, _):
        kw = dict(model="m", messages=[{"role": "user", "content": question}], tools=TOOLS, temperature=0,
                  max_tokens=80)
        whole = client(url).chat.completions.create(**kw).choices[0]
        assert whole.finish_reason == "tool_calls" and whole.message.content is None
        (call,) = whole.message.tool_calls
        assert call.function.name == "get_weather" and json.loads(call.function.arguments) == {"city": city}
        pieces, reasons = [], []
        for chunk in client(url).chat.completions.create(stream=True, **kw):
            for choice in chunk.choices:
                reasons.append(choice.finish_reason)
                pieces += [d.function.arguments for d in choice.delta.tool_calls or [] if d.function.arguments]
        assert reasons[-1] == "tool_calls" and "".join(pieces) == call.function.arguments
        assert len(pieces) > 1   # the arguments came as they were written
