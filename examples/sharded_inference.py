"""Tensor-parallel inference with NVFP4 weights: a two-layer MLP, column-parallel up projection and
row-parallel down projection (Megatron style), on a (data, model) device mesh.

    python examples/sharded_inference.py

What it does: quantizes a 256 -> 1024 -> 256 MLP to NVFP4, places its weights on a (data, model)
mesh of every device (the model axis 4, 2 or 1 wide) and runs 16 bf16 tokens through it three
ways, same numbers:
  1. jit + NamedSharding: place the weights sharded and let XLA partition the program. jax_fp4's
     partitioning rules keep every weight shard where it is: the up projection runs on each
     device's N columns (no communication), the down projection on each device's K slice, whose
     partial sums are added by ONE all-reduce; the bias is added once, after it.
  2. shard_map: write the per-device program yourself; jax_fp4.matmul runs on the local shards.
  3. Sharding in types (a mesh whose axes are Explicit, jax.make_mesh's default): the same
     placements; jax_fp4 lays the kernels out from the types, so the program also exports
     (jax.export) and here runs from its exported form.

What it needs: jax_fp4 installed (jax.export's serialization needs ``flatbuffers``). No GPU: on a
CPU-only machine it asks XLA for 8 host devices (unless XLA_FLAGS already sets a count); on GPUs
it uses every GPU JAX sees.

What it prints: one line per way: the mesh, the relative error against a float64 NumPy reference
(a few 1e-3: bf16 rounding), the collectives XLA inserted (read from the compiled HLO: one
all-reduce where the model axis is wider than 1) and the output's sharding.
"""

from __future__ import annotations

import argparse
import os
import re
import sys


def parse_args(argv=None):
    """The command line; defined before the imports below so that --help answers without them."""
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    return parser.parse_args(argv)


if __name__ == "__main__":
    parse_args()  # --help and argument errors exit here, before jax is imported

if "jax" not in sys.modules and "xla_force_host_platform_device_count" not in os.environ.get(
    "XLA_FLAGS", ""
):
    os.environ["XLA_FLAGS"] = (
        os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
    ).strip()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import AxisType, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P

import jax_fp4  # noqa: E402

D_MODEL, D_FF, BATCH = 256, 1024, 16


def make_mesh():
    n = jax.device_count()
    model = max(d for d in (1, 2, 4) if n % d == 0)
    # Auto axes: the classic jit + NamedSharding style, where XLA propagates shardings.
    return jax.make_mesh((n // model, model), ("data", "model"), axis_types=(AxisType.Auto,) * 2)


def make_params(key, mesh):
    k1, k2, k3, k4, k5 = jax.random.split(key, 5)
    quantize = jax.jit(jax_fp4.quantize)
    up = quantize(jax.random.normal(k1, (D_FF, D_MODEL)) / np.sqrt(D_MODEL))
    down = quantize(jax.random.normal(k2, (D_MODEL, D_FF)) / np.sqrt(D_FF))
    params = {
        "up": up,
        "b_up": 0.1 * jax.random.normal(k3, (D_FF,)),
        "down": down,
        "b_down": 0.1 * jax.random.normal(k4, (D_MODEL,)),
    }
    # A weight's PartitionSpec is over its logical [N, K]; .shardings gives one per array.
    specs = {
        "up": up.shardings(P("model", None)),  # column parallel: shard N
        "b_up": P("model"),
        "down": down.shardings(P(None, "model")),  # row parallel: shard K (whole scale blocks)
        "b_down": P(),
    }
    shardings = jax.tree.map(lambda s: NamedSharding(mesh, s), specs)
    x = jax.random.normal(k5, (BATCH, D_MODEL), jnp.bfloat16)
    return jax.device_put(params, shardings), specs, x


def mlp(params, x):
    h = jax.nn.gelu(jax_fp4.matmul(x, params["up"], params["b_up"].astype(x.dtype)))
    return jax_fp4.matmul(h, params["down"], params["b_down"].astype(x.dtype))


def mlp_shard_map(mesh, specs):
    def local(params, x):  # runs on each device with its shards
        h = jax.nn.gelu(jax_fp4.matmul(x, params["up"], params["b_up"].astype(x.dtype)))
        partial = jax_fp4.matmul(h, params["down"]).astype(jnp.float32)  # this K slice's share
        y = jax.lax.psum(partial, "model") + params["b_down"]  # bias once, after the sum
        return y.astype(x.dtype)

    return jax.shard_map(
        local, mesh=mesh, in_specs=(specs, P("data", None)), out_specs=P("data", None)
    )


def exported_under_explicit_axes(mesh, specs, params, x):
    mesh = jax.make_mesh(
        tuple(mesh.shape.values()),
        mesh.axis_names,
        axis_types=(AxisType.Explicit,) * len(mesh.axis_names),
    )
    place = lambda tree, spec: jax.device_put(  # noqa: E731
        tree, jax.tree.map(lambda s: NamedSharding(mesh, s), spec)
    )
    args = (place(params, specs), place(x, P("data", None)))
    exported = jax.export.export(jax.jit(mlp), disabled_checks=jax_fp4.export_disabled_checks())(
        *args
    )
    return jax.jit(exported.call), args


def reference(params, x):
    """float64 NumPy: dequantize every weight and run the MLP (gelu in float64 too)."""
    f64 = lambda v: np.asarray(v, np.float64)  # noqa: E731
    unit = jax.jit(
        lambda w: jax_fp4.dequantize(
            jax_fp4.NVFP4Weight(w.packed, w.scale, jnp.float32(1), w.block_size)
        )
    )

    def dequantize(w):  # e2m1 * e4m3 is exact in float32; the global scale is applied in float64
        return f64(unit(w)) * f64(w.global_scale)

    up, down = dequantize(params["up"]), dequantize(params["down"])
    h = f64(x) @ up.T + f64(params["b_up"])
    h = np.asarray(jax.nn.gelu(jnp.asarray(h, jnp.float32)), np.float64)
    return h @ down.T + f64(params["b_down"])


def collectives(hlo: str) -> dict:
    ops = ("all-gather", "all-reduce", "reduce-scatter", "all-to-all", "collective-permute")
    return {op: len(re.findall(rf"\b{op}(?:-start)?\(", hlo)) for op in ops}


def main(verbose: bool = True) -> dict:
    mesh = make_mesh()
    params, specs, x = make_params(jax.random.key(0), mesh)
    x = jax.device_put(x, NamedSharding(mesh, P("data", None)))
    ref = reference(params, x)
    facts = {"mesh": dict(mesh.shape)}
    for name, (fn, args) in (
        ("jit + NamedSharding", (jax.jit(mlp), (params, x))),
        ("shard_map", (jax.jit(mlp_shard_map(mesh, specs)), (params, x))),
        ("explicit axes, exported", exported_under_explicit_axes(mesh, specs, params, x)),
    ):
        hlo = fn.lower(*args).compile().as_text()
        y = fn(*args)
        err = float(np.linalg.norm(np.asarray(y, np.float64) - ref) / np.linalg.norm(ref))
        facts[name] = {
            "relative_error": err,
            "collectives": collectives(hlo),
            "output_spec": tuple(y.sharding.spec),
        }
        if verbose:
            used = {k: v for k, v in facts[name]["collectives"].items() if v} or "none"
            print(
                f"{name:24s} mesh {facts['mesh']}  rel. error vs float64 {err:.2e}  "
                f"collectives {used}  output {y.sharding.spec}"
            )
    return facts


if __name__ == "__main__":
    main()
