"""Quick timing of the CPU kernel (backend="cpu") on one weight: median of jitted calls, spec and
tiled layouts, bf16 activations. For A/B checks of ffi/cpu/matmul.cc variants on this machine;
`python -m bench --backend cpu` is the full measurement (bandwidth, bf16 baseline).

    python benchmarks/probes/cpu_kernel_timing.py --shape 4096x4096 --m 1,8,64 --repeats 15
"""

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np

import jax_fp4


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="4096x4096", help="NxK")
    parser.add_argument("--m", default="1,8,64", help="comma-separated rows of activations")
    parser.add_argument("--repeats", type=int, default=15)
    args = parser.parse_args()
    n, k = (int(x) for x in args.shape.split("x"))
    rng = np.random.default_rng(0)
    w = jax_fp4.quantize(rng.standard_normal((n, k)).astype(np.float32))
    f = jax.jit(lambda a, w: jax_fp4.matmul(a, w, backend="cpu"))
    print(f"{jax.devices()[0].device_kind}, jax {jax.__version__}, {n}x{k}, bf16, "
          f"median of {args.repeats}")
    for m in (int(x) for x in args.m.split(",")):
        a = jnp.asarray(rng.standard_normal((m, k)), jnp.bfloat16)
        for layout, weight in (("spec", w), ("tiled", jax_fp4.prepack(w))):
            f(a, weight).block_until_ready()
            times = []
            for _ in range(args.repeats):
                start = time.perf_counter()
                f(a, weight).block_until_ready()
                times.append(time.perf_counter() - start)
            print(f"M = {m:5d} {layout:5s} {np.median(times) * 1e3:8.2f} ms "
                  f"(min {min(times) * 1e3:.2f})")


if __name__ == "__main__":
    main()
