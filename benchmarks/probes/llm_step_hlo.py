"""What the compiled decode step of the LLM example (examples/llm) does with its KV caches, on whatever
device jax has (a CPU here): the ops of the optimized HLO whose result is as large as a layer's
cache (copies, transposes, converts), and XLA's estimate of the bytes the step accesses.

    python benchmarks/probes/llm_step_hlo.py --preset demo --batch 8 --max-len 4096
"""

from __future__ import annotations

import argparse
import functools
import math
import re
import sys
from pathlib import Path

import jax
import jax.numpy as jnp

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from tests._helpers import load_repo_package  # noqa: E402

llm = load_repo_package("examples/llm")


def cache_sized_ops(hlo: str, cache_elements: int) -> list[str]:
    """Lines of `hlo` whose result has at least `cache_elements` elements, other than the dots,
    fusions and parameters (what moves a cache rather than computing with it)."""
    found = []
    for line in hlo.splitlines():
        m = re.search(r"= \w+\[([\d,]+)\]\{[^}]*\} (copy|transpose|convert)\(", line)
        if m and math.prod(int(d) for d in m.group(1).split(",")) >= cache_elements:
            found.append(line.strip()[:160])
    return found


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", default="demo", choices=sorted(llm.PRESETS))
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--max-len", type=int, default=4096)
    args = parser.parse_args(argv)
    cfg, params = llm.random_model(llm.PRESETS[args.preset])
    k_cache, v_cache = llm.empty_cache(cfg, params, args.batch, args.max_len)
    step = jax.jit(functools.partial(llm.greedy_step, cfg), donate_argnums=(3, 4))
    compiled = step.lower(
        params, jnp.zeros((args.batch, 1), jnp.int32), 5, k_cache, v_cache
    ).compile()
    ops = cache_sized_ops(compiled.as_text(), k_cache[0].size)
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, list) else cost
    print(
        f"{jax.devices()[0].platform}, {args.preset}, batch {args.batch}, {args.max_len} positions: "
        f"{len(ops)} cache-sized copies / transposes / converts; XLA's bytes accessed "
        f"{cost.get('bytes accessed', float('nan')) / 1e6:.1f} MB"
    )
    for line in ops:
        print("  " + line)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
