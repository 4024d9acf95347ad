#!/usr/bin/env python3
"""Checks loom_tokenize against OpenAI's tiktoken on GPT-2's vocabulary.

    pip install tiktoken
    scripts/compare_tiktoken.py --ranks gpt2.tiktoken --tool build/release/examples/loom_tokenize FILE...

--ranks is GPT-2's merge ranks in tiktoken's format (base64 bytes, rank; one token a line), as
tiktoken's r50k_base and openai-whisper's whisper/assets/gpt2.tiktoken hold them. The script
writes them as an llm.c tokenizer file (ids = ranks, <|endoftext|> = 50256), encodes each FILE
(and a set of built-in strings that exercise the pattern: contractions, runs of white space,
letters and digits of other scripts, invalid UTF-8) with both, and prints where they differ."""
import argparse
import base64
import struct
import sys
import tempfile
from pathlib import Path

import tiktoken

from tokenizer_check import INVALID, STRINGS, compare, random_strings

GPT2_PATTERN = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""


def read_ranks(path):
    ranks = {}
    for line in Path(path).read_text().splitlines():
        if line:
            token, rank = line.split()
            ranks[base64.b64decode(token)] = int(rank)
    return ranks


def write_llmc_tokenizer(ranks, path):
    tokens = sorted(ranks, key=ranks.get)
    assert [ranks[t] for t in tokens] == list(range(len(tokens))), "ranks must be 0..n-1"
    tokens.append(b"<|endoftext|>")
    header = [20240328, 2, len(tokens), len(tokens) - 1] + [0] * 252
    with open(path, "wb") as f:
        f.write(struct.pack("<256i", *header))
        for t in tokens:
            f.write(bytes([len(t)]) + t)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ranks", required=True)
    parser.add_argument("--tool", required=True)
    parser.add_argument("--random", type=int, default=0, metavar="N",
                        help="also N random strings of assigned code points from every plane, spaces and digits")
    parser.add_argument("files", nargs="*")
    args = parser.parse_args()
    ranks = read_ranks(args.ranks)
    enc = tiktoken.Encoding("gpt2-check", pat_str=GPT2_PATTERN, mergeable_ranks=ranks,
                            special_tokens={"<|endoftext|>": len(ranks)})
    cases = [(f"string {i}", s.encode()) for i, s in enumerate(STRINGS)]
    cases += [(f"invalid {i}", b) for i, b in enumerate(INVALID)]
    cases += [(f, Path(f).read_bytes()) for f in args.files]
    cases += [(f"random {i}", s.encode()) for i, s in enumerate(random_strings(args.random))]

    def agrees(name, data, ours):
        if name.startswith("invalid"):
            # tiktoken takes str: its bytes are encoded piece by piece from the ranks alone;
            # compare only the round trip, which is what loom promises for invalid UTF-8.
            return b"".join(enc.decode_single_token_bytes(t) for t in ours) == data
        return ours == enc.encode(data.decode(), allowed_special={"<|endoftext|>"})

    with tempfile.TemporaryDirectory() as tmp:
        tokenizer = Path(tmp) / "gpt2_tokenizer.bin"
        write_llmc_tokenizer(ranks, tokenizer)
        return compare(args.tool, tokenizer, cases, agrees, "tiktoken")

if __name__ == "__main__":
    sys.exit(main())
