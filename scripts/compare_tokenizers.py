#!/usr/bin/env python3
"""Checks loom_tokenize against Hugging Face's tokenizers on a tokenizer.json (a byte-level BPE,
RoBERTa's or GPT-2's kind, or BERT's WordPiece).

    pip install tokenizers
    scripts/compare_tokenizers.py --tokenizer bert-base-uncased/tokenizer.json \\
        --tool build/release/examples/loom_tokenize --random 1000 FILE...

Encodes each FILE, the built-in strings of scripts/tokenizer_check.py, each added token of the
file with text and white space around it, and --random N random strings with both (tokenizers
without its post-processor: add_special_tokens=False), and prints where they differ. Bytes that
are not UTF-8 go to a WordPiece as U+FFFD (which its normalizer drops, as loom's does); a
byte-level BPE encodes them as bytes, which tokenizers cannot take, so they are left out there."""
import argparse
import json
import sys
from pathlib import Path

from tokenizers import Tokenizer

from tokenizer_check import INVALID, STRINGS, compare, random_strings


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokenizer", required=True, help="a Hugging Face tokenizer.json")
    parser.add_argument("--tool", required=True, help="loom_tokenize")
    parser.add_argument("--random", type=int, default=0, metavar="N",
                        help="also N random strings of code points from the first two planes, spaces and letters")
    parser.add_argument("files", nargs="*")
    args = parser.parse_args()
    reference = Tokenizer.from_file(args.tokenizer)
    spec = json.loads(Path(args.tokenizer).read_text(encoding="utf-8"))
    word_piece = spec["model"]["type"] == "WordPiece"
    added = [token["content"] for token in spec.get("added_tokens") or []]

    cases = [(f"string {i}", s.encode()) for i, s in enumerate(STRINGS)]
    cases += [(f"added {t}", f"a {t} b{t}c  {t}\n{t}".encode()) for t in added]
    if word_piece:
        cases += [(f"invalid {i}", b) for i, b in enumerate(INVALID)]
    cases += [(f, Path(f).read_bytes()) for f in args.files]
    cases += [(f"random {i}", s.encode()) for i, s in enumerate(random_strings(args.random))]

    def agrees(name, data, ours):
        return ours == reference.encode(data.decode(errors="replace"), add_special_tokens=False).ids

    return compare(args.tool, args.tokenizer, cases, agrees, "tokenizers")


if __name__ == "__main__":
    sys.exit(main())
