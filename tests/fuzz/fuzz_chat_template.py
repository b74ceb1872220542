"""Chat templates: an arbitrary template and conversation through
fastllm.tokenizer.chat_template.render_chat.

The input, as UTF-8 (invalid bytes replaced), split at NUL characters: the
template, then the contents of alternating user and assistant messages.
A template may fail (TemplateError) but must not crash, loop for long or
fill memory: the sandbox bounds its work."""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _target import instrumented, main  # noqa: E402

with instrumented():
    from fastllm.tokenizer.chat_template import TemplateError, render_chat

SPECIALS = {"bos_token": "<s>", "eos_token": "</s>"}


def TestOneInput(data: bytes):
    parts = data.decode("utf-8", "replace").split("\0")
    template = parts[0]
    contents = parts[1:9] or ["Hello"]
    messages = [{"role": ("user", "assistant")[i % 2], "content": c} for i, c in enumerate(contents)]
    try:
        render_chat(template, messages, add_generation_prompt=len(data) % 2 == 1,
                    special_tokens_map=SPECIALS)
    except TemplateError:
        return


if __name__ == "__main__":
    main(TestOneInput)
