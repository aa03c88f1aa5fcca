"""The mixture-of-experts block: `moe`, the `nvfp4_moe` primitive, its abstract evaluation,
lowering per platform, batching and JVP.

`moe(x, routing, w_gate_up, w_down, residual=residual)` is, for each token t of x [T, H],

    y[t] = residual[t] + sum over slots j of weights[t, j] * down_e(silu(gate_e(x[t])) * up_e(x[t]))

with e the expert of pair (t, j), the routing's (token, slot) pairs grouped by expert as
`route_top_k` gives them (weights [T, k], order [T k], inverse [T k], group_sizes [E]), w_gate_up
a stack of fused gate/up experts [E, 2 I, H] (rows [:I] the gate) and w_down [E, H, I].

Paths (jax_fp4.dispatch.moe_plan):
  composed  route_top_k's documented composition: the routed rows x[order // k], ragged_matmul
            with silu_mul, ragged_matmul, then the rows back in pair order (inverse) and each
            token's k outputs weighted and summed in float32, plus the residual, rounded once.
            The hidden rows and each expert's output round to x's dtype (ragged_matmul's results).
  kernels   two CUDA launches (ffi/cuda/grouped/moe_handler.cu): the gate/up grouped GEMV reads
            each row's token through `order` (no gathered copy of x) and writes silu(gate) * up;
            the down grouped GEMV keeps each pair's product in float32, weights it and, in the
            block that completes a token's k pairs, sums them in slot order and adds the
            residual: one rounding, bit-reproducible (no order-dependent atomics).
Both answer to the same float64 model of the formula, with each path's roundings in the bound
(tests/test_moe_block.py, tests/test_moe_kernels.py).

A routing need not come from route_top_k: any (weights, order, group_sizes) whose order is a
permutation of the T k pairs listing them grouped by expert, group_sizes[e] of them for expert e,
serves (the inverse permutation is read by the composition only; the kernels count each pair
once, so an order that repeats a pair leaves its token's output unwritten). Pairs past
sum(group_sizes) contribute nothing (ragged_matmul's rows past the groups), which is how an
expert-parallel shard_map body leaves out the pairs of other shards' experts. A negative size
counts as 0 at run time; concrete negative sizes are refused.

An optional shared expert (a dense NVFP4 MLP every token takes, with Qwen2-MoE's sigmoid gate)
runs first through jax_fp4.matmul and joins the residual (`shared_expert`).

Transformations: jit; vmap (the batch's tokens join one block, one pass over the weights; with
batched weight stacks, one block per element); the JVP is the composition's, so grad with respect
to x, the routing weights, the global scales and the residual runs through ragged_matmul's rules.
In a multi-device program XLA partitions the composition (ragged_matmul's sharding rules); in a
shard_map body the block runs on the local shards as it is.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend.core import Primitive
from jax.interpreters import ad, batching, mlir

from jax_fp4 import dispatch as _dispatch
from jax_fp4 import ffi as _ffi
from jax_fp4 import grouped as _grouped
from jax_fp4 import sharding as _sharding
from jax_fp4.explicit_axes import typed_mesh
from jax_fp4.format import NVFP4Weight, kernel_scale, not_a_weight_error
from jax_fp4.ops import (
    bind_per_batch_element,
    composition_jvp,
    def_compiled_impl,
    resolve_backend,
)
from jax_fp4.ops import matmul as _matmul
from jax_fp4.routing import expert_order

nvfp4_moe_p = Primitive("nvfp4_moe")

GATE_UP_TARGET = "jax_fp4_moe_gate_up_cuda"
DOWN_TARGET = "jax_fp4_moe_down_cuda"


def _split(operands, has_residual):
    """The operands (x, the two stacks' packed, scale and global_scale, the routing's weights,
    order, inverse and group_sizes, then the residual when has_residual) -> (x, gate_up, down,
    routing, residual or None)."""
    ops = tuple(operands)
    return ops[0], ops[1:4], ops[4:7], ops[7:11], (ops[11] if has_residual else None)


def bind(x, gate_up, down, routing, residual, *, gate_up_meta, down_meta, backend):
    """Bind the primitive. gate_up, down: (packed, scale bytes, global_scale); routing: (weights,
    order, inverse, group_sizes); *_meta: (block_size, layout); residual may be None. Operands
    must already be validated."""
    operands = (x, *gate_up, *down, *routing) + (() if residual is None else (residual,))
    return nvfp4_moe_p.bind(
        *operands,
        gate_up_meta=gate_up_meta,
        down_meta=down_meta,
        backend=backend,
        has_residual=residual is not None,
    )


def _abstract_eval(x, *operands, **params):
    del operands, params
    return jax.core.ShapedArray(x.shape, x.dtype)


nvfp4_moe_p.def_abstract_eval(_abstract_eval)
def_compiled_impl(nvfp4_moe_p)


# ---- the paths (traced inside the lowering) ----------------------------------------------------


def composed(x, gate_up, down, routing, residual, *, gate_up_meta, down_meta):
    """The block as route_top_k documents it: gather, two ragged_matmul calls, the combine."""
    weights, order, inverse, group_sizes = routing
    tokens, k = weights.shape
    rows = jnp.take(x, order // k, axis=0, mode="clip")
    hidden = _grouped.bind(
        rows,
        *gate_up,
        group_sizes,
        None,
        block_size=gate_up_meta[0],
        backend="auto",
        layout=gate_up_meta[1],
        activation="silu_mul",
    )
    out = _grouped.bind(
        hidden,
        *down,
        group_sizes,
        None,
        block_size=down_meta[0],
        backend="auto",
        layout=down_meta[1],
    )
    # Back to (token, slot) order, then each token's k outputs summed in float32: a gather and a
    # fixed-order sum (a scatter-add of the pairs onto their tokens would add in whatever order
    # the GPU's atomics land).
    out = jnp.take(out, inverse, axis=0, mode="clip").astype(jnp.float32)
    y = jnp.sum(
        out.reshape(tokens, k, out.shape[-1]) * weights.astype(jnp.float32)[..., None], axis=1
    )
    if residual is not None:
        y = y + residual.astype(jnp.float32)
    return y.astype(x.dtype)


def counter_tiles(hidden_size: int) -> int:
    """Columns of the down kernel's per-token counters: room for one per 16 output columns (a block
    spanning several counts on the first)."""
    return -(-hidden_size // 16)


def gate_up_kernel(x, gate_up, routing, *, gate_up_meta):
    """The gate/up launch: (hidden [T k, I] in row (expert) order, the down launch's counters,
    zeroed)."""
    weights, order, _, group_sizes = routing
    tokens, hidden_size = x.shape
    k = weights.shape[1]
    counters = jax.ShapeDtypeStruct((tokens, counter_tiles(hidden_size)), jnp.int32)
    hidden = jax.ShapeDtypeStruct((tokens * k, gate_up[0].shape[1] // 2), x.dtype)
    return jax.ffi.ffi_call(GATE_UP_TARGET, (hidden, counters))(
        x,
        *gate_up,
        group_sizes,
        order,
        block_size=np.int64(gate_up_meta[0]),
        tiled=gate_up_meta[1] == "tiled",
        top_k=np.int64(k),
    )


def down_kernel(hidden, counters, down, routing, residual, *, down_meta, dtype):
    """The down launch: y [T, H] in `dtype`, each token's k weighted pair products summed in slot
    order with the residual. The counters pass through it (aliased); its float32 pair products go
    to a scratch result."""
    weights, order, _, group_sizes = routing
    tokens, k = weights.shape
    hidden_size = down[0].shape[1]
    res = jnp.zeros((0,), dtype) if residual is None else residual
    y, _, _ = jax.ffi.ffi_call(
        DOWN_TARGET,
        (
            jax.ShapeDtypeStruct((tokens, hidden_size), dtype),
            jax.ShapeDtypeStruct(counters.shape, jnp.int32),
            jax.ShapeDtypeStruct((tokens * k, hidden_size), jnp.float32),
        ),
        input_output_aliases={8: 1},
    )(
        hidden,
        *down,
        group_sizes,
        order,
        weights,
        res,
        counters,
        block_size=np.int64(down_meta[0]),
        tiled=down_meta[1] == "tiled",
        top_k=np.int64(k),
    )
    return y


def kernels(x, gate_up, down, routing, residual, *, gate_up_meta, down_meta):
    """The two launches (ffi/cuda/grouped/moe_handler.cu). The gate/up call also zeroes the
    counters the down call counts each token's finished pairs in (aliased in and out of it)."""
    hidden, counters = gate_up_kernel(x, gate_up, routing, gate_up_meta=gate_up_meta)
    return down_kernel(
        hidden, counters, down, routing, residual, down_meta=down_meta, dtype=x.dtype
    )


_PATHS = {"composed": composed, "kernels": kernels}


def has_moe_kernels() -> bool:
    """Whether this build registered the block's two CUDA targets."""
    registered = _ffi.REGISTERED_TARGETS.get("CUDA", [])
    return GATE_UP_TARGET in registered and DOWN_TARGET in registered


def problems(x_shape, x_dtype, gu_packed_shape, dn_packed_shape, k, gate_up_meta, down_meta):
    """The block's two grouped products as GroupedProblems: [T k, H] x [E, 2 I, H] and
    [T k, I] x [E, H, I]."""
    pairs, inter = x_shape[0] * k, gu_packed_shape[1] // 2
    gate_up = _grouped.problem_of((pairs, x_shape[1]), x_dtype, gu_packed_shape, *gate_up_meta)
    down = _grouped.problem_of((pairs, inter), x_dtype, dn_packed_shape, *down_meta)
    return gate_up, down


def path_for(platform, x_shape, x_dtype, gu_packed_shape, dn_packed_shape, k, *, backend, **meta):
    """The path of a block lowered for `platform` ('cpu', 'cuda' or another) on this machine."""
    gate_up, down = problems(x_shape, x_dtype, gu_packed_shape, dn_packed_shape, k, **meta)
    target = _grouped.target_for(platform)
    return _dispatch.moe_plan(gate_up, down, target, backend, has_kernels=has_moe_kernels())


def _lowering_rule(ctx, *operands, gate_up_meta, down_meta, backend, has_residual, platform):
    x_aval, gu_aval, dn_aval, weights_aval = (ctx.avals_in[i] for i in (0, 1, 4, 7))
    meta = dict(gate_up_meta=gate_up_meta, down_meta=down_meta)
    path = path_for(
        platform,
        x_aval.shape,
        x_aval.dtype,
        gu_aval.shape,
        dn_aval.shape,
        weights_aval.shape[1],
        backend=backend,
        **meta,
    )
    multi_device = _sharding._needs_rule(ctx) or any(typed_mesh(a) for a in ctx.avals_in)
    if multi_device:
        path = "composed"  # XLA partitions the composition by ragged_matmul's rules
    run = _PATHS[path]

    def lowered(*ops):
        x, gate_up, down, routing, residual = _split(ops, has_residual)
        with jax.named_scope(f"jax_fp4/moe_{path}"):
            return run(x, gate_up, down, routing, residual, **meta)

    return mlir.lower_fun(lowered, multiple_results=False)(ctx, *operands)


mlir.register_lowering(nvfp4_moe_p, functools.partial(_lowering_rule, platform="other"))
for _platform in ("cpu", "cuda"):
    mlir.register_lowering(
        nvfp4_moe_p, functools.partial(_lowering_rule, platform=_platform), platform=_platform
    )
_sharding.register_primitive(nvfp4_moe_p)


# ---- batching -----------------------------------------------------------------------------------


def _merged_routing(weights, order, group_sizes):
    """One routing of a batch's B routings (weights [B, T, k], order [B, T k], group_sizes
    [B, E]): token t of element b becomes token b T + t, each pair keeps its expert, and the
    pairs past an element's groups stay past the merged groups."""
    b, t, k = weights.shape
    experts = group_sizes.shape[1]
    pairs = t * k

    def pair_experts(order, group_sizes):
        row_expert = _grouped.row_groups(group_sizes, pairs)  # E past the groups
        return jnp.full((pairs,), experts, jnp.int32).at[order].set(row_expert, mode="drop")

    flat = jax.vmap(pair_experts)(order, group_sizes).reshape(b * pairs)
    merged_order, merged_inverse, merged_sizes = expert_order(flat, experts + 1)
    return weights.reshape(b * t, k), merged_order, merged_inverse, merged_sizes[:experts]


def _batch(operands, dims, **params):
    has_residual = params["has_residual"]
    token_operands = (0, 7, 8, 9, 10) + ((11,) if has_residual else ())
    if any(d is not None for i, d in enumerate(dims) if i not in token_operands):
        # Weight stacks batched (layers): one block per batch element, in a loop.
        return bind_per_batch_element(nvfp4_moe_p, operands, dims, params)
    size = next(x.shape[d] for x, d in zip(operands, dims) if d is not None)

    def batched(i):
        x, d = operands[i], dims[i]
        return jnp.broadcast_to(x, (size, *x.shape)) if d is None else jnp.moveaxis(x, d, 0)

    x, weights, order, _, group_sizes = (batched(i) for i in token_operands[:5])
    b, t, h = x.shape
    routing = _merged_routing(weights, order, group_sizes)
    residual = batched(11).reshape(b * t, h) if has_residual else None
    ops = list(operands)
    ops[0] = x.reshape(b * t, h)
    ops[7:11] = routing
    if has_residual:
        ops[11] = residual
    return nvfp4_moe_p.bind(*ops, **params).reshape(b, t, h), 0


batching.primitive_batchers[nvfp4_moe_p] = _batch


# ---- autodiff -----------------------------------------------------------------------------------


def _jvp(primals, tangents, *, gate_up_meta, down_meta, backend, has_residual):
    """The block's value, and the tangent of its composition in the operands that move: x, the
    global scales, the routing weights and the residual (codes, scales and the routing's integer
    parts have none)."""
    params = dict(gate_up_meta=gate_up_meta, down_meta=down_meta)
    y = nvfp4_moe_p.bind(*primals, backend=backend, has_residual=has_residual, **params)
    x, gate_up, down, routing, residual = _split(primals, has_residual)
    dx, dgu, ddn, droute, dres = _split(tangents, has_residual)

    def composition(x, gu_gs, dn_gs, weights, residual):
        return composed(
            x,
            (*gate_up[:2], gu_gs),
            (*down[:2], dn_gs),
            (weights, *routing[1:]),
            residual,
            **params,
        )

    return composition_jvp(
        y,
        composition,
        (x, gate_up[2], down[2], routing[0], residual),
        (dx, dgu[2], ddn[2], droute[0], dres),
    )


ad.primitive_jvps[nvfp4_moe_p] = _jvp


# ---- the public function ------------------------------------------------------------------------

_X_DTYPES = (np.dtype("float16"), np.dtype("bfloat16"), np.dtype("float32"))


def _check_stack(w, name: str, shape_text: str):
    if not isinstance(w, NVFP4Weight):
        raise not_a_weight_error("moe", w, name)
    if w.packed.ndim != 3:
        raise ValueError(
            f"moe: {name} must be a stack of E expert weights, logical shape {shape_text}, got "
            f"shape {w.shape}"
        )
    if tuple(w.global_scale.shape) != (w.packed.shape[0],):
        raise ValueError(
            f"moe: {name}.global_scale must be [E] = ({w.packed.shape[0]},), one per expert, got "
            f"shape {tuple(w.global_scale.shape)}"
        )


def _as_array(x, name):
    if x is None:
        raise TypeError(f"moe: routing.{name} is missing (a route_top_k result has it)")
    return x if hasattr(x, "dtype") else jnp.asarray(x)


def _check_routing(routing, tokens: int, experts: int):
    """(weights float32 [T, k], order, inverse, group_sizes int32) from a route_top_k result or
    an object with those attributes, checked against T tokens and E experts."""
    parts = [_as_array(getattr(routing, n, None), n) for n in ("weights", "order", "inverse")]
    weights, order, inverse = parts
    group_sizes = _as_array(getattr(routing, "group_sizes", None), "group_sizes")
    if weights.ndim != 2 or weights.shape[0] != tokens:
        raise ValueError(
            f"moe: routing.weights must be [T, k] with T = {tokens} (x's tokens), got shape "
            f"{tuple(weights.shape)}"
        )
    if not jnp.issubdtype(weights.dtype, jnp.floating):
        raise TypeError(f"moe: routing.weights must be a float array, got {weights.dtype}")
    k = weights.shape[1]
    if not 1 <= k <= experts:
        raise ValueError(
            f"moe: routing's k (routing.weights.shape[1]) must be in [1, E = {experts}] (the "
            f"stacks' experts), got {k}"
        )
    if tuple(group_sizes.shape) != (experts,):
        raise ValueError(
            f"moe: routing.group_sizes must be [E] = ({experts},), one count per expert of the "
            f"stacks, got shape {tuple(group_sizes.shape)}"
        )
    for name, a in (("order", order), ("inverse", inverse)):
        if tuple(a.shape) != (tokens * k,):
            raise ValueError(
                f"moe: routing.{name} must be [T k] = ({tokens * k},), one entry per (token, "
                f"slot) pair, got shape {tuple(a.shape)}"
            )
    for name, a in (("order", order), ("inverse", inverse), ("group_sizes", group_sizes)):
        if not jnp.issubdtype(a.dtype, jnp.integer):
            raise TypeError(f"moe: routing.{name} must be an integer array, got {a.dtype}")
    _grouped.refuse_negative_sizes(group_sizes, "moe: routing.group_sizes")
    experts_ = getattr(routing, "experts", None)
    if experts_ is not None and tuple(experts_.shape) != (tokens, k):
        raise ValueError(
            f"moe: routing.experts must be [T, k] = ({tokens}, {k}), got shape "
            f"{tuple(experts_.shape)}"
        )
    return (
        weights.astype(jnp.float32),
        order.astype(jnp.int32),
        inverse.astype(jnp.int32),
        group_sizes.astype(jnp.int32),
    )


def stack_operands(w: NVFP4Weight):
    """An expert stack as the primitive takes it: (packed, scale, global_scale float32)."""
    return (w.packed, kernel_scale(w.scale), jnp.asarray(w.global_scale, jnp.float32))


def _check_shared(shared, shared_gate, hidden: int):
    """(w_gate_up, w_down, gate weight [H] or None) of the shared expert, checked."""
    if not isinstance(shared, (tuple, list)) or len(shared) != 2:
        raise TypeError(
            "moe: shared must be a pair (w_gate_up [2 I_s, H], w_down [H, I_s]) of NVFP4Weights, "
            f"got {type(shared).__name__}"
        )
    gate_up, down = shared
    for name, w in (("shared[0]", gate_up), ("shared[1]", down)):
        if not isinstance(w, NVFP4Weight):
            raise not_a_weight_error("moe", w, name)
        if w.packed.ndim != 2:
            raise ValueError(f"moe: {name} must be one weight [N, K], got shape {w.shape}")
    if gate_up.k != hidden or gate_up.n % 2:
        raise ValueError(
            f"moe: shared[0] must be a fused gate/up weight [2 I_s, H] with H = {hidden}, got "
            f"shape {gate_up.shape}"
        )
    if tuple(down.shape) != (hidden, gate_up.n // 2):
        raise ValueError(
            f"moe: shared[1] must be [H, I_s] = {(hidden, gate_up.n // 2)} to match shared[0] "
            f"{gate_up.shape}, got {down.shape}"
        )
    if shared_gate is None:
        return gate_up, down, None
    shared_gate = shared_gate if hasattr(shared_gate, "dtype") else jnp.asarray(shared_gate)
    if not jnp.issubdtype(shared_gate.dtype, jnp.floating) or shared_gate.size != hidden:
        raise ValueError(
            f"moe: shared_gate must be a float weight [H] (or [1, H]) with H = {hidden}, got "
            f"{shared_gate.dtype} {tuple(shared_gate.shape)}"
        )
    return gate_up, down, shared_gate.reshape(hidden)


def shared_expert(x, gate_up, down, gate, residual):
    """residual + the shared expert's down(silu(gate(x)) * up(x)), times sigmoid(x . gate) when
    `gate` is given, in x's dtype: jax_fp4.matmul's GEMV with silu_mul, then its residual
    fusion (or, with the gate, the gate's product and the sum in float32, rounded once)."""
    hidden = _matmul(x, gate_up, activation="silu_mul")
    if gate is None:
        return _matmul(hidden, down, residual=residual)
    y = _matmul(hidden, down).astype(jnp.float32)
    g = jnp.dot(x.astype(jnp.float32), gate.astype(jnp.float32), precision="highest")
    y = jax.nn.sigmoid(g)[:, None] * y
    return (y if residual is None else residual.astype(jnp.float32) + y).astype(x.dtype)


def moe(
    x,
    routing,
    w_gate_up: NVFP4Weight,
    w_down: NVFP4Weight,
    *,
    residual=None,
    shared=None,
    shared_gate=None,
    backend=None,
):
    """A mixture-of-experts MLP block on tokens x [T, H] (the module's docstring has the
    formula and the paths):

        r = jax_fp4.route_top_k(x @ router, 8, renormalize=True)
        h = jax_fp4.moe(x, r, w_gate_up, w_down, residual=h)  # h + the block

    Args:
      x: tokens [T, H], float16 or bfloat16 (float32 on the composed path).
      routing: route_top_k's result, or any object with its weights [T, k] (float), order
        [T k], inverse [T k] and group_sizes [E] (integers), built by the caller's own scoring.
      w_gate_up: an NVFP4Weight stack [E, 2 I, H] of fused gate/up experts, rows [:I] the gate.
      w_down: an NVFP4Weight stack [E, H, I].
      residual: optional [T, H], added in float32 before the one rounding (the layer's residual
        stream: the block then returns the stream's next value).
      shared: optional shared expert, a dense NVFP4 MLP every token goes through (Qwen2-MoE,
        DeepSeek-V3, Llama-4): (w_gate_up [2 I_s, H] fused gate/up, w_down [H, I_s]). It runs
        first, through jax_fp4.matmul (two GEMVs at decode), and its output joins the residual,
        rounded to x's dtype, before the routed sum.
      shared_gate: optional float [H] (or [1, H]): the shared expert's output times
        sigmoid(x . shared_gate) per token (Qwen2-MoE's shared_expert_gate).
      backend: None/"auto" (the kernels at decode sizes on a GPU that has them, else the
        composition), "composed", or "kernels" (raises ValueError where they cannot serve).

    Returns:
      [T, H] in x's dtype.
    """
    _check_stack(w_gate_up, "w_gate_up", "[E, 2 I, H]")
    _check_stack(w_down, "w_down", "[E, H, I]")
    x = x if hasattr(x, "dtype") else jnp.asarray(x)
    if np.dtype(x.dtype) not in _X_DTYPES:
        raise TypeError(f"moe: x must be float16, bfloat16 or float32, got dtype {x.dtype}")
    experts, two_inter, hidden = w_gate_up.shape
    if x.ndim != 2 or x.shape[1] != hidden:
        raise ValueError(
            f"moe: x must be [T, H] with H = {hidden} (w_gate_up's K), got shape {tuple(x.shape)}"
        )
    if two_inter % 2:
        raise ValueError(
            f"moe: w_gate_up must be fused gate/up experts [E, 2 I, H], so an even N; got "
            f"shape {w_gate_up.shape}"
        )
    expected_down = (experts, hidden, two_inter // 2)
    if tuple(w_down.shape) != expected_down:
        raise ValueError(
            f"moe: w_down must be [E, H, I] = {expected_down} to match w_gate_up "
            f"{w_gate_up.shape}, got {w_down.shape}"
        )
    routing = _check_routing(routing, x.shape[0], experts)
    if residual is not None:
        residual = residual if hasattr(residual, "dtype") else jnp.asarray(residual)
        if not jnp.issubdtype(residual.dtype, jnp.floating):
            raise TypeError(f"moe: residual must be a float array [T, H], got {residual.dtype}")
        if tuple(residual.shape) != tuple(x.shape):
            raise ValueError(
                f"moe: residual must be [T, H] = {tuple(x.shape)}, got {tuple(residual.shape)}"
            )
        residual = residual.astype(x.dtype)
    backend = resolve_backend(backend, _dispatch.MOE_BACKENDS, op="moe")
    if shared is not None:
        residual = shared_expert(x, *_check_shared(shared, shared_gate, hidden), residual)
    elif shared_gate is not None:
        raise ValueError("moe: shared_gate needs a shared expert (shared=)")
    gate_up_meta = (w_gate_up.block_size, w_gate_up.layout)
    down_meta = (w_down.block_size, w_down.layout)
    if backend == "kernels":  # the platform-independent part of a forced backend, at trace time
        gate_up, down = problems(
            x.shape,
            x.dtype,
            w_gate_up.packed.shape,
            w_down.packed.shape,
            routing[0].shape[1],
            gate_up_meta=gate_up_meta,
            down_meta=down_meta,
        )
        for name, p in (("w_gate_up", gate_up), ("w_down", down)):
            if (reason := _dispatch.grouped_gemv_unsupported_reason(p)) is not None:
                raise ValueError(f"moe: backend='kernels' cannot serve {name}: {reason}")

    return bind(
        x,
        stack_operands(w_gate_up),
        stack_operands(w_down),
        routing,
        residual,
        gate_up_meta=gate_up_meta,
        down_meta=down_meta,
        backend=backend,
    )


def moe_dispatch_path(x, routing_k: int, w_gate_up, w_down, *, backend=None, platform="cuda"):
    """The path `moe` takes for tokens like `x` (an array or jax.ShapeDtypeStruct), top-k
    `routing_k`, lowered for `platform` on this machine."""
    _check_stack(w_gate_up, "w_gate_up", "[E, 2 I, H]")
    _check_stack(w_down, "w_down", "[E, H, I]")
    return path_for(
        {"gpu": "cuda"}.get(platform, platform),
        tuple(x.shape),
        np.dtype(x.dtype),
        w_gate_up.packed.shape,
        w_down.packed.shape,
        routing_k,
        backend=resolve_backend(backend, _dispatch.MOE_BACKENDS, op="moe"),
        gate_up_meta=(w_gate_up.block_size, w_gate_up.layout),
        down_meta=(w_down.block_size, w_down.layout),
    )
