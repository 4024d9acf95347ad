"""What scripts/compare_tiktoken.py and scripts/compare_tokenizers.py share: the inputs they encode
with both loom_tokenize and a reference (strings that exercise the pre-tokenizers: contractions,
runs of white space, letters and digits of other scripts, Unicode's other spaces; bytes that are
not UTF-8; random strings of code points from the first two planes), loom_tokenize's ids, and
the count of inputs that agree."""
import random
import subprocess
import sys
import tempfile
from pathlib import Path

STRINGS = [
    "Hello, I'm a language model,",
    "It's they're we've I'm you'll he'd 'S 'twas rock'n'roll ''s",
    "a  b   c\t\td \n\n e\r\nf   ",
    "   leading and trailing   ",
    "naïve café — “quoted” ‘single’ … ½ ² ③ Ⅻ",
    "日本語のテキストと中文文本，한국어 텍스트",
    "Ελληνικά, кириллица, עברית, العربية ١٢٣ ٤٥",
    "emoji 👋🏽🙂 and ZWJ 👨‍👩‍👧 sequences",
    "numbers 3.14159 1,000,000 0x1F 2026-11-27 १२३",
    "code: for (int i = 0; i < n; ++i) { x[i] *= 2; }  // comment",
    "no\u00a0break\u2003em\u3000ideographic\u2028line\u2029para\u0085nel",
    "<|endoftext|>The end<|endoftext|><|endoftext|>",
    "x" * 300 + " " + "ab" * 200,
    " " * 50 + "\n" * 20,
]
INVALID = [b"bad \xff\xfe utf-8 \xc3", b"\xe2\x82 cut \xf0\x9f\x98", b"\xed\xa0\x80 surrogate \xc0\xaf overlong"]


def random_strings(count, seed=20261127, extra=" \n'sa1. "):
    """`count` strings of 200 characters: half code points below U+20000 (no surrogates), half
    drawn from `extra`."""
    draw = random.Random(seed)
    pool = [c for c in range(0x20000) if not 0xD800 <= c <= 0xDFFF]
    return ["".join(chr(draw.choice(pool)) if draw.random() < 0.5 else draw.choice(extra) for _ in range(200))
            for _ in range(count)]


def compare(tool, tokenizer, cases, agrees, reference, options=()):
    """Encodes each (name, bytes) of `cases` with loom_tokenize `tool` through `tokenizer` (one
    thread, and the command-line `options`) and checks agrees(name, data, ids); prints the inputs
    that differ and a summary naming `reference`. Returns 1 if any differs, else 0."""
    same = differ = tokens = 0
    with tempfile.TemporaryDirectory() as tmp:
        scratch = Path(tmp) / "input"
        for name, data in cases:
            scratch.write_bytes(data)
            command = [tool, "--threads", "1", "--tokenizer", str(tokenizer), *options, str(scratch)]
            out = subprocess.run(command, check=True, capture_output=True).stdout.decode().strip()
            ours = [int(x) for x in out.split(",")] if out else []
            ok = agrees(name, data, ours)
            tokens += len(ours)
            same += ok
            differ += not ok
            if not ok:
                print(f"DIFFERS: {name}", file=sys.stderr)
    print(f"{same} of {same + differ} inputs encode to the same ids as {reference} ({tokens} tokens)")
    return 1 if differ else 0
