"""Choosing the kernel for one matmul from static shapes: pure functions, tested on any machine.

Paths:
  empty      M, N or K is zero: no kernel, zeros (+ bias) or an empty array.
  reference  the pure-JAX decomposition (dequantize to float32, dot at HIGHEST precision).
  cpu        the fused C++ FFI handler (decode + dot, fp32 accumulation).
  gemv       CUDA fused decode GEMV for small M (block_size 16, K % 32 == 0, fp16/bf16).
  fused      CUDA fused NVFP4 x fp16/bf16 GEMM for Hopper (sm_90a), no dequantized copy: the
             mid-M range on compute capability 9.x (block_size 16, K % 128 == 0).
  dequant    CUDA dequantize kernel into an fp16/bf16 [N, K] buffer, then XLA's dot (cuBLAS).
  xla        the dequant path written in plain JAX (any platform, fp16/bf16): the same weight in
             the activations' dtype, then XLA's dot; XLA may fuse the dequantize into its GEMM.
             "auto" takes it where jax_fp4 has no kernels (platforms other than CPU and CUDA, a
             build without CUDA kernels, or a GPU none of the compiled architectures runs on).
  native     CUDA W4A4 SM120 (Blackwell GeForce) CUTLASS GEMM: activations quantized to NVFP4;
             only when JAX_FP4_NATIVE_SM120=1 (or forced) on compute capability 12.x.
"""

from __future__ import annotations

import dataclasses
import os
import re

import numpy as np

from jax_fp4 import fused as _fused, native as _native

BACKENDS = ("auto", "reference", "cpu", "gemv", "dequant", "fused", "native", "xla")

# The "auto" thresholds, from the crossovers measured on the H200 (benchmarks/NOTES_fused.md,
# "Eighth session"; benchmarks/results/sweeps/fused_bm256_crossovers_h200.json and
# fused_load_hoist_h200.json; since the twenty-third session benchmarks/dispatch_check.py, every
# backend timed by the bench's method: `bash benchmarks/device_run.sh build dispatch-check`):
# - M <= 8: the decode GEMV.
# - 9 <= M <= 16: the GEMV (two column and two row tiles per warp), except on prepacked (layout
#   "tiled") wide weights with long rows, N >= 8192 and K >= 8192, where the fused GEMM wins.
#   `python -m bench` with both backends forced in one call ("Twenty-second session",
#   results/sweeps/bench_m9_16_session22_h200.log): prepacked, the fused GEMM 6-19% faster on
#   28672x8192 and the GEMV 0-7% on 17408x5120 (kernel-only chains, fused_timing.py, had the GEMV
#   ahead on both, and on K = 4096 by 7-30%: "Twenty-first session"); on the spec layout, whose
#   fused GEMM runs these M 1.6-1.8x slower than prepacked, the GEMV 16-33% faster on both
#   (bench_spec_m9_16_session22_h200.log).
# - 16 < M <= 32 on prepacked weights with N <= 4096 and K >= 8192: still the GEMV.
#   benchmarks/dispatch_check.py ("Twenty-third session", results/sweeps/dispatch_check_*_session23_h200)
#   on 4096x11008, two calls: the GEMV 4-11% ahead at M = 17, 24 and 32, the fused GEMM 29% at M = 48;
#   on 5120x17408 and on the spec layout the fused GEMM leads from M = 17 on (by 20-40%).
#   Beyond that shape ("Twenty-seventh session", dispatch_check_tiled_narrow*_session27_h200): the
#   GEMV ahead or within 5% at M = 24-32 on 1024x16384 and 2048x8192, 17-32 on 4096x14336; behind on
#   2048x16384 from M = 24 (by 3-19%; one column tile per warp there: NOTES.md), a known miss.
# - 16 < M <= 64 on small weights, N <= 1024 and K <= 8192, where the GEMV runs on tensor cores:
#   the GEMV. There the fused GEMM's time is set by K, not by the weight's size (~10 us at K = 4096,
#   ~14 at 8192): prepacked, the GEMV 10-71% ahead at M = 20-64 on 1024x8192 and 1024x4096 (H200);
#   on the spec layout 15-74% ahead at M = 17-64 on the same two shapes (thirty-fifth session, an
#   H100: results/sweeps/dispatch_check_spec_small_session35_h100.json); at K = 16384
#   (1024x16384, prepacked) the fused GEMM 11% ahead at M = 48.
# - 16 < M <= 32 on spec-layout weights of at most 2^23 elements (N * K), where the GEMV runs on
#   tensor cores: the GEMV. The same H100 session's checks (dispatch_check_spec_small2/3_session35):
#   the GEMV 1.21-1.54x ahead at M = 17-32 on 2048x2048, 1536x4096 and 2048x4096; past 2^23 the
#   two within 2% at M = 32 (2048x8192, 3072x4096), the GEMV 7-16% ahead at M = 17 only; at M = 64
#   the fused GEMM ahead on 2048x4096 and larger. Prepacked weights of these sizes: not measured.
# - 16 < M <= 1024: the fused GEMM (M = 256: 1.2-1.8x faster than dequantize + cuBLAS). With
#   stream-K (fourteenth and fifteenth sessions) M = 512 is 1.18-1.37x faster and M = 1024
#   1.00-1.11x (benchmarks/results/sweeps/crossover_{fused,dequant}_session15_h200.json).
# - 1024 < M <= 2048: the fused GEMM on large wide weights (N >= 8192 and N * K >= 3 * 2^24),
#   dequantize + cuBLAS otherwise. dispatch_check.py, both layouts: at M = 1536-2048 the fused GEMM
#   2-13% ahead on 28672x8192 and 17408x5120, dequantize + cuBLAS 3-12% ahead on 11008x4096 and
#   4096x11008 at M = 2048; at M = 3072 the two within 5% on 17408x5120, dequant 4% ahead on 28672x8192.
#   The twenty-seventh session: 14336x4096 (N * K = 3.5 * 2^24) the fused GEMM 6% ahead at M = 1536
#   and 1% at 2048, 11008x4096 (2.7 * 2^24) the two within 1% at M = 2048: the bound between them.
# - larger M: dequantize + cuBLAS (M = 4096: the fused GEMM 1.05-1.37x slower).
# - Where the fused GEMM cannot run (not a Hopper GPU, or a shape it does not take) and the GEMV
#   runs on tensor cores: the GEMV to M = 64, before dequantize + cuBLAS. Not measured off the
#   H200; there, both forced, the GEMV was 1.4-3.4x faster than dequantize + cuBLAS at M = 17-64 on
#   the four prefill shapes and 1.04-1.25x slower at M = 128 (dispatch_check_tiled_session23_h200).
#   In bytes the GEMV moves less on any GPU: it reads the 0.56-byte weight once per 16 rows
#   (4x at M = 64, from L2 where it fits), dequantize + cuBLAS moves ~4.6 bytes per weight.
DECODE_MAX_M = 8
GEMV_MAX_M = 16
GEMV_MAX_M_WITHOUT_FUSED = 64  # GEMV_MAX_M where the fused GEMM cannot run (gemv_on_tensor_cores)
GEMV_MAX_M_NARROW_LONG = 32  # GEMV_MAX_M on prepacked weights with N <= NARROW_N and K >= LONG_K
GEMV_MAX_M_SMALL = 64  # GEMV_MAX_M with N <= SMALL_N and K <= LONG_K (GEMV on tensor cores)
GEMV_MAX_M_SMALL_SPEC = 32  # GEMV_MAX_M on spec-layout weights with N * K <= SMALL_WEIGHT
SMALL_N = 1024
SMALL_WEIGHT = 1 << 23
NARROW_N = 4096
WIDE_N = 8192
LONG_K = 8192
FUSED_MAX_M = 1024
FUSED_MAX_M_LARGE = 2048  # FUSED_MAX_M on weights with N >= WIDE_N and N * K >= LARGE_WEIGHT
LARGE_WEIGHT = 3 << 24

_HALF_DTYPES = (np.dtype("float16"), np.dtype("bfloat16"))
_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")


@dataclasses.dataclass(frozen=True)
class Problem:
    """The static facts a path decision depends on."""

    m: int
    n: int
    k: int
    block_size: int
    dtype: np.dtype
    tiled: bool = False  # the weight is prepacked (layout "tiled")


def env_flag(name: str, default: bool) -> bool:
    """A boolean environment variable: 0/1/true/false/yes/no/on/off; anything else is an error."""
    raw = os.environ.get(name)
    if raw is None or raw.strip() == "":
        return default
    value = raw.strip().lower()
    if value in _TRUE:
        return True
    if value in _FALSE:
        return False
    raise ValueError(f"environment variable {name} must be a boolean (0/1/true/false/yes/no), got {raw!r}")


CAPABILITY_ENV = "JAX_FP4_CUDA_CAPABILITY"


def parse_capability(text: str) -> tuple[int, int]:
    """'9.0' -> (9, 0); ValueError for anything but MAJOR.MINOR."""
    major, dot, minor = text.strip().partition(".")
    if not (dot and major.isdigit() and minor.isdigit()):
        raise ValueError(f"expected MAJOR.MINOR (e.g. 9.0), got {text!r}")
    return int(major), int(minor)


def env_capability() -> tuple[int, int] | None:
    """JAX_FP4_CUDA_CAPABILITY ("9.0"): the GPU the CUDA lowering picks kernels for in place of
    this machine's (None when unset), for exporting a program for a GPU this machine lacks."""
    raw = os.environ.get(CAPABILITY_ENV, "")
    if not raw.strip():
        return None
    try:
        return parse_capability(raw)
    except ValueError as err:
        raise ValueError(f"environment variable {CAPABILITY_ENV}: {err}") from None


def gemv_unsupported_reason(p: Problem) -> str | None:
    if p.dtype not in _HALF_DTYPES:
        return f"a must be float16 or bfloat16, got {p.dtype}"
    if p.block_size != 16:
        return f"block_size must be 16, got {p.block_size}"
    if p.k % 32:
        return f"K must be a multiple of 32, got {p.k}"
    return None


def half_dtype_unsupported_reason(p: Problem) -> str | None:
    """The dequant and xla paths: the weight is dequantized to the activations' dtype."""
    if p.dtype not in _HALF_DTYPES:
        return f"a must be float16 or bfloat16, got {p.dtype}"
    return None


def fused_unsupported_reason(p: Problem, capability) -> str | None:
    if capability is None or capability[0] != 9:
        return f"it needs a Hopper GPU (compute capability 9.x), this device has {capability}"
    return _fused.fused_supported(p.m, p.n, p.k, p.block_size, p.dtype)


def gemv_on_tensor_cores(p: Problem, capability) -> bool:
    """Whether the GEMV runs its tensor-core (mma.sync) kernel: sm_80+ on 128-wide K windows (the
    tiled layout has them by construction); the scalar kernel otherwise."""
    return capability is not None and tuple(capability) >= (8, 0) and (p.tiled or p.k % 128 == 0)


def auto_gemv_max_m(p: Problem, capability) -> int:
    """The largest M at which "auto" takes the GEMV (where the fused GEMM does not win first)."""
    tensor_cores = gemv_on_tensor_cores(p, capability)
    if fused_unsupported_reason(p, capability) is not None and tensor_cores:
        return GEMV_MAX_M_WITHOUT_FUSED
    if p.n <= SMALL_N and p.k <= LONG_K and (p.tiled or tensor_cores):
        return GEMV_MAX_M_SMALL
    if not p.tiled and p.n * p.k <= SMALL_WEIGHT and tensor_cores:
        return GEMV_MAX_M_SMALL_SPEC
    narrow_long = p.tiled and p.n <= NARROW_N and p.k >= LONG_K
    return GEMV_MAX_M_NARROW_LONG if narrow_long else GEMV_MAX_M


def auto_prefers_fused(p: Problem, capability) -> bool:
    """Whether "auto" takes the fused GEMM over the GEMV / dequant for this shape (where it can
    run at all): the measured crossovers above."""
    if p.m <= auto_gemv_max_m(p, capability):
        return p.m > DECODE_MAX_M and p.tiled and p.n >= WIDE_N and p.k >= LONG_K
    large = p.n >= WIDE_N and p.n * p.k >= LARGE_WEIGHT
    return p.m <= (FUSED_MAX_M_LARGE if large else FUSED_MAX_M)


_PLATFORM_OF = {"cpu": "cpu", "gemv": "cuda", "dequant": "cuda", "fused": "cuda", "native": "cuda"}
_UNSUPPORTED = {"gemv": gemv_unsupported_reason, "dequant": half_dtype_unsupported_reason,
                "xla": half_dtype_unsupported_reason}


def check_backend(backend: str, p: Problem) -> None:
    """Raise ValueError if a forced backend cannot serve the problem (platform-independent part)."""
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS} (or None), got {backend!r}")
    reason = _UNSUPPORTED.get(backend, lambda _: None)(p)
    if reason is not None:
        raise ValueError(f"backend={backend!r} cannot serve this matmul: {reason}")


def cuda_kernels_run_on(architectures: str, capability) -> bool:
    """Whether a build for `architectures` (CMake's list, e.g. "80-real;90a-real;80-virtual", or
    with commas as the compiled module reports it) has code a GPU of `capability` (major, minor)
    can run: a cubin for X.Y runs on X.y with y >= Y (an arch-specific "a" cubin on X.Y only), PTX
    for X.Y is compiled at load time for any later GPU. True when it cannot tell (no capability,
    or an entry such as "native")."""
    if capability is None or not architectures:
        return True
    for entry in re.split(r"[;,]", architectures):
        parsed = re.fullmatch(r"(\d+)([af]?)(?:-(real|virtual))?", entry.strip())
        if parsed is None:
            return True
        number, suffix, kind = int(parsed[1]), parsed[2], parsed[3]
        arch = (number // 10, number % 10)
        if suffix == "a":
            runs = tuple(capability) == arch
        elif kind == "real":
            runs = capability[0] == arch[0] and capability[1] >= arch[1]
        else:  # PTX (plain "80" is both cubin and PTX)
            runs = tuple(capability) >= arch
        if runs:
            return True
    return False


def auto_cuda_path(m: int, n: int, k: int, *, dtype, tiled: bool, capability,
                   native_enabled: bool = False, block_size: int = 16,
                   architectures: str = "") -> str:
    """The path "auto" takes on a CUDA device of `capability` (major, minor) with jax_fp4's kernels
    compiled for `architectures` (empty: for that device): the rules alone, no device needed
    (`python -m jax_fp4 paths`, dispatch_check.py)."""
    problem = Problem(m=m, n=n, k=k, block_size=block_size, dtype=np.dtype(dtype), tiled=tiled)
    return select_path("cuda", "auto", problem,
                       has_cuda_kernels=cuda_kernels_run_on(architectures, capability),
                       capability=capability, native_enabled=native_enabled)


def _check_platform(backend: str, platform: str, has_cuda_kernels: bool) -> None:
    needed = _PLATFORM_OF[backend]
    if platform != needed or (needed == "cuda" and not has_cuda_kernels):
        why = ("this jax_fp4 build has no CUDA kernels for this GPU (none compiled in, or none for "
               "its compute capability: `python -m jax_fp4 info` lists the architectures)"
               if platform == needed else f"the computation is lowered for platform {platform!r}")
        raise ValueError(f"backend={backend!r} needs platform {needed!r}, but {why}")


def select_path(platform: str, backend: str, p: Problem, *, has_cuda_kernels: bool,
                capability: tuple[int, int] | None = None, native_enabled: bool = False) -> str:
    """The path for one matmul lowered for `platform` ('cpu', 'cuda', ...).

    `has_cuda_kernels`: jax_fp4's CUDA kernels can run on this device (compiled in, and for its
    architecture: cuda_kernels_run_on). `capability` is the CUDA device's (major, minor) and
    `native_enabled` the value of JAX_FP4_NATIVE_SM120; all three matter only on 'cuda'.
    """
    check_backend(backend, p)
    if p.m == 0 or p.n == 0 or p.k == 0:
        return "empty"
    if backend in ("reference", "xla"):  # plain JAX: any platform
        return backend
    if backend != "auto":
        _check_platform(backend, platform, has_cuda_kernels)
        if backend == "native":  # raises ValueError with the reason when it cannot run
            _native.native_path_applies(capability, native_enabled, "native", p.m, p.n, p.k,
                                        p.block_size, p.dtype)
        elif backend == "fused" and (reason := fused_unsupported_reason(p, capability)):
            raise ValueError(f"backend='fused' cannot serve this matmul: {reason}")
        return backend
    if platform == "cpu":
        return "cpu"
    if platform == "cuda" and has_cuda_kernels:
        if auto_prefers_fused(p, capability) and fused_unsupported_reason(p, capability) is None:
            return "fused"
        # The native path, opted into, keeps everything past GEMV_MAX_M.
        native = _native.native_path_applies(capability, native_enabled, "auto", p.m, p.n, p.k,
                                             p.block_size, p.dtype)
        gemv_max_m = GEMV_MAX_M if native else auto_gemv_max_m(p, capability)
        if gemv_unsupported_reason(p) is None and p.m <= gemv_max_m:
            return "gemv"
        if native:
            return "native"
        if half_dtype_unsupported_reason(p) is None:
            return "dequant"
    if half_dtype_unsupported_reason(p) is None:
        return "xla"  # no jax_fp4 kernel here: XLA's own dot in the activations' dtype
    return "reference"
