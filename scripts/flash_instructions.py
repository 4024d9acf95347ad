#!/usr/bin/env python3
"""Instructions per tile step of the tiled attention kernels, from their SASS (nvdisasm's output).

    nvdisasm kernels.cubin | scripts/flash_instructions.py

For each kernel with a block barrier: its main loop is the one around the first BAR.SYNC (the
walk over tiles). Counted from the loop's first tensor-core instruction or shared-matrix load
(HMMA, HGMMA, LDSM: the copies of the next tile come before it) to the branch back: the
instructions of one step, once each as the code stands. "unmasked" leaves out the longest block
that a forward conditional branch skips and that holds selects but no product or exponential:
the masking, which only the tiles on the diagonal or at a padded end run. Static counts: a rough
measure of the issue slots a step takes, not a timing.
"""
import collections
import re
import sys

INSTRUCTION = re.compile(r"\s+/\*[0-9a-f]{4}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)")
LABEL = re.compile(r"^(\.L_x_\d+):")


def opcode(line):
    match = INSTRUCTION.match(line)
    return match.group(1).split(".")[0] if match else None


def functions(lines):
    name, body = None, []
    for line in lines:
        match = re.match(r"\.text\.(\S+):", line)
        if match:
            if name:
                yield name, body
            name, body = match.group(1), []
        elif name:
            body.append(line)
    if name:
        yield name, body


def main_loop(body):
    """(first, last) line indices of the loop around the first barrier, or None."""
    barriers = [i for i, line in enumerate(body) if "BAR.SYNC" in line]
    if not barriers:
        return None
    barrier = barriers[0]
    for start in reversed([i for i in range(barrier) if LABEL.match(body[i])]):
        label = LABEL.match(body[start]).group(1)
        for end in range(barrier, len(body)):
            if re.search(r"BRA `\(" + re.escape(label) + r"\)", body[end]):
                return start, end
    return None


def count(body, first, last):
    step = body[first:last + 1]
    ops = [opcode(line) for line in step if opcode(line)]
    labels = {LABEL.match(line).group(1): i for i, line in enumerate(step) if LABEL.match(line)}
    masking = 0
    for i, line in enumerate(step):
        match = re.search(r"@!?P\d\s+BRA `\((\.L_x_\d+)\)", line)
        if not match or labels.get(match.group(1), -1) <= i:
            continue
        skipped = collections.Counter(opcode(x) for x in step[i + 1:labels[match.group(1)]] if opcode(x))
        if skipped["FSEL"] + skipped["MOV"] + skipped["IMAD"] > 0 and not (
                skipped["HMMA"] or skipped["HGMMA"] or skipped["MUFU"]):
            masking = max(masking, sum(skipped.values()))
    kinds = collections.Counter(ops)
    return len(ops), len(ops) - masking, kinds["HMMA"] + kinds["HGMMA"], kinds["MUFU"]


def demangled(name):
    match = re.search(r"flash\d+(\w+?)I(.*?)EEv", name)
    if not match:
        return name
    arguments = re.findall(r"L(i|b)(\d+)E?", match.group(2))
    values = [v if kind == "i" else ("true" if v == "1" else "false") for kind, v in arguments]
    return f"{match.group(1)}<{', '.join(values)}>"


def main():
    lines = sys.stdin.read().split("\n")
    print(f"{'kernel':40s} {'step':>6s} {'unmasked':>9s} {'mma':>5s} {'ex2':>5s}")
    for name, body in functions(lines):
        loop = main_loop(body)
        if loop is None:
            continue
        start, end = loop
        firsts = [i for i in range(start, end) if re.search(r"\b(HMMA|HGMMA|LDSM)\b", body[i])]
        if not firsts:
            continue
        total, unmasked, mma, ex2 = count(body, firsts[0], end)
        print(f"{demangled(name):40s} {total:6d} {unmasked:9d} {mma:5d} {ex2:5d}")


if __name__ == "__main__":
    main()
