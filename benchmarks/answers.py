"""How the default model answers short questions, greedy, on its own Q4_1
file: fastllm with int8 activations (the default), with f32 activations,
with a presence penalty, and llama.cpp's llama-server on the same file,
every engine given the same prompt token ids (the chat template rendered by
fastllm). For each: the replies that hold the expected answer, the replies
that run to the 256-token limit (a loop), and the replies identical to
fastllm's default one, token for token; then, for the first question, the
two likeliest first tokens under each kind of activations.

    python benchmarks/answers.py --llama-server /path/to/llama-server [--json out.json]

Greedy decoding, at most 256 tokens, the end-of-turn token ends a reply;
one thread each, one engine at a time. llama-server runs with --no-repack
(no extra weight layouts such as AMX's, whose kernels fault where the
process is not granted AMX tile state), so it computes Q4_1 as its plain
CPU path does.
"""
import argparse
import json
import subprocess
import time
import urllib.request

import numpy as np

# (question, any of these in the reply counts as the answer; case-insensitive)
QUESTIONS = [
    ("What is the capital of France?", ["Paris"]), ("What is the capital of Italy?", ["Rome"]),
    ("What is the capital of Germany?", ["Berlin"]), ("What is the capital of Spain?", ["Madrid"]),
    ("What is the capital of Japan?", ["Tokyo"]), ("What is the capital of England?", ["London"]),
    ("What is the capital of Canada?", ["Ottawa"]), ("What is the capital of Egypt?", ["Cairo"]),
    ("What is 2+2?", ["4", "four"]), ("What is 3+5?", ["8", "eight"]), ("What is 10 minus 3?", ["7", "seven"]),
    ("What is 6 times 7?", ["42", "forty-two", "forty two"]), ("How many days are in a week?", ["7", "seven"]),
    ("How many legs does a spider have?", ["8", "eight"]), ("How many continents are there?", ["7", "seven"]),
    ("What color is the sky on a clear day?", ["blue"]), ("What color is grass?", ["green"]),
    ("What is the largest planet in the solar system?", ["Jupiter"]),
    ("Which planet is known as the Red Planet?", ["Mars"]),
    ("What is the boiling point of water in Celsius?", ["100"]),
    ("What is the freezing point of water in Celsius?", ["0", "zero"]),
    ("Who wrote Romeo and Juliet?", ["Shakespeare"]), ("What is the chemical symbol for water?", ["H2O", "H₂O"]),
    ("What is the largest ocean on Earth?", ["Pacific"]), ("What language is spoken in Brazil?", ["Portuguese"]),
    ("What do bees make?", ["honey"]), ("What is the opposite of hot?", ["cold"]), ("What animal says moo?", ["cow"]),
    ("How many hours are in a day?", ["24", "twenty-four", "twenty four"]),
    ("What is the tallest mountain in the world?", ["Everest"]),
    ("What is the capital of Russia?", ["Moscow"]), ("What is the capital of China?", ["Beijing"]),
    ("What is the capital of Australia?", ["Canberra"]), ("What is the capital of Greece?", ["Athens"]),
    ("What is the capital of Portugal?", ["Lisbon"]), ("What is the capital of Ireland?", ["Dublin"]),
    ("What is 5+5?", ["10", "ten"]), ("What is 9 minus 4?", ["5", "five"]), ("What is 2 times 3?", ["6", "six"]),
    ("What is half of 10?", ["5", "five"]), ("How many months are in a year?", ["12", "twelve"]),
    ("How many sides does a triangle have?", ["3", "three"]),
    ("How many wheels does a bicycle have?", ["2", "two"]), ("What color is a banana?", ["yellow"]),
    ("What color is snow?", ["white"]), ("What color is a ripe tomato?", ["red"]),
    ("What is the closest star to Earth?", ["Sun"]),
    ("What do plants need to make food from sunlight?",
     ["photosynthesis", "sunlight", "carbon dioxide", "water", "chlorophyll"]),
    ("Who painted the Mona Lisa?", ["Leonardo", "Vinci"]),
    ("What is the capital city of the United States?", ["Washington"]),
    ("What is the main language spoken in Mexico?", ["Spanish"]),
    ("What gas do humans breathe in to live?", ["oxygen"]), ("What is the largest mammal?", ["whale"]),
    ("What is the fastest land animal?", ["cheetah"]), ("What do cows drink?", ["water"]),
    ("What is the opposite of up?", ["down"]), ("What is the first letter of the English alphabet?", ["A"]),
    ("Which season comes after winter?", ["spring"]), ("What is frozen water called?", ["ice"]),
    ("How many minutes are in an hour?", ["60", "sixty"]),
]
LIMIT = 256


def prompts(model) -> list:
    return [model.tokenizer.encode(model.tokenizer.apply_chat_template(
        [{"role": "user", "content": q}], add_generation_prompt=True), add_special_tokens=False) for q, _ in QUESTIONS]


def fastllm_replies(activations: str, **settings) -> list:
    from fastllm import Model, SamplingParams
    model = Model.from_pretrained(activations=activations, threads=1, n_ctx=1024)
    sampling = SamplingParams(temperature=0, **settings)
    return [list(model.generate_tokens(ids, LIMIT, sampling)) for ids in prompts(model)]


def llama_replies(server: str, gguf: str, ids: list, port: int = 8990) -> list:
    proc = subprocess.Popen([server, "-m", gguf, "--port", str(port), "-c", "1024", "-np", "1", "-t", "1",
                             "--no-repack", "--no-warmup"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        for _ in range(1200):
            try:
                if urllib.request.urlopen(f"http://127.0.0.1:{port}/health").status == 200:
                    break
            except OSError:
                pass
            time.sleep(0.25)
        out = []
        for prompt in ids:
            body = {"prompt": prompt, "n_predict": LIMIT, "temperature": 0, "cache_prompt": False,
                    "return_tokens": True}
            req = urllib.request.Request(f"http://127.0.0.1:{port}/completion", data=json.dumps(body).encode(),
                                         headers={"Content-Type": "application/json"})
            reply = json.loads(urllib.request.urlopen(req, timeout=3600).read())
            tokens = reply["tokens"]
            if reply.get("stop_type") == "eos" and tokens:
                tokens = tokens[:-1]   # llama-server lists the end-of-turn token it stopped at
            out.append(tokens)
        return out
    finally:
        proc.terminate()
        proc.wait()


def first_token_odds(activations: str) -> list:
    """The two likeliest first tokens of the reply to the first question."""
    from fastllm import Model
    model = Model.from_pretrained(activations=activations, threads=1, n_ctx=1024)
    logits = model.logits(prompts(model)[0])[-1].astype(np.float64)
    p = np.exp(logits - logits.max())
    p /= p.sum()
    return [(model.tokenizer.decode([int(t)]), round(float(p[t]), 4)) for t in np.argsort(-p)[:2]]


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--llama-server", default=None, help="llama-server binary (llama.cpp); none: skip it")
    parser.add_argument("--json", default=None, help="write the replies here")
    args = parser.parse_args()
    from fastllm import Model
    from fastllm.load.hub import default_gguf_path
    model = Model.from_pretrained(threads=1, n_ctx=1024)
    runs = {"fastllm int8 (default)": fastllm_replies("int8"),
            "fastllm f32 activations": fastllm_replies("f32"),
            "fastllm int8, presence_penalty 0.5": fastllm_replies("int8", presence_penalty=0.5)}
    if args.llama_server:
        runs["llama.cpp (llama-server)"] = llama_replies(args.llama_server, str(default_gguf_path()),
                                                         prompts(model))
    base = runs["fastllm int8 (default)"]
    print(f"{len(QUESTIONS)} questions, greedy, at most {LIMIT} tokens\n")
    print("| run | answered | 256-token replies | replies identical to fastllm int8's |\n|---|---|---|---|")
    texts = {}
    for name, replies in runs.items():
        texts[name] = [model.tokenizer.decode(r, skip_special_tokens=True) for r in replies]
        answered = sum(any(a.lower() in t.lower() for a in ok) for t, (_, ok) in zip(texts[name], QUESTIONS))
        loops = sum(len(r) >= LIMIT for r in replies)
        same = sum(r == b for r, b in zip(replies, base))
        print(f"| {name} | {answered} | {loops} | {same} |")
    print(f"\n{QUESTIONS[0][0]!r}: first token, int8 {first_token_odds('int8')}, f32 {first_token_odds('f32')}")
    for name in runs:
        print(f"  {name}: {texts[name][0][:100]!r}")
    if args.json:
        json.dump({"questions": QUESTIONS, "replies": runs, "texts": texts}, open(args.json, "w"))


if __name__ == "__main__":
    main()
