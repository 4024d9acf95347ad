#!/usr/bin/env python3
"""Writes the BERT vocab.txt reference data of tests/unit/test_io_tokenizer_json.cpp into this folder:

- vocab_txt/vocab.txt: word_piece.json's vocabulary (uncased), a token a line in id order, then
  three lines a vocab.txt may hold: an empty line, a token with white space after it, and a token
  that repeats an earlier line (the later line's id is the token's). No tokenizer_config.json:
  loom infers "uncased" from a vocabulary without capitals.
- vocab_txt_cased/vocab.txt: the same tokens, each word that starts with a letter also
  capitalized (cased), and a tokenizer_config.json that says do_lower_case false,
  tokenize_chinese_chars false and strip_accents null.
- vocab_txt_expected.json: {case: [{"text", "ids"}]}: texts encoded by `tokenizers`'
  BertWordPieceTokenizer from each file (without [CLS] ... [SEP]), and from vocab_txt/vocab.txt
  with lowercase=False too. `tokenizers` is the independent reference.

Dev-time only (pip install tokenizers); reads the checked-in word_piece.json; the outputs are
checked in. Run from this folder."""
import json
import os

from tokenizers import BertWordPieceTokenizer

from make_reference import CORPUS, TEXTS
from make_tokenizer_json import BERT_TEXTS

EXTRA_TEXTS = ["The Loom weaves; THE loom Weaves.", "Ｔｈｅ ＬＯＯＭ 东京 weave\t weave"]


def main():
    with open("word_piece.json", encoding="utf-8") as f:
        vocab = json.load(f)["model"]["vocab"]
    tokens = [t for t, _ in sorted(vocab.items(), key=lambda kv: kv[1])]
    repeated = next(t for t in tokens if t.isalpha() and len(t) > 2)
    uncased = tokens + ["", "weave \t", repeated]
    capitals = [t[0].upper() + t[1:] for t in tokens if t[:1].isalpha() and t[0].upper() != t[0]]
    cased = tokens + capitals

    os.makedirs("vocab_txt", exist_ok=True)
    os.makedirs("vocab_txt_cased", exist_ok=True)
    with open("vocab_txt/vocab.txt", "w", encoding="utf-8", newline="\n") as f:
        f.write("\n".join(uncased) + "\n")
    with open("vocab_txt_cased/vocab.txt", "w", encoding="utf-8", newline="\n") as f:
        f.write("\n".join(cased) + "\n")
    with open("vocab_txt_cased/tokenizer_config.json", "w", encoding="utf-8") as f:
        json.dump({"do_lower_case": False, "tokenize_chinese_chars": False, "strip_accents": None,
                   "tokenizer_class": "BertTokenizer"}, f, indent=1)
        f.write("\n")

    texts = TEXTS + BERT_TEXTS + EXTRA_TEXTS + [CORPUS]
    cases = {
        "vocab_txt/vocab.txt": BertWordPieceTokenizer("vocab_txt/vocab.txt", lowercase=True),
        "vocab_txt/vocab.txt lowercase=false": BertWordPieceTokenizer("vocab_txt/vocab.txt", lowercase=False),
        "vocab_txt_cased/vocab.txt": BertWordPieceTokenizer("vocab_txt_cased/vocab.txt", lowercase=False,
                                                            handle_chinese_chars=False),
    }
    expected = {name: [{"text": t, "ids": tok.encode(t, add_special_tokens=False).ids} for t in texts]
                for name, tok in cases.items()}
    with open("vocab_txt_expected.json", "w", encoding="utf-8") as f:
        f.write("{\n" + ",\n".join(
            json.dumps(name) + ": [\n" + ",\n".join(json.dumps(e, ensure_ascii=False) for e in items) + "\n]"
            for name, items in expected.items()) + "\n}\n")
    print({name: (len(items), sum(len(e["ids"]) for e in items)) for name, items in expected.items()},
          "repeated:", repeated, "capitals:", len(capitals))


if __name__ == "__main__":
    main()
