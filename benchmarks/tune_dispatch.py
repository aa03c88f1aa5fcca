"""Measure this GPU's dispatch crossovers and print its entry for jax_fp4/dispatch.py's TABLES.

    python benchmarks/tune_dispatch.py --json tune.json          # the default grid, both layouts
    python benchmarks/tune_dispatch.py --quick                   # a CPU smoke run (tiny shapes)

Every (layout, shape, M) of the grid times the forced backends gemv, fused and dequant that can
serve it here (benchmarks/dispatch_check.py's check_shape: the bench's chains of distinct weights,
per-matmul time by chain differencing, backends taking turns). Each rule's bound is then the
largest M of the grid up to which its backend stays within --tolerance of the fastest, on every
shape of the grid the rule covers (the shape classes are those of the template entry: the
thresholds `small_n`, `narrow_n`, `wide_n`, `long_k`, `small_weight`, `large_weight` of
dispatch.HOPPER). A rule whose shapes the grid does not hold, or whose backend cannot run here,
keeps the template's value (the GPU's current entry); the report says which. The printed literal is
a proposal: check it with `python benchmarks/dispatch_check.py` before adding it to the table.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import os
import sys
import time
from collections.abc import Sequence

import bench
import dispatch_check
import jax

from jax_fp4 import dispatch as _dispatch
from jax_fp4 import native as _native

BACKENDS = ("gemv", "fused", "dequant")
DEFAULT_SHAPES = (
    "1024x4096,1024x8192,2048x4096,4096x4096,4096x11008,4096x14336,11008x4096,"
    "14336x4096,17408x5120,28672x8192"
)
DEFAULT_M = "1,8,9,12,16,17,24,32,48,64,96,128,256,512,1024,1536,2048,3072,4096"
QUICK_SHAPES, QUICK_M = "128x256,256x512", "1,5,17"


@dataclasses.dataclass(frozen=True)
class Timing:
    n: int
    k: int
    m: int
    us: dict  # backend -> per-matmul microseconds (the backends that ran)


def _within(t: Timing, backend: str, others: Sequence[str], tolerance: float) -> bool | None:
    """Whether `backend` is within `tolerance` of the fastest of `others` (None: not comparable)."""
    rivals = [t.us[b] for b in others if b in t.us]
    if backend not in t.us or not rivals:
        return None
    return t.us[backend] <= tolerance * min(rivals)


def last_m_ahead(
    timings: Sequence[Timing], backend: str, others: Sequence[str], tolerance: float, start: int = 0
) -> int | None:
    """The largest M (from `start` on) up to which `backend` stays within `tolerance` of `others`
    on one shape's timings; start - 1 when it trails from the first M on, None when nothing is
    comparable."""
    best, seen = None, False
    for t in sorted(timings, key=lambda t: t.m):
        if t.m < start:
            continue
        ok = _within(t, backend, others, tolerance)
        if ok is None:
            continue
        seen = True
        if not ok:
            break
        best = t.m
    return max(start - 1, 0) if seen and best is None else best


def _bound(by_shape: dict, shapes, backend, others, tolerance, start=0):
    """The smallest of the shapes' last-M-ahead (None when no shape measured it)."""
    found = [last_m_ahead(by_shape[s], backend, others, tolerance, start) for s in shapes]
    found = [m for m in found if m is not None]
    return min(found) if found else None


def derive(
    timings: Sequence[Timing],
    template: _dispatch.Crossovers,
    tolerance: float,
    findings: list[str],
    layout: str,
) -> _dispatch.Crossovers:
    """One layout's crossovers from its timings; fields without a measurement keep the template's."""
    c = template
    by_shape: dict = {}
    for t in timings:
        by_shape.setdefault((t.n, t.k), []).append(t)
    shapes = list(by_shape)

    def pick(field, value, covered):
        if value is None:
            findings.append(
                f"{layout}.{field}: no timing covers it here, kept {getattr(c, field)!r}"
            )
            return getattr(c, field)
        findings.append(f"{layout}.{field} = {value} from {sorted(covered)}")
        return value

    def cls(pred):
        return [s for s in shapes if pred(*s)]

    plain = cls(
        lambda n, k: (
            n > c.small_n
            and n * k > c.small_weight
            and k < c.long_k
            or n > c.narrow_n
            and k >= c.long_k
            and n < c.wide_n
        )
    )
    small = cls(lambda n, k: n <= c.small_n and k <= c.long_k)
    small_weight = cls(lambda n, k: n * k <= c.small_weight and n > c.small_n)
    narrow_long = cls(lambda n, k: n <= c.narrow_n and k >= c.long_k)
    wide_long = cls(lambda n, k: n >= c.wide_n and k >= c.long_k)
    large = cls(lambda n, k: n >= c.wide_n and n * k >= c.large_weight)
    rest = cls(lambda n, k: not (n >= c.wide_n and n * k >= c.large_weight))

    gemv = pick(
        "gemv_max_m", _bound(by_shape, plain, "gemv", ("fused", "dequant"), tolerance), plain
    )
    fields = dict(
        gemv_max_m=max(gemv, _dispatch.DECODE_MAX_M),
        gemv_max_m_without_fused=pick(
            "gemv_max_m_without_fused",
            _bound(by_shape, shapes, "gemv", ("dequant",), tolerance),
            shapes,
        ),
    )

    def optional_rule(field, covered):
        if getattr(c, field) is None and not covered:
            return None
        bound = _bound(by_shape, covered, "gemv", ("fused", "dequant"), tolerance)
        value = pick(field, bound, covered)
        return None if value is None or value <= fields["gemv_max_m"] else value

    fields["gemv_max_m_small"] = optional_rule("gemv_max_m_small", small)
    fields["gemv_max_m_small_weight"] = optional_rule("gemv_max_m_small_weight", small_weight)
    fields["gemv_max_m_narrow_long"] = optional_rule("gemv_max_m_narrow_long", narrow_long)
    # The fused GEMM inside the GEMV's range on wide, long weights: from the first M past decode
    # at which it leads on every such shape up to the GEMV's bound.
    first = None
    wide_timings = [
        t
        for s in wide_long
        for t in by_shape[s]
        if _dispatch.DECODE_MAX_M < t.m <= fields["gemv_max_m"]
    ]
    if wide_timings and all("fused" in t.us and "gemv" in t.us for t in wide_timings):
        for m in sorted({t.m for t in wide_timings}):
            if all(_within(t, "fused", ("gemv",), 1.0) for t in wide_timings if t.m >= m):
                first = m
                break
        findings.append(f"{layout}.fused_min_m_wide_long = {first} from {sorted(wide_long)}")
    else:
        first = c.fused_min_m_wide_long
        findings.append(f"{layout}.fused_min_m_wide_long: no timing covers it here, kept {first!r}")
    fields["fused_min_m_wide_long"] = first
    start = fields["gemv_max_m"] + 1
    fused = _bound(by_shape, rest, "fused", ("dequant",), tolerance, start)
    fused_large = _bound(by_shape, large, "fused", ("dequant",), tolerance, start)
    fields["fused_max_m"] = pick("fused_max_m", fused, rest)
    fields["fused_max_m_large"] = max(
        pick("fused_max_m_large", fused_large, large), fields["fused_max_m"]
    )
    return dataclasses.replace(c, **fields)


def entry_literal(device_kind: str, entry: _dispatch.Entry) -> str:
    def crossovers(c):
        parts = [f"        {f.name}={getattr(c, f.name)!r}," for f in dataclasses.fields(c)]
        return "Crossovers(\n" + "\n".join(parts) + "\n    )"

    return (
        f"    {device_kind!r}: Entry(\n    spec={crossovers(entry.spec)},\n"
        f"    tiled={crossovers(entry.tiled)}),"
    )


def measure(shapes, ms, layout, args, budget, key, log) -> list[Timing]:
    timings = []

    def record(v: dispatch_check.Verdict) -> None:
        us = {b: t for b, t in v.us.items() if b in BACKENDS}
        log(
            f"{layout:5} {v.n:>6}x{v.k:<6} M={v.m:5}  "
            + "  ".join(f"{b} {t:8.2f}" for b, t in us.items())
        )
        timings.append(Timing(v.n, v.k, v.m, us))

    for shape, shape_key in zip(shapes, jax.random.split(key, len(shapes))):
        dispatch_check.check_shape(
            shape,
            ms,
            BACKENDS,
            layout=layout,
            dtype=bench.DTYPES[args.dtype],
            passes=args.passes,
            repeats=args.repeats,
            warmup=args.warmup,
            min_time_s=args.min_time,
            budget=budget,
            tolerance=args.tolerance,
            key=shape_key,
            record=record,
        )
    return timings


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shapes", default=None, help=f"NxK list (default {DEFAULT_SHAPES})")
    p.add_argument("--m", default=None, help=f"M list (default {DEFAULT_M})")
    p.add_argument("--layouts", default="spec,tiled")
    p.add_argument("--dtype", choices=sorted(bench.DTYPES), default="bf16")
    p.add_argument("--passes", type=int, default=2)
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--min-time", type=float, default=None, help="default 0.2 (0 with --quick)")
    p.add_argument(
        "--cache-mb",
        type=float,
        default=None,
        help="the cache the chains must exceed (default: the H200's L2; tiny with --quick)",
    )
    p.add_argument(
        "--tolerance",
        type=float,
        default=1.0,
        help="a backend 'leads' while within this ratio of the fastest (default 1.0)",
    )
    p.add_argument(
        "--device-kind",
        default=None,
        help="the table key to print (default: this machine's first GPU's)",
    )
    p.add_argument("--quick", action="store_true", help="tiny shapes and chains: a CPU smoke run")
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--json", metavar="PATH")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    shapes = [
        bench.parse_shape(s)
        for s in (args.shapes or (QUICK_SHAPES if args.quick else DEFAULT_SHAPES)).split(",")
    ]
    ms = [int(m) for m in (args.m or (QUICK_M if args.quick else DEFAULT_M)).split(",")]
    layouts = [x.strip() for x in args.layouts.split(",") if x.strip()]
    if set(layouts) - {"spec", "tiled"} or not layouts:
        raise SystemExit(f"--layouts: spec and/or tiled, got {args.layouts!r}")
    if args.min_time is None:
        args.min_time = 0.0 if args.quick else 0.2
    cache_mb = (
        args.cache_mb
        if args.cache_mb is not None
        else (0.03 if args.quick else bench.DEFAULT_CACHE_BYTES / bench.MB)
    )
    budget = bench.Budget(
        cache_bytes=int(cache_mb * bench.MB),
        max_layers=bench.QUICK_MAX_LAYERS if args.quick else bench.Budget.max_layers,
    )
    seed = args.seed if args.seed is not None else int.from_bytes(os.urandom(4), "little")
    log = functools.partial(print, file=sys.stderr, flush=True)
    device_kind = args.device_kind or _native.device_kind() or bench.default_device().device_kind
    capability = _native.device_capability()
    current = _dispatch.entry_for(device_kind, capability)
    log(
        f"tune dispatch on {bench.device_description()} (table key {device_kind!r}, capability "
        f"{capability}), layouts {layouts}, seed {seed}"
    )
    started = time.perf_counter()
    key = jax.random.key(seed)
    findings: list[str] = []
    derived, raw = {}, {}
    for layout, layout_key in zip(layouts, jax.random.split(key, len(layouts))):
        template = _dispatch.HOPPER.for_layout(layout == "tiled")
        template = dataclasses.replace(
            template,
            **{
                f.name: getattr(current.for_layout(layout == "tiled"), f.name)
                for f in dataclasses.fields(template)
                if f.name.startswith(("gemv_", "fused_"))
            },
        )
        timings = measure(shapes, ms, layout, args, budget, layout_key, log)
        raw[layout] = [dataclasses.asdict(t) for t in timings]
        derived[layout] = derive(timings, template, args.tolerance, findings, layout)
    entry = _dispatch.Entry(
        spec=derived.get("spec", current.spec), tiled=derived.get("tiled", current.tiled)
    )
    log(f"done in {time.perf_counter() - started:.1f} s")
    for finding in findings:
        log(finding)
    if args.json:
        bench.write_json_file(
            args.json,
            {
                "device": bench.device_description(),
                "device_kind": device_kind,
                "jax_version": jax.__version__,
                "seed": seed,
                "tolerance": args.tolerance,
                "timings": raw,
                "findings": findings,
                "entry": {
                    "spec": dataclasses.asdict(entry.spec),
                    "tiled": dataclasses.asdict(entry.tiled),
                },
            },
        )
    print(
        f"# jax_fp4/dispatch.py TABLES entry measured by benchmarks/tune_dispatch.py "
        f"(tolerance {args.tolerance})"
    )
    print(entry_literal(device_kind, entry))
    return 0


if __name__ == "__main__":
    sys.exit(main())
