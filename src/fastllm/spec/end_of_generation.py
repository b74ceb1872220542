"""Which generated tokens end a generation.

transformers stops at the eos ids of generation_config.json (else
config.json's). llama.cpp stops at more: eos, eot and eom, and every token
whose text marks an end, whatever the file says its eos is. A Qwen2.5 file
whose eos is <|im_end|> then still stops a plain completion at
<|endoftext|>, which is what its users expect, so fastllm stops as llama.cpp
does, for GGUF files and model folders alike.
"""
from __future__ import annotations

# Texts of the tokens that end a turn or a document, as llama.cpp lists them.
END_TEXTS = (
    "<|eot_id|>", "<|im_end|>", "<|end|>", "<|return|>", "<|call|>", "<|flush|>", "<|calls|>",
    "<end_of_turn>", "<|endoftext|>", "</s>", "<|eom_id|>", "<EOT>", "_<EOT>", "[EOT]", "[EOS]",
    "<|end_of_text|>", "<end_of_utterance>", "<eos>", "<turn|>", "<|tool_response>",
    "<\uff5cend\u2581of\u2581sentence\uff5c>", "[e~[",
)
# Fill-in-the-middle padding and separators: a code model emits them where a
# completion is over.
FIM_TEXTS = (
    "<|fim_pad|>", "<fim-pad>", "<fim_pad>", "<PAD>", "[PAD]",
    "<|fim_repo|>", "<|repo_name|>", "<fim-repo>", "<REPO>", "<reponame>", "<|file_sep|>",
)


def _by_text(tokenizer) -> set:
    """Ids of the vocabulary's end-marking tokens, with llama.cpp's two
    exceptions: where <|return|> and <|call|> (or <|calls|> and <|flush|>)
    end a turn, <|end|> only ends a message; where <|tool_response> or
    <|plamo:eos|> exist, </s> is ordinary text."""
    found = {}
    for text in END_TEXTS + FIM_TEXTS:
        token_id = tokenizer.token_to_id(text)
        if token_id is not None:
            found[text] = token_id
    has = found.__contains__
    if (has("<|return|>") and has("<|call|>")) or (has("<|calls|>") and has("<|flush|>")):
        found.pop("<|end|>", None)
    if has("<|tool_response>") or tokenizer.token_to_id("<|plamo:eos|>") is not None:
        found.pop("</s>", None)
    return set(found.values())


def end_of_generation_ids(gen_config: dict, config, tokenizer) -> set:
    """The ids that end a generation: the eos ids of generation_config.json
    (an id or a list), else config.json's, else the tokenizer's eos token;
    and every token whose text marks an end."""
    eos = gen_config.get("eos_token_id")
    ids = [] if eos is None else list(eos) if isinstance(eos, list) else [eos]
    if not ids:
        ids = list(config.eos_token_id)
    if not ids and tokenizer is not None and tokenizer.eos_token_id is not None:
        ids = [tokenizer.eos_token_id]
    out = {int(i) for i in ids}
    if tokenizer is not None:
        out |= _by_text(tokenizer)
    return {i for i in out if 0 <= i < config.vocab_size}


def finish_reason(n_tokens: int, n_ctx: int, sampler, generated: int, max_new_tokens: int) -> str | None:
    """Why a generation ends once a token (not an end token) is handed out,
    or None while it goes on: "context" where the sequence, n_tokens with
    that token, fills the context; "stop" where the sampler's constraint is
    complete; "length" after max_new_tokens. Model.generate_tokens and the
    batch engine both end by these rules."""
    if n_tokens >= n_ctx:
        return "context"
    if sampler.done:
        return "stop"
    if generated >= max_new_tokens:
        return "length"
    return None
