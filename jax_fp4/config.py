"""jax_fp4's switches: the environment variables users set, and the kernel tuning benchmarks pass.

Environment variables, each read when a matmul is traced (not at import), so a test or a program
may change one between traces (jit caches a trace per function: retrace to see a change).
Booleans take 1/0, true/false, yes/no, on/off (any case); anything else is a ValueError.

  variable                     default  effect
  JAX_FP4_GEMV_MMA             1        the GEMV's tensor-core (mma.sync) kernel where it can run
                                        (sm_80+, K % 128 == 0 or a prepacked weight); 0: the
                                        scalar kernel everywhere (the dispatch then plans for it)
  JAX_FP4_GEMV_ROW_TILING      1        the tensor-core GEMV's two row tiles per warp at M = 9-16
  JAX_FP4_NATIVE_SM120         0        opt into the W4A4 native path on compute capability 12.x
                                        under backend="auto" (backend="native" forces it anyway)
  JAX_FP4_CUSTOM_PARTITIONING  1        the partitioning rules of jax_fp4/sharding.py; 0: XLA
                                        gathers the operands of a kernel call (for comparison)
  JAX_FP4_CUDA_CAPABILITY      unset    "MAJOR.MINOR": lower CUDA programs for that GPU instead of
                                        this machine's (exporting for a GPU this machine lacks);
                                        the dispatch then uses that capability's table entry
  JAX_FP4_CPU_AVX512           1        the CPU kernel's AVX-512 GEMM where the CPU has it; 0: the
                                        AVX2 one (the same bits either way)

Kernel choices that only measurements need (tile sizes, split counts, launch modes) are not
environment variables: they are a `KernelTuning` passed to `jax_fp4.matmul(..., tuning=...)`,
a static parameter of the primitive that the lowering turns into the kernels' FFI attributes.
"""

from __future__ import annotations

import dataclasses
import os

GEMV_MMA_ENV = "JAX_FP4_GEMV_MMA"
GEMV_ROW_TILING_ENV = "JAX_FP4_GEMV_ROW_TILING"
NATIVE_SM120_ENV = "JAX_FP4_NATIVE_SM120"
CUSTOM_PARTITIONING_ENV = "JAX_FP4_CUSTOM_PARTITIONING"
CAPABILITY_ENV = "JAX_FP4_CUDA_CAPABILITY"
CPU_AVX512_ENV = "JAX_FP4_CPU_AVX512"

_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")


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
    raise ValueError(
        f"environment variable {name} must be a boolean (0/1/true/false/yes/no), got {raw!r}"
    )


def gemv_tensor_cores() -> bool:
    return env_flag(GEMV_MMA_ENV, True)


def gemv_row_tiling() -> bool:
    return env_flag(GEMV_ROW_TILING_ENV, True)


def native_sm120() -> bool:
    return env_flag(NATIVE_SM120_ENV, False)


def custom_partitioning() -> bool:
    return env_flag(CUSTOM_PARTITIONING_ENV, True)


def cpu_avx512() -> bool:
    return env_flag(CPU_AVX512_ENV, True)


def parse_capability(text: str) -> tuple[int, int]:
    """'9.0' -> (9, 0); ValueError for anything but MAJOR.MINOR."""
    major, dot, minor = text.strip().partition(".")
    if not (dot and major.isdigit() and minor.isdigit()):
        raise ValueError(f"expected MAJOR.MINOR (e.g. 9.0), got {text!r}")
    return int(major), int(minor)


def cuda_capability_override() -> tuple[int, int] | None:
    """JAX_FP4_CUDA_CAPABILITY ("9.0"): the GPU the CUDA lowering picks kernels for in place of
    this machine's (None when unset)."""
    raw = os.environ.get(CAPABILITY_ENV, "")
    if not raw.strip():
        return None
    try:
        return parse_capability(raw)
    except ValueError as err:
        raise ValueError(f"environment variable {CAPABILITY_ENV}: {err}") from None


# ---- kernel tuning (measurement only) -----------------------------------------------------------

_ALLOWED = {
    "gemv_col_tiles": (0, 1, 2),
    "gemv_rows_per_block": (0, 1, 2, 4),
    "fused_split": tuple(range(9)),
    "fused_tile_m": (0, 16, 32, 64, 128, 256),
    "fused_tile_n": (0, 128, 256),
    "fused_warp_specialized": (None, False, True),
    "fused_stream_k": (None, False, True),
    "programmatic_launch": (False, True),
    "gemv_norm_scale": (False, True),
}


# A tri-state tuning choice as the kernels' attribute: -1 the heuristic, 0 off, 1 on.
_TRI_STATE = {None: -1, False: 0, True: 1}


@dataclasses.dataclass(frozen=True)
class KernelTuning:
    """Kernel choices for measurements, in place of the kernels' own heuristics (0 / None: the
    heuristic). Hashable: a static parameter of the primitive, so each tuning compiles its own
    program. Not needed for normal use: the heuristics are what the benchmarks chose.

      gemv_col_tiles       the GEMV's column tiles per warp: 1 or 2
      gemv_k_split         warps splitting K in the GEMV's block: >= 1 (clamped to the block's
                           warp budget by the kernel)
      gemv_rows_per_block  the scalar GEMV's rows per block: 1, 2 or 4
      fused_split          the fused GEMM's split-K: 1..8
      fused_tile_m         the fused GEMM's activation tile: 16, 32, 64, 128 or 256 rows
      fused_tile_n         the fused GEMM's weight rows per CTA: 128 or 256
      fused_warp_specialized  the warp-specialized kernel (True) or the multistage one (False)
      fused_stream_k       stream-K (True) or cluster split-K (False) in the warp-specialized kernel
      programmatic_launch  programmatic dependent launch (sm_90+) of the GEMV and the fused GEMM
      gemv_norm_scale      a bfloat16 GEMV call's RMSNorm split around the product: a * norm_weight
                           and the rows' sums of squares in one XLA fusion before the kernel, each
                           row's 1 / RMS in its epilogue (jax_fp4/lowering.py), where the RMSNorm
                           is otherwise an XLA fusion of its own
    """

    gemv_col_tiles: int = 0
    gemv_k_split: int = 0
    gemv_rows_per_block: int = 0
    fused_split: int = 0
    fused_tile_m: int = 0
    fused_tile_n: int = 0
    fused_warp_specialized: bool | None = None
    fused_stream_k: bool | None = None
    programmatic_launch: bool = False
    gemv_norm_scale: bool = False

    def __post_init__(self):
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if field.name == "gemv_k_split":
                ok = type(value) is int and value >= 0
                allowed = "0 (the heuristic) or a positive int"
            else:
                choices = _ALLOWED[field.name]
                # bool is an int: 1 must not pass for True, nor True for 1.
                ok = any(
                    value is c
                    if c is None or isinstance(c, bool)
                    else (type(value) is int and value == c)
                    for c in choices
                )
                allowed = ", ".join(map(repr, choices))
            if not ok:
                raise ValueError(
                    f"KernelTuning.{field.name} must be one of {allowed}, got {value!r}"
                )

    def gemv_attributes(self) -> dict:
        """The GEMV target's tuning attributes (INTERFACE: col_tiles, k_split, rows_per_block,
        programmatic)."""
        return dict(
            col_tiles=self.gemv_col_tiles,
            k_split=self.gemv_k_split,
            rows_per_block=self.gemv_rows_per_block,
            programmatic=self.programmatic_launch,
        )

    def fused_attributes(self) -> dict:
        """The fused GEMM target's tuning attributes (-1: the heuristic, for the tri-state ones)."""
        return dict(
            split=self.fused_split,
            tile_m=self.fused_tile_m,
            tile_n=self.fused_tile_n,
            warp_specialized=_TRI_STATE[self.fused_warp_specialized],
            stream_k=_TRI_STATE[self.fused_stream_k],
            programmatic=self.programmatic_launch,
        )


DEFAULT_TUNING = KernelTuning()
