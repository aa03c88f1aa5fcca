"""Where a `python -m bench --json` run stands against the H200 targets of issue 4 (decode
GEMV) and issue 7 (fused prefill GEMM): one Markdown row per target and measured row.

    python benchmarks/targets.py benchmarks/results/h200.json

Columns: the measured value, the goal, whether it is met, and for the speedup targets the bound
(`speedup_bound`: bf16 time / the least time jax_fp4 could take, reading its bytes at the run's
streaming-read bandwidth or running its FLOPs at the tensor cores' dense bf16 peak). A row the run
did not measure shows as "not measured". The dispatch target of issue 7 (auto within 5% of the
fastest backend) needs every backend timed, which a default sweep does not do: --dispatch adds the
rows of a `benchmarks/dispatch_check.py --json` run.

    python benchmarks/targets.py benchmarks/results/h200.json --dispatch dispatch.json
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import pathlib
import sys

PREFILL_SHAPES = ((11008, 4096), (4096, 11008), (17408, 5120), (28672, 8192))
DECODE_SHAPES = PREFILL_SHAPES + ((5120, 17408),)
DECODE_MS = (1, 2, 4, 8)
READ_FRACTION_GOAL = 0.85
M8_SLOWDOWN_GOAL = 1.10  # M = 8 at most 10% slower than M = 1
LM_HEAD = (248320, 2048, 4)
LM_HEAD_GOAL_US = 80.0
SMALL_SHAPE = (4096, 4096)  # "4096x4096 and smaller": within 1.5x of the floor
SMALL_FLOOR_GOAL = 1.5
BF16_M1_SHAPE = (11008, 4096)
BF16_M1_GOAL = 5.0
# Issue 7: the least speedup over bf16 jnp.dot for M in [first, last] on the prefill shapes.
PREFILL_GOALS = ((16, 64, 2.5), (128, 128, 1.5), (256, 256, 1.1), (512, 4096, 0.95))
# NVIDIA's datasheet figure for the H200 SXM, dense (no sparsity): the tensor-core side of `bound`.
H200_BF16_DENSE_TFLOPS = 989.0


@dataclasses.dataclass(frozen=True)
class Check:
    issue: int
    target: str
    row: str  # "N x K, M" or what else the value is of
    value: str  # measured, formatted; "not measured" when absent
    goal: str
    met: bool
    bound: str = ""  # what the memory system allows, where that says something


def _shape(n: int, k: int) -> str:
    return f"{n}x{k}"


def speedup_bound(r: dict) -> float:
    """bf16 time / the least time jax_fp4 could take: reading its bytes at the run's streaming-read
    bandwidth (floor_us) or running its FLOPs at the tensor cores' dense bf16 peak."""
    compute_us = 2 * r["m"] * r["n"] * r["k"] / (H200_BF16_DENSE_TFLOPS * 1e6)
    return r["bf16_us"] / max(r["floor_us"], compute_us)


def _speedup_check(issue, target, row, r, goal) -> Check:
    if r is None:
        return Check(issue, target, row, "not measured", f">= {goal:g}x", False)
    return Check(issue, target, row, f"{r['speedup_vs_bf16']:.2f}x ({r['path']}, {r['us']:.1f} us)",
                 f">= {goal:g}x", r["speedup_vs_bf16"] >= goal, f"{speedup_bound(r):.2f}x")


def checks(results: dict) -> list[Check]:
    """Every target measurable from one bench run, in the order of the issues."""
    rows = {(r["n"], r["k"], r["m"]): r for r in results["rows"]}
    out = []
    for n, k in DECODE_SHAPES:
        for m in DECODE_MS:
            r = rows.get((n, k, m))
            row = f"{_shape(n, k)}, M = {m}"
            goal = f">= {READ_FRACTION_GOAL:.0%}"
            if r is None:
                out.append(Check(4, "% of read BW", row, "not measured", goal, False))
            else:
                f = r["fraction_of_read_bw"]
                out.append(Check(4, "% of read BW", row, f"{f:.0%} ({r['tbps']:.2f} TB/s)", goal,
                                 f >= READ_FRACTION_GOAL))
    for n, k in DECODE_SHAPES:
        r1, r8 = rows.get((n, k, 1)), rows.get((n, k, 8))
        row = f"{_shape(n, k)}, M = 8 / M = 1"
        goal = f"<= {M8_SLOWDOWN_GOAL:.2f}"
        if r1 is None or r8 is None:
            out.append(Check(4, "M = 8 against M = 1", row, "not measured", goal, False))
        else:
            ratio = r8["us"] / r1["us"]
            out.append(Check(4, "M = 8 against M = 1", row, f"{ratio:.2f}", goal, ratio <= M8_SLOWDOWN_GOAL))
    r = rows.get(LM_HEAD)
    row = f"{_shape(*LM_HEAD[:2])}, M = {LM_HEAD[2]}"
    goal = f"<= {LM_HEAD_GOAL_US:g} us"
    out.append(Check(4, "lm_head", row, "not measured", goal, False) if r is None else
               Check(4, "lm_head", row, f"{r['us']:.1f} us", goal, r["us"] <= LM_HEAD_GOAL_US,
                     f"floor {r['floor_us']:.1f} us"))
    for m in DECODE_MS:
        r = rows.get((*SMALL_SHAPE, m))
        row = f"{_shape(*SMALL_SHAPE)}, M = {m}"
        goal = f"<= {SMALL_FLOOR_GOAL:g}x floor"
        if r is None:
            out.append(Check(4, "small weights near the floor", row, "not measured", goal, False))
        else:
            ratio = r["us"] / r["floor_us"]
            out.append(Check(4, "small weights near the floor", row,
                             f"{ratio:.2f}x ({r['us']:.1f} / {r['floor_us']:.1f} us)", goal,
                             ratio <= SMALL_FLOOR_GOAL))
    out.append(_speedup_check(4, "x bf16 at M = 1", f"{_shape(*BF16_M1_SHAPE)}, M = 1",
                              rows.get((*BF16_M1_SHAPE, 1)), BF16_M1_GOAL))
    step = results.get("decode_step")
    out.append(Check(4, "decode step reported", "113 matmuls, M = 1",
                     "not measured" if step is None else
                     f"{step['step_us']:.0f} us ({step['speedup_vs_bf16']:.2f}x bf16)",
                     "reported with the floor sum", step is not None,
                     "" if step is None else f"floor {step['floor_us']:.0f} us"))
    for first, last, goal in PREFILL_GOALS:
        target = f"x bf16 at M = {first}" + ("" if first == last else f"-{last}")
        for n, k in PREFILL_SHAPES:
            ms = sorted(m for (rn, rk, m) in rows if (rn, rk) == (n, k) and first <= m <= last)
            if not ms:
                out.append(_speedup_check(7, target, f"{_shape(n, k)}", None, goal))
            for m in ms:
                out.append(_speedup_check(7, target, f"{_shape(n, k)}, M = {m}", rows[(n, k, m)], goal))
    return out


def dispatch_checks(dispatch: dict) -> list[Check]:
    """Issue 7's dispatch target from a dispatch_check.py JSON: a row per (shape, M)."""
    return [Check(7, "auto within 5% of the fastest", f"{_shape(r['n'], r['k'])}, M = {r['m']}",
                  f"{r['auto_over_fastest']:.2f} (auto {r['auto']}, fastest {r['fastest']})",
                  f"<= {dispatch['tolerance']:g}", bool(r["within"]))
            for r in dispatch["rows"]]


def markdown(found: list[Check]) -> str:
    lines = ["| issue | target | row | measured | goal | met | bound |",
             "|---:|---|---|---|---|---|---|"]
    lines += [f"| {c.issue} | {c.target} | {c.row} | {c.value} | {c.goal} | {'yes' if c.met else 'no'} "
              f"| {c.bound} |" for c in found]
    return "\n".join(lines)


def summary(found: list[Check]) -> str:
    parts = []
    for issue in sorted({c.issue for c in found}):
        mine = [c for c in found if c.issue == issue]
        parts.append(f"issue {issue}: {sum(c.met for c in mine)} of {len(mine)} met")
    return "; ".join(parts)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("results", help="a `python -m bench --json` file")
    parser.add_argument("--dispatch", metavar="JSON", nargs="+", default=[],
                        help="benchmarks/dispatch_check.py --json files")
    args = parser.parse_args(argv)
    results = json.loads(pathlib.Path(args.results).read_text())
    if not results.get("complete", True):  # runs before the field was added were complete
        print(f"note: {args.results} is a run cut short (`complete`: false): its missing rows "
              "count as not met\n")
    found = checks(results)
    for path in args.dispatch:
        found += dispatch_checks(json.loads(pathlib.Path(path).read_text()))
    print(markdown(found))
    print()
    print(summary(found))
    return 0


if __name__ == "__main__":
    sys.exit(main())
