#!/usr/bin/env python3
"""Writes the reference data of the cl100k_base and Llama 3 pre-tokenizers
(tests/unit/test_io_pretokenizers.cpp) into this folder:

- pretokenizers_expected.json: {"gpt2" | "gpt2_possessive" | "cl100k" | "llama3" | "o200k": [{"text", "pieces"}]}: the
  pieces Python's `regex` module finds in each text with each pattern of io::pretokenizer_patterns
  (PATTERNS below, copied from tiktoken 0.14's tiktoken_ext/openai_public.py and Llama 3's
  tokenizer.json).
- tiktoken/cl100k_base.tiktoken, tiktoken/o200k_base.tiktoken, tiktoken/r50k_base.tiktoken:
  vocab.json's 556 ranks (make_reference.py) as a tiktoken file (base64 bytes and rank, a line
  each), under the names that tell loom the encoding's pattern and special tokens.
- cl100k_expected.json, o200k_expected.json: [{"text", "ids"}]: the texts encoded by OpenAI's
  tiktoken with cl100k_base's (o200k_base's) pattern and special tokens and those ranks, the
  end-of-text token allowed.
- llama3_like.json, o200k_like.json: byte-level BPEs in Hugging Face's tokenizer.json format,
  trained here by `tokenizers` on make_reference.py's CORPUS (600 tokens, <|begin_of_text|> and
  <|end_of_text|> first) with a Split by Llama 3's (o200k_base's) pattern before a ByteLevel that
  does not split, as Llama 3's tokenizer.json has it; split_expected.json: {file: [{"text",
  "ids"}]}, the texts encoded by `tokenizers` from each. (Not cl100k_base's pattern: `tokenizers` runs Oniguruma, which reads its
  \p{N}{1,3}+ as (\p{N}{1,3})+ and so keeps digit runs whole.)

The texts: make_reference.py's, texts written for these patterns (contractions in any case and
with the long s, digit runs, punctuation before line ends, white space at the end of a text with
and without line ends, a character before a letter run), and random strings of assigned code
points. Dev-time only (pip install regex tiktoken tokenizers); the outputs are checked in. Run
from this folder."""
import base64
import json
import os
import random
import unicodedata

import regex
import tiktoken
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

from make_reference import CORPUS, TEXTS

PATTERNS = {
    "gpt2": r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+""",
    "gpt2_possessive": r"""'(?:[sdmt]|ll|ve|re)| ?\p{L}++| ?\p{N}++| ?[^\s\p{L}\p{N}]++|\s++$|\s+(?!\S)|\s""",
    "cl100k": r"""'(?i:[sdmt]|ll|ve|re)|[^\r\n\p{L}\p{N}]?+\p{L}++|\p{N}{1,3}+| ?[^\s\p{L}\p{N}]++[\r\n]*+|\s++$|\s*[\r\n]|\s+(?!\S)|\s""",
    "llama3": r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+""",
    "o200k": "|".join([
        r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
        r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
        r"""\p{N}{1,3}""",
        r""" ?[^\s\p{L}\p{N}]+[\r\n/]*""",
        r"""\s*[\r\n]+""",
        r"""\s+(?!\S)""",
        r"""\s+""",
    ]),
}

CL100K_TEXTS = [
    "It'S THEY'RE We'Ve I'M you'LL He'D 'ſ 'Ll'rE ''s ?'s 'x '",
    "don't DON'T rock'n'roll o'clock 'tis '",
    "1 12 123 1234 12345 1234567890 3.14159 1,000,000 ١٢٣٤٥ ½¾ Ⅻ ②③④⑤",
    "a1b2 x123y 2026-11-28 0x1F9A",
    "end.\nnext;\r\nthen!!\n\n\nmore?\r\r\nlast\n",
    "\"quoted\" (paren) [bracket] {brace} <angle> «guillemets» —dash …ellipsis",
    "\thello\t\tworld  two   three\u00a0nbsp\u3000ideographic\u2003em",
    "\rcarriage\nline\u0085next\u2028sep",
    "trailing spaces   ",
    "trailing line end\n",
    "trailing mixed \n \t ",
    "trailing \n\n",
    "   \n  \n   ",
    "\n",
    " ",
    "x \n y",
    "$100 and 50% off: #hashtag @user e-mail@example.com https://example.com/a/b?c=d",
    "Ελληνικά'Σ кириллица'S עברית العربية",
    "日本語のテキスト、中文，한국어",
    "emoji 👋🏽🙂 and a joined 👨‍👩‍👧 family 🇩🇪",
    "combining: e\u0301 a\u0308 n\u0303, and marks alone \u0301\u0308",
    "camelCase loomWeavesThreads HTTPServer getHTTPResponse XMLHttpRequest iPhone McDonald's",
    "HELLOworld ABCdefGHI I'M DON'T they'RE You'Ve 'S 's",
    "\u01c5ungla \u01c8ubljana \u02b0aspirated \u02b0A Aʰ ʰ\u0301 \u3042\u3044U\u3046 \u0915\u093f\u0924\u093e\u092c",
    "path/to/file.txt\n/usr/bin /// a/b ./x\n\n/y ?/\r\n/",
    "\u0301abc \u0301ABC x\u0301Y \u0301 A\u0301\u0302b É́e",
]


def random_texts(count, seed=20261128, extra=" \n\r\t'sS1.,\u00a0"):
    """`count` strings of 120 characters: half code points below U+20000 that Unicode 14 (Python's
    unicodedata) assigns, so that loom's Unicode 16 tables and the `regex` module agree on them;
    half drawn from `extra`."""
    draw = random.Random(seed)
    pool = [c for c in range(0x20000)
            if not 0xD800 <= c <= 0xDFFF and unicodedata.category(chr(c)) not in ("Cn", "Co", "Cs")]
    return ["".join(chr(draw.choice(pool)) if draw.random() < 0.5 else draw.choice(extra) for _ in range(120))
            for _ in range(count)]


ALL_TEXTS = TEXTS + CL100K_TEXTS + random_texts(40) + [CORPUS]
SPECIAL = ["<|begin_of_text|>", "<|end_of_text|>"]


def dump_list(items):
    return "[\n" + ",\n".join(json.dumps(e, ensure_ascii=False) for e in items) + "\n]"


def train(pattern):
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(pattern), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=600, special_tokens=SPECIAL, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator([CORPUS], trainer)
    return tok


def main():
    pieces = {name: [{"text": t, "pieces": regex.findall(p, t)} for t in ALL_TEXTS] for name, p in PATTERNS.items()}
    for name, items in pieces.items():
        for item in items:
            assert "".join(item["pieces"]) == item["text"], (name, item["text"])
    with open("pretokenizers_expected.json", "w", encoding="utf-8") as f:
        f.write("{\n" + ",\n".join(json.dumps(n) + ": " + dump_list(items) for n, items in pieces.items()) + "\n}\n")

    with open("vocab.json", encoding="utf-8") as f:
        vocab = json.load(f)
    table = {}  # GPT-2's byte-to-character table, inverted
    prints = list(range(0x21, 0x7F)) + list(range(0xA1, 0xAD)) + list(range(0xAE, 0x100))
    extra = 0
    for b in range(256):
        if b in prints:
            table[chr(b)] = b
        else:
            table[chr(0x100 + extra)] = b
            extra += 1
    vocab.pop("<|endoftext|>")
    ranks = {bytes(table[c] for c in token): i for token, i in vocab.items()}
    os.makedirs("tiktoken", exist_ok=True)
    for name in ("cl100k_base", "o200k_base", "r50k_base"):
        with open(f"tiktoken/{name}.tiktoken", "w") as f:
            f.writelines(f"{base64.b64encode(token).decode()} {rank}\n" for token, rank in ranks.items())
    cl100k_special = {"<|endoftext|>": 100257, "<|fim_prefix|>": 100258, "<|fim_middle|>": 100259,
                      "<|fim_suffix|>": 100260, "<|endofprompt|>": 100276}
    o200k_special = {"<|endoftext|>": 199999, "<|endofprompt|>": 200018}
    for name, special in (("cl100k", cl100k_special), ("o200k", o200k_special)):
        enc = tiktoken.Encoding(f"loom-{name}-test", pat_str=PATTERNS[name], mergeable_ranks=ranks,
                                special_tokens=special)
        ids = [{"text": t, "ids": enc.encode(t, allowed_special={"<|endoftext|>"})} for t in ALL_TEXTS]
        with open(f"{name}_expected.json", "w", encoding="utf-8") as f:
            f.write(dump_list(ids) + "\n")
        print(name, sum(len(e["ids"]) for e in ids), "ids")

    expected = {}
    for name, pattern in (("llama3_like.json", PATTERNS["llama3"]), ("o200k_like.json", PATTERNS["o200k"])):
        tok = train(pattern)
        text = json.dumps(json.loads(tok.to_str()), ensure_ascii=False, indent=1) + "\n"
        with open(name, "w", encoding="utf-8") as f:
            f.write(text)
        tok = Tokenizer.from_str(text)
        texts = ALL_TEXTS + ["<|begin_of_text|>The loom<|end_of_text|>\n<|begin_of_text|> weaves  \n"]
        expected[name] = [{"text": t, "ids": tok.encode(t, add_special_tokens=False).ids} for t in texts]
    with open("split_expected.json", "w", encoding="utf-8") as f:
        f.write("{\n" + ",\n".join(json.dumps(n) + ": " + dump_list(items) for n, items in expected.items()) + "\n}\n")
    print({n: len(items) for n, items in pieces.items()},
          {n: sum(len(e["ids"]) for e in items) for n, items in expected.items()})


if __name__ == "__main__":
    main()
