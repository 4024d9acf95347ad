#!/usr/bin/env python3
"""Writes include/loom/io/detail/unicode_bert.hpp: the character tables of BERT's normalizer and
pre-tokenizer (Devlin et al. 2019, its `tokenization.py`) as Hugging Face's `tokenizers` applies
them, for io::TokenEncoder's WordPiece (token_encoder.hpp). Its Rust code takes its character
classes from crates of several Unicode versions, so the tables are read off `tokenizers` itself:
each code point (surrogates aside) goes through BertNormalizer and BertPreTokenizer with one
option on at a time, and what comes out is recorded. The header records the `tokenizers` version.

- removed: what clean_text drops (NUL, U+FFFD, and the "other" categories as tokenizers has them,
  some of Unicode's White_Space among them); the rest of White_Space it turns into spaces;
- punctuation: what BertPreTokenizer splits off as a piece of its own;
- nonspacing: what strip_accents drops (the nonspacing marks, after NFD);
- stripped: what strip_accents turns into other characters (the NFD of an accented letter, less
  its marks), Hangul syllables aside (their NFD is arithmetic: token_encoder.hpp);
- lowercase: what lowercase turns into other characters.

Run from the repository root: scripts/unicode_bert.py (pip install tokenizers)."""
import sys
from pathlib import Path

import tokenizers
from tokenizers import normalizers, pre_tokenizers

HANGUL = range(0xAC00, 0xAC00 + 11172)
CHINESE = [(0x4E00, 0x9FFF), (0x3400, 0x4DBF), (0x20000, 0x2A6DF), (0x2A700, 0x2B73F), (0x2B740, 0x2B81F),
           (0x2B920, 0x2CEAF), (0xF900, 0xFAFF), (0x2F800, 0x2FA1F)]


def probe():
    one = lambda **on: normalizers.BertNormalizer(**{"clean_text": False, "handle_chinese_chars": False,
                                                     "strip_accents": False, "lowercase": False, **on})
    clean, strip, lower, chinese = one(clean_text=True), one(strip_accents=True), one(lowercase=True), one(
        handle_chinese_chars=True)
    pre = pre_tokenizers.BertPreTokenizer()
    found = {"removed": set(), "spaces": set(), "punctuation": set(), "split_spaces": set(), "nonspacing": set(),
             "chinese": set()}
    stripped, lowercase = {}, {}
    for c in range(0x110000):
        if 0xD800 <= c <= 0xDFFF:
            continue
        ch = chr(c)
        cleaned = clean.normalize_str("a" + ch + "b")
        if cleaned == "ab":
            found["removed"].add(c)
        elif cleaned == "a b":
            found["spaces"].add(c)
        pieces = pre.pre_tokenize_str("a" + ch + "a")
        if len(pieces) == 3:
            found["punctuation"].add(c)
        elif len(pieces) == 2:
            found["split_spaces"].add(c)
        s = strip.normalize_str(ch)
        if s == "":
            found["nonspacing"].add(c)
        elif s != ch and c not in HANGUL:
            stripped[c] = s
        low = lower.normalize_str(ch)
        if low != ch:
            lowercase[c] = low
        if chinese.normalize_str(ch) != ch:
            found["chinese"].add(c)
    return found, stripped, lowercase


def ranges(points):
    out, start, last = [], None, None
    for c in sorted(points):
        if start is not None and c == last + 1:
            last = c
            continue
        if start is not None:
            out.append((start, last))
        start = last = c
    if start is not None:
        out.append((start, last))
    return out


def range_table(name, doc, points):
    rows = ranges(points)
    lines = [f"//! {doc}: {len(points)} code points in {len(rows)} ranges.",
             f"inline constexpr CodePointRange {name}[] = {{"]
    for i in range(0, len(rows), 4):
        lines.append("    " + " ".join(f"{{0x{a:04X}, 0x{b:04X}}}," for a, b in rows[i:i + 4]))
    lines.append("};")
    return "\n".join(lines)


def map_table(name, doc, mapping, width):
    lines = [f"//! {doc}: {len(mapping)} code points.", f"inline constexpr CodePointMapping<{width}> {name}[] = {{"]
    items = sorted(mapping.items())
    for i in range(0, len(items), 3):
        row = []
        for c, to in items[i:i + 3]:
            assert 1 <= len(to) <= width, (hex(c), to)
            cps = ", ".join(f"0x{ord(x):04X}" for x in to)
            row.append(f"{{0x{c:04X}, {len(to)}, {{{cps}}}}},")
        lines.append("    " + " ".join(row))
    lines.append("};")
    return "\n".join(lines)


def main():
    found, stripped, lowercase = probe()
    white_space = {0x09, 0x0A, 0x0B, 0x0C, 0x0D, 0x20, 0x85, 0xA0, 0x1680, *range(0x2000, 0x200B), 0x2028, 0x2029,
                   0x202F, 0x205F, 0x3000}
    # What the header assumes rather than tabulates, checked here.
    assert found["split_spaces"] == white_space, "BertPreTokenizer splits at Unicode's White_Space"
    assert found["spaces"] | {0x20} == white_space - found["removed"], "clean_text turns the rest of White_Space into spaces"
    assert found["chinese"] == {c for a, b in CHINESE for c in range(a, b + 1)}, "the CJK ranges"
    text = f"""#pragma once
//! \\file The character tables of BERT's normalizer and pre-tokenizer as Hugging Face's
//! `tokenizers` {tokenizers.__version__} applies them, for io::TokenEncoder's WordPiece (token_encoder.hpp).
//! Generated by scripts/unicode_bert.py, which reads them off `tokenizers` itself (its classes
//! come from crates of several Unicode versions): do not edit. White space (Unicode's White_Space:
//! the pre-tokenizer splits at it, clean_text makes spaces of what it does not drop), the CJK
//! ideographs that handle_chinese_chars spaces out and the Hangul syllables' decomposition are
//! not tables: the script checks the first two.

#include "loom/io/detail/unicode_classes.hpp"

namespace loom::io::detail {{

//! A code point and the `length` code points it becomes.
template <int N>
struct CodePointMapping {{
  char32_t from;
  int length;
  char32_t to[N];
}};

{range_table("bert_removed", "What clean_text drops", found["removed"])}

{range_table("bert_punctuation", "What BertPreTokenizer splits off as a piece of its own", found["punctuation"])}

{range_table("bert_nonspacing", "What strip_accents drops (after decomposing)", found["nonspacing"])}

{map_table("bert_stripped", "What strip_accents turns into other characters (Hangul syllables aside)", stripped, 3)}

{map_table("bert_lowercase", "What lowercase turns into other characters", lowercase, 2)}

}}  // namespace loom::io::detail
"""
    Path("include/loom/io/detail/unicode_bert.hpp").write_text(text)
    print({k: len(v) for k, v in found.items()}, "stripped", len(stripped), "lowercase", len(lowercase))


if __name__ == "__main__":
    sys.exit(main())
