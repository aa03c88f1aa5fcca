"""jax.export of programs that call jax_fp4.

Two things jax.export needs from a library of custom calls:
  - its pytree types registered for serialization, so an exported function can take and return
    weights (`NVFP4Weight`, `PrepackedNVFP4Weight`) as arguments;
  - the waiver of its safety check for custom calls: jax only vouches for the targets jaxlib
    ships. jax_fp4's targets are looked up by name when the exported program runs, so the process
    that runs it must `import jax_fp4` first (which registers them), with the same kernel ABI.

Multi-device programs export when their mesh axes are Explicit (`jax.make_mesh`'s default): the
kernels are then laid out by shard_map from the sharding types (jax_fp4/sharding.py). Under
Auto axes the partitioning rules are Python callbacks, which jax.export cannot serialize.
"""

from __future__ import annotations

import json

import jax

from jax_fp4 import ffi as _ffi
from jax_fp4.format import NVFP4Weight
from jax_fp4.native import PrepackedNVFP4Weight


def export_disabled_checks() -> list:
    """The `disabled_checks` for `jax.export.export` that let it serialize jax_fp4's FFI calls:

        exported = jax.export.export(jax.jit(model),
                                     disabled_checks=jax_fp4.export_disabled_checks())(params, x)

    One waiver per FFI target of jax_fp4 (every platform, built here or not)."""
    return [
        jax.export.DisabledSafetyCheck.custom_call(name)
        for names in _ffi.FFI_TARGETS.values()
        for name in names
    ]


def _register_serialization() -> None:
    # Static data: NVFP4Weight's (block_size, layout), PrepackedNVFP4Weight's block_size.
    jax.export.register_pytree_node_serialization(
        NVFP4Weight,
        serialized_name="jax_fp4.NVFP4Weight",
        serialize_auxdata=lambda static: json.dumps(list(static)).encode(),
        deserialize_auxdata=lambda data: tuple(json.loads(data)),
    )
    jax.export.register_pytree_node_serialization(
        PrepackedNVFP4Weight,
        serialized_name="jax_fp4.PrepackedNVFP4Weight",
        serialize_auxdata=lambda block_size: json.dumps(block_size).encode(),
        deserialize_auxdata=json.loads,
    )


_register_serialization()
