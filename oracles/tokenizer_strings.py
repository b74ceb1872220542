"""Strings for checking tokenizers against each other.

Three sources, all deterministic:

* EDGE_CASES: hand-picked strings that stress pre-tokenizer regexes,
  normalizers and added-token matching (whitespace runs, CR/LF, Unicode
  spaces, zero-width and combining characters, NFC-sensitive pairs, math
  alphanumerics, contractions in every case, digit runs, emoji sequences).
* prose_and_code(): multilingual prose and chunks of Python source files from
  the standard library on this machine.
* random_strings(): seeded random strings over a mixed-script pool.

corpus() combines them; mixed_text() makes one long text for benchmarks.

Characters are taken from Unicode 14 or older: newer code points are
classified differently by the `regex` package and by the Rust crates in
`tokenizers`, which would turn a Unicode-version difference into a spurious
mismatch.
"""
from __future__ import annotations

import os
import random
import sysconfig

SPECIAL_MARKERS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>",
                   "<tool_call>", "</tool_call>")

_CONTRACTIONS = ["'s", "'t", "'re", "'ve", "'m", "'ll", "'d", "'S", "'T", "'RE", "'VE", "'M", "'LL",
                 "'D", "'Re", "'rE", "'Ve", "'Ll", "'lL", "'vE", "\u2019s", "'\u017f", "'\u00df",
                 "'x", "''", "'"]

EDGE_CASES = [
    "", " ", "  ", "   ", "\t", "\n", "\r\n", "\n\n", "\r", "\r\r\n", " \n ", "\t\t\tx",
    "Hello world", " Hello world", "  Hello  world  ", "Hello\tworld", "Hello\r\nworld",
    "a  b   c    d", "word    \n   next", "trailing spaces   ", "   leading spaces",
    "line one\nline two\r\nline three\rline four", "\n\n\nmany\n\n\n\nblank\n\n",
    "  \t \n \r\n  mixed whitespace before words",
    "tab\tseparated\tvalues\t1\t2\t3", "x\u00a0y", "\u00a0\u00a0nbsp lead", "nbsp\u00a0\u00a0\u00a0run",
    "em\u2003space", "thin\u2009space", "ideographic\u3000space", "narrow\u202fnbsp", "math\u205fspace",
    "ogham\u1680space", "line\u2028separator", "para\u2029separator", "nel\x85char", "vt\x0bff\x0c",
    "file\x1cgroup\x1drecord\x1eunit\x1f", "zero\u200bwidth", "zw\u200cnj", "zw\u200dj", "bom\ufeffmid",
    "soft\u00adhyphen", "word\u2060joiner", "\u200b\u200b\u200b",
    "cafe\u0301", "caf\u00e9", "e\u0301", "\u00e9", "A\u030a", "\u00c5", "\u212b", "\u1e9b\u0323",
    "n\u0303o", "\u0915\u093c", "\u0958", "\uac00", "\u1100\u1161", "\u2126", "\ufb01",
    "combining \u0301 alone", "\u0301\u0302\u0303", "a\u0308\u0304\u0301", "Z\u0351\u0345\u0320\u0322a\u0364l\u0335g\u0328o",
    "\U0001d5bb\U0001d5ba\U0001d5c5\U0001d5c5\U0001d5c8", "\U0001d400\U0001d401 \U0001d7ce\U0001d7cf",
    "\U0001d56c\U0001d586\U0001d59a", "\u2460\u2461 \u00b2\u00b3 \u2153 \u216b",
    "it's", "It's", "IT'S", "we're", "WE'RE", "We'Re", "I've", "I'VE", "I'm", "I'M", "you'll",
    "YOU'LL", "You'Ll", "he'd", "HE'D", "don't", "DON'T", "Don'T", "'s", "'S", "'ll", "'LL",
    "rock 'n' roll", "the '90s", "O'Neil's", "'tis", "'''", "' s", "'\u017f", "'\u00df", "'\ufb06",
    "'\u212a", "l'homme", "dell'arte", "\u2019s curly", "it\u2019s",
    "0", "1", "12", "123", "1234", "12345", "1234567890", "3.14159", "1,000,000", "1e-10", "0x1F",
    "2024-11-29", "v1.2.3", "$19.99", "50%", "\u0661\u0662\u0663", "\u096a\u096b", "\uff11\uff12\uff13",
    "a1b2c3", "x2", "2x", " 42", "  42", "\t42", "-42", "+42", "(42)", "[1, 2, 3]",
    "\U0001f600", "\U0001f44d\U0001f3fd", "\U0001f468\u200d\U0001f469\u200d\U0001f467\u200d\U0001f466",
    "\U0001f3f3\ufe0f\u200d\U0001f308", "\U0001f1fa\U0001f1f8\U0001f1ef\U0001f1f5", "\U0001f1e9\U0001f1ea flag",
    "1\ufe0f\u20e3", "\u2764\ufe0f", "\u2764", "\U0001f9d1\U0001f3fe\u200d\U0001f4bb", "emoji\U0001f600run\U0001f600",
    "\U0001f600 \U0001f600  \U0001f600", "\U0001f3f4\U000e0067\U000e0062\U000e0073\U000e0063\U000e0074\U000e007f",
    "\u65e5\u672c\u8a9e\u306e\u30c6\u30ad\u30b9\u30c8", "\u4e2d\u6587\u5b57\u7b26", "\u4eba\u529b\u8d44\u6e90",
    "\ud55c\uad6d\uc5b4 \ud14d\uc2a4\ud2b8", "\u0420\u0443\u0441\u0441\u043a\u0438\u0439 \u0442\u0435\u043a\u0441\u0442",
    " \u043c\u0443\u0441\u043e\u0440", "\u0628\u0633\u0628\u0628", "\u0627\u0644\u0639\u0631\u0628\u064a\u0629",
    "\u05e2\u05d1\u05e8\u05d9\u05ea", "\u0939\u093f\u0928\u094d\u0926\u0940", "\u0e20\u0e32\u0e29\u0e32\u0e44\u0e17\u0e22",
    "\u0395\u03bb\u03bb\u03b7\u03bd\u03b9\u03ba\u03ac", "\u03a3\u039f\u03a6\u039f\u03a3", "Ti\u1ebfng Vi\u1ec7t",
    "T\u00fcrk\u00e7e \u0130stanbul", "stra\u00dfe STRASSE", "\u0130i\u0131I",
    "<|endoftext|>", "<|im_start|>user\nhi<|im_end|>", "a<|im_end|>b", " <|im_end|> ", "<|im_end|><|im_end|>",
    "<|im_start|><|im_start|>", "<|im_end", "|im_end|>", "<|im_end|>\n", "text<think>\nreason\n</think>\n\nanswer",
    "<tool_call>{\"a\": 1}</tool_call>", "<<|im_end|>>", "<|endoftext|>Hello<|endoftext|>",
    "x = {'key': [1, 2, 3]}  # comment", "def f(a, b):\n    return a + b\n", "if (x) {\n\treturn y;\n}",
    "SELECT * FROM t WHERE id = 1;", "<div class=\"a\">text</div>", "https://example.com/path?q=1&r=2",
    "user@example.com", "C:\\Windows\\System32", "~/.config/app.json", "#!/usr/bin/env python3",
    "!!!", "???", "...", "\u2026", "--", "\u2014\u2014", "***bold***", "____", "====", "####",
    "a" * 200, " " * 100, "\n" * 50, "ab" * 100, "\u00e9" * 60, "\U0001f600" * 30, "1" * 90, "-" * 120,
]


def _r(a, b):
    return "".join(chr(c) for c in range(a, b + 1))


_POOLS = {
    "ascii_lower": "abcdefghijklmnopqrstuvwxyz",
    "ascii_upper": "ABCDEFGHIJKLMNOPQRSTUVWXYZ",
    "digits": "0123456789",
    "punct": "!\"#$%&'()*+,-./:;<=>?@[\\]^_`{|}~",
    "latin1": _r(0xC0, 0xFF) + _r(0x100, 0x17F),
    "cyrillic": _r(0x410, 0x44F) + "\u0401\u0451",
    "greek": _r(0x391, 0x3A9).replace("\u03a2", "") + _r(0x3B1, 0x3C9),
    "arabic": _r(0x621, 0x64A) + _r(0x660, 0x669),
    "hebrew": _r(0x5D0, 0x5EA),
    "devanagari": _r(0x905, 0x939) + _r(0x93E, 0x94D) + _r(0x966, 0x96F),
    "thai": _r(0xE01, 0xE30) + _r(0xE31, 0xE3A) + _r(0xE40, 0xE4E),
    "cjk": _r(0x4E00, 0x4E80) + "\u7684\u662f\u4e0d\u4e86\u4eba\u6211\u5728\u6709\u4ed6\u8fd9\u4e2d\u5927",
    "kana": _r(0x3041, 0x3096) + _r(0x30A1, 0x30FA),
    "hangul": _r(0xAC00, 0xAC40) + "\ud55c\uad6d\uc5b4",
    "combining": _r(0x300, 0x36F),
    "spaces": " \u00a0\u2002\u2003\u2009\u202f\u3000\u200b\u200d\u2060\ufeff",
    "math": "\U0001d5bb\U0001d5ba\U0001d400\U0001d7ce\u221e\u2211\u221a\u2248\u2260\u00b1\u00d7\u00f7",
    "symbols": "\u00a9\u00ae\u2122\u20ac\u00a3\u00a5\u00a7\u00b6\u2022\u2020\u2021\u2190\u2192\u2191\u2193\u25cf\u2605",
}

_EMOJI = ["\U0001f600", "\U0001f602", "\U0001f44d", "\U0001f44d\U0001f3fd", "\u2764\ufe0f", "\U0001f525",
          "\U0001f468\u200d\U0001f469\u200d\U0001f467", "\U0001f3f3\ufe0f\u200d\U0001f308", "\U0001f1fa\U0001f1f8",
          "\U0001f1ef\U0001f1f5", "\U0001f1e9\U0001f1ea", "1\ufe0f\u20e3", "\U0001f9d1\u200d\U0001f4bb", "\u2728",
          "\U0001f680", "\U0001f914"]

_WORDS = ["the", "of", "and", "to", "in", "is", "you", "that", "it", "he", "was", "for", "on", "are", "with",
          "they", "be", "at", "one", "have", "this", "from", "or", "had", "by", "word", "but", "what", "some",
          "we", "can", "out", "other", "were", "all", "there", "when", "up", "use", "your", "how", "said",
          "an", "each", "she", "which", "do", "their", "time", "if", "will", "way", "about", "many", "then",
          "Hello", "World", "Python", "Tokenizer", "GPU", "CPU", "HTTP", "JSON", "camelCase", "snake_case",
          "kebab-case", "MixedCASE", "naïve", "café", "résumé", "Straße", "Ελλάδα", "Москва", "東京", "北京",
          "서울", "القاهرة", "ירושלים", "मुंबई", "กรุงเทพ", "Hà Nội", "İstanbul", "Kraków", "São Paulo"]

_WS = [" ", " ", " ", "  ", "   ", "\t", "\n", "\r\n", "\n\n", " \n", "\t\t", "    ", "\u00a0", "\u3000", "\r"]


def _atom(rng):
    k = rng.random()
    if k < 0.22:
        return rng.choice(_WORDS)
    if k < 0.40:
        return rng.choice(_WS)
    if k < 0.46:
        return "".join(rng.choice(_POOLS["digits"]) for _ in range(rng.randint(1, 7)))
    if k < 0.52:
        return rng.choice(_CONTRACTIONS)
    if k < 0.57:
        return rng.choice(_EMOJI)
    if k < 0.62:
        return "".join(rng.choice(_POOLS["punct"]) for _ in range(rng.randint(1, 4)))
    if k < 0.66:
        # a letter followed by combining marks
        return rng.choice(_POOLS["ascii_lower"] + _POOLS["latin1"]) + "".join(
            rng.choice(_POOLS["combining"]) for _ in range(rng.randint(1, 3)))
    pool = rng.choice(list(_POOLS))
    return "".join(rng.choice(_POOLS[pool]) for _ in range(rng.randint(1, 8)))


def random_strings(n, seed=0, max_atoms=24, specials=()):
    """n seeded random strings built from mixed-script atoms.  When specials
    is given, about one string in eight also contains one of them."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        parts = [_atom(rng) for _ in range(rng.randint(1, max_atoms))]
        if specials and rng.random() < 0.125:
            parts.insert(rng.randint(0, len(parts)), rng.choice(specials))
        out.append("".join(parts))
    return out


PROSE = [
    "The quick brown fox jumps over the lazy dog. It wasn't the first time; the dog didn't mind.",
    "In 2024, roughly 8.1 billion people lived on Earth — up from 2.5 billion in 1950.",
    "Tokenizers split text into pieces: words, sub-words, bytes. Getting it exactly right matters!",
    "Der schnelle braune Fuchs springt über den faulen Hund. Größere Straßen heißen Autobahnen.",
    "Le cœur a ses raisons que la raison ne connaît point. « Où est la bibliothèque ? »",
    "¿Dónde está la estación? ¡Qué día tan bonito! El niño comió piña y jalapeños.",
    "Съешь же ещё этих мягких французских булок, да выпей чаю. Москва является столицей России.",
    "Ξεσκεπάζω την ψυχοφθόρα βδελυγμία. Η Αθήνα είναι η πρωτεύουσα της Ελλάδας.",
    "我能吞下玻璃而不伤身体。北京是中华人民共和国的首都，人口超过两千万。",
    "私はガラスを食べられます。それは私を傷つけません。東京タワーは高さ333メートルです。",
    "나는 유리를 먹을 수 있어요. 그래도 아프지 않아요. 서울은 대한민국의 수도입니다.",
    "أنا قادر على أكل الزجاج و هذا لا يؤلمني. القاهرة هي عاصمة مصر. تأخرت بسبب المطر.",
    "Saya bisa makan kaca. Selanjutnya, kami akan membahas langkah berikutnya.",
    "我去过加拿大和新加坡，那里的足球俱乐部很有名。",
    "אני יכול לאכול זכוכית וזה לא מזיק לי. ירושלים היא עיר עתיקה.",
    "मैं काँच खा सकता हूँ और मुझे उससे कोई चोट नहीं पहुंचती. नई दिल्ली भारत की राजधानी है।",
    "ฉันกินกระจกได้ แต่มันไม่ทำให้ฉันเจ็บ กรุงเทพมหานครเป็นเมืองหลวงของประเทศไทย",
    "Tôi có thể ăn thủy tinh mà không hại gì. Hà Nội là thủ đô của Việt Nam.",
    "Cam yiyebilirim, bana zararı dokunmaz. İstanbul'un nüfusu 15 milyondan fazladır.",
    "Mogę jeść szkło i mi nie szkodzi. Zażółć gęślą jaźń — każdy Polak to zna.",
    "Math: ∀x∈ℝ, x² ≥ 0; ∑ᵢ aᵢ = 1; ∫₀¹ f(x) dx ≈ 0.5; 𝔼[X] = μ ± σ.",
    "Emoji chat: 😀 that's great!! 👍🏽👍🏽 see you at 8pm 🎉🇺🇸 — family: 👨‍👩‍👧‍👦",
    "Mixed 中文 and English in one 句子, with numbers 12345 and symbols €100.",
    "    Indented text with trailing spaces   \n\tand a tab-indented line\r\n",
]


def _stdlib_sources():
    lib = sysconfig.get_paths()["stdlib"]
    names = ["textwrap.py", "json/encoder.py", "string.py", "heapq.py", "bisect.py", "colorsys.py",
             "fnmatch.py", "shlex.py", "html/parser.py", "calendar.py"]
    out = []
    for name in names:
        path = os.path.join(lib, name)
        try:
            with open(path, encoding="utf-8") as f:
                out.append(f.read())
        except OSError:
            continue
    return out


CODE = [
    "#include <stdio.h>\n\nint main(void) {\n\tprintf(\"Hello, %s!\\n\", \"world\");\n\treturn 0;\n}\n",
    "fn main() {\n    let v: Vec<u32> = (0..10).map(|x| x * x).collect();\n    println!(\"{:?}\", v);\n}\n",
    "const add = (a, b) => a + b;\nconsole.log(`sum: ${add(2, 3)}`); // 5\n",
    "SELECT name, COUNT(*) AS n\nFROM users\nWHERE created_at >= '2024-01-01'\nGROUP BY name;\n",
    "<!DOCTYPE html>\n<html lang=\"en\">\n  <body><p class=\"x\">Hi &amp; bye</p></body>\n</html>\n",
    "{\"name\": \"fastllm\", \"version\": \"0.1.0\", \"tags\": [\"llm\", \"cpu\"], \"ok\": true}\n",
    "#!/bin/bash\nfor f in *.txt; do\n  wc -l \"$f\" | awk '{print $1}'\ndone\n",
]


def prose_and_code(max_chunk_lines=12):
    """Prose paragraphs and source-code chunks (stdlib files cut into line groups)."""
    out = list(PROSE) + list(CODE)
    for src in _stdlib_sources():
        lines = src.splitlines(keepends=True)
        for i in range(0, len(lines), max_chunk_lines):
            out.append("".join(lines[i:i + max_chunk_lines]))
    return out


def corpus(n=20000, seed=0, specials=()):
    """At least n strings: edge cases, prose and code, then random strings.

    Without specials, strings containing SPECIAL_MARKERS are left out (for
    references such as tiktoken that do not know a file's added tokens)."""
    fixed = list(EDGE_CASES) + prose_and_code()
    if not specials:
        fixed = [s for s in fixed if not any(m in s for m in SPECIAL_MARKERS)]
    rest = max(0, n - len(fixed))
    return fixed + random_strings(rest, seed=seed, specials=tuple(specials))


def mixed_text(size=1_000_000, seed=0):
    """One text of about `size` UTF-8 bytes mixing prose, code and random strings."""
    rng = random.Random(seed)
    blocks = prose_and_code()
    parts = []
    total = 0
    rand = random_strings(4000, seed=seed)
    while total < size:
        k = rng.random()
        if k < 0.5:
            s = rng.choice(blocks)
        else:
            s = " ".join(rng.choice(rand) for _ in range(8))
        s += rng.choice(["\n", "\n\n", " "])
        parts.append(s)
        total += len(s.encode("utf-8"))
    text = "".join(parts)
    b = text.encode("utf-8")[:size]
    return b.decode("utf-8", "ignore")
