"""Summarises an Nsight Compute source-page export of one kernel (`ncu -i REPORT --page source
--print-source sass --csv > kernel_sass.csv`): where the warps' stall samples fall, by reason, over
the whole kernel, over the span of its tensor-core instructions (the main loop's core) and over
any instruction ranges you name, and which instructions hold the most samples.

    python benchmarks/ncu_sass_summary.py ncu_fused_512_11008x4096_sass.csv
    python benchmarks/ncu_sass_summary.py kernel_sass.csv --region copier:9000:10050 --top 0.5

Rows are SASS instructions in address order, numbered from 0 (the index --region takes). The csv
names 18 stall reasons per instruction; a sample with none of them (the `gmma` reason: a warp
waiting for its warpgroup's siblings at a wgmma) is counted as `unlisted`. Writes text to stdout.
"""

from __future__ import annotations

import argparse
import collections
import csv
import re
import sys
from typing import NamedTuple

SAMPLES = "Warp Stall Sampling (All Samples)"
EXECUTED = "Instructions Executed"
TENSOR_OPS = re.compile(r"\b(HGMMA|HMMA|QGMMA|IMMA)\b")


class Instruction(NamedTuple):
    source: str
    samples: int
    executed: int
    stalls: dict[str, int]  # reason -> samples, `unlisted` included


def _int(text: str) -> int:
    text = text.strip().replace(",", "")
    return int(float(text)) if text and text != "-" else 0


def read_export(path: str) -> tuple[str, list[Instruction]]:
    """The kernel name (empty if the export has none) and its instructions."""
    with open(path, newline="") as f:
        rows = [r for r in csv.reader(f) if r]
    if not rows:
        raise ValueError(f"{path}: empty file")
    kernel = ""
    if rows[0][0] == "Kernel Name":
        kernel = rows[0][1] if len(rows[0]) > 1 else ""
        rows = rows[1:]
    header = rows[0]
    if "Source" not in header or SAMPLES not in header:
        raise ValueError(f"{path}: not an ncu source-page csv (no 'Source' / '{SAMPLES}' column)")
    col = {name: i for i, name in enumerate(header)}
    reasons = [h for h in header if h.startswith("stall_") and not h.endswith("(Not Issued)")]
    out = []
    for row in rows[1:]:
        if len(row) < len(header):
            continue
        stalls = {r[len("stall_") :]: _int(row[col[r]]) for r in reasons}
        samples = _int(row[col[SAMPLES]])
        stalls["unlisted"] = max(samples - sum(stalls.values()), 0)
        executed = _int(row[col[EXECUTED]]) if EXECUTED in col else 0
        out.append(Instruction(row[col["Source"]].strip(), samples, executed, stalls))
    return kernel, out


def tensor_span(instrs: list[Instruction]) -> tuple[int, int] | None:
    """[first, last + 1) of the tensor-core instructions, or None if there are none."""
    idx = [i for i, ins in enumerate(instrs) if TENSOR_OPS.search(ins.source)]
    return (idx[0], idx[-1] + 1) if idx else None


def region_line(name: str, instrs: list[Instruction], lo: int, hi: int, total: int) -> str:
    part = instrs[lo:hi]
    samples = sum(i.samples for i in part)
    reasons = collections.Counter()
    for ins in part:
        reasons.update(ins.stalls)
    top = ", ".join(f"{r} {100 * n / samples:.1f}%" for r, n in reasons.most_common(7) if n)
    share = 100 * samples / total if total else 0.0
    return (
        f"{name} [{lo}, {hi}): {samples} samples ({share:.1f}%), "
        f"{sum(i.executed for i in part)} instructions executed" + (f"; {top}" if top else "")
    )


def summarise(
    instrs: list[Instruction], regions: list[tuple[str, int, int]], top_percent: float
) -> str:
    total = sum(i.samples for i in instrs)
    lines = [
        f"{len(instrs)} instructions, {total} stall samples, "
        f"{sum(i.executed for i in instrs)} instructions executed (warp-level)"
    ]
    span = tensor_span(instrs)
    named = [("whole kernel", 0, len(instrs))]
    if span is not None:
        named.append(("tensor-core span", *span))
    named += regions
    lines += [region_line(name, instrs, lo, hi, total) for name, lo, hi in named]
    lines.append(
        f"instructions with >= {top_percent:g}% of the samples "
        "(index, SASS, samples, executions, top stalls):"
    )
    for i, ins in enumerate(instrs):
        if total and ins.samples >= top_percent / 100 * total:
            top = sorted(ins.stalls.items(), key=lambda kv: -kv[1])[:3]
            why = " ".join(f"{r}={n}" for r, n in top if n)
            lines.append(
                f"  {i:6d} {ins.source[:64]:64s} {ins.samples:6d} {ins.executed:9d}  {why}"
            )
    return "\n".join(lines) + "\n"


def parse_region(text: str, count: int) -> tuple[str, int, int]:
    parts = text.rsplit(":", 2)
    if len(parts) != 3 or not parts[1].isdigit() or not parts[2].isdigit():
        raise argparse.ArgumentTypeError(f"--region must be NAME:FIRST:END (indices), got {text!r}")
    name, lo, hi = parts[0], int(parts[1]), int(parts[2])
    if not 0 <= lo < hi <= count:
        raise argparse.ArgumentTypeError(
            f"--region {text!r}: need 0 <= FIRST < END <= {count} (the instruction count)"
        )
    return name, lo, hi


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("csv", help="ncu --page source --print-source sass --csv export of one kernel")
    ap.add_argument(
        "--region",
        action="append",
        default=[],
        metavar="NAME:FIRST:END",
        help="also summarise instructions [FIRST, END) (repeatable)",
    )
    ap.add_argument(
        "--top",
        type=float,
        default=1.0,
        metavar="PERCENT",
        help="list instructions holding at least this share of the samples",
    )
    args = ap.parse_args(argv)
    kernel, instrs = read_export(args.csv)
    try:
        regions = [parse_region(r, len(instrs)) for r in args.region]
    except argparse.ArgumentTypeError as e:
        ap.error(str(e))
    if kernel:
        sys.stdout.write(kernel[:200] + "\n")
    sys.stdout.write(summarise(instrs, regions, args.top))
    return 0


if __name__ == "__main__":
    sys.exit(main())
