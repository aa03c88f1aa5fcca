"""Partitioning rules for the kernel paths: how XLA's SPMD partitioner splits one fp4 matmul.

An FFI custom call is opaque to XLA: without a rule, the partitioner gathers every operand onto
every device, which would silently replicate sharded weights. `partitioned` wraps a path
implementation (the function the lowering traces: a [..., K], packed [N, K/2], scale [N, KB],
global_scale [], bias [N] or None) in `jax.experimental.custom_partitioning`, with a Shardy
`sharding_rule` for propagation and a `partition` callback that picks one of these plans from the
shardings the partitioner proposes:

  data parallel    a's leading (M) dims sharded, weight replicated: each device runs the kernel
                   on its rows. Output sharded like a's leading dims. No collective.
  column parallel  packed, scale (and bias) sharded along N: each device runs the kernel on its
                   columns. Output sharded along N. No collective.
  row parallel     packed and scale sharded along K (same mesh axes), a sharded along K to match
                   (a is resharded if it is not): each device runs the kernel on its K slice
                   without bias, the partial products are summed in float32 by one all-reduce
                   (psum), then bias is added once and the result rounded to a's dtype.

The three combine (e.g. a 2-D mesh with data-parallel rows and column- or row-parallel weights).
The weight's own sharding decides N and K; a is resharded (cheap: activations) to follow it.

Row parallelism needs every K shard to hold whole scale blocks: K % (block_size * shards) == 0
with block_size even (so each shard's K is even and its packed bytes and scale columns line up),
and the K slice must suit the path chosen for the whole K (gemv: K_local % 32 == 0).
When that does not hold, or a dimension is not divisible by the number of shards on it, or the
shardings come without a mesh (GSPMDSharding), the rule asks for that dimension replicated and
the partitioner gathers it: correct results, at the cost of the gather it would have done anyway.

Where the rules apply: kernel paths (cpu, gemv, dequant, fused) lowered into a multi-device jit
program (a ShardingContext with more than one device), in one of two ways with the same plans:
  - Auto mesh axes (and shardings without a mesh): `partitioned`, custom_partitioning. The lowered
    StableHLO holds a `CustomSPMDPartitioning` custom call in place of the kernel; the FFI target
    appears in the partitioned program (`jit(f).lower(...).compile().as_text()`), once per device
    program, on local shapes.
  - Explicit mesh axes (`jax.make_mesh`'s default, every axis Explicit): the operands' sharding
    types are known at trace time, so `by_sharding_types` writes the plan as a shard_map
    (`sdy.manual_computation` in the StableHLO) and the result gets the type abstract eval gave
    it (`result_sharding`). The program holds no callback, so jax.export serializes it.
Everything else traces the kernel as before:
  - single-device programs (8 host devices or not): the HLO is unchanged; the FFI target, e.g.
    `jax_fp4_matmul_cpu`, shows in `jit(f).lower(...).as_text()`.
  - shard_map and pmap bodies: the kernel runs on the local shards as is. A shard_map that leaves
    some mesh axes free (axis_names=...) lays the kernel out over them by type when they are
    Explicit; Auto ones get no rule: XLA gathers over those axes.
  - the pure-JAX paths (reference, xla, empty): XLA partitions them natively.

Limits:
  - Under Auto axes, jax.export of a multi-device program fails (custom_partitioning's rules are
    Python callbacks, which jax.export cannot serialize), and so does
    lowering for an AbstractMesh (the rule needs the devices). Export under Explicit axes, or of a
    single-device program, works (jax_fp4/export.py).
  - A mesh mixing Explicit and Auto axes takes custom_partitioning; the result's type carries
    its Explicit axes only.
  - JAX_FP4_CUSTOM_PARTITIONING=0 switches the rules off (for comparison and debugging).
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax._src import dispatch as _jax_dispatch
from jax.experimental.custom_partitioning import custom_partitioning
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jax_fp4 import config as _config
from jax_fp4 import dispatch as _dispatch
from jax_fp4 import fused as _fused
from jax_fp4.explicit_axes import (
    axes_size,
    explicit_entries,
    explicit_type,
    spec_axes,
    spec_entry,
    typed_mesh,
)


def register_primitive(prim) -> None:
    """custom_partitioning needs the device assignment while lowering; jit passes it only when the
    program holds a primitive registered here (custom_partitioning_p registers itself, but it is
    bound inside our lowering rule, after jit took that decision)."""
    _jax_dispatch.prim_requires_devices_during_lowering.add(prim)


def _spec(sharding, ndim) -> list[tuple[str, ...]] | None:
    """The per-dimension mesh axes of a NamedSharding (None for shardings without a mesh)."""
    return spec_axes(sharding, ndim) if isinstance(sharding, NamedSharding) else None


def weight_axes(mesh, n_axes, k_axes, *, n, k, block_size, tiled=False, local_k_check=None):
    """(n_axes, k_axes, reasons): the mesh axes a weight's N and K stay split over, from the
    proposed ones, and why any proposed split was dropped (that axis is gathered). N shards must
    divide N and, in the tiled layout, keep whole 16-row tiles; K shards must keep whole scale
    blocks of an even block size, in a slice the kernel takes (`local_k_check(k_local)`: why not,
    or None), and the tiled layout cannot split K (its tiles hold all of it)."""
    reasons = []
    n_shards = axes_size(mesh, n_axes)
    if n_axes and n % n_shards:
        reasons.append(f"N={n} is not divisible by the {n_shards} shards of {n_axes}: gathering N")
        n_axes = ()
    if n_axes and tiled and (n // n_shards) % 16:
        reasons.append(f"tiled layout: N shards of {n // n_shards} rows split its 16-row tiles")
        n_axes = ()
    if k_axes and tiled:
        reasons.append("tiled layout: its 16-row tiles hold all of K: gathering K")
        k_axes = ()
    if k_axes:
        shards = axes_size(mesh, k_axes)
        if block_size % 2 or k % (block_size * shards):
            reasons.append(
                f"row-parallel K={k} over {shards} shards needs K % (block_size*shards) == 0 "
                f"with an even block_size (block_size={block_size}): gathering K"
            )
            k_axes = ()
        elif local_k_check is not None and (why := local_k_check(k // shards)) is not None:
            reasons.append(f"row-parallel K slice {k // shards}: {why}: gathering K")
            k_axes = ()
    return n_axes, k_axes, reasons


def plan(
    mesh, a_shape, a_sharding, packed_sharding, *, n, k, block_size, local_k_check=None, tiled=False
):
    """Choose (lead_axes per leading dim, n_axes, k_axes, reasons) from the proposed shardings.

    Pure function of shapes and shardings; `reasons` lists why a proposed sharding was dropped.
    `local_k_check(k_local)` returns why the kernel cannot take that K slice (None if it can).
    `tiled`: the weight is in the tiled layout, whose 16-row tiles hold all of K: N shards must
    keep whole tiles and K cannot be split.
    """
    a_spec = _spec(a_sharding, len(a_shape))
    w_spec = _spec(packed_sharding, 2)
    if a_spec is None or w_spec is None or mesh is None or mesh.empty:
        return [()] * (len(a_shape) - 1), (), (), ["shardings without a mesh: replicated"]
    n_axes, k_axes, reasons = weight_axes(
        mesh, *w_spec, n=n, k=k, block_size=block_size, tiled=tiled, local_k_check=local_k_check
    )
    used = set(n_axes) | set(k_axes)
    lead = []
    for dim, axes in zip(a_shape[:-1], a_spec[:-1]):
        keep = tuple(ax for ax in axes if ax not in used)
        if keep != axes:
            reasons.append(f"a's leading axes {axes} overlap the weight's axes {sorted(used)}")
        shards = axes_size(mesh, keep)
        if keep and dim % shards:
            reasons.append(f"a's leading dim {dim} is not divisible by {shards} shards")
            keep = ()
        used |= set(keep)
        lead.append(keep)
    return lead, n_axes, k_axes, reasons


def _on_local_shards(run, k_axes):
    """The per-device program of a plan: `run` on the local shards; with K split (row parallel)
    the partial products are summed in float32 over `k_axes`, then bias is added once."""

    def local(a, packed, scale, global_scale, *maybe_bias):
        bias = maybe_bias[0] if maybe_bias else None
        if not k_axes:
            return run(a, packed, scale, global_scale, bias)
        partial = run(a, packed, scale, global_scale, None).astype(jnp.float32)
        y = jax.lax.psum(partial, k_axes)
        if bias is not None:
            y = y + bias.astype(jnp.float32)
        return y.astype(a.dtype)

    return local


@functools.cache
def _wrapped(
    impl, block_size: int, has_bias: bool, a_ndim: int, k: int, local_k_check=None, tiled=False
):
    """custom_partitioning around `impl` for one static configuration."""

    def run(a, packed, scale, global_scale, bias):
        return impl(a, packed, scale, global_scale, bias, block_size=block_size)

    if has_bias:

        def fn(a, packed, scale, global_scale, bias):
            return run(a, packed, scale, global_scale, bias)
    else:

        def fn(a, packed, scale, global_scale):
            return run(a, packed, scale, global_scale, None)

    fn.__name__ = f"jax_fp4_{getattr(impl, '__name__', 'kernel').lstrip('_')}"
    cp = custom_partitioning(fn)

    def run_unsharded(a, packed, scale, global_scale, *maybe_bias):
        return run(a, packed, scale, global_scale, maybe_bias[0] if maybe_bias else None)

    def partition(mesh, arg_shapes, result_shape):
        a_shape = arg_shapes[0].shape
        n = arg_shapes[1].shape[0]
        lead, n_axes, k_axes, _ = plan(
            mesh,
            a_shape,
            arg_shapes[0].sharding,
            arg_shapes[1].sharding,
            n=n,
            k=k,
            block_size=block_size,
            local_k_check=local_k_check,
            tiled=tiled,
        )
        if mesh is None or mesh.empty or not isinstance(arg_shapes[0].sharding, NamedSharding):
            # Shardings without a mesh (GSPMDSharding): run the kernel on replicated operands.
            from jax._src.sharding_impls import GSPMDSharding  # noqa: PLC0415 - no public name

            rep = GSPMDSharding.get_replicated(arg_shapes[0].sharding._device_assignment)
            return mesh, run_unsharded, rep, tuple(rep for _ in arg_shapes)
        lead_spec = [spec_entry(ax) for ax in lead]
        a_sh = NamedSharding(mesh, P(*lead_spec, spec_entry(k_axes)))
        w_sh = NamedSharding(mesh, P(spec_entry(n_axes), spec_entry(k_axes)))
        arg_shardings = [a_sh, w_sh, w_sh, NamedSharding(mesh, P())]
        if has_bias:
            arg_shardings.append(NamedSharding(mesh, P(spec_entry(n_axes))))
        out_sh = NamedSharding(mesh, P(*lead_spec, spec_entry(n_axes)))

        return mesh, _on_local_shards(run, k_axes), out_sh, tuple(arg_shardings)

    def infer_sharding_from_operands(mesh, arg_shapes, result_shape):
        # Used by the GSPMD partitioner (jax_use_shardy_partitioner=False); Shardy uses the rule.
        if mesh is None or mesh.empty or not isinstance(arg_shapes[0].sharding, NamedSharding):
            from jax._src.sharding_impls import GSPMDSharding  # noqa: PLC0415

            return GSPMDSharding.get_replicated(arg_shapes[0].sharding._device_assignment)
        lead, n_axes, _, _ = plan(
            mesh,
            arg_shapes[0].shape,
            arg_shapes[0].sharding,
            arg_shapes[1].sharding,
            n=arg_shapes[1].shape[0],
            k=k,
            block_size=block_size,
            local_k_check=local_k_check,
            tiled=tiled,
        )
        return NamedSharding(mesh, P(*[spec_entry(ax) for ax in lead], spec_entry(n_axes)))

    lead = " ".join(f"m{i}" for i in range(a_ndim - 1))
    bias_rule = ", n" if has_bias else ""
    if block_size % 2 == 0 and k % block_size == 0:
        # One factor `kb` (the scale blocks) ties the K dims of a, packed and scale together, so
        # Shardy shards them consistently; `b` and `h` are the elements and bytes inside a block.
        rule = f"{lead} (kb b), n (kb h), n kb, {bias_rule} -> {lead} n"
        cp.def_partition(
            partition,
            infer_sharding_from_operands=infer_sharding_from_operands,
            sharding_rule=rule,
            reduction_factors=("kb",),
            b=block_size,
            h=block_size // 2,
        )
    else:
        rule = f"{lead} k, n kh, n kb, {bias_rule} -> {lead} n"
        cp.def_partition(
            partition,
            infer_sharding_from_operands=infer_sharding_from_operands,
            sharding_rule=rule,
            need_replication_factors=("k", "kh", "kb"),
        )
    return cp


def partitioned(
    impl, *, block_size: int, has_bias: bool, a_ndim: int, k: int, local_k_check=None, tiled=False
):
    """`impl` (a path implementation) as a call XLA's partitioner splits with the rules above.

    `impl(a, packed, scale, global_scale, bias_or_None, *, block_size)` must take a of any rank
    and must not capture array constants (custom_partitioning traces it and refuses constants).
    """
    cp = _wrapped(impl, block_size, has_bias, a_ndim, k, local_k_check, tiled)

    def call(a, packed, scale, global_scale, bias, *, block_size):
        del block_size
        return cp(a, packed, scale, global_scale, *(() if bias is None else (bias,)))

    return call


# Paths whose implementation is an opaque FFI call (the pure-JAX paths partition natively).
KERNEL_PATHS = ("cpu", "gemv", "dequant", "fused")


def _needs_rule(ctx) -> bool:
    """Whether this lowering is for a multi-device program that XLA's partitioner will split
    (single-device programs and fully manual shard_map bodies run the kernel as is)."""
    from jax._src import sharding_impls  # noqa: PLC0415 - private; only the context types

    axis_context = ctx.module_context.axis_context
    if isinstance(axis_context, sharding_impls.ShardingContext):
        return axis_context.num_devices > 1 and axis_context.device_assignment is not None
    # shard_map / pmap bodies (SPMDAxisContext): the kernel runs per shard as it is. A body that
    # leaves some mesh axes Auto also runs it as is (operands replicated over those axes).
    return False


@functools.cache
def _with_kwargs(impl, impl_kwargs):
    """`impl` with static keyword arguments bound: one function per (impl, kwargs), so the
    partitioning rules, cached per function, are made once for each."""
    kwargs = dict(impl_kwargs)

    @functools.wraps(impl)
    def bound(*args, **more):
        return impl(*args, **kwargs, **more)

    return bound


def wrap_impl(
    ctx,
    path: str,
    impl,
    *,
    block_size: int,
    has_bias: bool,
    tiled: bool = False,
    impl_kwargs: tuple = (),
):
    """The implementation the lowering should trace: `impl`, or `impl` under the partitioning
    rules when `path` is a kernel path lowered into a multi-device program. `tiled`: the weight
    operands are in the tiled layout. `impl_kwargs`: ((name, value), ...) of hashable static
    keyword arguments `impl` gets on every call (the kernel's attributes)."""
    if impl_kwargs:
        impl = _with_kwargs(impl, tuple(impl_kwargs))
    if path not in KERNEL_PATHS:
        return impl
    if not _config.custom_partitioning():
        return impl  # debugging switch: XLA then gathers the operands, as for any opaque call
    a_aval = ctx.avals_in[0]
    local_k_check = _local_k_check(path, block_size, np.dtype(a_aval.dtype))
    if typed_mesh(a_aval) is not None:  # jit or a shard_map body, with Explicit axes
        return by_sharding_types(
            impl,
            a_aval,
            ctx.avals_in[1],
            ctx.avals_out[0],
            block_size=block_size,
            has_bias=has_bias,
            local_k_check=local_k_check,
            tiled=tiled,
        )
    if not _needs_rule(ctx):
        return impl
    return partitioned(
        impl,
        block_size=block_size,
        has_bias=has_bias,
        a_ndim=a_aval.ndim,
        k=a_aval.shape[-1],
        local_k_check=local_k_check,
        tiled=tiled,
    )


def by_sharding_types(
    impl,
    a_aval,
    packed_aval,
    out_aval,
    *,
    block_size: int,
    has_bias: bool,
    local_k_check=None,
    tiled=False,
):
    """`impl` laid out by the operands' sharding types (a mesh whose axes are all Explicit):
    the same plans as the partitioning rules, taken at trace time from the types and written as
    a shard_map, so the program holds no partitioner callback (jax.export can serialize it).
    Operands are resharded to the plan and the result to the type abstract eval gave it."""
    mesh = a_aval.sharding.mesh
    lead, n_axes, k_axes, _ = plan(
        mesh,
        a_aval.shape,
        a_aval.sharding,
        packed_aval.sharding,
        n=packed_aval.shape[0],
        k=a_aval.shape[-1],
        block_size=block_size,
        local_k_check=local_k_check,
        tiled=tiled,
    )
    lead_spec = [spec_entry(ax) for ax in lead]
    weight_spec = P(spec_entry(n_axes), spec_entry(k_axes))
    specs = (P(*lead_spec, spec_entry(k_axes)), weight_spec, weight_spec, P())
    specs += (P(spec_entry(n_axes)),) if has_bias else ()

    def run(a, packed, scale, global_scale, bias):
        return impl(a, packed, scale, global_scale, bias, block_size=block_size)

    local = jax.shard_map(
        _on_local_shards(run, k_axes),
        mesh=mesh,
        in_specs=specs,
        out_specs=P(*lead_spec, spec_entry(n_axes)),
        axis_names=set(mesh.explicit_axes),
        check_vma=False,
    )

    def call(a, packed, scale, global_scale, bias, *, block_size):
        del block_size
        operands = (a, packed, scale, global_scale) + (() if bias is None else (bias,))
        operands = [
            jax.sharding.reshard(x, NamedSharding(mesh, spec)) for x, spec in zip(operands, specs)
        ]
        return jax.sharding.reshard(local(*operands), out_aval.sharding)

    return call


@functools.cache
def _local_k_check(path: str, block_size: int, dtype):
    """The path's own limits on K (e.g. gemv: K % 32 == 0), applied to a row-parallel K slice:
    the path was chosen for the whole K."""
    if path == "fused":
        return lambda k_local: _fused.fused_supported(1, 1, k_local, block_size, dtype)
    check = _dispatch._UNSUPPORTED.get(path)
    if check is None:
        return None
    return lambda k_local: check(
        _dispatch.Problem(m=1, n=1, k=k_local, block_size=block_size, dtype=dtype)
    )


def merge_leading(a):
    """a [..., K] -> [M, K] for the 2-D kernels.

    Under explicit sharding types (meshes from `jax.make_mesh`, whose axes are Explicit by
    default) merging a sharded leading dim with another has no sharding type, and `reshape`
    refuses it. The merge only happens in the traced body of the partitioned call (the rules
    above lay out the real computation, on local shards) or in a program with one device, so it
    is typed replicated there.
    """
    m, k = math.prod(a.shape[:-1]), a.shape[-1]
    sharding = explicit_type(jax.typeof(a))
    leading_sharded = sharding is not None and any(e is not None for e in tuple(sharding.spec)[:-1])
    if a.ndim > 2 and leading_sharded:
        return jax.lax.reshape(a, (m, k), out_sharding=NamedSharding(sharding.mesh, P()))
    return a.reshape(m, k)


def result_sharding(a_aval, packed_aval):
    """The result's sharding type under explicit mesh axes (None: leave it to the default).

    Leading dims keep a's explicit axes and N takes the weight's; K's axes are summed over inside
    the partitioned call, so they do not appear in the result.
    """
    a_sh = explicit_type(a_aval)
    if a_sh is None:
        return None
    a_spec = explicit_entries(a_sh, a_aval.ndim)
    w_sh = explicit_type(packed_aval)
    w_spec = explicit_entries(w_sh, 2) if w_sh is not None else [(), ()]
    used = set(w_spec[0]) | set(w_spec[1]) | set(a_spec[-1])
    lead = []
    for axes in a_spec[:-1]:
        keep = tuple(ax for ax in axes if ax not in used)
        used |= set(keep)
        lead.append(spec_entry(keep))
    return NamedSharding(a_sh.mesh, P(*lead, spec_entry(w_spec[0])))
