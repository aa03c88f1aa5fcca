"""Sharding in types: helpers for operands typed under Explicit mesh axes (`jax.make_mesh`'s
default), where an array's sharding is part of its type and operations that cannot infer their
result's sharding (a dot contracting a sharded axis, a reshape across one, a gather) refuse to
trace unless told. Under Auto axes (or without a mesh) every helper is a no-op.

A leaf module (jax only), so the layout transforms and the primitive's rules can both use it.
"""

from __future__ import annotations

import math

import jax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P


def axes_of(entry) -> tuple[str, ...]:
    """The mesh axes of one PartitionSpec entry (None, a name, or a tuple of names)."""
    if entry is None:
        return ()
    if isinstance(entry, (tuple, list)):
        return tuple(entry)
    return (entry,)


def axes_size(mesh, axes) -> int:
    """The number of shards `axes` of `mesh` split a dimension into."""
    return math.prod(mesh.shape[a] for a in axes)


def spec_axes(sharding, ndim: int) -> list[tuple[str, ...]]:
    """Per dimension, the mesh axes a NamedSharding splits it over (its spec padded to `ndim`)."""
    spec = tuple(sharding.spec) + (None,) * (ndim - len(sharding.spec))
    return [axes_of(e) for e in spec]


def explicit_type(aval):
    """`aval`'s sharding when its mesh has Explicit axes (its sharding type), else None."""
    sharding = getattr(aval, "sharding", None)
    mesh = getattr(sharding, "mesh", None)
    if mesh is None or mesh.empty or not mesh._any_axis_explicit:
        return None
    return sharding


def typed_mesh(aval):
    """The mesh of `aval`'s sharding type when its types alone lay a computation out: Explicit
    axes over more than one device and no Auto ones (Manual ones, in a shard_map body, are laid
    out already). Else None."""
    mesh = getattr(getattr(aval, "sharding", None), "mesh", None)
    if mesh is None or mesh.empty or mesh.auto_axes:
        return None
    if axes_size(mesh, mesh.explicit_axes) <= 1:
        return None
    return mesh


def explicit_entries(sharding, ndim: int) -> list[tuple[str, ...]]:
    """Per dimension, the Explicit mesh axes `sharding` splits it over."""
    explicit = set(sharding.mesh.explicit_axes)
    return [tuple(ax for ax in axes if ax in explicit) for axes in spec_axes(sharding, ndim)]


def typed_like(x, aval):
    """`x` resharded to `aval`'s sharding type under Explicit axes (else `x` as it is):
    tangents and cotangents must carry their primal's type."""
    sharding = explicit_type(aval)
    return x if sharding is None else jax.sharding.reshard(x, sharding)


def by_row_tiles(fn, x, rows: int, *, keep_type: bool):
    """fn(x) for a transform of x [..., N, C] that maps each tile of `rows` rows (with all of C) on
    its own: the tiled layout's 16-row tiles, the SM120 scales' 128-row atoms.

    Under Explicit axes its reshapes across a sharded axis would need typing, so fn runs per
    shard: N stays split where every shard holds whole tiles, C is gathered (a tile spans all of
    it), leading dims keep their axes; `keep_type` reshards the result to x's type (for transforms
    that keep x's shape). Elsewhere XLA partitions fn as it is."""
    sharding = explicit_type(jax.typeof(x))
    if sharding is None:
        return fn(x)
    mesh = sharding.mesh
    *lead, n_axes, _ = explicit_entries(sharding, x.ndim)
    if x.shape[-2] % (axes_size(mesh, n_axes) * rows):
        n_axes = ()
    local = P(*(spec_entry(e) for e in lead), spec_entry(n_axes), None)
    y = jax.shard_map(
        fn, mesh=mesh, in_specs=local, out_specs=local, axis_names=set(mesh.explicit_axes)
    )(jax.sharding.reshard(x, NamedSharding(mesh, local)))
    return jax.sharding.reshard(y, sharding) if keep_type else y


def spec_entry(axes):
    """A tuple of mesh axes as one PartitionSpec entry (the inverse of axes_of)."""
    if not axes:
        return None
    return axes[0] if len(axes) == 1 else tuple(axes)
