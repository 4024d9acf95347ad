#!/usr/bin/env python3
"""Writes vocab_merges/vocab.json and vocab_merges/merges.txt: roberta_like.json's byte-level
BPE (ids shuffled away from the merge order) as the pair of files GPT-2's and RoBERTa's
Hugging Face repositories hold beside, or instead of, a tokenizer.json. loom reads the pair
with the same five special tokens (<mask> taking the white space before it), so the test
expects tokenizer_json_expected.json's ids for roberta_like.json; this script checks first that
`tokenizers` gives those ids from the pair too (BPE.from_file, the ByteLevel pre-tokenizer, the
special tokens added as transformers' RobertaTokenizerFast adds them).

Dev-time only (pip install tokenizers); reads the checked-in roberta_like.json and
tokenizer_json_expected.json. Run from this folder."""
import json
import os

from tokenizers import AddedToken, Tokenizer, models, pre_tokenizers


def main():
    with open("roberta_like.json", encoding="utf-8") as f:
        spec = json.load(f)
    os.makedirs("vocab_merges", exist_ok=True)
    with open("vocab_merges/vocab.json", "w", encoding="utf-8") as f:
        json.dump(spec["model"]["vocab"], f, ensure_ascii=False)
    with open("vocab_merges/merges.txt", "w", encoding="utf-8", newline="\n") as f:
        f.write("#version: 0.2\n" + "".join(f"{a} {b}\n" for a, b in spec["model"]["merges"]))

    tok = Tokenizer(models.BPE.from_file("vocab_merges/vocab.json", "vocab_merges/merges.txt"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.add_special_tokens(["<s>", "<pad>", "</s>", "<unk>", AddedToken("<mask>", lstrip=True)])
    with open("tokenizer_json_expected.json", encoding="utf-8") as f:
        expected = json.load(f)["roberta_like.json"]
    differ = [e["text"] for e in expected if tok.encode(e["text"], add_special_tokens=False).ids != e["ids"]]
    assert not differ, differ
    print(f"{len(spec['model']['merges'])} merges; {len(expected)} texts encode as roberta_like.json does")


if __name__ == "__main__":
    main()
