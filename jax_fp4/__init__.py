"""jax_fp4: NVFP4 weight-only matmul for JAX.

w = jax_fp4.quantize(weight)            # float [N, K] -> NVFP4Weight
w = jax_fp4.prepack(w)                  # optional, once: the decode GEMV's faster layout
y = jax_fp4.matmul(a, w, bias)          # a [..., K] fp16/bf16 -> y [..., N]

Mixture-of-experts layers: a stack of expert weights and the rows of each expert, sorted by expert:
experts = jax_fp4.quantize(weights)     # float [G, N, K] -> NVFP4Weight stack
y = jax_fp4.ragged_matmul(x, experts, group_sizes)  # x [M, K], group_sizes int32 [G] -> [M, N]
r = jax_fp4.route_top_k(logits, k)      # router logits [T, G] -> weights, experts, order, ...
y = jax_fp4.moe(x, r, w_gate_up, w_down, residual=h)  # the whole routed MLP block -> [T, H]
"""

from jax_fp4 import ffi as _ffi  # noqa: F401  (importing it registers the FFI targets)
from jax_fp4.config import KernelTuning
from jax_fp4.dispatch import BACKENDS, GEMV_MAX_M, GROUPED_BACKENDS, MOE_BACKENDS
from jax_fp4.export import export_disabled_checks
from jax_fp4.format import NVFP4Weight, dequantize, pack_codes, unpack_codes
from jax_fp4.grouped import nvfp4_ragged_matmul_p, ragged_dispatch_path, ragged_matmul
from jax_fp4.moe_block import moe, moe_dispatch_path, nvfp4_moe_p
from jax_fp4.native import PrepackedNVFP4Weight
from jax_fp4.ops import dispatch_path, dispatch_reasons, matmul, nvfp4_matmul_p
from jax_fp4.prepacking import prepack, unprepack
from jax_fp4.quantization import quantize
from jax_fp4.routing import TopKRouting, route_top_k, top_k_routing_p

__version__ = "0.1.0"

# Submodules with optional dependencies (flax) load on first use: `jax_fp4.nnx.FP4Linear`.
_LAZY_SUBMODULES = ("nnx", "linen", "checkpoint")


def __getattr__(name):
    if name in _LAZY_SUBMODULES:
        import importlib

        return importlib.import_module(f"jax_fp4.{name}")
    raise AttributeError(f"module 'jax_fp4' has no attribute {name!r}")


__all__ = [
    "BACKENDS",
    "GEMV_MAX_M",
    "GROUPED_BACKENDS",
    "KernelTuning",
    "NVFP4Weight",
    "dequantize",
    "dispatch_path",
    "dispatch_reasons",
    "export_disabled_checks",
    "matmul",
    "moe",
    "MOE_BACKENDS",
    "moe_dispatch_path",
    "nvfp4_matmul_p",
    "nvfp4_moe_p",
    "nvfp4_ragged_matmul_p",
    "pack_codes",
    "prepack",
    "PrepackedNVFP4Weight",
    "quantize",
    "ragged_dispatch_path",
    "ragged_matmul",
    "route_top_k",
    "top_k_routing_p",
    "TopKRouting",
    "unpack_codes",
    "unprepack",
]
