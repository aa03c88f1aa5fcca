"""Does `auto` pick the fastest jax_fp4 backend? The dispatch's goal (the default within 5% of the
fastest of gemv / fused / dequant at every M), measured with the bench's method.

    python benchmarks/dispatch_check.py --layout tiled --m 9,16,32,1024,2048 --json dispatch.json

Each row (shape, M) times every backend of --backends that can serve it (one that the dispatch
refuses at trace time, e.g. fused on a GPU that is not a Hopper, is left out) and auto's own pick,
all on the same weights and activations: `bench`'s chains of distinct weights rotating
beyond the cache, per-matmul time by chain differencing. With --passes P the backends take turns P times and each
keeps its median. The verdict: auto's time over the fastest backend's, within --tolerance or not.

    python benchmarks/dispatch_check.py --rejudge dispatch.json [more.json ...] --json rejudged.json

judges earlier runs' times again with this checkout's dispatch rules (auto's pick by
`jax_fp4.dispatch.plan` for the run's GPU: its device kind's table entry, compute capability 9.0
unless --capability says otherwise), as one table: every backend was timed, so a rule changed
after a run is checked against the same measurements without the GPU.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import math
import os
import statistics
import sys
import time
from collections.abc import Callable, Sequence

import bench
import jax
import jax.numpy as jnp
import numpy as np

import jax_fp4
from jax_fp4 import dispatch as _dispatch
from jax_fp4.config import parse_capability

DEFAULT_BACKENDS = ("gemv", "fused", "dequant")
DEFAULT_TOLERANCE = 1.05  # auto within 5% of the fastest backend
DEFAULT_SHAPES = "11008x4096,4096x11008,17408x5120,28672x8192"
DEFAULT_M = "1,8,9,12,16,17,32,64,128,256,512,1024,2048,4096"


@dataclasses.dataclass(frozen=True)
class Verdict:
    n: int
    k: int
    m: int
    layout: str
    us: dict[str, float]  # backend -> median per-matmul time over the passes
    us_passes: dict[str, list[float]]
    noisy: list[str]  # backends with a noisy pass (chain difference not positive)
    auto: str  # the backend `auto` picks
    fastest: str
    auto_over_fastest: float
    within: bool


def judge(us: dict[str, float], auto: str, tolerance: float) -> tuple[str, float, bool]:
    """(fastest backend, auto's time / the fastest's, whether that is within `tolerance`)."""
    fastest = min(us, key=us.get)
    ratio = us[auto] / us[fastest]
    return fastest, ratio, ratio <= tolerance


@functools.partial(jax.jit, static_argnums=(1, 2))
def _make_weight(key, n: int, k: int) -> jax_fp4.NVFP4Weight:
    # The bench's inputs (bench._make_layer_weights) without the dense copy no row here times.
    return jax_fp4.quantize(jax.random.normal(key, (n, k), jnp.float32) / math.sqrt(k))


def servable(backends: Sequence[str], a, w) -> list[str]:
    """The backends of `backends` that the dispatch accepts for (a, w) on the default device."""
    found = []
    for backend in backends:
        try:
            jax_fp4.dispatch_path(a, w, backend=backend)
        except ValueError:
            continue
        found.append(backend)
    return found


def check_shape(
    shape: bench.Shape,
    ms: Sequence[int],
    backends: Sequence[str],
    *,
    layout: str,
    dtype,
    passes: int,
    repeats: int,
    warmup: int,
    min_time_s: float,
    budget: bench.Budget,
    tolerance: float,
    key,
    record: Callable[[Verdict], None],
) -> None:
    """Times every backend of `backends` (and auto's pick) at each M; `record` gets each row's
    verdict as soon as it is measured."""
    itemsize = np.dtype(dtype).itemsize
    l1, l2 = bench.chain_lengths(
        bench.nvfp4_weight_bytes(shape.n, shape.k), shape.n * shape.k * itemsize, budget
    )  # the bench's chains
    weight_key, act_key = jax.random.split(key)
    weights = [
        bench.in_layout(_make_weight(k, shape.n, shape.k), layout)
        for k in jax.random.split(weight_key, l2)
    ]
    for m, m_key in zip(ms, jax.random.split(act_key, len(ms))):
        acts = bench.make_activations(m_key, m, shape.k, l2, dtype)
        auto = jax_fp4.dispatch_path(acts[0], weights[0])
        timed = servable(list(dict.fromkeys([*backends, auto])), acts[0], weights[0])
        runs = {b: [] for b in timed}
        for _ in range(passes):
            for b in timed:
                runs[b].append(
                    bench.time_chain(
                        bench.chain_of(bench.fp4_layer(b)),
                        (acts, weights),
                        l1,
                        l2,
                        repeats,
                        warmup,
                        min_time_s,
                    )
                )
        us = {b: statistics.median(t.us for t in runs[b]) for b in timed}
        fastest, ratio, within = judge(us, auto, tolerance)
        v = Verdict(
            shape.n,
            shape.k,
            m,
            weights[0].layout,
            us,
            {b: [t.us for t in runs[b]] for b in timed},
            [b for b in timed if any(t.noisy for t in runs[b])],
            auto,
            fastest,
            ratio,
            within,
        )
        record(v)
        del acts


def device_kind_of(device: str | None) -> str | None:
    """The device kind of a run's "device" entry ("gpu:NVIDIA H200" -> "NVIDIA H200")."""
    if not device:
        return None
    return device.partition(":")[2] or None


def rejudged(
    row: dict, dtype: str, tolerance: float, capability=(9, 0), device_kind: str | None = None
) -> Verdict:
    """A verdict of a dispatch_check.py JSON row with auto's pick by this checkout's rules, for a
    GPU of `capability` and `device_kind` (None: the capability's table entry)."""
    problem = _dispatch.Problem(
        m=row["m"],
        n=row["n"],
        k=row["k"],
        block_size=16,
        dtype=np.dtype(bench.DTYPES[dtype]),
        tiled=row["layout"] == "tiled",
    )
    auto = _dispatch.plan(problem, _dispatch.cuda_target(capability, device_kind=device_kind)).path
    if auto not in row["us"]:
        raise ValueError(
            f"row {row['n']}x{row['k']} M = {row['m']}: the rules pick {auto!r}, "
            f"which that run did not time (it timed {sorted(row['us'])})"
        )
    fastest, ratio, within = judge(row["us"], auto, tolerance)
    return Verdict(
        row["n"],
        row["k"],
        row["m"],
        row["layout"],
        row["us"],
        row["us_passes"],
        row["noisy"],
        auto,
        fastest,
        ratio,
        within,
    )


def format_verdict(v: Verdict) -> str:
    times = "  ".join(f"{b} {us:8.2f}{'?' if b in v.noisy else ''}" for b, us in v.us.items())
    return (
        f"{v.n:>6}x{v.k:<6} {v.m:5}  {times}  | fastest {v.fastest}, auto {v.auto} "
        f"x{v.auto_over_fastest:.2f} {'ok' if v.within else 'MISS'}"
    )


def markdown(verdicts: Sequence[Verdict], backends: Sequence[str]) -> str:
    columns = list(dict.fromkeys([*backends, *(b for v in verdicts for b in v.us)]))
    lines = [
        "| N x K | M | "
        + " | ".join(f"{b} us" for b in columns)
        + " | fastest | auto | auto / fastest | within |",
        "|---|---:|" + "---:|" * len(columns) + "---|---|---:|---|",
    ]
    for v in verdicts:
        cells = [
            f"{v.us[b]:.1f}{'?' if b in v.noisy else ''}" if b in v.us else "-" for b in columns
        ]
        lines.append(
            f"| {v.n}x{v.k} | {v.m} | "
            + " | ".join(cells)
            + f" | {v.fastest} | {v.auto} | {v.auto_over_fastest:.2f} | "
            + ("yes" if v.within else "**no**")
            + " |"
        )
    return "\n".join(lines)


def summary(verdicts: Sequence[Verdict], tolerance: float) -> str:
    within = sum(v.within for v in verdicts)
    return (
        f"auto within {100 * (tolerance - 1):.0f}% of the fastest backend on {within} of "
        f"{len(verdicts)} rows"
    )


def _capability(text: str) -> tuple[int, int]:
    try:
        return parse_capability(text)
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from None


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shapes", default=DEFAULT_SHAPES, help=f"NxK list (default {DEFAULT_SHAPES})")
    p.add_argument("--m", default=DEFAULT_M, help=f"M list (default {DEFAULT_M})")
    p.add_argument(
        "--backends",
        default=",".join(DEFAULT_BACKENDS),
        help="backends to time besides auto's pick (default gemv,fused,dequant)",
    )
    p.add_argument("--layout", choices=("spec", "tiled"), default="tiled")
    p.add_argument("--dtype", choices=sorted(bench.DTYPES), default="bf16")
    p.add_argument("--passes", type=int, default=2)
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--min-time", type=float, default=0.2)
    p.add_argument(
        "--cache-mb",
        type=float,
        default=bench.DEFAULT_CACHE_BYTES / bench.MB,
        help="the cache the chains must exceed (default: the H200's L2)",
    )
    p.add_argument("--tolerance", type=float, default=DEFAULT_TOLERANCE)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--json", metavar="PATH")
    p.add_argument(
        "--rejudge",
        metavar="JSON",
        nargs="+",
        help="judge earlier --json runs' times with the current rules; times nothing",
    )
    p.add_argument(
        "--capability",
        type=_capability,
        default=(9, 0),
        help="--rejudge: the compute capability the runs' GPU has (default 9.0)",
    )
    return p


def write_json(path: str, header: dict, verdicts: Sequence[Verdict]) -> None:
    bench.write_json_file(path, {**header, "rows": [dataclasses.asdict(v) for v in verdicts]})


def rejudge_main(args, command: str) -> int:
    runs = [json.loads(open(path).read()) for path in args.rejudge]
    verdicts = [
        rejudged(
            row,
            run["dtype"],
            args.tolerance,
            capability=args.capability,
            device_kind=device_kind_of(run.get("device")),
        )
        for run in runs
        for row in run["rows"]
    ]
    shapes = list(dict.fromkeys((v.n, v.k) for v in verdicts))  # the runs' shape order, then M
    verdicts.sort(key=lambda v: (v.layout, shapes.index((v.n, v.k)), v.m))
    if args.json:
        write_json(
            args.json,
            {
                "rejudged": command,
                "tolerance": args.tolerance,
                "runs": [{k: v for k, v in run.items() if k != "rows"} for run in runs],
            },
            verdicts,
        )
    print(markdown(verdicts, list(dict.fromkeys(b for v in verdicts for b in v.us))))
    print()
    print(summary(verdicts, args.tolerance))
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    for name in ("passes", "repeats", "warmup"):
        if getattr(args, name) < 1:
            raise SystemExit(f"--{name} must be >= 1, got {getattr(args, name)}")
    if args.tolerance < 1:
        raise SystemExit(f"--tolerance is a ratio >= 1 (1.05: within 5%), got {args.tolerance}")
    command = "python benchmarks/dispatch_check.py " + " ".join(
        argv if argv is not None else sys.argv[1:]
    )
    if args.rejudge:
        return rejudge_main(args, command)
    backends = [b.strip() for b in args.backends.split(",") if b.strip()]
    unknown = [b for b in backends if b not in jax_fp4.BACKENDS or b == "auto"]
    if unknown:
        raise SystemExit(
            f"--backends: unknown {unknown}; choose from "
            f"{[b for b in jax_fp4.BACKENDS if b != 'auto']}"
        )
    shapes = [bench.parse_shape(s) for s in args.shapes.split(",")]
    ms = [int(m) for m in args.m.split(",")]
    seed = args.seed if args.seed is not None else int.from_bytes(os.urandom(4), "little")
    budget = bench.Budget(cache_bytes=int(args.cache_mb * bench.MB))
    log = functools.partial(print, file=sys.stderr, flush=True)
    log(
        f"dispatch check on {bench.device_description()}, layout {args.layout}, dtype {args.dtype}, "
        f"backends {backends} + auto, {args.passes} passes, seed {seed}"
    )
    started = time.perf_counter()
    verdicts = []

    def record(v: Verdict) -> None:
        log(format_verdict(v))
        verdicts.append(v)
        if args.json:  # after every row, so a run cut short by a time limit keeps what it measured
            write_json(
                args.json,
                {
                    "device": bench.device_description(),
                    "jax_version": jax.__version__,
                    "command": command,
                    "layout": args.layout,
                    "dtype": args.dtype,
                    "tolerance": args.tolerance,
                    "passes": args.passes,
                    "seed": seed,
                },
                verdicts,
            )

    for shape, key in zip(shapes, jax.random.split(jax.random.key(seed), len(shapes))):
        check_shape(
            shape,
            ms,
            backends,
            layout=args.layout,
            dtype=bench.DTYPES[args.dtype],
            passes=args.passes,
            repeats=args.repeats,
            warmup=args.warmup,
            min_time_s=args.min_time,
            budget=budget,
            tolerance=args.tolerance,
            key=key,
            record=record,
        )
    log(f"done in {time.perf_counter() - started:.1f} s")
    print(markdown(verdicts, backends))
    print()
    print(summary(verdicts, args.tolerance))
    return 0


if __name__ == "__main__":
    sys.exit(main())
