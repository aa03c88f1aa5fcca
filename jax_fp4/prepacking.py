"""`prepack` / `unprepack`: weight layouts prepared once at load time for a kernel path.

target="tiled"  the tiled layout (jax_fp4/layout.py): the packed codes and block scales
                reordered (same shapes and bytes). The CUDA GEMV, fused GEMM and dequant kernels
                and the CPU kernel read it directly (the CUDA ones faster than the spec layout
                on the H200); the reference and native paths transform it back inside the
                program (on SM120 with the native path, use target="sm120").
target="sm120"  the native Blackwell SM120 path's swizzled scales, kept beside the plain ones
                (jax_fp4/native.py).
"""

from __future__ import annotations

import jax

from jax_fp4 import layout as _layout
from jax_fp4 import native as _native
from jax_fp4.format import NVFP4Weight, not_a_weight_error, spec_arrays

TARGETS = ("tiled", "sm120")


def prepack(w: NVFP4Weight, target: str = "tiled") -> NVFP4Weight:
    """A copy of `w` laid out for `target`'s kernels ("tiled" or "sm120"); pure jnp, jit-able, keeps
    stacked leading axes. Computes the same matmul as `w` on every path."""
    if not isinstance(w, NVFP4Weight):
        raise not_a_weight_error("prepack", w)
    if target not in TARGETS:
        raise ValueError(f"prepack: target must be one of {TARGETS}, got {target!r}")
    if target == "sm120":
        return _native.prepack(unprepack(w), target="sm120")
    if w.layout == "tiled":
        return w
    if (reason := _layout.tiled_layout_unsupported(w.n, w.k, w.block_size)) is not None:
        raise ValueError(f"prepack: the tiled layout {reason} (weight shape {w.shape})")
    return _tile(w)


def unprepack(w: NVFP4Weight) -> NVFP4Weight:
    """`w` as a plain NVFP4Weight in the spec layout (what checkpoints store)."""
    if not isinstance(w, NVFP4Weight):
        raise not_a_weight_error("unprepack", w)
    if w.layout == "spec" and type(w) is NVFP4Weight:
        return w
    return _untile(w)


# The transforms are compiled once per weight shape: eagerly their dozens of small ops take 15-20x
# longer (11008x4096 on two CPU cores: 0.66-0.93 s against 0.044 s).
@jax.jit
def _tile(w: NVFP4Weight) -> NVFP4Weight:
    return NVFP4Weight(
        _layout.tile_packed(w.packed),
        _layout.tile_scale(w.scale),
        w.global_scale,
        w.block_size,
        layout="tiled",
    )


@jax.jit
def _untile(w: NVFP4Weight) -> NVFP4Weight:
    packed, scale = spec_arrays(w)
    return NVFP4Weight(packed, scale, w.global_scale, w.block_size)


def in_layout(w: NVFP4Weight, layout: str) -> NVFP4Weight:
    """`w` in `layout` where its shape allows: "tiled" prepacks it when the tiled layout takes the
    shape (block size 16, N % 16 == 0, K % 128 == 0) and returns `w` itself otherwise; "spec"
    returns `w`. For loaders and benchmarks that take whatever layout each weight can have."""
    if layout == "tiled" and _layout.tiled_layout_unsupported(w.n, w.k, w.block_size) is None:
        return prepack(w)
    return w
