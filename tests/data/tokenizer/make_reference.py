#!/usr/bin/env python3
"""Writes the reference data of tests/unit/test_io_token_encoder.cpp into this folder:

- vocab.json: a small byte-level BPE vocabulary in Hugging Face's format (GPT-2's byte-to-character
  table): the 256 bytes in GPT-2's order (the bytes that print, then the rest), then 300 merges
  learned here from CORPUS below, then <|endoftext|>. Ids are merge ranks, as in GPT-2.
- bytes_vocab.json: the first 256 of those tokens, the bytes alone (no merges, no end-of-text), for
  gpt2_train's 256-token demo model (examples/CMakeLists.txt).
- expected.json: [{"text", "ids"}]: texts encoded by OpenAI's tiktoken with GPT-2's pattern and
  these ranks, the end-of-text token allowed. tiktoken is the independent reference.

Dev-time only (pip install tiktoken regex); the outputs are checked in. Run from this folder."""
import collections
import json

import regex
import tiktoken

PATTERN = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
MERGES = 300

# Written for this test: English with contractions and numbers, code, and other scripts, so that
# merges form inside letters, digits, punctuation, white space and multi-byte characters.
CORPUS = """
The loom weaves threads into cloth; the trainer weaves ranks into one model. It's the same model
whether it runs on one rank or on eight: that's what the tests check, and they're strict about it.
We've trained the tiny model for 1000 steps, then 2000, then 4096 steps at a learning rate of 3e-4.
    for (int step = 0; step < 1000; ++step) { loss = trainer.step(batch); }
    if (loss > 10.0) throw std::runtime_error("the loss diverged");
Naïve café owners in Zürich say "grüezi" and serve crème brûlée — très bien, n'est-ce pas?
東京の天気は晴れです。東京タワーから富士山が見えます。 中文文本在这里，机器学习很有趣。
Ελληνικά γράμματα και κυριλлица: привет, мир! Привет ещё раз. 한국어 텍스트도 조금 있습니다.
The numbers ١٢٣ and ४५६ are digits too, as are ½ and Ⅻ in their own way.
    the the the the  the   the    the\tthe\t\tthe\n\nthe\n\n\n
I'll say it again: you'd better write tests, and we'll run them; they'd fail loudly if it's wrong.
"""

TEXTS = [
    "The loom weaves threads into cloth.",
    "It's they're we've I'm you'll he'd 'S 'twas rock'n'roll ''s ?'s",
    "a  b   c\t\td \n\n e\r\nf   ",
    "   leading and trailing white space   ",
    "Naïve café — “quoted” ‘single’ … ½ ² ③ Ⅻ",
    "東京の天気は晴れです。中文文本，한국어 텍스트",
    "Ελληνικά, кириллица, עברית, العربية ١٢٣ ٤٥",
    "emoji 👋🏽🙂 and a joined 👨‍👩‍👧 family",
    "numbers 3.14159 1,000,000 0x1F 2026-11-27 १२३",
    "    for (int step = 0; step < 1000; ++step) { x[i] *= 2; }  // comment",
    "no\u00a0break\u2003em\u3000ideographic\u2028line\u2029para\u0085next",
    "<|endoftext|>The end<|endoftext|><|endoftext|>",
    "the the the  the   the\tthe\n\nthe",
    "theeeeeeeeeeeeeeeeeeeeeeeeeeeeeeeee " + "ab" * 40,
    " " * 40 + "\n" * 10 + "x",
    "",
]


def bytes_to_unicode():
    prints = list(range(0x21, 0x7F)) + list(range(0xA1, 0xAD)) + list(range(0xAE, 0x100))
    table, extra = {}, 0
    for b in range(256):
        if b in prints:
            table[b] = chr(b)
        else:
            table[b] = chr(0x100 + extra)
            extra += 1
    return table


def train(corpus, merges):
    """Plain BPE: count adjacent pairs inside the pattern's pieces, merge the most frequent (ties:
    the smaller pair of byte strings), repeat."""
    words = collections.Counter(tuple(bytes([b]) for b in piece.encode()) for piece in regex.findall(PATTERN, corpus))
    learned = []
    for _ in range(merges):
        pairs = collections.Counter()
        for word, count in words.items():
            for a, b in zip(word, word[1:]):
                pairs[(a, b)] += count
        if not pairs:
            break
        best = min(pairs, key=lambda p: (-pairs[p], p))
        learned.append(best[0] + best[1])
        merged = collections.Counter()
        for word, count in words.items():
            out, i = [], 0
            while i < len(word):
                if i + 1 < len(word) and (word[i], word[i + 1]) == best:
                    out.append(word[i] + word[i + 1])
                    i += 2
                else:
                    out.append(word[i])
                    i += 1
            merged[tuple(out)] += count
        words = merged
    return learned


def main():
    table = bytes_to_unicode()
    order = [b for b in range(256) if table[b] == chr(b)] + [b for b in range(256) if table[b] != chr(b)]
    tokens = [bytes([b]) for b in order]
    for t in train(CORPUS, MERGES):
        if t not in tokens:
            tokens.append(t)
    ranks = {t: i for i, t in enumerate(tokens)}
    end = len(tokens)
    vocab = {"".join(table[b] for b in t): i for t, i in ranks.items()}
    vocab["<|endoftext|>"] = end
    for name, entries in (("vocab.json", vocab), ("bytes_vocab.json", {k: v for k, v in vocab.items() if v < 256})):
        with open(name, "w", encoding="utf-8") as f:
            json.dump(entries, f, ensure_ascii=False, indent=0)
            f.write("\n")
    enc = tiktoken.Encoding("loom-test", pat_str=PATTERN, mergeable_ranks=ranks, special_tokens={"<|endoftext|>": end})
    expected = [{"text": t, "ids": enc.encode(t, allowed_special={"<|endoftext|>"})} for t in TEXTS + [CORPUS]]
    with open("expected.json", "w", encoding="utf-8") as f:
        f.write("[\n" + ",\n".join(json.dumps(e, ensure_ascii=False) for e in expected) + "\n]\n")
    print(f"{len(vocab)} tokens ({len(tokens) - 256} merges); {len(expected)} texts,",
          sum(len(e["ids"]) for e in expected), "ids")


if __name__ == "__main__":
    main()
