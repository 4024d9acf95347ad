#!/usr/bin/env python3
"""Sums the kernel times of an Nsight Compute CSV (one row per launch) by kernel name.

    ncu --csv --metrics gpu__time_duration.sum --log-file k.csv PROGRAM ...
    python3 scripts/kernel_profile.py k.csv [--divide STEPS] [--top N]

Prints each kernel's launches, total and share of the whole, largest first: where a step's
device time goes (ncu runs the launches one at a time, so gaps between kernels are not in it).
"""
import argparse
import collections
import csv
import sys


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("csv")
    p.add_argument("--divide", type=float, default=1.0, help="divide totals by this (the steps profiled)")
    p.add_argument("--top", type=int, default=30)
    args = p.parse_args()
    with open(args.csv, newline="") as f:
        lines = [line for line in f if line.startswith('"')]
    rows = list(csv.reader(lines))
    header = rows[0]
    name_col, value_col, unit_col = header.index("Kernel Name"), header.index("Metric Value"), header.index("Metric Unit")
    scale = {"nsecond": 1e-6, "ns": 1e-6, "usecond": 1e-3, "us": 1e-3, "msecond": 1.0, "ms": 1.0, "second": 1e3}
    totals, counts = collections.defaultdict(float), collections.Counter()
    for row in rows[1:]:
        if len(row) <= value_col:
            continue
        name = row[name_col].split("(")[0].replace("void ", "")
        ms = float(row[value_col].replace(",", "")) * scale.get(row[unit_col], 1e-6)
        totals[name] += ms / args.divide
        counts[name] += 1
    whole = sum(totals.values())
    print(f"{'kernel':70s} {'launches':>8s} {'ms':>9s} {'share':>6s}")
    for name, ms in sorted(totals.items(), key=lambda kv: -kv[1])[: args.top]:
        print(f"{name[:70]:70s} {counts[name] / args.divide:8.0f} {ms:9.3f} {100 * ms / whole:5.1f}%")
    print(f"{'all kernels':70s} {sum(counts.values()) / args.divide:8.0f} {whole:9.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
