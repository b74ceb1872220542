"""Generation ends where llama.cpp ends it: at the eos ids the files name,
and at every token whose text marks an end, for GGUF files and folders."""
import json

import pytest

from fastllm import Model, SamplingParams
from fastllm.spec.end_of_generation import end_of_generation_ids


class _Vocab:
    def __init__(self, tokens, eos=None):
        self.ids = {t: i for i, t in enumerate(tokens)}
        self.eos_token_id = eos

    def token_to_id(self, text):
        return self.ids.get(text)


class _Config:
    def __init__(self, vocab_size=100, eos=()):
        self.vocab_size = vocab_size
        self.eos_token_id = list(eos)


def test_the_named_eos_and_every_end_marking_token_end_a_generation():
    vocab = _Vocab(["a", "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|fim_pad|>", "<|file_sep|>", "b"])
    got = end_of_generation_ids({"eos_token_id": 3}, _Config(), vocab)
    assert got == {1, 3, 4, 5}


def test_generation_config_comes_before_config_json_and_the_tokenizer():
    vocab = _Vocab(["a", "b", "c"], eos=2)
    assert end_of_generation_ids({"eos_token_id": [0, 1]}, _Config(eos=[2]), vocab) == {0, 1}
    assert end_of_generation_ids({}, _Config(eos=[1]), vocab) == {1}
    assert end_of_generation_ids({}, _Config(), vocab) == {2}
    assert end_of_generation_ids({}, _Config(), None) == set()


def test_ids_outside_the_model_vocabulary_are_left_out():
    vocab = _Vocab(["a", "b", "<|im_end|>"])
    assert end_of_generation_ids({"eos_token_id": 7}, _Config(vocab_size=2), vocab) == set()


def test_end_ends_only_a_message_where_return_and_call_end_turns():
    harmony = _Vocab(["<|start|>", "<|end|>", "<|return|>", "<|call|>"])
    assert end_of_generation_ids({}, _Config(), harmony) == {2, 3}
    phi = _Vocab(["<|user|>", "<|end|>", "<|endoftext|>"])
    assert end_of_generation_ids({}, _Config(), phi) == {1, 2}


def test_the_closing_s_is_text_where_a_tool_response_token_exists():
    gemma4 = _Vocab(["<eos>", "</s>", "<|tool_response>", "<turn|>"])
    assert end_of_generation_ids({}, _Config(), gemma4) == {0, 2, 3}
    llama2 = _Vocab(["<unk>", "<s>", "</s>"])
    assert end_of_generation_ids({}, _Config(), llama2) == {2}


@pytest.fixture(scope="module")
def qwen25(request, tmp_path_factory):
    """A tiny random Qwen2.5 folder whose eos is <|im_end|>, and the GGUF
    file fastllm exports from it."""
    from fastllm.formats.gguf_writer import export_gguf
    from oracles.tiny_chat_models import make_tiny_chat_model
    cache = request.config.cache.mkdir("fastllm_qwen_tokenizers")
    folder = make_tiny_chat_model("qwen2.5", tmp_path_factory.mktemp("qwen25"), cache)
    gguf_path = export_gguf(folder, tmp_path_factory.mktemp("qwen25-gguf") / "qwen25.gguf", mix="q8_0")
    return folder, gguf_path


@pytest.mark.slow
@pytest.mark.parametrize("source", ["gguf", "folder"])
def test_a_plain_completion_of_qwen25_stops_at_endoftext(qwen25, source):
    import gguf

    folder, gguf_path = qwen25
    model = Model.from_pretrained(gguf_path if source == "gguf" else folder, n_ctx=64, threads=2)
    tok = model.tokenizer
    im_end, endoftext = tok.token_to_id("<|im_end|>"), tok.token_to_id("<|endoftext|>")
    if source == "gguf":
        reader = gguf.GGUFReader(str(gguf_path))
        field = reader.fields["tokenizer.ggml.eos_token_id"]
        assert int(field.parts[field.data[0]][0]) == im_end, "the file's eos is <|im_end|>"
    else:
        assert json.loads((folder / "generation_config.json").read_text())["eos_token_id"] == im_end
    assert {im_end, endoftext} <= model.eos_token_ids

    prompt = tok.encode("The capital of France is", add_special_tokens=False)
    # The bias makes <|endoftext|> the first token generated.
    forced = SamplingParams(temperature=0.0, logit_bias={endoftext: 100})
    assert list(model.generate_tokens(prompt, 6, sampling=forced, stop_token_ids=())) == [endoftext] * 6
    got = list(model.generate_tokens(prompt, 6, sampling=forced))
    assert got == [], f"generation went on past <|endoftext|>: {got}"
    text = model.generate("The capital of France is", max_new_tokens=6, temperature=0.0,
                          logit_bias={endoftext: 100})
    assert text == ""
