"""Choosing the kernel for one matmul from static shapes: a table of measured crossovers per GPU
and layout, and one function, `plan`, that turns (problem, target, backend) into a path and the
GEMV's kernel variant. Pure: tested on any machine, no device needed.

Paths:
  empty      M, N or K is zero: no kernel, zeros (+ bias) or an empty array.
  reference  the pure-JAX decomposition (dequantize to float32, dot at HIGHEST precision).
  cpu        the fused C++ FFI handler (decode + dot, fp32 accumulation).
  gemv       CUDA fused decode GEMV for small M (block_size 16, K % 32 == 0, fp16/bf16), on tensor
             cores (sm_80+, K % 128 == 0 or a prepacked weight) or the scalar kernel.
  fused      CUDA fused NVFP4 x fp16/bf16 GEMM for Hopper (sm_90a), no dequantized copy: the
             mid-M range on compute capability 9.x (block_size 16, K % 128 == 0).
  dequant    CUDA dequantize kernel into an fp16/bf16 [N, K] buffer, then XLA's dot (cuBLAS).
  xla        the dequant path written in plain JAX (any platform, fp16/bf16): the same weight in
             the activations' dtype, then XLA's dot; XLA may fuse the dequantize into its GEMM.
             "auto" takes it where jax_fp4 has no kernels (platforms other than CPU and CUDA, a
             build without CUDA kernels, or a GPU none of the compiled architectures runs on).
  native     CUDA W4A4 SM120 (Blackwell GeForce) CUTLASS GEMM: activations quantized to NVFP4;
             only when JAX_FP4_NATIVE_SM120=1 (or forced) on compute capability 12.x.

The crossovers are `Crossovers` entries in TABLES (keyed by the device kind JAX reports), with
CAPABILITY_FALLBACK for GPUs of a measured compute capability under another name, and DEFAULT
for the rest. Each number's measurement is in its comment; docs/design.md gives the reasoning
and benchmarks/RESULTS.md the tables. `python benchmarks/tune_dispatch.py` measures a new GPU
and prints its entry.
"""

from __future__ import annotations

import dataclasses
import re

import numpy as np

from jax_fp4 import fused as _fused
from jax_fp4 import native as _native

BACKENDS = ("auto", "reference", "cpu", "gemv", "dequant", "fused", "native", "xla")

# M <= 8 is decode: the GEMV keeps it on every GPU (the native path and the fused GEMM's
# wide-weight rule start above it).
DECODE_MAX_M = 8

_HALF_DTYPES = (np.dtype("float16"), np.dtype("bfloat16"))


@dataclasses.dataclass(frozen=True)
class Crossovers:
    """Where "auto" moves from one CUDA path to the next, for one GPU and one weight layout.

    The GEMV's range is the largest bound of the rules that apply (None: no such rule); past it
    the fused GEMM up to its bound where it can serve, then dequantize + cuBLAS. "Tensor cores":
    the GEMV runs its mma.sync kernel (`gemv_tensor_cores`).
    """

    gemv_max_m: int  # the GEMV on any weight
    gemv_max_m_without_fused: int  # ... no fused GEMM for it, GEMV on tensor cores
    gemv_max_m_small: int | None = None  # ... N <= small_n, K <= long_k, tensor cores
    gemv_max_m_small_weight: int | None = None  # ... N * K <= small_weight, tensor cores
    gemv_max_m_narrow_long: int | None = None  # ... N <= narrow_n and K >= long_k
    fused_min_m_wide_long: int | None = None  # the fused GEMM from here: N >= wide_n, K >= long_k
    fused_max_m: int = 0  # the fused GEMM past the GEMV to here (0: never)
    fused_max_m_large: int = 0  # ... N >= wide_n and N * K >= large_weight
    small_n: int = 0
    small_weight: int = 0
    narrow_n: int = 0
    wide_n: int = 0
    long_k: int = 0
    large_weight: int = 0


@dataclasses.dataclass(frozen=True)
class Entry:
    """One GPU's crossovers: `spec` for weights in the spec's layout, `tiled` for prepacked ones."""

    spec: Crossovers
    tiled: Crossovers

    def for_layout(self, tiled: bool) -> Crossovers:
        return self.tiled if tiled else self.spec


# Hopper, measured on the H200 except where a line says H100; the H100 runs the same kernels
# with the same ranking on the shapes checked on both (the small-weight rules are its numbers).
HOPPER_SPEC = Crossovers(
    # M = 9-16: the GEMV 16-33% ahead of the fused GEMM on 28672x8192 and 17408x5120 (H200).
    gemv_max_m=16,
    # the GEMV 1.4-3.4x faster than dequantize + cuBLAS at M = 17-64, 1.04-1.25x slower at 128.
    gemv_max_m_without_fused=64,
    # the GEMV 15-74% ahead of the fused GEMM at M = 17-64 on 1024x8192 and 1024x4096 (H100).
    gemv_max_m_small=64,
    # the GEMV 1.21-1.54x ahead at M = 17-32 on 2048x2048, 1536x4096, 2048x4096 (H100).
    gemv_max_m_small_weight=32,
    # the fused GEMM 1.2-1.8x (M = 256) to 1.00-1.11x (M = 1024) faster than dequant (H200).
    fused_max_m=1024,
    # M = 1536-2048: the fused GEMM 2-13% ahead on 28672x8192 and 17408x5120 (H200).
    fused_max_m_large=2048,
    # up to here the fused GEMM's time is set by K (~10 us at 4096, ~14 at 8192), not by N.
    small_n=1024,
    # past 2^23 elements the GEMV is within 2% at M = 32 (2048x8192, 3072x4096; H100).
    small_weight=1 << 23,
    # prepacked, the GEMV ahead or within 5% at M = 17-32 on 4096x11008 and 4096x14336 (H200).
    narrow_n=4096,
    # the fused GEMM's M = 9-16 lead is on 28672x8192; 4096x11008 keeps the GEMV (H200).
    wide_n=8192,
    # at K = 16384 (1024x16384) the fused GEMM is 11% ahead at M = 48 (H200).
    long_k=8192,
    # 11008x4096 (2.7 * 2^24) within 1% at M = 2048, 14336x4096 (3.5 * 2^24) fused ahead.
    large_weight=3 << 24,
)
HOPPER_TILED = dataclasses.replace(
    HOPPER_SPEC,
    # M = 9-16: the GEMV 0-7% ahead on 17408x5120 (the fused GEMM's rule takes wider ones).
    gemv_max_m=16,
    # the GEMV 10-71% ahead of the fused GEMM at M = 20-64 on 1024x8192 and 1024x4096 (H200).
    gemv_max_m_small=64,
    # the GEMV 17% ahead of the fused GEMM at M = 32 on 4096x4096 (11.3 against 13.6 us,
    # kernel-only), behind from 6144x4096 (16.4 against 15.5) and at M = 64 (H100).
    gemv_max_m_small_weight=32,
    small_weight=1 << 24,
    # the GEMV 4-11% ahead at M = 17-32 on 4096x11008, the fused GEMM 29% at M = 48 (H200).
    gemv_max_m_narrow_long=32,
    # prepacked, the fused GEMM 6-19% faster than the GEMV at M = 9-16 on 28672x8192 (H200).
    fused_min_m_wide_long=DECODE_MAX_M + 1,
)
HOPPER = Entry(spec=HOPPER_SPEC, tiled=HOPPER_TILED)

# GPUs not in the table: the GEMV's decode range, no fused GEMM (it needs sm_90a, whose GPUs
# are in the table), dequantize + cuBLAS past it; the GEMV to M = 64 where it runs on tensor
# cores, as it moves ~8x fewer bytes than dequantize + cuBLAS there (0.56 bytes per weight read
# once per 16 rows against ~4.6 bytes; 1.4-3.4x faster on the H200).
_DEFAULT_CROSSOVERS = Crossovers(gemv_max_m=16, gemv_max_m_without_fused=64)
DEFAULT = Entry(spec=_DEFAULT_CROSSOVERS, tiled=_DEFAULT_CROSSOVERS)

TABLES: dict[str, Entry] = {
    "NVIDIA H200": HOPPER,
    "NVIDIA H100 80GB HBM3": HOPPER,
}
CAPABILITY_FALLBACK: dict[tuple[int, int], Entry] = {
    (9, 0): HOPPER,  # other Hopper parts (H100 PCIe / NVL, GH200) and JAX_FP4_CUDA_CAPABILITY=9.0
}

# The M up to which "auto" takes the GEMV (where it serves) on every GPU and layout.
GEMV_MAX_M = min(c.gemv_max_m for e in (*TABLES.values(), DEFAULT) for c in (e.spec, e.tiled))


def entry_for(device_kind: str | None, capability) -> Entry:
    """The table entry of a GPU: by its device kind, else its compute capability, else DEFAULT."""
    if device_kind in TABLES:
        return TABLES[device_kind]
    return CAPABILITY_FALLBACK.get(None if capability is None else tuple(capability), DEFAULT)


@dataclasses.dataclass(frozen=True)
class Problem:
    """The static facts a path decision depends on."""

    m: int
    n: int
    k: int
    block_size: int
    dtype: np.dtype
    tiled: bool = False  # the weight is prepacked (layout "tiled")


@dataclasses.dataclass(frozen=True)
class Target:
    """Where the matmul is lowered for. `capability`, `device_kind` (as JAX reports it, None when
    unknown or overridden), `has_cuda_kernels` (jax_fp4's CUDA kernels run there:
    cuda_kernels_run_on), `native_enabled` (JAX_FP4_NATIVE_SM120) and `gemv_mma`
    (JAX_FP4_GEMV_MMA) matter only on 'cuda'; `has_grouped_kernels` only to `grouped_plan`."""

    platform: str
    capability: tuple[int, int] | None = None
    device_kind: str | None = None
    has_cuda_kernels: bool = False
    native_enabled: bool = False
    gemv_mma: bool = True
    has_grouped_kernels: bool = False  # the grouped CUDA targets are registered (ragged_matmul)

    @property
    def crossovers(self) -> Entry:
        return entry_for(self.device_kind, self.capability)


# The fused GEMM runs the epilogue fusions (silu_mul, the residual) in its kernel up to this M:
# its 16- to 64-row tiles, which reduce split-K on chip in a cluster. Above, where stream-K may
# run, they compose around its product: stream-K stores mid-run tiles from the accumulators, where
# a warpgroup holds gate or up rows, never both (ffi/cuda/fused/epilogue.cuh, EpilogueFusion).
FUSED_EPILOGUE_MAX_M = 64


@dataclasses.dataclass(frozen=True)
class Plan:
    path: str
    gemv_tensor_cores: bool = False  # path "gemv": its mma.sync kernel (else the scalar one)
    # silu_mul and the residual can run in the kernel's epilogue (the GEMV's fused instances, the
    # fused GEMM's EpilogueFusion) rather than composed around the product.
    epilogue_in_kernel: bool = False


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


def gemv_tensor_cores(p: Problem, target: Target) -> bool:
    """Whether the GEMV runs its tensor-core (mma.sync) kernel: sm_80+ on 128-wide K windows (the
    tiled layout has them by construction), unless JAX_FP4_GEMV_MMA=0; the scalar kernel
    otherwise. The one place this is decided: the lowering passes it to the kernel."""
    cap = target.capability
    return (
        target.platform == "cuda"
        and target.gemv_mma
        and cap is not None
        and tuple(cap) >= (8, 0)
        and (p.tiled or p.k % 128 == 0)
    )


def gemv_max_m(p: Problem, c: Crossovers, *, tensor_cores: bool, fused_serves: bool) -> int:
    """The largest M at which "auto" takes the GEMV: the largest bound of the rules that apply."""
    rules = [
        (c.gemv_max_m, True),
        (c.gemv_max_m_without_fused, tensor_cores and not fused_serves),
        (c.gemv_max_m_small, tensor_cores and p.n <= c.small_n and p.k <= c.long_k),
        (c.gemv_max_m_small_weight, tensor_cores and p.n * p.k <= c.small_weight),
        (c.gemv_max_m_narrow_long, p.n <= c.narrow_n and p.k >= c.long_k),
    ]
    return max(bound for bound, applies in rules if applies and bound is not None)


def prefers_fused(p: Problem, c: Crossovers, gemv_bound: int) -> bool:
    """Whether "auto" takes the fused GEMM (where it can serve) over the GEMV / dequant."""
    wide = p.n >= c.wide_n
    if p.m <= gemv_bound:
        return (
            c.fused_min_m_wide_long is not None
            and p.m >= c.fused_min_m_wide_long
            and (wide and p.k >= c.long_k)
        )
    large = wide and p.n * p.k >= c.large_weight
    return p.m <= (c.fused_max_m_large if large else c.fused_max_m)


_PLATFORM_OF = {"cpu": "cpu", "gemv": "cuda", "dequant": "cuda", "fused": "cuda", "native": "cuda"}
_UNSUPPORTED = {
    "gemv": gemv_unsupported_reason,
    "dequant": half_dtype_unsupported_reason,
    "xla": half_dtype_unsupported_reason,
}


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


def cuda_target(
    capability,
    *,
    device_kind: str | None = None,
    architectures: str = "",
    native_enabled: bool = False,
    gemv_mma: bool = True,
) -> Target:
    """A CUDA device of `capability` with jax_fp4's kernels compiled for `architectures` (empty:
    for that device): for judging the rules without the device (`python -m jax_fp4 paths`,
    benchmarks/dispatch_check.py)."""
    return Target(
        "cuda",
        capability=capability,
        device_kind=device_kind,
        has_cuda_kernels=cuda_kernels_run_on(architectures, capability),
        native_enabled=native_enabled,
        gemv_mma=gemv_mma,
    )


def _check_platform(backend: str, platform: str, has_cuda_kernels: bool) -> None:
    needed = _PLATFORM_OF[backend]
    if platform != needed or (needed == "cuda" and not has_cuda_kernels):
        why = (
            "this jax_fp4 build has no CUDA kernels for this GPU (none compiled in, or none for "
            "its compute capability: `python -m jax_fp4 info` lists the architectures)"
            if platform == needed
            else f"the computation is lowered for platform {platform!r}"
        )
        raise ValueError(f"backend={backend!r} needs platform {needed!r}, but {why}")


def plan(p: Problem, target: Target, backend: str = "auto") -> Plan:
    """The path of one matmul lowered for `target`, and the GEMV's kernel variant. A forced
    `backend` that cannot serve it raises ValueError with the reason."""
    tensor_cores = gemv_tensor_cores(p, target)
    path = _path(p, target, backend, tensor_cores)
    in_kernel = path == "gemv" or (path == "fused" and p.m <= FUSED_EPILOGUE_MAX_M)
    return Plan(
        path, gemv_tensor_cores=path == "gemv" and tensor_cores, epilogue_in_kernel=in_kernel
    )


def _path(p: Problem, target: Target, backend: str, tensor_cores: bool) -> str:
    check_backend(backend, p)
    if p.m == 0 or p.n == 0 or p.k == 0:
        return "empty"
    if backend in ("reference", "xla"):  # plain JAX: any platform
        return backend
    capability = target.capability
    if backend != "auto":
        _check_platform(backend, target.platform, target.has_cuda_kernels)
        if backend == "native":  # raises ValueError with the reason when it cannot run
            _native.native_path_applies(
                capability, target.native_enabled, "native", p.m, p.n, p.k, p.block_size, p.dtype
            )
        elif backend == "fused" and (reason := fused_unsupported_reason(p, capability)):
            raise ValueError(f"backend='fused' cannot serve this matmul: {reason}")
        return backend
    if target.platform == "cpu":
        return "cpu"
    if target.platform == "cuda" and target.has_cuda_kernels:
        c = target.crossovers.for_layout(p.tiled)
        fused_serves = fused_unsupported_reason(p, capability) is None
        # The native path, opted into, keeps everything past the GEMV's decode range.
        native = _native.native_path_applies(
            capability, target.native_enabled, "auto", p.m, p.n, p.k, p.block_size, p.dtype
        )
        bound = (
            c.gemv_max_m
            if native
            else gemv_max_m(p, c, tensor_cores=tensor_cores, fused_serves=fused_serves)
        )
        if fused_serves and prefers_fused(p, c, bound):
            return "fused"
        if gemv_unsupported_reason(p) is None and p.m <= bound:
            return "gemv"
        if native:
            return "native"
        if half_dtype_unsupported_reason(p) is None:
            return "dequant"
    if half_dtype_unsupported_reason(p) is None:
        return "xla"  # no jax_fp4 kernel here: XLA's own dot in the activations' dtype
    return "reference"


# ---- grouped products (jax_fp4.ragged_matmul) ----------------------------------------------------
#
# Paths of the grouped product (rows of `a` sorted by group, group g times weight g):
#   empty         M, N, K or G is zero: zeros (+ the bias of each row's group where K is zero).
#   reference     dequantize the stack to float32, jax.lax.ragged_dot at HIGHEST precision.
#   xla           dequantize to the activations' dtype, jax.lax.ragged_dot (fp16/bf16).
#   cpu           the CPU kernel, once per group with rows (jax_fp4_grouped_matmul_cpu).
#   grouped_gemv  CUDA grouped decode GEMV: each group's rows against its weight; a group without
#                 rows reads no weight. Any number of rows per group, fastest for few.
#   grouped_gemm  CUDA grouped GEMM (the Hopper fused GEMM's mainloop over a per-group schedule).
# "auto" has only static shapes: the group sizes are run-time values, so the rows per group it
# plans for is the mean, M / G.

GROUPED_BACKENDS = ("auto", "reference", "xla", "cpu", "grouped_gemv", "grouped_gemm")


@dataclasses.dataclass(frozen=True)
class GroupedProblem:
    """The static facts a grouped path decision depends on: a [M, K], a stack of G [N, K]
    weights."""

    m: int
    groups: int
    n: int
    k: int
    block_size: int
    dtype: np.dtype
    tiled: bool = False

    @property
    def rows_per_group(self) -> float:
        """The mean rows per group, M / G: the static hint the crossover reads."""
        return self.m / self.groups if self.groups else 0.0


@dataclasses.dataclass(frozen=True)
class GroupedCrossovers:
    """Where "auto" moves from the grouped GEMV to the grouped GEMM, for one GPU."""

    gemv_max_rows_per_group: float  # the grouped GEMV while M / G is at most this
    # "auto" runs jax_fp4.moe's own kernels (within the grouped GEMV's range) where they beat the
    # composition; backend="kernels" runs them regardless. Off on the H100 and the H200: at 1-32
    # tokens they take 0.9-1.4x the composition's time a layer (docs/design.md section 11).
    moe_kernels: bool = False


# An H100, G = 128 experts of 1536x2048 and 2048x768, uniform top-8 routing, ncu kernel times:
# the grouped GEMV is 13-30% ahead up to 8 rows per group, the grouped GEMM 15% ahead (gate_up) or
# tied (down) at 16 and 1.6-1.7x at 32. Other GPUs take the same crossover until measured.
GROUPED_DEFAULT = GroupedCrossovers(gemv_max_rows_per_group=8)
GROUPED_TABLES: dict[str, GroupedCrossovers] = {"NVIDIA H100 80GB HBM3": GROUPED_DEFAULT}


def grouped_crossovers(device_kind: str | None) -> GroupedCrossovers:
    return GROUPED_TABLES.get(device_kind, GROUPED_DEFAULT)


_INT32_LIMIT = (1 << 31) - 1
# The grouped GEMM's grid: ceil(M / 64) + min(G, M) row slots at its smallest (64-row) tile must
# fit CUDA's grid y limit (ffi/cuda/grouped/gemm_handler.cu).
_GROUPED_GEMM_MAX_SLOTS = 65535


def _grouped_kernel_shape_reason(p: GroupedProblem) -> str | None:
    """What both grouped CUDA kernels need (ffi/cuda/grouped/operands.h): fp16/bf16, block size
    16, K a multiple of 128 (their 128-wide windows), M, N, K below 2^31."""
    if p.dtype not in _HALF_DTYPES:
        return f"a must be float16 or bfloat16, got {p.dtype}"
    if p.block_size != 16:
        return f"block_size must be 16, got {p.block_size}"
    if p.k % 128:
        return f"K must be a multiple of 128, got {p.k}"
    if max(p.m, p.n, p.k, p.groups) >= _INT32_LIMIT:
        return f"M, N, K and G must be below 2^31, got M={p.m}, N={p.n}, K={p.k}, G={p.groups}"
    return None


def grouped_gemv_unsupported_reason(p: GroupedProblem, capability=None) -> str | None:
    """Why the grouped GEMV cannot serve `p` (None: it can). It runs on mma.sync: compute
    capability 8.0 or newer. `capability` None: the shape limits only."""
    if capability is not None and tuple(capability) < (8, 0):
        return f"it needs compute capability 8.0 or newer (mma.sync), this device has {capability}"
    return _grouped_kernel_shape_reason(p)


def grouped_gemm_unsupported_reason(p: GroupedProblem, capability=None) -> str | None:
    """Why the grouped GEMM cannot serve `p` (None: it can): the Hopper fused GEMM's mainloop,
    sm_90a, and a grid of at most 65535 row slots. `capability` None: the shape limits only."""
    if capability is not None and tuple(capability)[0] != 9:
        return f"it needs a Hopper GPU (compute capability 9.x), this device has {capability}"
    if (reason := _grouped_kernel_shape_reason(p)) is not None:
        return reason
    slots = -(-p.m // 64) + min(p.groups, p.m)
    if slots > _GROUPED_GEMM_MAX_SLOTS:
        return (
            f"ceil(M / 64) + min(G, M) must be at most {_GROUPED_GEMM_MAX_SLOTS}, got M={p.m}, "
            f"G={p.groups}"
        )
    return None


_GROUPED_UNSUPPORTED = {
    "xla": half_dtype_unsupported_reason,
    "grouped_gemv": grouped_gemv_unsupported_reason,
    "grouped_gemm": grouped_gemm_unsupported_reason,
}
_GROUPED_PLATFORM_OF = {"cpu": "cpu", "grouped_gemv": "cuda", "grouped_gemm": "cuda"}


def check_grouped_backend(backend: str, p: GroupedProblem) -> None:
    """Raise ValueError if a forced grouped backend cannot serve the problem (the part that does
    not depend on the platform)."""
    if backend not in GROUPED_BACKENDS:
        raise ValueError(f"backend must be one of {GROUPED_BACKENDS} (or None), got {backend!r}")
    reason = _GROUPED_UNSUPPORTED.get(backend, lambda _: None)(p)
    if reason is not None:
        raise ValueError(f"backend={backend!r} cannot serve this ragged_matmul: {reason}")


def grouped_plan(p: GroupedProblem, target: Target, backend: str = "auto") -> str:
    """The path of one grouped product lowered for `target`. A forced `backend` that cannot serve
    it raises ValueError with the reason."""
    check_grouped_backend(backend, p)
    if p.m == 0 or p.n == 0 or p.k == 0 or p.groups == 0:
        return "empty"
    if backend in ("reference", "xla"):  # plain JAX: any platform
        return backend
    grouped_cuda = (
        target.platform == "cuda" and target.has_cuda_kernels and target.has_grouped_kernels
    )
    if backend != "auto":
        needed = _GROUPED_PLATFORM_OF[backend]
        if target.platform != needed:
            raise ValueError(
                f"backend={backend!r} needs platform {needed!r}, but the computation is lowered "
                f"for platform {target.platform!r}"
            )
        if needed == "cuda" and not grouped_cuda:
            raise ValueError(
                f"backend={backend!r} needs jax_fp4's grouped CUDA kernels, which this build "
                "does not have for this GPU (`python -m jax_fp4 info` lists the FFI targets)"
            )
        reason = _GROUPED_UNSUPPORTED[backend](p, target.capability) if needed == "cuda" else None
        if reason is not None:
            raise ValueError(f"backend={backend!r} cannot serve this ragged_matmul: {reason}")
        return backend
    if target.platform == "cpu":
        return "cpu"
    if grouped_cuda:
        gemv = grouped_gemv_unsupported_reason(p, target.capability) is None
        gemm = grouped_gemm_unsupported_reason(p, target.capability) is None
        few_rows = (
            p.rows_per_group <= grouped_crossovers(target.device_kind).gemv_max_rows_per_group
        )
        if gemv and (few_rows or not gemm):
            return "grouped_gemv"
        if gemm:
            return "grouped_gemm"
    if p.dtype in _HALF_DTYPES:
        return "xla"
    return "reference"


def grouped_paths(
    groups: int, n: int, k: int, target: Target, *, tiled: bool, dtype="bfloat16", max_m: int = 8192
) -> list[tuple[int, int, str]]:
    """The path `auto` takes for a stack of `groups` N x K weights on `target`, as ranges of M:
    [(first M, last M, path), ...] for M = 1..max_m (the rules only, no device needed)."""
    ranges: list[tuple[int, int, str]] = []
    for m in range(1, max_m + 1):
        problem = GroupedProblem(
            m=m, groups=groups, n=n, k=k, block_size=16, dtype=np.dtype(dtype), tiled=tiled
        )
        path = grouped_plan(problem, target)
        if ranges and ranges[-1][2] == path:
            ranges[-1] = (ranges[-1][0], m, path)
        else:
            ranges.append((m, m, path))
    return ranges


# ---- top-k routing (jax_fp4.route_top_k) ---------------------------------------------------------
# Paths:
#   kernel  CUDA, one block (ffi/cuda/routing.cu): softmax, top k, renormalisation and the stable
#           grouping of the (token, slot) pairs by expert in one launch. The block holds at most
#           ROUTING_BLOCK_MAX_PAIRS pairs (T k) and ROUTING_BLOCK_MAX_EXPERTS experts (the
#           handler's kRoutingMaxPairs / kRoutingMaxExperts).
#   xla     the same results composed of XLA's softmax, top_k and a pair comparison or a sort
#           (any platform, any size): six kernels at decode sizes on a GPU.
# "auto" takes the kernel up to ROUTING_KERNEL_MAX_PAIRS pairs: its warps take a token each and one
# warp places the pairs 32 at a time, so its time grows with the tokens while XLA's stays flat.
# 128 experts, top 8, us a call in a chain of calls (benchmarks/routing.py, H100): 1 token 5.9
# against 10.4, 8 tokens 6.7 against 13.9, 16 tokens 8.6 against 13.3, 32 tokens 17.1 against 10.1.
ROUTING_BLOCK_MAX_PAIRS = 1024
ROUTING_BLOCK_MAX_EXPERTS = 4096
ROUTING_KERNEL_MAX_PAIRS = 128


def routing_path(tokens: int, experts: int, k: int, target: Target, *, has_kernel: bool) -> str:
    """The path of a top-k routing of `tokens` x `experts` logits on `target`; `has_kernel`: the
    routing kernel is registered and may run (one device's program)."""
    fits = tokens * k <= ROUTING_KERNEL_MAX_PAIRS and experts <= ROUTING_BLOCK_MAX_EXPERTS
    on_gpu = target.platform == "cuda" and target.has_cuda_kernels and has_kernel
    return "kernel" if on_gpu and fits else "xla"


# ---- the mixture-of-experts block (jax_fp4.moe) --------------------------------------------------
# Paths:
#   kernels   CUDA: the gate/up grouped GEMV gathering its tokens by index with silu(gate) * up in
#             its epilogue (jax_fp4_moe_gate_up_cuda), then the down grouped GEMV weighting each
#             (token, slot) and summing each token's k outputs in slot order, plus the residual
#             (jax_fp4_moe_down_cuda): two launches after the routing.
#   composed  the gather, two ragged_matmul calls and the combine in XLA (any platform; each
#             ragged_matmul takes its own path, so multi-device programs keep its sharding rules).
# "auto" takes the kernels where the grouped GEMV would serve both products (few rows per expert:
# decode) and composes past it, where the grouped GEMM's tiles pay for the extra launches.

MOE_BACKENDS = ("auto", "composed", "kernels")


def moe_kernels_unsupported_reason(
    gate_up: GroupedProblem, down: GroupedProblem, target: Target, *, has_kernels: bool
) -> str | None:
    """Why the block's kernels cannot serve the two products on `target` (None: they can)."""
    if target.platform != "cuda":
        return f"they run on CUDA devices, and the computation is lowered for {target.platform!r}"
    if not (target.has_cuda_kernels and has_kernels):
        return "this build has no MoE block kernels for this GPU (`python -m jax_fp4 info`)"
    # The down product's K is I: I % 128 == 0 also starts a tiled w_gate_up's up rows on a tile.
    for name, p in (("w_gate_up", gate_up), ("w_down", down)):
        reason = grouped_gemv_unsupported_reason(p, target.capability)
        if reason is not None:
            return f"{name}: {reason}"
    return None


def moe_plan(
    gate_up: GroupedProblem,
    down: GroupedProblem,
    target: Target,
    backend: str = "auto",
    *,
    has_kernels: bool,
) -> str:
    """The path of one MoE block ("kernels" or "composed"); gate_up and down are its two grouped
    products ([T k, H] x [E, 2 I, H] and [T k, I] x [E, H, I]). A forced backend that cannot serve
    it raises ValueError with the reason."""
    if backend not in MOE_BACKENDS:
        raise ValueError(f"backend must be one of {MOE_BACKENDS} (or None), got {backend!r}")
    empty = 0 in (gate_up.m, gate_up.groups, gate_up.n, gate_up.k, down.n, down.k)
    if backend == "composed" or empty:  # an empty block: ragged_matmul's empty path
        return "composed"
    reason = moe_kernels_unsupported_reason(gate_up, down, target, has_kernels=has_kernels)
    if backend == "kernels":
        if reason is not None:
            raise ValueError(f"backend='kernels' cannot serve this moe block: {reason}")
        return "kernels"
    crossovers = grouped_crossovers(target.device_kind)
    few_rows = gate_up.rows_per_group <= crossovers.gemv_max_rows_per_group
    return "kernels" if crossovers.moe_kernels and reason is None and few_rows else "composed"
