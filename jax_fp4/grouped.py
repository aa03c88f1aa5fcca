"""Grouped (ragged) products with stacked NVFP4 weights: `ragged_matmul`, the
`nvfp4_ragged_matmul` primitive, its abstract evaluation, lowering per platform, batching, JVP
and transpose.

`ragged_matmul(a, w, group_sizes)` is `jax.lax.ragged_dot(a, dequant(w).swapaxes(1, 2),
group_sizes)`: the rows of `a` [M, K] come sorted by group, group g holds the next
group_sizes[g] rows and multiplies weight g of the stack w [G, N, K] (mixture-of-experts layers:
a group per expert). Rows past sum(group_sizes) are zeros. The group sizes are run-time values:
the program never depends on them at trace time, so one compiled program serves every routing.

Operands of the primitive: a [M, K], packed uint8 [G, N, K/2], scale [G, N, ceil(K/bs)] (E4M3,
float8_e4m3fn or uint8 bytes), global_scale float32 [G], group_sizes int32 [G], then bias [G, N]
(a's dtype) when has_bias.
Result: [M, N] in a's dtype; [M, N / 2] with activation "silu_mul" (static): each weight a fused
gate/up pair, silu(gate) * up taken from the float32 products with one rounding, in the grouped
GEMV's kernel (its epilogue) and composed around the product on the other paths, as matmul's
fusions (jax_fp4/lowering.py). Its JVP is that of the composition.

Group sizes out of range: ragged_dot leaves them unspecified. Here every path reads them as the
kernels do: a negative size counts as 0 (eager calls with concrete sizes raise instead), and
the groups end at M (a sum past M leaves the groups that start past M without rows, as
ragged_dot's masks do).

Sharding: in a shard_map body the primitive runs as is on the local shards, which is how
expert parallelism is written (each shard its [G_local, N, K] stack, its local group_sizes and
the rows routed to them), and tensor parallelism as well (a stack split along N: each shard its
columns, no collective; along K: partial products, then a psum). Under a multi-device jit the
kernel paths follow the weight stack's sharding along N (column parallel) or K (row parallel, one
all-reduce) as jax_fp4.matmul does (partitioning rules below); a stack split along G, and a's
rows, are gathered: which rows a group holds is known only at run time. The reference and xla
paths are plain JAX (ragged_dot) that XLA partitions itself.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend.core import Primitive
from jax.interpreters import ad, batching, mlir
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jax_fp4 import config as _config
from jax_fp4 import dispatch as _dispatch
from jax_fp4 import ffi as _ffi
from jax_fp4 import fused as _fused
from jax_fp4 import lowering as _lowering
from jax_fp4 import sharding as _sharding
from jax_fp4.config import KernelTuning
from jax_fp4.explicit_axes import (
    explicit_entries,
    explicit_type,
    spec_axes,
    spec_entry,
    typed_like,
    typed_mesh,
)
from jax_fp4.format import NVFP4Weight, host_values, kernel_scale, not_a_weight_error
from jax_fp4.ops import (
    bind_per_batch_element,
    check_activation_name,
    check_bias,
    check_tuning,
    composition_jvp,
    def_compiled_impl,
    default_device,
    is_zero,
    resolve_backend,
)

nvfp4_ragged_matmul_p = Primitive("nvfp4_ragged_matmul")

CPU_TARGET = "jax_fp4_grouped_matmul_cpu"
GEMV_TARGET = "jax_fp4_grouped_gemv_cuda"
GEMM_TARGET = "jax_fp4_grouped_gemm_cuda"


def bind(
    a,
    packed,
    scale,
    global_scale,
    group_sizes,
    bias,
    *,
    block_size: int,
    backend: str,
    layout: str = "spec",
    tuning: KernelTuning | None = None,
    activation: str | None = None,
):
    """Bind the primitive; `bias` may be None. Operands must already be validated."""
    operands = (a, packed, scale, global_scale, group_sizes) + (() if bias is None else (bias,))
    return nvfp4_ragged_matmul_p.bind(
        *operands,
        block_size=block_size,
        backend=backend,
        layout=layout,
        has_bias=bias is not None,
        tuning=tuning,
        activation=activation,
    )


def split_operands(operands, has_bias):
    """The operand tuple -> (a, packed, scale, global_scale, group_sizes, bias or None)."""
    a, packed, scale, global_scale, group_sizes, *rest = operands
    return a, packed, scale, global_scale, group_sizes, (rest[0] if has_bias else None)


# ---- group bookkeeping (traced: the sizes are run-time values) ----------------------------------


def group_ends(group_sizes, m: int):
    """The end row of each group as the kernels read the sizes: a negative size counts as 0 and
    the running sum stops at M. int32 [G], nondecreasing, at most M (no overflow for M < 2^30)."""
    sizes = jnp.clip(group_sizes.astype(jnp.int32), 0, m)
    if sizes.shape[0] == 0:
        return sizes
    return jax.lax.associative_scan(lambda x, y: jnp.minimum(x + y, m), sizes)


def effective_sizes(group_sizes, m: int):
    """The group sizes with group_ends' rule applied: nonnegative, summing to at most M."""
    ends = group_ends(group_sizes, m)
    return jnp.diff(ends, prepend=jnp.zeros((1,), ends.dtype))


def row_groups(group_sizes, m: int):
    """The group of each row, int32 [M]: G for the rows past the last group."""
    ends = group_ends(group_sizes, m)
    return jnp.searchsorted(ends, jnp.arange(m, dtype=jnp.int32), side="right").astype(jnp.int32)


def bias_rows(bias, group_sizes, m: int):
    """Each row's group's bias in float32 [M, N]; zeros past the last group."""
    rows = row_groups(group_sizes, m)
    return jnp.take(bias.astype(jnp.float32), rows, axis=0, mode="fill", fill_value=0)


def group_sums(x, group_sizes):
    """Per-group sums of the rows of x [M, ...] in float32: [G, ...] (rows past the groups
    dropped)."""
    rows = row_groups(group_sizes, x.shape[0])
    return jax.ops.segment_sum(x.astype(jnp.float32), rows, num_segments=group_sizes.shape[0])


# ---- abstract evaluation ------------------------------------------------------------------------


def result_sharding(a_aval, packed_aval):
    """The result's sharding type under Explicit mesh axes (None: leave it to the default): N
    takes the weight stack's Explicit axes of N; M is replicated (the rows of a group are known
    only at run time, so no rule can keep a's rows split)."""
    sharding = explicit_type(packed_aval) or explicit_type(a_aval)
    if sharding is None:
        return None
    n_axes = ()
    if (w_sh := explicit_type(packed_aval)) is not None:
        n_axes = explicit_entries(w_sh, 3)[1]
    return NamedSharding(sharding.mesh, P(None, spec_entry(n_axes)))


def _abstract_eval(*operands, activation=None, **params):
    del params
    a, packed = operands[0], operands[1]
    shape = (a.shape[0], packed.shape[1] // (2 if activation == "silu_mul" else 1))
    sharding = result_sharding(a, packed)
    if sharding is None:
        return jax.core.ShapedArray(shape, a.dtype)
    return jax.core.ShapedArray(shape, a.dtype, sharding=sharding)


nvfp4_ragged_matmul_p.def_abstract_eval(_abstract_eval)


def_compiled_impl(nvfp4_ragged_matmul_p)


# ---- path implementations (traced inside the lowering) ------------------------------------------


def _with_bias(y32, bias, group_sizes, dtype):
    if bias is not None:
        y32 = y32 + bias_rows(bias, group_sizes, y32.shape[0])
    return y32.astype(dtype)


# The pure-JAX paths round their float32 product to `out_dtype` (default a's dtype); a call with an
# activation takes it unrounded (float32) for the epilogue.


def _empty(a, packed, scale, global_scale, group_sizes, bias, *, out_dtype=None, **_):
    y = jnp.zeros((a.shape[0], packed.shape[1]), jnp.float32)
    return _with_bias(y, bias, group_sizes, out_dtype or a.dtype)


def _dense(packed, scale, global_scale, block_size, layout, dtype):
    """The dequantized stack [G, N, K] in `dtype` (rounded once, as `dequantize`)."""
    return _lowering.dense(packed, scale, global_scale, block_size, layout, dtype=dtype)


def _ragged_dot(lhs, rhs, group_sizes, **kwargs):
    """jax.lax.ragged_dot; under Explicit mesh axes on replicated operands, typed replicated
    (ragged_dot infers no result sharding)."""
    lhs, rhs, group_sizes = _replicated_by_type((lhs, rhs, group_sizes))
    out_sharding = explicit_type(jax.typeof(lhs))
    return jax.lax.ragged_dot(lhs, rhs, group_sizes, out_sharding=out_sharding, **kwargs)


def _reference(
    a, packed, scale, global_scale, group_sizes, bias, *, block_size, layout, out_dtype=None, **_
):
    w = _dense(packed, scale, global_scale, block_size, layout, jnp.float32)
    y = _ragged_dot(
        a.astype(jnp.float32),
        jnp.swapaxes(w, 1, 2),
        effective_sizes(group_sizes, a.shape[0]),
        precision=jax.lax.Precision.HIGHEST,
        preferred_element_type=jnp.float32,
    )
    return _with_bias(y, bias, group_sizes, out_dtype or a.dtype)


def _xla(
    a, packed, scale, global_scale, group_sizes, bias, *, block_size, layout, out_dtype=None, **_
):
    # The weight in a's dtype, as the dense xla path: XLA may fuse the dequantize into its product.
    w = _dense(packed, scale, global_scale, block_size, layout, a.dtype)
    y = _ragged_dot(
        a,
        jnp.swapaxes(w, 1, 2),
        effective_sizes(group_sizes, a.shape[0]),
        preferred_element_type=jnp.float32,
    )
    return _with_bias(y, bias, group_sizes, out_dtype or a.dtype)


def _bias_operand(bias, dtype):
    # The handlers take bias [G, N], or an empty array for "no bias", so one target serves both.
    return jnp.zeros((0,), dtype) if bias is None else bias


def _kernel_operands(a, packed, scale, global_scale, group_sizes, bias):
    return (a, packed, scale, global_scale, group_sizes, _bias_operand(bias, a.dtype))


def _cpu(a, packed, scale, global_scale, group_sizes, bias, *, block_size, layout, avx512, **_):
    out = jax.ShapeDtypeStruct((a.shape[0], packed.shape[1]), a.dtype)
    return jax.ffi.ffi_call(CPU_TARGET, out)(
        *_kernel_operands(a, packed, scale, global_scale, group_sizes, bias),
        block_size=np.int64(block_size),
        tiled=layout == "tiled",
        avx512=avx512,
    )


def _grouped_gemv(
    a, packed, scale, global_scale, group_sizes, bias, *, block_size, layout, activation=None, **_
):
    silu_mul = activation == "silu_mul"
    out = jax.ShapeDtypeStruct((a.shape[0], packed.shape[1] // (2 if silu_mul else 1)), a.dtype)
    return jax.ffi.ffi_call(GEMV_TARGET, out)(
        *_kernel_operands(a, packed, scale, global_scale, group_sizes, bias),
        block_size=np.int64(block_size),
        tiled=layout == "tiled",
        activation=np.int64(1 if silu_mul else 0),
    )


def grouped_gemm_workspace_bytes(m: int, n: int, k: int, g: int) -> int:
    """Bytes of the grouped GEMM's workspace result for a [M, K] and a stack of G [N, K] weights:
    none (its tile schedule lives in each CTA's registers; ffi/cuda/grouped/config.h,
    GroupedGemmWorkspaceBytes)."""
    del m, n, k, g
    return 0


def _grouped_gemm(a, packed, scale, global_scale, group_sizes, bias, *, block_size, layout, **_):
    m, n, k, g = a.shape[0], packed.shape[1], a.shape[1], packed.shape[0]
    outs = (
        jax.ShapeDtypeStruct((m, n), a.dtype),
        jax.ShapeDtypeStruct((grouped_gemm_workspace_bytes(m, n, k, g),), jnp.uint8),
    )
    # The fused GEMM's activation order: its decode hands each lane whole words in fragment order.
    a = _fused.to_fragment_order(a, layout == "tiled")
    y, _ = jax.ffi.ffi_call(GEMM_TARGET, outs)(
        *_kernel_operands(a, packed, scale, global_scale, group_sizes, bias),
        block_size=np.int64(block_size),
        tiled=layout == "tiled",
    )
    return y


_PATHS = {
    "empty": _empty,
    "reference": _reference,
    "xla": _xla,
    "cpu": _cpu,
    "grouped_gemv": _grouped_gemv,
    "grouped_gemm": _grouped_gemm,
}


def problem_of(a_shape, a_dtype, packed_shape, block_size, layout) -> _dispatch.GroupedProblem:
    g, n, half_k = packed_shape
    return _dispatch.GroupedProblem(
        m=a_shape[0],
        groups=g,
        n=n,
        k=2 * half_k,
        block_size=block_size,
        dtype=np.dtype(a_dtype),
        tiled=layout == "tiled",
    )


def has_grouped_kernels() -> bool:
    """Whether this build registered the grouped CUDA targets."""
    registered = _ffi.REGISTERED_TARGETS.get("CUDA", [])
    return GEMV_TARGET in registered and GEMM_TARGET in registered


def target_for(platform: str) -> _dispatch.Target:
    """The dispatch's view of `platform` on this machine, grouped kernels included."""
    target = _lowering.target_for(platform)
    if platform == "cuda":
        target = dataclasses.replace(target, has_grouped_kernels=has_grouped_kernels())
    return target


def path_for(platform, a_shape, a_dtype, packed_shape, block_size, backend, layout) -> str:
    return _dispatch.grouped_plan(
        problem_of(a_shape, a_dtype, packed_shape, block_size, layout),
        target_for(platform),
        backend,
    )


def _replicated_by_type(operands):
    """Operands typed sharded under Explicit mesh axes, resharded to replicated: the pure-JAX
    paths then run on whole operands (ragged_dot infers no sharding)."""
    mesh = next((m for x in operands if (m := typed_mesh(jax.typeof(x))) is not None), None)
    if mesh is None:
        return operands
    replicated = NamedSharding(mesh, P())
    return [jax.sharding.reshard(x, replicated) for x in operands]


# ---- partitioning of the kernel paths ------------------------------------------------------------
# A kernel call is opaque to XLA: without a rule, the partitioner gathers every operand. The rule
# keeps the two layouts that need no knowledge of the group sizes:
#   column parallel  packed, scale (and bias) split along N: each device runs the kernel on its
#                    columns of every group's weight. Result split along N. No collective.
#   row parallel     packed, scale split along K (a resharded to match): each device runs the
#                    kernel on its K slice without bias, the partial products are summed in
#                    float32 by one all-reduce, then each row's bias is added once.
# M and G stay whole: the rows of each group are known only at run time, so neither a's rows nor
# the stack can be split by a static rule (expert parallelism is a shard_map, module docstring).
# The conditions on N and K are matmul's (jax_fp4/sharding.py): whole tiled-layout tiles, whole
# scale blocks per K shard, and a K slice the chosen kernel takes; otherwise that axis is gathered.

KERNEL_PATHS = ("cpu", "grouped_gemv", "grouped_gemm")


def partition_plan(mesh, packed_sharding, *, n, k, block_size, tiled, local_k_check=None):
    """(n_axes, k_axes, reasons) for the proposed sharding of the packed stack [G, N, K/2]:
    the mesh axes N and K stay split over, and why any proposed split was dropped."""
    if mesh is None or mesh.empty or not isinstance(packed_sharding, NamedSharding):
        return (), (), ["shardings without a mesh: replicated"]
    g_axes, n_axes, k_axes = spec_axes(packed_sharding, 3)
    reasons = []
    if g_axes:
        reasons.append(
            f"the stack's G split over {g_axes}: a group's rows are known only at run time "
            "(expert parallelism is a shard_map): gathering G"
        )
    n_axes, k_axes, weight_reasons = _sharding.weight_axes(
        mesh,
        n_axes,
        k_axes,
        n=n,
        k=k,
        block_size=block_size,
        tiled=tiled,
        local_k_check=local_k_check,
    )
    reasons += weight_reasons
    return n_axes, k_axes, reasons


@functools.cache
def _local_k_check(path: str, block_size: int, dtype):
    """The chosen kernel's own limits on K (the grouped CUDA kernels: K % 128 == 0), applied to a
    row-parallel K slice."""
    if path == "cpu":
        return None

    def check(k_local):
        p = _dispatch.GroupedProblem(1, 1, 1, k_local, block_size, np.dtype(dtype))
        return _dispatch.grouped_gemv_unsupported_reason(p)

    return check


def _on_local_shards(run, k_axes):
    """The per-device program of a plan: `run` on the local shards; with K split the partial
    products are summed in float32 over `k_axes`, then each row's bias is added once."""

    def local(a, packed, scale, global_scale, group_sizes, *maybe_bias):
        bias = maybe_bias[0] if maybe_bias else None
        if not k_axes:
            return run(a, packed, scale, global_scale, group_sizes, bias)
        partial = run(a, packed, scale, global_scale, group_sizes, None).astype(jnp.float32)
        return _with_bias(jax.lax.psum(partial, k_axes), bias, group_sizes, a.dtype)

    return local


def _plan_specs(n_axes, k_axes, has_bias):
    """(operand PartitionSpecs, result PartitionSpec) of a plan."""
    n, k = spec_entry(n_axes), spec_entry(k_axes)
    specs = (P(None, k), P(None, n, k), P(None, n, k), P(), P()) + (
        (P(None, n),) if has_bias else ()
    )
    return specs, P(None, n)


@functools.cache
def _partitioned(run, has_bias: bool, k: int, block_size: int, tiled: bool, local_k_check):
    """custom_partitioning around `run(a, packed, scale, global_scale, group_sizes, bias)` for
    one static configuration (cached: one rule per configuration)."""
    from jax._src.sharding_impls import GSPMDSharding  # noqa: PLC0415 - no public name
    from jax.experimental.custom_partitioning import custom_partitioning  # noqa: PLC0415

    if has_bias:

        def fn(a, packed, scale, global_scale, group_sizes, bias):
            return run(a, packed, scale, global_scale, group_sizes, bias)
    else:

        def fn(a, packed, scale, global_scale, group_sizes):
            return run(a, packed, scale, global_scale, group_sizes, None)

    fn.__name__ = f"jax_fp4_ragged_{getattr(run, '__name__', 'kernel').lstrip('_')}"
    cp = custom_partitioning(fn)

    def plan_of(mesh, arg_shapes):
        return partition_plan(
            mesh,
            arg_shapes[1].sharding,
            n=arg_shapes[1].shape[1],
            k=k,
            block_size=block_size,
            tiled=tiled,
            local_k_check=local_k_check,
        )

    def without_mesh(mesh, arg_shapes):
        return mesh is None or mesh.empty or not isinstance(arg_shapes[0].sharding, NamedSharding)

    def partition(mesh, arg_shapes, result_shape):
        del result_shape
        if without_mesh(mesh, arg_shapes):  # GSPMDSharding: the kernel on replicated operands
            rep = GSPMDSharding.get_replicated(arg_shapes[0].sharding._device_assignment)
            return mesh, fn, rep, tuple(rep for _ in arg_shapes)
        n_axes, k_axes, _ = plan_of(mesh, arg_shapes)
        specs, out_spec = _plan_specs(n_axes, k_axes, has_bias)
        shardings = tuple(NamedSharding(mesh, spec) for spec in specs)
        return mesh, _on_local_shards(run, k_axes), NamedSharding(mesh, out_spec), shardings

    def infer_sharding_from_operands(mesh, arg_shapes, result_shape):
        # The GSPMD partitioner's question (jax_use_shardy_partitioner=False); Shardy reads the rule.
        del result_shape
        if without_mesh(mesh, arg_shapes):
            return GSPMDSharding.get_replicated(arg_shapes[0].sharding._device_assignment)
        n_axes, _, _ = plan_of(mesh, arg_shapes)
        return NamedSharding(mesh, P(None, spec_entry(n_axes)))

    bias_rule = ", g n" if has_bias else ""
    if block_size % 2 == 0 and k % block_size == 0:
        # `kb` (the scale blocks) ties the K dims of a, packed and scale together; `b` and `h` are
        # the elements and bytes inside a block.
        cp.def_partition(
            partition,
            infer_sharding_from_operands=infer_sharding_from_operands,
            sharding_rule=f"m (kb b), g n (kb h), g n kb, g, g{bias_rule} -> m n",
            reduction_factors=("kb",),
            need_replication_factors=("m", "g"),
            b=block_size,
            h=block_size // 2,
        )
    else:
        cp.def_partition(
            partition,
            infer_sharding_from_operands=infer_sharding_from_operands,
            sharding_rule=f"m k, g n kh, g n kb, g, g{bias_rule} -> m n",
            need_replication_factors=("m", "g", "k", "kh", "kb"),
        )
    return cp


def _by_sharding_types(run, mesh, packed_aval, has_bias, k, block_size, tiled, local_k_check):
    """The same plans under Explicit mesh axes, taken from the operands' types at trace time and
    written as a shard_map (no partitioner callback: jax.export can serialize the program)."""
    n_axes, k_axes, _ = partition_plan(
        mesh,
        explicit_type(packed_aval) or NamedSharding(mesh, P()),
        n=packed_aval.shape[1],
        k=k,
        block_size=block_size,
        tiled=tiled,
        local_k_check=local_k_check,
    )
    specs, out_spec = _plan_specs(n_axes, k_axes, has_bias)
    local = jax.shard_map(
        _on_local_shards(run, k_axes),
        mesh=mesh,
        in_specs=specs,
        out_specs=out_spec,
        axis_names=set(mesh.explicit_axes),
        check_vma=False,
    )

    def call(*operands):
        return local(
            *[jax.sharding.reshard(x, NamedSharding(mesh, s)) for x, s in zip(operands, specs)]
        )

    return call


@functools.cache
def _kernel_run(impl, layout: str, block_size: int, attributes: tuple):
    """`impl` with its static arguments bound: one function per configuration, so the
    partitioning rules (cached per function) are made once for each."""

    def run(a, packed, scale, global_scale, group_sizes, bias):
        return impl(
            a,
            packed,
            scale,
            global_scale,
            group_sizes,
            bias,
            block_size=block_size,
            layout=layout,
            **dict(attributes),
        )

    run.__name__ = impl.__name__
    return run


def _fuses_in_kernel(path: str, layout: str, n: int) -> bool:
    """Whether `path` runs silu_mul in its kernel: the grouped GEMV's fused epilogue, which pairs
    a 16-row gate tile with its up tile (on the tiled layout the up rows must start on a tile)."""
    return path == "grouped_gemv" and (layout == "spec" or (n // 2) % 16 == 0)


_F32_PATHS = ("empty", "reference", "xla")  # paths that give the product unrounded (out_dtype)


def _lowering_rule(
    ctx, *operands, block_size, backend, layout, has_bias, tuning=None, activation=None, platform
):
    del tuning  # the grouped kernels have no tuning attributes
    a_aval, packed_aval = ctx.avals_in[0], ctx.avals_in[1]
    out_sharding = explicit_type(ctx.avals_out[0])
    path = path_for(
        platform, a_aval.shape, a_aval.dtype, packed_aval.shape, block_size, backend, layout
    )
    mesh = next((m for aval in ctx.avals_in if (m := typed_mesh(aval)) is not None), None)
    rules = path in KERNEL_PATHS and _config.custom_partitioning()
    partitioned = rules and (mesh is not None or _sharding._needs_rule(ctx))
    # An activation runs in the kernel where it can (one device's program), else around the
    # product, taken in float32 where the path can give it (reference, xla, empty, and cpu run on
    # float32 activations) and rounded to a's dtype first on the CUDA kernels.
    in_kernel = (
        activation is not None
        and not partitioned
        and _fuses_in_kernel(path, layout, packed_aval.shape[1])
    )
    composed = activation is not None and not in_kernel
    attributes = (("avx512", _config.cpu_avx512()),) if path == "cpu" else ()
    if in_kernel:
        attributes += (("activation", activation),)
    elif composed and path in _F32_PATHS:
        attributes += (("out_dtype", jnp.float32),)
    run = _kernel_run(_PATHS[path], layout, block_size, attributes)
    static = (has_bias, a_aval.shape[1], block_size, layout == "tiled")
    local_k_check = _local_k_check(path, block_size, np.dtype(a_aval.dtype))
    if rules and mesh is not None:
        call = _by_sharding_types(run, mesh, packed_aval, *static, local_k_check)
    elif partitioned:
        call = _partitioned(run, *static, local_k_check)
    else:

        def call(*ops):
            return run(*split_operands(_replicated_by_type(ops), has_bias))

    def product_then_epilogue(*ops):
        if path == "cpu":  # its float32 build: the product unrounded
            ops = [x.astype(jnp.float32) if i in (0, 5) else x for i, x in enumerate(ops)]
        y32 = call(*ops).astype(jnp.float32)
        return _lowering.epilogue(y32, activation, None, a_aval.dtype)

    def lowered(*ops):
        with jax.named_scope(f"jax_fp4/{path}"):
            y = product_then_epilogue(*ops) if composed else call(*ops)
        return y if out_sharding is None else jax.sharding.reshard(y, out_sharding)

    return mlir.lower_fun(lowered, multiple_results=False)(ctx, *operands)


mlir.register_lowering(nvfp4_ragged_matmul_p, functools.partial(_lowering_rule, platform="other"))
for _platform in ("cpu", "cuda"):
    mlir.register_lowering(
        nvfp4_ragged_matmul_p,
        functools.partial(_lowering_rule, platform=_platform),
        platform=_platform,
    )
_sharding.register_primitive(nvfp4_ragged_matmul_p)


# ---- batching -----------------------------------------------------------------------------------


def _folded(a, group_sizes, packed, scale, global_scale, bias, params):
    """vmap over activations and group sizes with one weight stack: the batch's rows of each
    group are gathered next to each other (group-major, batch element, row), one grouped product
    runs over all of them (each weight read once), and the rows go back to their places.

    a [B, M, K], group_sizes [B, G] -> [B, M, N]."""
    b, m, k = a.shape
    g = group_sizes.shape[1]
    if g == 0 or m == 0:  # no group has rows
        return jnp.zeros((b, m, packed.shape[1]), a.dtype)
    sizes = jax.vmap(lambda s: effective_sizes(s, m))(group_sizes)  # [B, G]
    ends = jnp.cumsum(sizes, axis=1)
    starts = ends - sizes
    rows = jax.vmap(lambda s: row_groups(s, m))(group_sizes)  # [B, M], G past the groups
    valid = rows < g
    safe = jnp.minimum(rows, g - 1)
    total = jnp.sum(sizes, axis=0)  # [G]: the folded group sizes
    first = jnp.cumsum(total) - total  # each group's first folded row
    earlier = jnp.cumsum(sizes, axis=0) - sizes  # [B, G]: its rows in earlier batch elements
    within = jnp.arange(m, dtype=jnp.int32)[None, :] - jnp.take_along_axis(starts, safe, axis=1)
    place = first[safe] + jnp.take_along_axis(earlier, safe, axis=1) + within
    # Rows past the groups go after every group's rows, where the product writes zeros.
    spare = jnp.sum(total) + jnp.cumsum(~valid.reshape(-1)) - 1
    place = jnp.where(valid.reshape(-1), place.reshape(-1), spare).astype(jnp.int32)
    source = jnp.zeros((b * m,), jnp.int32).at[place].set(jnp.arange(b * m, dtype=jnp.int32))
    y = nvfp4_ragged_matmul_p.bind(
        a.reshape(b * m, k)[source],
        packed,
        scale,
        global_scale,
        total.astype(jnp.int32),
        *(() if bias is None else (bias,)),
        **params,
    )
    return y[place].reshape(b, m, y.shape[-1])


def _batch(operands, dims, **params):
    has_bias = params["has_bias"]
    a, packed, scale, global_scale, group_sizes, bias = split_operands(operands, has_bias)
    a_dim, p_dim, s_dim, gs_dim, sizes_dim, bias_dim = split_operands(dims, has_bias)
    size = next(x.shape[d] for x, d in zip(operands, dims) if d is not None)
    if all(d is None for d in (p_dim, s_dim, gs_dim, bias_dim)):
        # One weight stack: one grouped product over the whole batch's rows.
        a = jnp.broadcast_to(a, (size, *a.shape)) if a_dim is None else jnp.moveaxis(a, a_dim, 0)
        group_sizes = (
            jnp.broadcast_to(group_sizes, (size, *group_sizes.shape))
            if sizes_dim is None
            else jnp.moveaxis(group_sizes, sizes_dim, 0)
        )
        return _folded(a, group_sizes, packed, scale, global_scale, bias, params), 0
    # Weight stacks (layers) or biases batched: one grouped product per batch element, in a loop.
    return bind_per_batch_element(nvfp4_ragged_matmul_p, operands, dims, params)


batching.primitive_batchers[nvfp4_ragged_matmul_p] = _batch


# ---- autodiff -----------------------------------------------------------------------------------
# y[i] = gs[g] * (a[i] @ D[g]^T) + bias[g] for row i of group g, D[g] the block-scaled codes:
# linear in (a, bias) for fixed global scales, and linear in the global scales for fixed a. The
# packed codes, block scales and group sizes are integer data and have no tangent.


def _activation_jvp(primals, tangents, *, activation, has_bias, **static):
    """The JVP of a call with an activation: the fused primitive's value, and the tangent of its
    composition (the plain product, then the float32 epilogue), in the operands that move."""
    a, packed, scale, global_scale, group_sizes, bias = split_operands(primals, has_bias)
    da, _, _, dgs, _, dbias = split_operands(tangents, has_bias)
    y = nvfp4_ragged_matmul_p.bind(*primals, activation=activation, has_bias=has_bias, **static)

    def composition(a, global_scale, bias):
        y = bind(a, packed, scale, global_scale, group_sizes, bias, **static)
        return _lowering.epilogue(y.astype(jnp.float32), activation, None, a.dtype)

    return composition_jvp(y, composition, (a, global_scale, bias), (da, dgs, dbias))


def _jvp(primals, tangents, *, block_size, backend, layout, has_bias, tuning=None, activation=None):
    static = dict(block_size=block_size, backend=backend, layout=layout, tuning=tuning)
    if activation is not None:
        return _activation_jvp(
            primals, tangents, activation=activation, has_bias=has_bias, **static
        )
    a, packed, scale, global_scale, group_sizes, bias = split_operands(primals, has_bias)
    da, _, _, dgs, _, dbias = split_operands(tangents, has_bias)
    y = bind(a, packed, scale, global_scale, group_sizes, bias, **static)
    out = []
    dbias = None if dbias is None or is_zero(dbias) else dbias
    if not is_zero(da):
        out.append(bind(da, packed, scale, global_scale, group_sizes, dbias, **static))
    elif dbias is not None:  # only the bias moves: no product needed
        rows = bias_rows(dbias, group_sizes, a.shape[0]).astype(y.dtype)
        out.append(typed_like(rows, jax.typeof(y)))
    if not is_zero(dgs):
        out.append(bind(a, packed, scale, dgs, group_sizes, None, **static))
    if not out:
        return y, ad.Zero.from_primal_value(y)
    return y, functools.reduce(jnp.add, out)


def _transpose(ct, *operands, block_size, backend, layout, has_bias, tuning=None, activation=None):
    if activation is not None:  # not linear: its JVP (the composition's) leaves plain products
        raise NotImplementedError("ragged_matmul: a call with an activation is not linear")
    a, packed, scale, global_scale, group_sizes, bias = split_operands(operands, has_bias)
    if any(ad.is_undefined_primal(x) for x in (packed, scale, group_sizes)):
        raise TypeError(
            "ragged_matmul: the quantized weight (packed codes, block scales) and the group "
            "sizes are not differentiable"
        )
    if is_zero(ct):
        ct = jnp.zeros(ct.aval.shape, ct.aval.dtype)
    ct32 = ct.astype(jnp.float32)
    ct_a = ct_gs = ct_bias = None
    if ad.is_undefined_primal(global_scale):
        # y is linear in each group's global scale: dL/dgs[g] = sum over g's rows of ct * y(gs=1).
        unit = bind(
            a,
            packed,
            scale,
            jnp.ones(global_scale.aval.shape, jnp.float32),
            group_sizes,
            None,
            block_size=block_size,
            backend=backend,
            layout=layout,
            tuning=tuning,
        )
        ct_gs = group_sums(jnp.sum(ct32 * unit.astype(jnp.float32), axis=1), group_sizes)
        ct_gs = typed_like(ct_gs, global_scale.aval)
    else:
        if ad.is_undefined_primal(a):
            # dA[i] = dY[i] @ W[g]: the grouped product with the weights untransposed, in float32.
            w = _dense(packed, scale, global_scale, block_size, layout, jnp.float32)
            ct_a = _ragged_dot(
                ct32,
                w,
                effective_sizes(group_sizes, ct.shape[0]),
                precision=jax.lax.Precision.HIGHEST,
                preferred_element_type=jnp.float32,
            ).astype(a.aval.dtype)
            ct_a = typed_like(ct_a, a.aval)
        if has_bias and ad.is_undefined_primal(bias):
            ct_bias = typed_like(group_sums(ct32, group_sizes).astype(bias.aval.dtype), bias.aval)
    result = [ct_a, None, None, ct_gs, None]
    return result + ([ct_bias] if has_bias else [])


ad.primitive_jvps[nvfp4_ragged_matmul_p] = _jvp
ad.primitive_transposes[nvfp4_ragged_matmul_p] = _transpose


# ---- the public entry point ---------------------------------------------------------------------

_ACTIVATION_DTYPES = (np.dtype("float16"), np.dtype("bfloat16"), np.dtype("float32"))
_INT32 = np.iinfo(np.int32)


def _check_weight(w) -> None:
    if not isinstance(w, NVFP4Weight):
        raise not_a_weight_error("ragged_matmul", w)
    if w.packed.ndim != 3:
        raise ValueError(
            "ragged_matmul: w must be a stack of G weights, logical shape [G, N, K], got shape "
            f"{w.shape}" + (" (a single weight: use jax_fp4.matmul)" if w.packed.ndim == 2 else "")
        )
    if tuple(w.global_scale.shape) != (w.packed.shape[0],):
        raise ValueError(
            f"ragged_matmul: w.global_scale must be [G] = ({w.packed.shape[0]},), one per "
            f"weight, got shape {tuple(w.global_scale.shape)}"
        )


def _check_activation(a, w: NVFP4Weight):
    if not hasattr(a, "dtype"):
        a = jnp.asarray(a)
    if np.dtype(a.dtype) not in _ACTIVATION_DTYPES:
        raise TypeError(
            f"ragged_matmul: a must be float16 or bfloat16 (float32 on the cpu and reference "
            f"paths), got dtype {a.dtype}"
        )
    if a.ndim != 2 or a.shape[1] != w.k:
        raise ValueError(
            f"ragged_matmul: a must be [M, K] with K = {w.k} (w.shape = {w.shape}), got "
            f"a.shape = {tuple(a.shape)}"
        )
    return a


def refuse_negative_sizes(group_sizes, name: str) -> None:
    """ValueError naming `name` where concrete group sizes hold a negative one; traced sizes are
    run-time values, where a negative size counts as 0 (group_ends)."""
    values = host_values(group_sizes)
    if values is not None and (values < 0).any():
        bad = int(np.argmax(values < 0))
        raise ValueError(f"{name} must be nonnegative, got {values[bad]} at index {bad}")


def _check_group_sizes(group_sizes, groups: int):
    if not hasattr(group_sizes, "dtype"):
        group_sizes = jnp.asarray(group_sizes)
    if not jnp.issubdtype(group_sizes.dtype, jnp.integer):
        raise TypeError(
            f"ragged_matmul: group_sizes must be an integer array [G] (int32), got dtype "
            f"{group_sizes.dtype}"
        )
    if tuple(group_sizes.shape) != (groups,):
        raise ValueError(
            f"ragged_matmul: group_sizes must have shape (G,) = ({groups},), one size per weight "
            f"of w, got {tuple(group_sizes.shape)}"
        )
    refuse_negative_sizes(group_sizes, "ragged_matmul: group_sizes")
    if np.dtype(group_sizes.dtype) != np.int32:
        info = np.iinfo(group_sizes.dtype)
        if info.max > _INT32.max or info.min < _INT32.min:  # out-of-range sizes saturate
            group_sizes = jnp.clip(group_sizes, max(info.min, _INT32.min), _INT32.max)
        group_sizes = group_sizes.astype(jnp.int32)
    return group_sizes


def ragged_matmul(
    a,
    w: NVFP4Weight,
    group_sizes,
    bias=None,
    *,
    activation: str | None = None,
    backend: str | None = None,
    tuning: KernelTuning | None = None,
):
    """Y = jax.lax.ragged_dot(A, dequant(W).swapaxes(1, 2), group_sizes) (+ each group's bias).

    Args:
      a: activations [M, K], float16 or bfloat16 (float32 on the cpu and reference paths), rows
        sorted by group: group g holds the next group_sizes[g] rows.
      w: an NVFP4Weight stack of logical shape [G, N, K] (spec or tiled layout), global_scale [G].
      group_sizes: integer [G] (int32), run-time values. Rows past their sum are zeros; a sum past
        M leaves the groups past M without rows; a negative size counts as 0 (an eager call with
        concrete sizes raises ValueError instead).
      bias: optional [G, N], group g's row added to its rows, cast to a's dtype.
      activation: None, or "silu_mul": each weight of the stack is a fused gate/up weight
        [2 I, K] (rows [:I] the gate, [I:] the up projection) and the result is silu(gate) * up
        [M, I], from the float32 products with one rounding where the path allows it (the grouped
        GEMV's kernel, reference, xla, cpu; the grouped GEMM rounds its product first), as
        `matmul`'s activation. A mixture-of-experts MLP's first product then needs no separate
        activation pass.
      backend: None/"auto" picks a path from the static shapes (M, G, N, K) and the platform;
        one of GROUPED_BACKENDS ("reference", "xla", "cpu", "grouped_gemv", "grouped_gemm")
        forces one, and raises ValueError if it cannot serve these shapes or this platform.
      tuning: a jax_fp4.KernelTuning (static), accepted for symmetry with `matmul`; the grouped
        kernels have no tuning attributes and ignore it.

    Returns:
      [M, N] in a's dtype ([M, N / 2] with activation "silu_mul").

    Differentiable with respect to a, bias and w.global_scale; the packed codes, block scales and
    group sizes are integer data (no tangent).
    """
    _check_weight(w)
    a = _check_activation(a, w)
    group_sizes = _check_group_sizes(group_sizes, w.packed.shape[0])
    bias = check_bias(bias, (w.packed.shape[0], w.n), a.dtype, op="ragged_matmul", axes=("G", "N"))
    activation = check_activation_name(activation, w, op="ragged_matmul")
    backend = resolve_backend(backend, _dispatch.GROUPED_BACKENDS, op="ragged_matmul")
    tuning = check_tuning(tuning, op="ragged_matmul")
    _dispatch.check_grouped_backend(
        backend, problem_of(a.shape, a.dtype, w.packed.shape, w.block_size, w.layout)
    )
    return bind(
        a,
        w.packed,
        kernel_scale(w.scale),
        jnp.asarray(w.global_scale, jnp.float32),
        group_sizes,
        bias,
        block_size=w.block_size,
        backend=backend,
        layout=w.layout,
        tuning=tuning,
        activation=activation,
    )


def ragged_dispatch_path(
    a, w: NVFP4Weight, *, backend: str | None = None, platform: str | None = None
) -> str:
    """The path `ragged_matmul(a, w, ..., backend=backend)` takes when lowered for `platform`
    (default: the default device's platform). `a` may be an array or a jax.ShapeDtypeStruct."""
    _check_weight(w)
    a = _check_activation(a, w)
    if platform is None:
        platform = default_device().platform
    platform = {"gpu": "cuda"}.get(platform, platform)
    return path_for(
        platform,
        a.shape,
        a.dtype,
        w.packed.shape,
        w.block_size,
        resolve_backend(backend, _dispatch.GROUPED_BACKENDS, op="ragged_matmul"),
        w.layout,
    )
