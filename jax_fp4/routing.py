"""Top-k routing of a mixture-of-experts layer: `route_top_k` and the `top_k_routing` primitive,
its abstract evaluation, lowering per platform, batching and JVP.

`route_top_k(logits, k)` takes router logits [T, E] and gives everything `ragged_matmul` needs
to run the chosen experts and what combines their outputs:

  weights      [T, k] float32  the chosen experts' softmax probabilities (float32 softmax over
                               the E logits; renormalize: over the k chosen ones, which sum to 1)
  experts      [T, k] int32    each token's k largest logits' experts, largest first (the lower
                               expert on ties)
  order        [T k] int32     the (token, slot) pairs t * k + j stably sorted by expert: row r of
                               the grouped product is pair order[r], token order[r] // k
  inverse      [T k] int32     the inverse permutation: pair p is row inverse[p]
  group_sizes  [E] int32       the pairs of each expert

On a GPU one kernel computes all five at decode sizes (ffi/cuda/routing.cu; up to
dispatch.ROUTING_KERNEL_MAX_PAIRS pairs, jax_fp4.dispatch.routing_path); elsewhere, past them and
in multi-device programs, which XLA partitions itself, they are composed of XLA's softmax, top_k
and a pair comparison (a sort past COMPARE_PAIRS_MAX pairs). Both give the same experts and
grouping; the weights agree to float32 rounding. NaN logits route to distinct valid experts (which
ones is unspecified) with NaN weights.

Derivatives: the weights are differentiable in the logits (the chosen experts held fixed, as
for jax.lax.top_k's values); the integer results have none.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend.core import Primitive
from jax.interpreters import ad, batching, mlir

from jax_fp4 import dispatch as _dispatch
from jax_fp4 import ffi as _ffi
from jax_fp4 import lowering as _lowering
from jax_fp4 import sharding as _sharding
from jax_fp4.ops import bind_per_batch_element, def_compiled_impl

top_k_routing_p = Primitive("top_k_routing")
top_k_routing_p.multiple_results = True

KERNEL_TARGET = "jax_fp4_top_k_routing_cuda"

_LOGIT_DTYPES = (np.dtype("float16"), np.dtype("bfloat16"), np.dtype("float32"))


class TopKRouting(NamedTuple):
    """What `route_top_k` returns (see the module's docstring)."""

    weights: jax.Array
    experts: jax.Array
    order: jax.Array
    inverse: jax.Array
    group_sizes: jax.Array


def _abstract_eval(logits, *, k, renormalize):
    del renormalize
    tokens, experts = logits.shape
    i32 = np.dtype("int32")
    return (
        jax.core.ShapedArray((tokens, k), np.dtype("float32")),
        jax.core.ShapedArray((tokens, k), i32),
        jax.core.ShapedArray((tokens * k,), i32),
        jax.core.ShapedArray((tokens * k,), i32),
        jax.core.ShapedArray((experts,), i32),
    )


top_k_routing_p.def_abstract_eval(_abstract_eval)
def_compiled_impl(top_k_routing_p)


# ---- the XLA composition ------------------------------------------------------------------------


def chosen_weights(logits, experts, renormalize: bool):
    """The softmax weights [T, k] float32 of the chosen `experts` [T, k] of `logits` [T, E]:
    exp(l - max) over the row's sum, or over the chosen ones' sum when `renormalize`."""
    x = logits.astype(jnp.float32)
    exp = jnp.exp(x - jax.lax.stop_gradient(jnp.max(x, axis=-1, keepdims=True)))
    chosen = jnp.take_along_axis(exp, experts, axis=-1)
    return chosen / jnp.sum(chosen if renormalize else exp, axis=-1, keepdims=True)


# Up to this many pairs the composition compares every pair with every other ([P, P] and [E, P]
# comparisons that XLA runs as a few fused reductions: 5 kernels a layer fewer than the sort's,
# 8% off Qwen3-30B-A3B's decode step at batch 1 on an H100, docs/design.md); past it (a million
# comparisons) the pairs are sorted (a sort, and scatters for the inverse and the sizes).
COMPARE_PAIRS_MAX = 1024


def _order_by_comparison(flat, experts: int):
    index = jnp.arange(flat.shape[0], dtype=jnp.int32)
    ahead = (flat[None, :] < flat[:, None]) | (
        (flat[None, :] == flat[:, None]) & (index[None, :] < index[:, None])
    )  # [j, i]: pair i goes before pair j
    inverse = jnp.sum(ahead, axis=1, dtype=jnp.int32)
    order = jnp.sum(
        jnp.where(inverse[None, :] == index[:, None], index[None, :], 0), axis=1, dtype=jnp.int32
    )
    ids = jnp.arange(experts, dtype=flat.dtype)
    group_sizes = jnp.sum(flat[None, :] == ids[:, None], axis=1, dtype=jnp.int32)
    return order, inverse, group_sizes


def _order_by_sort(flat, experts: int):
    order = jnp.argsort(flat, stable=True).astype(jnp.int32)
    inverse = jnp.zeros_like(order).at[order].set(jnp.arange(order.size, dtype=jnp.int32))
    group_sizes = jnp.bincount(flat, length=experts).astype(jnp.int32)
    return order, inverse, group_sizes


def expert_order(flat, experts: int):
    """(order, inverse, group_sizes) of pairs whose experts are flat [P] (int32, each in
    [0, experts)): the pairs stably sorted by expert, its inverse and each expert's count."""
    if flat.shape[0] <= COMPARE_PAIRS_MAX:
        return _order_by_comparison(flat, experts)
    return _order_by_sort(flat, experts)


def _composed(logits, *, k, renormalize):
    x = logits.astype(jnp.float32)
    x = jnp.where(x == 0, 0.0, x)  # -0 ties with +0, as in the kernel
    experts = jax.lax.top_k(x, k)[1].astype(jnp.int32)
    weights = chosen_weights(logits, experts, renormalize)
    return (weights, experts, *expert_order(experts.reshape(-1), logits.shape[1]))


def _kernel(logits, *, k, renormalize):
    avals = _abstract_eval(logits, k=k, renormalize=renormalize)
    outs = tuple(jax.ShapeDtypeStruct(x.shape, x.dtype) for x in avals)
    return jax.ffi.ffi_call(KERNEL_TARGET, outs)(logits, k=np.int64(k), renormalize=renormalize)


_PATHS = {"kernel": _kernel, "xla": _composed}


def has_routing_kernel() -> bool:
    """Whether this build registered the routing kernel."""
    return KERNEL_TARGET in _ffi.REGISTERED_TARGETS.get("CUDA", [])


def routing_path(tokens: int, experts: int, k: int, platform: str) -> str:
    """The path of a routing of [tokens, experts] logits lowered for `platform` on this machine
    (one device's program)."""
    target = _lowering.target_for(platform)
    return _dispatch.routing_path(tokens, experts, k, target, has_kernel=has_routing_kernel())


def _lowering_rule(ctx, logits, *, k, renormalize, platform):
    tokens, experts = ctx.avals_in[0].shape
    path = routing_path(tokens, experts, k, platform)
    if _sharding._needs_rule(ctx):
        path = "xla"  # XLA partitions the composition; the kernel would gather the logits
    run = functools.partial(_PATHS[path], k=k, renormalize=renormalize)

    def lowered(x):
        with jax.named_scope(f"jax_fp4/routing_{path}"):
            return run(x)

    return mlir.lower_fun(lowered, multiple_results=True)(ctx, logits)


mlir.register_lowering(top_k_routing_p, functools.partial(_lowering_rule, platform="other"))
for _platform in ("cpu", "cuda"):
    mlir.register_lowering(
        top_k_routing_p, functools.partial(_lowering_rule, platform=_platform), platform=_platform
    )
_sharding.register_primitive(top_k_routing_p)


# ---- batching and autodiff ----------------------------------------------------------------------


def _batch(operands, dims, **params):
    # Each batch element routes its own tokens (its own grouping): one call per element.
    outs, _ = bind_per_batch_element(top_k_routing_p, operands, dims, params)
    return outs, (0,) * len(outs)


batching.primitive_batchers[top_k_routing_p] = _batch


def _jvp(primals, tangents, *, k, renormalize):
    (logits,), (dlogits,) = primals, tangents
    outs = top_k_routing_p.bind(logits, k=k, renormalize=renormalize)
    no_tangent = [ad.Zero(jax.core.ShapedArray(x.shape, jax.dtypes.float0)) for x in outs[1:]]
    if type(dlogits) is ad.Zero:
        dweights = ad.Zero(jax.core.ShapedArray(outs[0].shape, outs[0].dtype))
    else:
        experts = outs[1]
        _, dweights = jax.jvp(
            lambda x: chosen_weights(x, experts, renormalize), (logits,), (dlogits,)
        )
    return outs, [dweights, *no_tangent]


ad.primitive_jvps[top_k_routing_p] = _jvp


# ---- the public function ------------------------------------------------------------------------


def route_top_k(logits, k: int, *, renormalize: bool = False) -> TopKRouting:
    """Top-k routing of router logits [T, E] (float16, bfloat16 or float32): each token's k
    largest logits' experts with their softmax weights, and the (token, slot) pairs grouped by
    expert for `ragged_matmul`:

        r = jax_fp4.route_top_k(router_logits, 8, renormalize=True)
        y = jax_fp4.ragged_matmul(x[r.order // 8], experts, r.group_sizes)  # [T 8, N]
        out = jnp.sum(y[r.inverse].reshape(T, 8, N) * r.weights[..., None], axis=1)

    renormalize: divide the chosen weights by their sum (Qwen3-MoE's norm_topk_prob, Mixtral)
    instead of the softmax over all E. Returns a TopKRouting (weights, experts, order, inverse,
    group_sizes); the module's docstring defines each.
    """
    shape = getattr(logits, "shape", None)
    dtype = getattr(logits, "dtype", None)
    if shape is None or len(shape) != 2:
        raise ValueError(f"route_top_k: logits must be a 2-D array [T, E], got shape {shape}")
    if dtype is None or np.dtype(dtype) not in _LOGIT_DTYPES:
        raise TypeError(
            f"route_top_k: logits must be float16, bfloat16 or float32, got dtype {dtype}"
        )
    experts = shape[1]
    if isinstance(k, bool) or not isinstance(k, (int, np.integer)) or not 1 <= k <= experts:
        raise ValueError(f"route_top_k: k must be an int in [1, E = {experts}], got {k!r}")
    if not isinstance(renormalize, (bool, np.bool_)):
        raise TypeError(f"route_top_k: renormalize must be a bool, got {renormalize!r}")
    outs = top_k_routing_p.bind(logits, k=int(k), renormalize=bool(renormalize))
    return TopKRouting(*outs)
