#!/usr/bin/env python3
"""Checks loom_tokenize against Hugging Face's tokenizers on a tokenizer.json (a byte-level BPE,
RoBERTa's or GPT-2's kind, or BERT's WordPiece), on a vocab.json with its merges.txt beside it
(BPE.from_file, the ByteLevel pre-tokenizer, and the special tokens loom adds), or on a BERT
vocab.txt (tokenizers' BertWordPieceTokenizer, lowercase as --lowercase says, given to both; the
other normalizer options, and lowercase without --lowercase, from tokenizer_config.json beside
it, as loom reads them).

    pip install tokenizers
    scripts/compare_tokenizers.py --tokenizer bert-base-uncased/tokenizer.json \\
        --tool build/release/examples/loom_tokenize --random 1000 FILE...
    scripts/compare_tokenizers.py --tokenizer bert-base-cased/vocab.txt --lowercase false \\
        --tool build/release/examples/loom_tokenize --random 1000

Encodes each FILE, the built-in strings of scripts/tokenizer_check.py, each added token of the
file with text and white space around it, and --random N random strings with both (tokenizers
without its post-processor: add_special_tokens=False), and prints where they differ. Bytes that
are not UTF-8 go to a WordPiece as U+FFFD (which its normalizer drops, as loom's does); a
byte-level BPE encodes them as bytes, which tokenizers cannot take, so they are left out there."""
import argparse
import json
import sys
from pathlib import Path

from tokenizers import AddedToken, BertWordPieceTokenizer, Tokenizer, models, pre_tokenizers

from tokenizer_check import INVALID, STRINGS, compare, random_strings


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokenizer", required=True,
                        help="a Hugging Face tokenizer.json, a vocab.json with merges.txt beside it, or a BERT vocab.txt")
    parser.add_argument("--lowercase", choices=["true", "false"],
                        help="a vocab.txt only: lowercase (default: tokenizer_config.json's do_lower_case, else true)")
    parser.add_argument("--tool", required=True, help="loom_tokenize")
    parser.add_argument("--random", type=int, default=0, metavar="N",
                        help="also N random strings of code points from the first two planes, spaces and letters")
    parser.add_argument("files", nargs="*")
    args = parser.parse_args()
    options = ()
    if args.tokenizer.endswith(".txt"):
        config_file = Path(args.tokenizer).parent / "tokenizer_config.json"
        config = json.loads(config_file.read_text(encoding="utf-8")) if config_file.is_file() else {}
        lowercase = args.lowercase == "true" if args.lowercase else config.get("do_lower_case", True)
        reference = BertWordPieceTokenizer(args.tokenizer, lowercase=lowercase,
                                           handle_chinese_chars=config.get("tokenize_chinese_chars", True),
                                           strip_accents=config.get("strip_accents"))
        options = ("--lowercase", "true" if lowercase else "false")
        word_piece = True
        added = [t for t in ("[UNK]", "[SEP]", "[CLS]", "[PAD]", "[MASK]") if reference.token_to_id(t) is not None]
    elif "model" not in (spec := json.loads(Path(args.tokenizer).read_text(encoding="utf-8"))):
        reference = Tokenizer(models.BPE.from_file(args.tokenizer, str(Path(args.tokenizer).parent / "merges.txt")))
        reference.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        added = [t for t in ("<|endoftext|>", "<s>", "<pad>", "</s>", "<unk>", "<mask>") if t in spec]
        reference.add_special_tokens([AddedToken(t, lstrip=t == "<mask>") for t in added])
        word_piece = False
    else:
        reference = Tokenizer.from_file(args.tokenizer)
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

    return compare(args.tool, args.tokenizer, cases, agrees, "tokenizers", options)


if __name__ == "__main__":
    sys.exit(main())
