"""lm-evaluation-harness against fastllm serve, as people evaluate a model
behind vLLM or llama-server: its local-completions model scores a
multiple-choice task (written here, nothing downloaded) through
/v1/completions with batches of token-id prompts, echo, logprobs and no
generation. Every item's log-likelihood is the one fastllm's Python
Model.logits gives for the same text, and the accuracy is lm_eval's own
transformers (hf) backend's on the same model folder."""
import json

import numpy as np
import pytest

lm_eval = pytest.importorskip("lm_eval")
pytest.importorskip("uvicorn")
torch = pytest.importorskip("torch")

from fastllm import Model  # noqa: E402
from test_server import running  # noqa: E402

# (question, choices, index of the right one)
ITEMS = [
    ("What is the capital of France?", ["Paris", "Rome", "Berlin", "Madrid"], 0),
    ("What is the capital of Italy?", ["Vienna", "Rome", "Lisbon", "Oslo"], 1),
    ("What is the capital of Japan?", ["Seoul", "Beijing", "Tokyo", "Bangkok"], 2),
    ("What is the capital of Spain?", ["Madrid", "Paris", "Athens", "Dublin"], 0),
    ("How many legs does a spider have?", ["six", "four", "ten", "eight"], 3),
    ("How many days are in a week?", ["five", "seven", "ten", "twelve"], 1),
    ("What color is the sky on a clear day?", ["green", "red", "blue", "black"], 2),
    ("What color is grass?", ["green", "purple", "white", "orange"], 0),
    ("Which animal says moo?", ["a cat", "a dog", "a duck", "a cow"], 3),
    ("Which animal barks?", ["a dog", "a fish", "a snake", "a horse"], 0),
    ("What is two plus two?", ["three", "four", "five", "six"], 1),
    ("What is ten minus three?", ["five", "six", "seven", "eight"], 2),
    ("What do bees make?", ["milk", "silk", "wool", "honey"], 3),
    ("What falls from clouds when it rains?", ["water", "sand", "stones", "leaves"], 0),
    ("Which season comes after winter?", ["autumn", "spring", "summer", "winter"], 1),
    ("What is frozen water called?", ["steam", "fog", "ice", "salt"], 2),
    ("Which planet do we live on?", ["Mars", "Venus", "Jupiter", "Earth"], 3),
    ("What do you use to write on paper?", ["a pen", "a spoon", "a shoe", "a cup"], 0),
    ("Where do fish live?", ["in trees", "in water", "in deserts", "in clouds"], 1),
    ("What is the opposite of hot?", ["warm", "wet", "cold", "loud"], 2),
    ("What is the opposite of up?", ["left", "right", "over", "down"], 3),
    ("Which fruit is yellow and long?", ["a banana", "a cherry", "a grape", "a plum"], 0),
    ("What does a clock show?", ["the weather", "the time", "the news", "the price"], 1),
    ("What do cows drink?", ["oil", "juice", "water", "coffee"], 2),
]

TASK = """task: fastllm_quiz
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "Question: {{{{question}}}}\\nAnswer:"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{answer}}}}"
metric_list:
  - metric: acc
"""


@pytest.fixture(scope="module")
def task_dir(tmp_path_factory, monkeypatch_module):
    folder = tmp_path_factory.mktemp("lm_eval_task")
    data = folder / "quiz.jsonl"
    data.write_text("".join(json.dumps({"question": q, "choices": c, "answer": a}) + "\n" for q, c, a in ITEMS))
    (folder / "quiz.yaml").write_text(TASK.format(data=data))
    # datasets' JSON loader reads the local file; nothing is fetched
    monkeypatch_module.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch_module.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch_module.setenv("HF_DATASETS_CACHE", str(folder / "cache"))
    return folder


@pytest.fixture(scope="module")
def monkeypatch_module():
    with pytest.MonkeyPatch.context() as m:
        yield m


def evaluate(task_dir, model, model_args):
    from lm_eval.tasks import TaskManager
    out = lm_eval.simple_evaluate(model=model, model_args=model_args, tasks=["fastllm_quiz"],
                                  task_manager=TaskManager(include_path=str(task_dir), include_defaults=False),
                                  log_samples=True,
                                  bootstrap_iters=0, random_seed=0)
    samples = sorted(out["samples"]["fastllm_quiz"], key=lambda s: s["doc_id"])
    return out["results"]["fastllm_quiz"]["acc,none"], samples


def log_likelihood(model, context: str, continuation: str) -> float:
    """The continuation's log-likelihood after the context, from Model.logits
    in float64, the text split into tokens as lm_eval splits it (the
    context's trailing spaces go with the continuation)."""
    spaces = len(context) - len(context.rstrip())
    context, continuation = context[:len(context) - spaces], context[len(context) - spaces:] + continuation
    whole = model.tokenizer.encode(context + continuation, add_special_tokens=False)
    n = len(model.tokenizer.encode(context, add_special_tokens=False))
    rows = torch.from_numpy(model.logits(whole)[n - 1:-1]).double()
    return float(torch.log_softmax(rows, dim=-1)[torch.arange(len(rows)), whole[n:]].sum())


@pytest.mark.slow
def test_local_completions_scores_each_item_as_model_logits(task_dir, smollm2_dir):
    model = Model.from_pretrained(smollm2_dir, n_ctx=512, threads=2)
    with running(model, parallel=4) as (url, _):
        acc, samples = evaluate(task_dir, "local-completions", {
            "model": "smollm2", "base_url": f"{url}/completions", "tokenizer": str(smollm2_dir),
            "tokenizer_backend": "huggingface", "batch_size": 8, "max_retries": 1})
    assert len(samples) == len(ITEMS)
    for sample in samples:
        for (context, continuation), resp in zip(sample["arguments"], sample["resps"]):
            ll, greedy = resp[0]
            assert ll == pytest.approx(log_likelihood(model, context, continuation), rel=1e-9, abs=1e-9)
    # the right answer is the likeliest for most of these easy questions
    assert acc >= 0.5
    hf_acc, hf_samples = evaluate(task_dir, "hf", {"pretrained": str(smollm2_dir), "dtype": "float32",
                                                   "device": "cpu", "batch_size": 8})
    assert hf_acc == acc
    ours = np.array([[r[0][0] for r in s["resps"]] for s in samples])
    theirs = np.array([[r[0][0] for r in s["resps"]] for s in hf_samples])
    assert np.abs(ours - theirs).max() < 1e-3   # float32 transformers against fastllm's f32 run
