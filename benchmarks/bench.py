"""Benchmark jax_fp4.matmul against what JAX users get today: `python benchmarks/bench.py`.

For every (shape N x K, M, dtype) row, measured in the same run:

  jax_fp4   jax_fp4.matmul(a, w) with the default dispatch ("auto") or a forced --backend.
  bf16      a @ W.T with W the dense [N, K] weight in the activation dtype (bf16, or fp16 with
            --dtype fp16). [N, K] row-major is the natural layout: XLA lowers the transpose into the
            dot's dimension numbers (cuBLAS "TN"), so no copy of W is made.
  naive     NVFP4 dequantized in plain jnp as a user would write it (a 16-entry table lookup of the
            E2M1 codes, times the E4M3 block scale and the global scale, in the activation dtype),
            then a @ W.T in that dtype. Not backend="reference", which works in float32 at HIGHEST.
  read      a plain streaming read of the NVFP4 weight's bytes: the fastest of three XLA reductions
            over a uint32 buffer of that size (READ_KERNELS). What the memory system delivers to an
            XLA kernel of that size: the yardstick for `fraction_of_read_bw` and `floor_us`.

Method (benchmarks/README.md has the details): each variant runs as a jitted
chain of L layers, each layer with its own weight and activation, so that the weights rotate through
several times the 60 MB L2 and no layer reads another's weight from cache. Every layer's output passes an optimization barrier and one
element of it joins a scalar sum, so XLA can neither drop nor shrink any matmul. Two chains, L1 < L2
layers, take the same argument lists (the shorter one leaves the last L2 - L1 layers unused, with
jit(keep_unused=True)), so host dispatch cost is identical; the time per matmul is
(t(L2) - t(L1)) / (L2 - L1): fixed costs cancel. Each t is the median of --repeats calls (more for
cheap rows, see --min-time) timed with time.perf_counter around a block_until_ready'ed call of the
compiled chain, after --warmup calls; L1 and L2 calls alternate. With --passes P > 1 each row is
timed P times (all three variants per pass, the passes one after another) and reports the median
pass, with every pass's jax_fp4 time in `us_passes`: rows that move between passes show it.
Inputs are fresh normal random numbers (seeded from --seed, or from the OS when not given).

Bytes per matmul (for TB/s and floors): packed N*K/2 + scales N*ceil(K/16) + global scale 4 +
activations M*K*2 + outputs M*N*2. floor_us = bytes / measured read bandwidth.
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

import jax
import jax.numpy as jnp
import numpy as np

import jax_fp4
from jax_fp4 import ffi as _ffi
from jax_fp4.format import E2M1_VALUES
from jax_fp4.ops import default_device
from jax_fp4.prepacking import in_layout

MB = 1_000_000
GB = 1_000_000_000

DEFAULT_M = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 4096)
QUICK_M = (1, 4, 16)

# Defaults sized for an H200: 60 MB of L2, 141 GB of HBM.
DEFAULT_CACHE_BYTES = 60 * MB
DEFAULT_DENSE_CAP_BYTES = 8 * GB  # most dense 16-bit weight bytes one chain may hold
QUICK_CACHE_BYTES = 64 * 1024  # --quick: CPU-sized chains (a few layers of tiny weights)
QUICK_MAX_LAYERS = 8


@dataclasses.dataclass(frozen=True)
class Shape:
    """A weight [N, K]; `max_m` limits the M sweep (a vocabulary-sized lm_head only decodes)."""

    n: int
    k: int
    max_m: int | None = None

    @property
    def name(self) -> str:
        return f"{self.n}x{self.k}"

    def ms(self, ms: Sequence[int]) -> list[int]:
        return [m for m in ms if self.max_m is None or m <= self.max_m]


DEFAULT_SHAPES = (
    Shape(4096, 4096),
    Shape(11008, 4096),
    Shape(4096, 11008),
    Shape(17408, 5120),
    Shape(28672, 8192),
    Shape(5120, 17408, max_m=8),  # decode-only: a down projection with long rows
    Shape(248320, 2048, max_m=8),  # lm_head
)
QUICK_SHAPES = (Shape(256, 512), Shape(512, 256))

DTYPES = {"bf16": jnp.bfloat16, "fp16": jnp.float16}


# ---- byte and flop counts -----------------------------------------------------------------------


def nvfp4_weight_bytes(n: int, k: int, block_size: int = 16) -> int:
    """Packed codes + E4M3 block scales + the f32 global scale."""
    return n * (k // 2) + n * math.ceil(k / block_size) + 4


def io_bytes(m: int, n: int, k: int, itemsize: int) -> int:
    """Activations read plus outputs written."""
    return m * k * itemsize + m * n * itemsize


def matmul_flops(m: int, n: int, k: int) -> int:
    return 2 * m * n * k


@dataclasses.dataclass(frozen=True)
class Budget:
    """How large the chains are: sized from the cache, capped by the dense weights' memory."""

    cache_bytes: int = DEFAULT_CACHE_BYTES
    dense_cap_bytes: int = DEFAULT_DENSE_CAP_BYTES
    max_layers: int = 256


def chain_lengths(layer_bytes: int, dense_layer_bytes: int, budget: Budget) -> tuple[int, int]:
    """(L1, L2): the L1 chain holds >= 2x the cache of NVFP4 weights, and the L2 - L1 layers that
    the difference measures another >= 6x, so no layer finds its weight in cache; the dense chain
    stays under the memory cap (a single layer of a vocabulary-sized weight already exceeds L2), and
    no chain is longer than `max_layers`."""
    l1 = max(1, math.ceil(2 * budget.cache_bytes / layer_bytes))
    l2 = l1 + max(4, math.ceil(6 * budget.cache_bytes / layer_bytes))
    cap = max(2, min(budget.max_layers, budget.dense_cap_bytes // dense_layer_bytes))
    if l2 > cap:
        l2 = cap
        l1 = max(1, min(l1, l2 // 3))
    return l1, l2


# ---- timing ------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class ChainTiming:
    """Per-layer device time from two chain lengths."""

    us: float  # per layer
    l1: int
    l2: int
    t1_us: float  # median time of one call of each chain
    t2_us: float
    noisy: bool = (
        False  # the difference was not positive: `us` falls back to t2 / L2 (an upper bound)
    )
    iqr_us: float = 0.0  # interquartile range of the per-pair estimates (t2_i - t1_i) / (L2 - L1)


def _time_once(fn: Callable, args) -> float:
    t0 = time.perf_counter()
    jax.block_until_ready(fn(*args))
    return time.perf_counter() - t0


def time_chain(
    make_chain: Callable[[int], Callable],
    args,
    l1: int,
    l2: int,
    repeats: int,
    warmup: int,
    min_time_s: float = 0.0,
) -> ChainTiming:
    """Compile the L1 and L2 chains once each, warm both up, then alternate timed calls: `repeats`
    pairs, or more (up to 10x) where that many pairs take less than `min_time_s`."""
    f1 = jax.jit(make_chain(l1), keep_unused=True).lower(*args).compile()
    f2 = jax.jit(make_chain(l2), keep_unused=True).lower(*args).compile()
    # Warm up for `warmup` pairs and at least a quarter of min_time_s: the device idled while
    # compiling, and its clocks take a moment to come back up.
    warm_until = time.perf_counter() + min_time_s / 4
    done = 0
    while done < max(warmup, 1) or time.perf_counter() < warm_until:
        pair_s = _time_once(f1, args) + _time_once(f2, args)
        done += 1
    if min_time_s > 0:
        repeats = max(repeats, min(10 * repeats, math.ceil(min_time_s / pair_s)))
    t1, t2 = [], []
    for _ in range(repeats):
        t1.append(_time_once(f1, args))
        t2.append(_time_once(f2, args))
    m1, m2 = statistics.median(t1) * 1e6, statistics.median(t2) * 1e6
    iqr = pair_estimates_iqr(t1, t2, l2 - l1)
    diff = (m2 - m1) / (l2 - l1)
    if diff > 0:
        return ChainTiming(diff, l1, l2, m1, m2, iqr_us=iqr)
    return ChainTiming(m2 / l2, l1, l2, m1, m2, noisy=True, iqr_us=iqr)


def pair_estimates_iqr(t1: Sequence[float], t2: Sequence[float], layers: int) -> float:
    """The spread of the single-pair estimates (t2_i - t1_i) / layers, in us per layer: their
    interquartile range (0 with fewer than two pairs). The median of the pairs is far steadier
    than one pair; a large IQR next to a small `us` says the row is dominated by host jitter."""
    if len(t1) < 2:
        return 0.0
    quartiles = statistics.quantiles([(b - a) * 1e6 / layers for a, b in zip(t1, t2)], n=4)
    return quartiles[2] - quartiles[0]


def warm_up_device(seconds: float) -> None:
    """Keep the device busy for `seconds` (dense matmuls) so the first measurement does not run at
    idle clocks."""
    x = jax.random.normal(jax.random.key(0), (4096, 4096), jnp.float32).astype(jnp.bfloat16)
    step = jax.jit(lambda x: x @ x)
    deadline = time.perf_counter() + seconds
    while time.perf_counter() < deadline:
        jax.block_until_ready(step(x))


def chain_of(layer: Callable) -> Callable[[int], Callable]:
    """make_chain(L): a function of per-layer operand lists (each of length >= L) that runs
    `layer(*operands)` on the first L layers and sums one element of each output, taken behind an
    optimization barrier so that XLA must compute every output in full."""

    def make_chain(length: int):
        def chain(*operand_lists):
            total = jnp.zeros((), jnp.float32)
            for operands in zip(*(ops[:length] for ops in operand_lists)):
                y = jax.lax.optimization_barrier(layer(*operands))
                total = total + y.reshape(-1)[0].astype(jnp.float32)
            return total

        return chain

    return make_chain


def fit_width(x, width: int):
    """x [M, N] -> [M, width]: its first `width` columns, or its columns repeated up to `width`
    (what joins a matmul's output to the next one's input in a dependent chain)."""
    n = x.shape[-1]
    if n < width:
        x = jnp.tile(x, (1, -(-width // n)))
    return x if x.shape[-1] == width else x[:, :width]


def dependent_chain_of(layer: Callable) -> Callable[[int], Callable]:
    """make_chain(L) for a chain in which each layer's output feeds the next, as in a model: a
    function of (x [M, K], weights) that runs x = fit_width(layer(x, w), K) over the first L
    weights (all of one shape) and returns the last x. Each output passes an optimization barrier,
    so XLA can neither shrink a matmul to the columns the next one takes nor merge two. Where N !=
    K the joint is a small XLA kernel per layer (`glue_chain` measures it)."""

    def make_chain(length: int):
        def chain(x, weights):
            for w in weights[:length]:
                x = fit_width(jax.lax.optimization_barrier(layer(x, w)), x.shape[-1])
            return x

        return chain

    return make_chain


def glue_chain(n: int) -> Callable[[int], Callable]:
    """make_chain(L) with the joints of `dependent_chain_of` alone, for weights [n, K]: the same
    arguments (x [M, K], weights, unused), and per layer one XLA kernel taking an [M, n] array to
    [M, K] and back (fused into one), so the dependent chain's time per layer minus this one's is
    the matmul's."""

    def make_chain(length: int):
        def chain(x, weights):
            k = x.shape[-1]
            z = fit_width(x, n)
            for _ in weights[:length]:
                z = jax.lax.optimization_barrier(fit_width(fit_width(z, k), n))
            return fit_width(z, k)

        return chain

    return make_chain


# Streaming reads of a uint32 buffer (a multiple of READ_ROW words): XLA emits a different reduction
# kernel for each; the fastest is the achievable read bandwidth at that size.
READ_ROW = 8192
READ_KERNELS = {  # --quick tries only "sum"
    "sum": lambda b: jnp.sum(b, dtype=jnp.uint32),
    "row_sums": lambda b: jnp.sum(b.reshape(-1, READ_ROW), axis=1, dtype=jnp.uint32),
    "col_sums": lambda b: jnp.sum(b.reshape(-1, 4096), axis=0, dtype=jnp.uint32),
}


# ---- the three matmuls --------------------------------------------------------------------------


def naive_dequantize(w: jax_fp4.NVFP4Weight, dtype) -> jax.Array:
    """NVFP4 -> dense [N, K] in plain jnp, the way a user would write it: table lookup in `dtype`."""
    codes = jnp.stack([w.packed & 0xF, w.packed >> 4], axis=-1).reshape(w.n, w.k)
    values = jnp.asarray(E2M1_VALUES, dtype)[codes]
    scale = w.scale
    if scale.dtype == jnp.uint8:
        scale = jax.lax.bitcast_convert_type(scale, jnp.float8_e4m3fn)
    scale = jnp.repeat(scale.astype(dtype), w.block_size, axis=-1)[:, : w.k]
    return values * scale * w.global_scale.astype(dtype)


def fp4_layer(backend: str | None, tuning: jax_fp4.KernelTuning | None = None) -> Callable:
    def jax_fp4_matmul(a, w):
        return jax_fp4.matmul(a, w, backend=backend, tuning=tuning)

    return jax_fp4_matmul


def parse_tuning(text: str | None) -> jax_fp4.KernelTuning | None:
    """'fused_tile_m=64,programmatic_launch=1' -> KernelTuning(fused_tile_m=64,
    programmatic_launch=True): the kernel choices a measurement fixes (None for an empty text).
    Booleans take 0/1/true/false; the tri-state ones (default None: fused_warp_specialized,
    fused_stream_k) also 'auto' (None)."""
    if not text:
        return None
    fields = {f.name: f for f in dataclasses.fields(jax_fp4.KernelTuning)}
    values = {}
    for item in text.split(","):
        name, eq, raw = item.strip().partition("=")
        if not eq or name not in fields:
            raise ValueError(
                f"tuning: expected NAME=VALUE with NAME one of {sorted(fields)}, got {item!r}"
            )
        raw = raw.strip().lower()
        default = fields[name].default
        if default is None or isinstance(default, bool):
            booleans = {"1": True, "true": True, "0": False, "false": False}
            if default is None:
                booleans["auto"] = None
            if raw not in booleans:
                raise ValueError(f"tuning: {name} takes {'/'.join(booleans)}, got {raw!r}")
            values[name] = booleans[raw]
        else:
            try:
                values[name] = int(raw)
            except ValueError:
                raise ValueError(f"tuning: {name} takes an integer, got {raw!r}") from None
    return jax_fp4.KernelTuning(**values)


def dense_layer(a, w):
    return a @ w.T


def bf16_peak_tflops(size: int = 8192, repeats: int = 20) -> float:
    """The bf16 jnp.dot rate on a large square GEMM (size^3, random inputs), the median of
    `repeats` timed calls: the compute ceiling a matmul's compute floor is measured against."""
    a, b = (
        jax.random.normal(key, (size, size), jnp.float32).astype(jnp.bfloat16)
        for key in jax.random.split(jax.random.key(0), 2)
    )
    dot = jax.jit(lambda a, b: a @ b)
    jax.block_until_ready(dot(a, b))
    times = sorted(_time_once(dot, (a, b)) for _ in range(repeats))
    return tflops(2 * size**3, times[len(times) // 2] * 1e6)


def naive_layer(a, w):
    return a @ naive_dequantize(w, a.dtype).T


# ---- inputs ------------------------------------------------------------------------------------


@functools.partial(jax.jit, static_argnums=(1, 2, 3))
def _make_layer_weights(key, n: int, k: int, dtype):
    w = jax.random.normal(key, (n, k), jnp.float32) / math.sqrt(k)
    return w.astype(dtype), jax_fp4.quantize(w)


def make_weights(key, shape: Shape, count: int, dtype) -> tuple[list, list]:
    """`count` distinct random weights: (dense [N, K] in dtype, NVFP4Weight) lists."""
    dense, fp4 = [], []
    for layer_key in jax.random.split(key, count):
        d, q = _make_layer_weights(layer_key, shape.n, shape.k, dtype)
        dense.append(d)
        fp4.append(q)
    return dense, fp4


@functools.partial(jax.jit, static_argnums=(1, 2))
def _make_activation(key, shape: tuple[int, ...], dtype):
    return jax.random.normal(key, shape, jnp.float32).astype(dtype)


def make_activations(key, m: int, k: int, count: int, dtype) -> list:
    return [
        _make_activation(layer_key, (m, k), dtype) for layer_key in jax.random.split(key, count)
    ]


@functools.partial(jax.jit, static_argnums=(1,))
def _make_buffer(key, words: int):
    return jax.random.bits(key, (words,), jnp.uint32)


# ---- results ------------------------------------------------------------------------------------


@dataclasses.dataclass
class Row:
    """One (shape, M, dtype) measurement. Times are per matmul; bf16_* is the dense 16-bit baseline
    in the row's dtype, naive_* the jnp dequantize-then-dot baseline (its TB/s on the NVFP4 bytes)."""

    path: str
    m: int
    n: int
    k: int
    dtype: str
    us: float
    tbps: float
    tflops: float
    speedup_vs_bf16: float
    speedup_vs_naive: float
    bf16_us: float
    naive_us: float
    read_bw_tbps: float
    fraction_of_read_bw: float
    floor_us: float
    bytes: int
    bf16_bytes: int
    bf16_tbps: float
    bf16_tflops: float
    naive_tbps: float
    naive_tflops: float
    layers: tuple[int, int]
    noisy: bool
    layout: str = "spec"  # the jax_fp4 weights' layout ("tiled": jax_fp4.prepack)
    us_iqr: float = 0.0  # jax_fp4's ChainTiming.iqr_us: the spread of its single-pair estimates
    us_passes: tuple[float, ...] = ()  # jax_fp4's time in each pass (--passes > 1), in pass order


@dataclasses.dataclass
class ReadBandwidth:
    """The fastest of READ_KERNELS over buffers of `bytes_per_layer`, chained like the matmuls."""

    bytes_per_layer: int
    us: float
    tbps: float
    kernel: str
    layers: tuple[int, int]
    noisy: bool


def tbps(nbytes: int, us: float) -> float:
    return nbytes / (us * 1e-6) / 1e12


def tflops(flops: int, us: float) -> float:
    return flops / (us * 1e-6) / 1e12


# A row whose passes (--passes > 1) differ by more than this ratio is marked '~' in the tables:
# it moved within the run, so its time is less certain than the method's usual spread.
UNSTEADY_PASS_RATIO = 1.10


def unsteady(us_passes: Sequence[float]) -> bool:
    """Whether a row's per-pass times (Row.us_passes; empty with one pass) spread too far."""
    return len(us_passes) > 1 and max(us_passes) > UNSTEADY_PASS_RATIO * min(us_passes)


def row_mark(noisy: bool, us_passes: Sequence[float]) -> str:
    """'?' for a noisy row (its chain difference was not positive), '~' for an unsteady one."""
    return "?" if noisy else ("~" if unsteady(us_passes) else "")


def median_pass(passes: Sequence[ChainTiming]) -> ChainTiming:
    """One timing from several passes over the same chains: the median pass by per-layer time (the
    lower middle one for an even count), noisy if any pass was."""
    ranked = sorted(passes, key=lambda t: t.us)
    chosen = ranked[(len(ranked) - 1) // 2]
    return dataclasses.replace(chosen, noisy=any(t.noisy for t in passes))


def make_row(
    path: str,
    m: int,
    shape: Shape,
    dtype_name: str,
    fp4: ChainTiming,
    dense: ChainTiming,
    naive: ChainTiming,
    read: ReadBandwidth,
    layout: str = "spec",
    us_passes: tuple[float, ...] = (),
) -> Row:
    itemsize = np.dtype(DTYPES[dtype_name]).itemsize
    n, k = shape.n, shape.k
    nbytes = nvfp4_weight_bytes(n, k) + io_bytes(m, n, k, itemsize)
    dense_bytes = n * k * itemsize + io_bytes(m, n, k, itemsize)
    flops = matmul_flops(m, n, k)
    fp4_tbps = tbps(nbytes, fp4.us)
    return Row(
        path=path,
        m=m,
        n=n,
        k=k,
        dtype=dtype_name,
        us=fp4.us,
        tbps=fp4_tbps,
        tflops=tflops(flops, fp4.us),
        speedup_vs_bf16=dense.us / fp4.us,
        speedup_vs_naive=naive.us / fp4.us,
        bf16_us=dense.us,
        naive_us=naive.us,
        read_bw_tbps=read.tbps,
        fraction_of_read_bw=fp4_tbps / read.tbps,
        floor_us=nbytes / (read.tbps * 1e12) * 1e6,
        bytes=nbytes,
        bf16_bytes=dense_bytes,
        bf16_tbps=tbps(dense_bytes, dense.us),
        bf16_tflops=tflops(flops, dense.us),
        naive_tbps=tbps(nbytes, naive.us),
        naive_tflops=tflops(flops, naive.us),
        layers=(fp4.l1, fp4.l2),
        noisy=fp4.noisy or dense.noisy or naive.noisy or read.noisy,
        layout=layout,
        us_iqr=fp4.iqr_us,
        us_passes=us_passes,
    )


# ---- measurements -------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Settings:
    dtype_name: str = "bf16"
    backend: str | None = None
    layout: str = "spec"  # "tiled": the jax_fp4 weights prepacked (where the shape allows)
    tuning: jax_fp4.KernelTuning | None = None  # kernel choices fixed for the jax_fp4 matmuls
    repeats: int = 10
    warmup: int = 2
    min_time_s: float = 0.2  # time at least this long per chain pair (more repeats, up to 10x)
    passes: int = 1  # times each row is measured (median_pass)
    read_kernels: tuple[str, ...] = tuple(READ_KERNELS)
    budget: Budget = Budget()

    @property
    def dtype(self):
        return DTYPES[self.dtype_name]


class Bench:
    """Runs the measurements; caches the read bandwidth per byte count."""

    def __init__(self, settings: Settings, key, log: Callable[[str], None] = lambda s: None):
        self.settings = settings
        self.key = key
        self.log = log
        self._read: dict[int, ReadBandwidth] = {}

    @property
    def reads(self) -> list[ReadBandwidth]:
        return list(self._read.values())

    def _next_key(self):
        self.key, key = jax.random.split(self.key)
        return key

    def _time(self, make_chain, args, l1, l2) -> ChainTiming:
        s = self.settings
        return time_chain(make_chain, args, l1, l2, s.repeats, s.warmup, s.min_time_s)

    def read_bandwidth(self, layer_bytes: int) -> ReadBandwidth:
        """Streaming-read bandwidth over buffers of about `layer_bytes` each (rounded up to whole
        rows of READ_ROW words), chained like the matmuls: the fastest of READ_KERNELS."""
        if layer_bytes in self._read:
            return self._read[layer_bytes]
        words = math.ceil(layer_bytes / 4 / READ_ROW) * READ_ROW
        nbytes = 4 * words
        l1, l2 = chain_lengths(nbytes, nbytes, self.settings.budget)
        buffers = [_make_buffer(key, words) for key in jax.random.split(self._next_key(), l2)]
        best = None
        for name in self.settings.read_kernels:
            t = self._time(chain_of(READ_KERNELS[name]), (buffers,), l1, l2)
            if best is None or (not t.noisy and (best[1].noisy or t.us < best[1].us)):
                best = (name, t)
        name, t = best
        result = ReadBandwidth(nbytes, t.us, tbps(nbytes, t.us), name, (l1, l2), t.noisy)
        self._read[layer_bytes] = result
        self.log(
            f"read bandwidth, {nbytes / MB:.1f} MB per buffer: {result.tbps:.3f} TB/s ({name})"
        )
        return result

    def shape_rows(self, shape: Shape, ms: Sequence[int]) -> list[Row]:
        """All rows of one weight shape: the weights are made once, each M compiles its chains."""
        s = self.settings
        itemsize = np.dtype(s.dtype).itemsize
        layer_bytes = nvfp4_weight_bytes(shape.n, shape.k)
        read = self.read_bandwidth(layer_bytes)
        l1, l2 = chain_lengths(layer_bytes, shape.n * shape.k * itemsize, s.budget)
        dense_ws, fp4_ws = make_weights(self._next_key(), shape, l2, s.dtype)
        run_ws = [self.laid_out(w) for w in fp4_ws]  # the naive baseline reads the spec layout
        rows = []
        for m in ms:
            started = time.perf_counter()
            acts = make_activations(self._next_key(), m, shape.k, l2, s.dtype)
            path = jax_fp4.dispatch_path(acts[0], run_ws[0], backend=s.backend)
            passes = []
            for _ in range(s.passes):
                layer = fp4_layer(s.backend, s.tuning)
                passes.append(
                    (
                        self._time(chain_of(layer), (acts, run_ws), l1, l2),
                        self._time(chain_of(dense_layer), (acts, dense_ws), l1, l2),
                        self._time(chain_of(naive_layer), (acts, fp4_ws), l1, l2),
                    )
                )
            fp4, dense, naive = (median_pass(variant) for variant in zip(*passes))
            us_passes = tuple(p[0].us for p in passes) if s.passes > 1 else ()
            row = make_row(
                path, m, shape, s.dtype_name, fp4, dense, naive, read, run_ws[0].layout, us_passes
            )
            passes_note = (
                f" passes {'/'.join(f'{us:.2f}' for us in us_passes)}" if us_passes else ""
            )
            self.log(f"{format_row(row)}   [{time.perf_counter() - started:.1f} s]{passes_note}")
            rows.append(row)
            del acts
        return rows

    def laid_out(self, w: jax_fp4.NVFP4Weight) -> jax_fp4.NVFP4Weight:
        return in_layout(w, self.settings.layout)

    def decode_step(self, model: DecodeModel) -> DecodeResult:
        return run_decode_step(self, model)


# ---- a decode step of a Qwen3-like model ----------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class DecodeModel:
    """Qwen3-8B-like shapes (hidden 4096, 32 q / 8 kv heads of 128, MLP 12288), `layers` deep."""

    hidden: int = 4096
    qkv: int = 6144
    intermediate: int = 12288
    vocab: int = 151936
    layers: int = 28

    def layer_shapes(self) -> dict[str, Shape]:
        h = self.hidden
        return {
            "qkv": Shape(self.qkv, h),
            "o": Shape(h, h),
            "gate_up": Shape(2 * self.intermediate, h),
            "down": Shape(h, self.intermediate),
        }

    def all_shapes(self) -> list[Shape]:
        return list(self.layer_shapes().values()) * self.layers + [Shape(self.vocab, self.hidden)]


QUICK_DECODE_MODEL = DecodeModel(hidden=256, qkv=384, intermediate=512, vocab=1024, layers=2)


@dataclasses.dataclass
class DecodeResult:
    hidden: int
    layers: int
    vocab: int
    matmuls: int
    weight_bytes: int
    path: str
    e2e_us: float  # one jitted step call, host-timed (dispatch included)
    step_us: float  # device time per step: (t(2 steps) - t(1 step))
    floor_us: float  # sum over the matmuls of bytes / read bandwidth
    fraction_of_floor: float
    bf16_e2e_us: float
    bf16_step_us: float
    naive_e2e_us: float
    naive_step_us: float
    speedup_vs_bf16: float
    speedup_vs_naive: float
    read_bw_tbps: float
    noisy: bool


def _rms_norm(x):
    x32 = x.astype(jnp.float32)
    return (x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + 1e-6)).astype(x.dtype)


def decode_forward(x, layers, lm_head, mm: Callable, hidden: int):
    """One decode step: per layer qkv -> (attention stand-in: the q part) -> o, gate_up -> SiLU*up ->
    down, with residuals and RMS norms; then lm_head. `mm(a, w)` is the matmul under test."""
    h = x
    for qkv, o, gate_up, down in layers:
        attn = mm(_rms_norm(h), qkv)[:, :hidden]
        h = h + mm(attn, o)
        gate, up = jnp.split(mm(_rms_norm(h), gate_up), 2, axis=-1)
        h = h + mm(jax.nn.silu(gate) * up, down)
    return mm(_rms_norm(h), lm_head)


def _decode_steps(mm: Callable, hidden: int, steps: int):
    """Run `steps` decode steps, step i on input xs[i] with its own weights models[i] (so XLA can
    neither merge the steps' matmuls nor share one dequantized weight between them); combine them."""

    def run(xs, models):
        total = jnp.zeros((), jnp.float32)
        for x, (layers, lm_head) in zip(xs[:steps], models[:steps]):
            logits = jax.lax.optimization_barrier(decode_forward(x, layers, lm_head, mm, hidden))
            total = total + logits[0, 0].astype(jnp.float32)
        return total

    return run


def make_decode_model(bench: Bench, model: DecodeModel) -> tuple[tuple, tuple]:
    """Random weights of one model: (dense, nvfp4), each (layers [(qkv, o, gate_up, down)], lm_head)."""
    dtype = bench.settings.dtype
    shapes = model.layer_shapes()
    layers_dense, layers_fp4 = [], []
    for _ in range(model.layers):
        made = [_make_layer_weights(bench._next_key(), sh.n, sh.k, dtype) for sh in shapes.values()]
        layers_dense.append(tuple(d for d, _ in made))
        layers_fp4.append(tuple(q for _, q in made))
    head_dense, head_fp4 = _make_layer_weights(bench._next_key(), model.vocab, model.hidden, dtype)
    return (layers_dense, head_dense), (layers_fp4, head_fp4)


def _is_weight(x) -> bool:
    return isinstance(x, jax_fp4.NVFP4Weight)


def run_decode_step(bench: Bench, model: DecodeModel) -> DecodeResult:
    s = bench.settings
    all_shapes = model.all_shapes()
    itemsize = np.dtype(s.dtype).itemsize
    per_matmul = [
        nvfp4_weight_bytes(sh.n, sh.k) + io_bytes(1, sh.n, sh.k, itemsize) for sh in all_shapes
    ]
    read = bench.read_bandwidth(sum(per_matmul[:4]))  # one layer's bytes per buffer
    floor_us = sum(per_matmul) / (read.tbps * 1e12) * 1e6

    # Two models: the 2-step chain runs each once; the 1-step chain takes both (keep_unused).
    (dense1, fp4_1), (dense2, fp4_2) = (
        make_decode_model(bench, model),
        make_decode_model(bench, model),
    )
    xs = make_activations(bench._next_key(), 1, model.hidden, 2, s.dtype)

    def measure(mm, models):
        t = bench._time(lambda steps: _decode_steps(mm, model.hidden, steps), (xs, models), 1, 2)
        # End to end: one jitted step on one model, as a decode loop calls it (dispatch included).
        args = (xs[:1], models[:1])
        one = jax.jit(_decode_steps(mm, model.hidden, 1)).lower(*args).compile()
        for _ in range(s.warmup):
            _time_once(one, args)
        e2e = statistics.median(_time_once(one, args) for _ in range(s.repeats)) * 1e6
        bench.log(
            f"decode step, {getattr(mm, '__name__', 'jax_fp4')}: {t.us:.1f} us/step, "
            f"{e2e:.1f} us end to end"
        )
        return t, e2e

    laid_out = [
        jax.tree_util.tree_map(bench.laid_out, m, is_leaf=_is_weight) for m in (fp4_1, fp4_2)
    ]
    fp4, fp4_e2e = measure(fp4_layer(s.backend, s.tuning), laid_out)
    dense, dense_e2e = measure(dense_layer, [dense1, dense2])
    naive, naive_e2e = measure(naive_layer, [fp4_1, fp4_2])
    path = jax_fp4.dispatch_path(xs[0], fp4_1[1], backend=s.backend)
    return DecodeResult(
        hidden=model.hidden,
        layers=model.layers,
        vocab=model.vocab,
        matmuls=len(all_shapes),
        weight_bytes=sum(nvfp4_weight_bytes(sh.n, sh.k) for sh in all_shapes),
        path=path,
        e2e_us=fp4_e2e,
        step_us=fp4.us,
        floor_us=floor_us,
        fraction_of_floor=floor_us / fp4.us,
        bf16_e2e_us=dense_e2e,
        bf16_step_us=dense.us,
        naive_e2e_us=naive_e2e,
        naive_step_us=naive.us,
        speedup_vs_bf16=dense.us / fp4.us,
        speedup_vs_naive=naive.us / fp4.us,
        read_bw_tbps=read.tbps,
        noisy=fp4.noisy or dense.noisy or naive.noisy or read.noisy,
    )


# ---- output ---------------------------------------------------------------------------------------

_COLUMNS = (
    ("shape", 13, lambda r: f"{r.n}x{r.k}"),
    ("M", 5, lambda r: f"{r.m}"),
    ("path", 9, lambda r: r.path),
    ("layout", 6, lambda r: r.layout),
    ("us", 9, lambda r: f"{r.us:.2f}"),
    ("TB/s", 6, lambda r: f"{r.tbps:.3g}"),
    ("%read", 6, lambda r: f"{100 * r.fraction_of_read_bw:.0f}%"),
    ("floor", 8, lambda r: f"{r.floor_us:.2f}"),
    ("TFLOP/s", 8, lambda r: f"{r.tflops:.3g}"),
    ("bf16_us", 9, lambda r: f"{r.bf16_us:.2f}"),
    ("naive_us", 9, lambda r: f"{r.naive_us:.2f}"),
    ("x_bf16", 7, lambda r: f"{r.speedup_vs_bf16:.2f}"),
    ("x_naive", 7, lambda r: f"{r.speedup_vs_naive:.2f}"),
    ("", 1, lambda r: row_mark(r.noisy, r.us_passes)),
)


def format_row(row: Row) -> str:
    return " ".join(fmt(row).rjust(width) for _, width, fmt in _COLUMNS).rstrip()


def format_table(rows: Sequence[Row]) -> str:
    header = " ".join(name.rjust(width) for name, width, _ in _COLUMNS).rstrip()
    return "\n".join([header] + [format_row(r) for r in rows])


def format_decode(d: DecodeResult) -> str:
    return "\n".join(
        [
            f"decode step: {d.layers} layers x (qkv, o, gate_up, down) + lm_head = {d.matmuls} matmuls, "
            f"hidden {d.hidden}, vocab {d.vocab}, M=1, {d.weight_bytes / GB:.2f} GB of NVFP4 weights",
            f"  jax_fp4 ({d.path}): {d.step_us:.1f} us/step on device, {d.e2e_us:.1f} us end to end; "
            f"floor {d.floor_us:.1f} us ({100 * d.fraction_of_floor:.0f}% of floor)",
            f"  bf16 jnp.dot: {d.bf16_step_us:.1f} us/step ({d.bf16_e2e_us:.1f} e2e) -> x{d.speedup_vs_bf16:.2f}",
            f"  naive dequant+dot: {d.naive_step_us:.1f} us/step ({d.naive_e2e_us:.1f} e2e) "
            f"-> x{d.speedup_vs_naive:.2f}" + ("  (noisy)" if d.noisy else ""),
        ]
    )


# Markdown tables of a results JSON (benchmarks/README.md): (header, format) per column, over the
# JSON's row dicts; the memory-bound rows (M <= 8) with bandwidth, the rest with TFLOP/s.
_MD_COMMON = (
    ("N x K", lambda r: f"{r['n']}x{r['k']}"),
    ("M", lambda r: f"{r['m']}"),
    ("path", lambda r: r["path"]),
    ("us", lambda r: f"{r['us']:.1f}" + row_mark(r.get("noisy", False), r.get("us_passes", ()))),
)
_MD_TAIL = (
    ("bf16 us", lambda r: f"{r['bf16_us']:.1f}"),
    ("naive us", lambda r: f"{r['naive_us']:.1f}"),
    ("x bf16", lambda r: f"{r['speedup_vs_bf16']:.2f}"),
    ("x naive", lambda r: f"{r['speedup_vs_naive']:.2f}"),
)
_MD_DECODE = (
    _MD_COMMON
    + (
        ("TB/s", lambda r: f"{r['tbps']:.2f}"),
        ("% of read BW", lambda r: f"{100 * r['fraction_of_read_bw']:.0f}%"),
        ("floor us", lambda r: f"{r['floor_us']:.1f}"),
    )
    + _MD_TAIL
)
_MD_PREFILL = _MD_COMMON + (("TFLOP/s", lambda r: f"{r['tflops']:.0f}"),) + _MD_TAIL
MARKDOWN_DECODE_MAX_M = 8


def markdown_table(columns, rows, text_columns=("N x K", "path")) -> str:
    """rows as a Markdown table: columns are (name, row -> str) pairs; the columns named in
    text_columns align left, the numbers right."""
    lines = [
        "| " + " | ".join(name for name, _ in columns) + " |",
        "|" + "|".join("---" if name in text_columns else "---:" for name, _ in columns) + "|",
    ]
    lines += ["| " + " | ".join(fmt(r) for _, fmt in columns) + " |" for r in rows]
    return "\n".join(lines)


def markdown_tables(results: dict) -> str:
    """The rows of a `--json` results dict as two Markdown tables (M <= 8, then M > 8), in the
    order of the JSON; '?' after the time marks a noisy row, '~' an unsteady one (row_mark)."""
    rows = results["rows"]
    decode = [r for r in rows if r["m"] <= MARKDOWN_DECODE_MAX_M]
    prefill = [r for r in rows if r["m"] > MARKDOWN_DECODE_MAX_M]
    parts = []
    if decode:
        parts.append(markdown_table(_MD_DECODE, decode))
    if prefill:
        parts.append(markdown_table(_MD_PREFILL, prefill))
    return "\n\n".join(parts)


def device_description() -> str:
    d = default_device()
    return f"{d.platform}:{d.device_kind}"


def write_json_file(path: str, obj) -> None:
    """JSON through a temporary file and a rename: a run killed mid-write (a device call's time
    limit) leaves the previous version whole."""
    temporary = f"{path}.tmp"
    with open(temporary, "w") as f:
        json.dump(obj, f, indent=1)
    os.replace(temporary, path)


def results_json(
    rows: Sequence[Row],
    reads: Sequence[ReadBandwidth],
    decode: DecodeResult | None,
    settings: Settings,
    seed: int,
    complete: bool = True,
) -> dict:
    """The run as JSON; `complete` False while it is still running (written after every shape)."""
    return {
        "device": device_description(),
        "jax_version": jax.__version__,
        "jax_fp4_version": jax_fp4.__version__,
        "cpu_kernel_builds": _ffi.cpu_kernel_builds(),  # what the `cpu` path ran on this CPU
        "dtype": settings.dtype_name,
        "backend": settings.backend or "auto",
        "tuning": None if settings.tuning is None else dataclasses.asdict(settings.tuning),
        "layout": settings.layout,
        "repeats": settings.repeats,
        "passes": settings.passes,
        "warmup": settings.warmup,
        "seed": seed,
        "read_bw_tbps": max((r.tbps for r in reads), default=None),
        "read_bw": [dataclasses.asdict(r) for r in reads],
        "rows": [dataclasses.asdict(r) for r in rows],
        "decode_step": dataclasses.asdict(decode) if decode is not None else None,
        "complete": complete,
    }


# ---- command line -------------------------------------------------------------------------------


def parse_shape(text: str) -> Shape:
    try:
        n, k = (int(part) for part in text.lower().split("x"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"a shape is NxK, e.g. 4096x11008; got {text!r}") from None
    if n <= 0 or k <= 0 or k % 2:
        raise argparse.ArgumentTypeError(f"N and K must be positive and K even; got {text!r}")
    return Shape(n, k)


def _int_list(text: str) -> list[int]:
    return [int(x) for x in text.replace(",", " ").split()]


def _shape_list(text: str) -> list[Shape]:
    return [parse_shape(x) for x in text.replace(",", " ").split()]


def _tuning(text: str) -> jax_fp4.KernelTuning | None:
    try:
        return parse_tuning(text)
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from None


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python benchmarks/bench.py",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--m",
        type=_int_list,
        default=None,
        help=f"M values, e.g. '1,8,64' (default {','.join(map(str, DEFAULT_M))})",
    )
    p.add_argument(
        "--shapes",
        type=_shape_list,
        default=None,
        help="weight shapes NxK, e.g. '4096x4096,11008x4096' (default: the sweep in the README)",
    )
    p.add_argument("--dtype", choices=sorted(DTYPES), default="bf16", help="activation dtype")
    p.add_argument(
        "--backend",
        choices=[b for b in jax_fp4.BACKENDS],
        default=None,
        help="force a jax_fp4 backend (default: auto dispatch)",
    )
    p.add_argument(
        "--tuning",
        type=_tuning,
        default=None,
        help="fix kernel choices of the jax_fp4 matmuls (jax_fp4.KernelTuning fields), "
        "e.g. 'fused_tile_m=64,programmatic_launch=1' (default: the heuristics)",
    )
    p.add_argument(
        "--layout",
        choices=("spec", "tiled"),
        default="spec",
        help="weight layout of the jax_fp4 matmuls: 'tiled' prepacks them "
        "(jax_fp4.prepack, the layout the CUDA kernels read fastest) where the shape "
        "allows (default spec)",
    )
    p.add_argument(
        "--repeats",
        type=int,
        default=None,
        help="timed calls per chain (median; default 10, quick 5)",
    )
    p.add_argument(
        "--warmup", type=int, default=2, help="untimed calls per chain after compiling (>= 1)"
    )
    p.add_argument(
        "--passes",
        type=int,
        default=1,
        help="measure each row this many times and keep the median pass; every pass's "
        "jax_fp4 time goes to the JSON's us_passes (default 1)",
    )
    p.add_argument(
        "--min-time",
        type=float,
        default=None,
        help="seconds of timed calls per chain pair at least: cheap rows repeat more, up "
        "to 10x --repeats (default 0.2; 0 with --quick)",
    )
    p.add_argument("--json", metavar="PATH", help="write the results as JSON")
    p.add_argument("--quick", action="store_true", help="tiny shapes and chains: a CPU smoke run")
    p.add_argument(
        "--decode-step",
        action="store_true",
        help="also time a Qwen3-like decode step (28 layers + lm_head, M=1)",
    )
    p.add_argument(
        "--no-sweep",
        action="store_true",
        help="skip the (shape, M) sweep (e.g. with --decode-step for the step alone)",
    )
    p.add_argument(
        "--cache-mb",
        type=float,
        default=None,
        help="last-level cache size that the chains must exceed (default 60, the H200's L2)",
    )
    p.add_argument(
        "--dense-cap-gb",
        type=float,
        default=DEFAULT_DENSE_CAP_BYTES / GB,
        help="most dense weight bytes per chain (default 8)",
    )
    p.add_argument(
        "--seed", type=int, default=None, help="random seed (default: fresh from the OS)"
    )
    p.add_argument(
        "--markdown-from",
        metavar="JSON",
        help="print an earlier --json result as Markdown tables and exit (no device work)",
    )
    return p


def log_progress(text: str) -> None:
    """A progress line, on stderr (stdout holds the tables)."""
    print(text, file=sys.stderr, flush=True)


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.markdown_from:
        with open(args.markdown_from) as f:
            print(markdown_tables(json.load(f)))
        return 0
    if args.repeats is not None and args.repeats < 1:
        raise SystemExit("--repeats must be >= 1")
    if args.passes < 1:
        raise SystemExit(f"--passes must be >= 1, got {args.passes}")
    seed = args.seed if args.seed is not None else int.from_bytes(os.urandom(4), "little")
    cache = (
        args.cache_mb * MB
        if args.cache_mb is not None
        else (QUICK_CACHE_BYTES if args.quick else DEFAULT_CACHE_BYTES)
    )
    settings = Settings(
        dtype_name=args.dtype,
        backend=args.backend,
        layout=args.layout,
        tuning=args.tuning,
        repeats=args.repeats if args.repeats is not None else (5 if args.quick else 10),
        warmup=args.warmup,
        passes=args.passes,
        min_time_s=args.min_time if args.min_time is not None else (0.0 if args.quick else 0.2),
        budget=Budget(
            cache_bytes=int(cache),
            dense_cap_bytes=int(args.dense_cap_gb * GB),
            max_layers=QUICK_MAX_LAYERS if args.quick else Budget.max_layers,
        ),
        read_kernels=("sum",) if args.quick else tuple(READ_KERNELS),
    )

    shapes = args.shapes or (QUICK_SHAPES if args.quick else DEFAULT_SHAPES)
    ms = args.m or (QUICK_M if args.quick else DEFAULT_M)

    log_progress(
        f"jax_fp4 bench on {device_description()}, jax {jax.__version__}, dtype {args.dtype}, "
        f"backend {args.backend or 'auto'}, layout {args.layout}, {settings.repeats} repeats, "
        f"{settings.passes} pass{'es' if settings.passes > 1 else ''}, "
        f"seed {seed}"
    )
    bench = Bench(settings, jax.random.key(seed), log=log_progress)
    started = time.perf_counter()
    if not args.quick:
        warm_up_device(1.0)
    rows: list[Row] = []
    decode = None

    def write_json(complete: bool) -> dict:
        results = results_json(rows, bench.reads, decode, settings, seed, complete)
        if args.json:
            write_json_file(args.json, results)
        return results

    if not args.no_sweep:
        for shape in shapes:
            rows += bench.shape_rows(shape, shape.ms(ms))
            write_json(complete=False)  # a run cut short by a time limit keeps its shapes
    if args.decode_step:
        decode = bench.decode_step(QUICK_DECODE_MODEL if args.quick else DecodeModel())
    log_progress(f"done in {time.perf_counter() - started:.1f} s")

    results = write_json(complete=True)
    if args.json:
        log_progress(f"wrote {args.json}")
    read_bw = results["read_bw_tbps"]
    print(
        f"device {results['device']}, jax {results['jax_version']}, read bandwidth "
        f"{'-' if read_bw is None else f'{read_bw:.3g}'} TB/s; times in us per matmul "
        f"('?' marks a noisy row, '~' one whose passes differ by more than "
        f"{100 * (UNSTEADY_PASS_RATIO - 1):.0f}%)"
    )
    if rows:
        print(format_table(rows))
    if decode is not None:
        print(format_decode(decode))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
