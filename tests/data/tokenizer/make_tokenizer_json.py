#!/usr/bin/env python3
"""Writes the tokenizer.json reference data of tests/unit/test_io_tokenizer_json.cpp into this folder:

- roberta_like.json: a byte-level BPE in Hugging Face's tokenizer.json format, trained here by the
  `tokenizers` library on make_reference.py's CORPUS (600 tokens), with RoBERTa's five special
  tokens first (<s> <pad> </s> <unk> <mask>, <mask> taking the white space on its left) and the
  other ids shuffled, so that an id says nothing of a merge's rank: only `model.merges` does.
  Merges are written as pairs (["a", "b"], as tokenizers >= 0.20 write them).
- prefix_space.json: the same vocabulary and merges, written as "a b" strings (the older form),
  with add_prefix_space, ignore_merges and </s> taking the white space on its right.
- word_piece.json: BERT's WordPiece (uncased: BertNormalizer with lowercase and accents
  stripped, BertPreTokenizer), 492 tokens trained by `tokenizers` on the same text (it asked for 500) with BERT's
  five special tokens first.
- word_piece_cased.json: the same vocabulary, cased (no lowercase, accents kept), with
  max_input_chars_per_word 8 and continuation prefix "@@".
- tokenizer_json_expected.json: {file: [{"text", "ids"}]}: texts (make_reference.py's, and some
  with the special tokens, accents, CJK and control characters) encoded by `tokenizers` from each
  file. `tokenizers` is the independent reference.

Dev-time only (pip install tokenizers regex tiktoken); the outputs are checked in. Run from this
folder."""
import json
import random

from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

from make_reference import CORPUS, TEXTS

SPECIAL = ["<s>", "<pad>", "</s>", "<unk>", "<mask>"]
SPECIAL_TEXTS = [
    "<s>The loom weaves.</s></s>It's the same model.</s>",
    "The trainer <mask> ranks into one <mask>.",
    "a<mask>b  <mask>\n<mask>   </s>  x </s>\n\ny",
    "<mask><mask> <s> <pad><unk>",
    "</s",
    " leading space, then <s> and text",
]
BERT_SPECIAL = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
BERT_TEXTS = [
    "[CLS] The loom weaves. [SEP] It's the same model! [SEP]",
    "The trainer [MASK] ranks into one [MASK].",
    "ÀÉÎÕÜ àéîõü Çç Ññ ß İı Σσς ǅ Ǆ ﬁ Å Ω K",
    "control\x00chars\x01\x7f\u200b\ufeff and\ufffdreplacement\u00ad soft",
    "東京の天気 中文，한국어 텍스트 丽 豈 𠀀",
    "a-b_c.d,e!f?g(h)i[j]k{l}m$n+o<p=q>r^s`t|u~v",
    "supercalifragilisticexpialidocious antidisestablishmentarianism",
    "\t tabs\u3000ideographic\u00a0nbsp\u2028line\r\nwindows",
]


def train():
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=600, special_tokens=SPECIAL, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator([CORPUS], trainer)
    return json.loads(tok.to_str())


def train_word_piece():
    tok = Tokenizer(models.WordPiece(unk_token="[UNK]"))
    tok.normalizer = normalizers.BertNormalizer(lowercase=True)
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.decoder = decoders.WordPiece()
    trainer = trainers.WordPieceTrainer(vocab_size=500, special_tokens=BERT_SPECIAL, show_progress=False)
    tok.train_from_iterator([CORPUS], trainer)
    return json.loads(tok.to_str())


def shuffled(spec):
    """The ids of every token but the special ones permuted (seeded), in the vocabulary and the
    added tokens alike."""
    vocab = spec["model"]["vocab"]
    others = sorted((t for t in vocab if t not in SPECIAL), key=lambda t: vocab[t])
    ids = [vocab[t] for t in others]
    random.Random(20261128).shuffle(ids)
    spec["model"]["vocab"] = {**{t: vocab[t] for t in SPECIAL}, **dict(zip(others, ids))}
    spec["model"]["vocab"] = dict(sorted(spec["model"]["vocab"].items(), key=lambda kv: kv[1]))
    return spec


def added(spec, content, **flags):
    for token in spec["added_tokens"]:
        if token["content"] == content:
            token.update(flags)


def main():
    roberta = shuffled(train())
    added(roberta, "<mask>", lstrip=True)
    merges = roberta["model"]["merges"]
    assert merges and isinstance(merges[0], list), "tokenizers >= 0.20 writes merges as pairs"

    prefix = json.loads(json.dumps(roberta))
    added(prefix, "<mask>", lstrip=False)
    added(prefix, "</s>", rstrip=True)
    prefix["pre_tokenizer"]["add_prefix_space"] = True
    prefix["model"]["ignore_merges"] = True
    prefix["model"]["merges"] = [a + " " + b for a, b in merges]

    uncased = train_word_piece()
    cased = json.loads(json.dumps(uncased))
    cased["normalizer"]["lowercase"] = False
    cased["normalizer"]["strip_accents"] = False
    cased["model"]["max_input_chars_per_word"] = 8
    cased["model"]["continuing_subword_prefix"] = "@@"
    cased["model"]["vocab"] = {("@@" + t[2:] if t.startswith("##") else t): i for t, i in cased["model"]["vocab"].items()}

    expected = {}
    for name, spec, texts in (("roberta_like.json", roberta, TEXTS + SPECIAL_TEXTS + [CORPUS]),
                              ("prefix_space.json", prefix, TEXTS + SPECIAL_TEXTS + [CORPUS]),
                              ("word_piece.json", uncased, TEXTS + BERT_TEXTS + [CORPUS]),
                              ("word_piece_cased.json", cased, TEXTS + BERT_TEXTS + [CORPUS])):
        text = json.dumps(spec, ensure_ascii=False, indent=1) + "\n"
        with open(name, "w", encoding="utf-8") as f:
            f.write(text)
        tok = Tokenizer.from_str(text)
        expected[name] = [{"text": t, "ids": tok.encode(t, add_special_tokens=False).ids} for t in texts]
    with open("tokenizer_json_expected.json", "w", encoding="utf-8") as f:
        f.write("{\n" + ",\n".join(
            json.dumps(name) + ": [\n" + ",\n".join(json.dumps(e, ensure_ascii=False) for e in items) + "\n]"
            for name, items in expected.items()) + "\n}\n")
    print({name: (len(items), sum(len(e["ids"]) for e in items)) for name, items in expected.items()})


if __name__ == "__main__":
    main()
