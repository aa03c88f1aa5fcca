"""What the compiled decode step of the LLM example (examples/llm) does with its KV caches, on whatever
device jax has (a CPU here): the ops of the optimized HLO whose result is as large as a layer's
cache (copies, transposes, converts), and XLA's estimate of the bytes the step accesses; with
--census, every kernel the step launches, grouped by what it computes (`kernel_census`): where a
GPU step's non-matmul kernels come from, printed rather than written to a file.

    python benchmarks/probes/llm_step_hlo.py --preset demo --batch 8 --max-len 4096
    python benchmarks/probes/llm_step_hlo.py --preset llama3-8b --layers 2 --batch 1 --census
"""

from __future__ import annotations

import argparse
import collections
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


# Ops that launch nothing: bookkeeping, and the calls whose computations are walked instead.
_NO_KERNEL = {
    "parameter",
    "constant",
    "get-tuple-element",
    "tuple",
    "bitcast",
    "call",
    "while",
    "conditional",
    "after-all",
    "add-dependency",
    "opt-barrier",
    "partition-id",
    "replica-id",
}
_COMPUTATION = re.compile(r"^(?:ENTRY )?%([\w.-]+) \(")
_INSTRUCTION = re.compile(r"^\s+(?:ROOT )?%[\w.-]+ = (?:\([^=]*?\)|\S+) ([\w-]+)\((.*)$")


def kernel_census(hlo: str) -> collections.Counter:
    """The kernels an optimized HLO module launches, counted by kind: each op outside fusion
    bodies and reducers that is not bookkeeping (`_NO_KERNEL`), keyed "fusion(kind): the distinct
    ops of its body" for fusions, "custom-call: target" for custom calls and the op's name
    otherwise. Computations reached through call, while or conditional (XLA's command buffers
    among them) count as the ENTRY's do."""
    bodies: dict[str, list[tuple[str, str]]] = {}  # computation -> (opcode, rest of line)
    name = None
    for line in hlo.splitlines():
        if m := _COMPUTATION.match(line):
            name = m.group(1)
            bodies[name] = []
        elif name is not None and (m := _INSTRUCTION.match(line)):
            bodies[name].append((m.group(1), m.group(2)))
    inner = set()  # fusion bodies, reducers and whatever they call
    for ops in bodies.values():
        for opcode, rest in ops:
            if opcode != "call":
                inner.update(re.findall(r"(?:calls|to_apply)=%([\w.-]+)", rest))
    pending = list(inner)
    while pending:
        for _, rest in bodies.get(pending.pop(), []):
            for callee in re.findall(r"(?:calls|to_apply)=%([\w.-]+)", rest):
                if callee not in inner:
                    inner.add(callee)
                    pending.append(callee)
    census = collections.Counter()
    for computation, ops in bodies.items():
        if computation in inner:
            continue
        for opcode, rest in ops:
            if opcode in _NO_KERNEL:
                continue
            if opcode == "fusion":
                kind = re.search(r"kind=(\w+)", rest)
                body = re.search(r"calls=%([\w.-]+)", rest)
                inside = sorted(
                    {op for op, _ in bodies.get(body.group(1), []) if op not in _NO_KERNEL}
                    if body
                    else ()
                )
                key = f"fusion({kind.group(1) if kind else '?'}): {', '.join(inside)}"
            elif opcode == "custom-call":
                target = re.search(r'custom_call_target="([^"]+)"', rest)
                key = f"custom-call: {target.group(1) if target else '?'}"
            else:
                key = opcode
            census[key] += 1
    return census


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", default="demo", choices=sorted(llm.PRESETS))
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--max-len", type=int, default=4096)
    parser.add_argument("--layers", type=int, default=0, help="layers of the preset (0: all)")
    parser.add_argument(
        "--census", action="store_true", help="also every kernel of the step, grouped by kind"
    )
    args = parser.parse_args(argv)
    config = dict(llm.PRESETS[args.preset])
    if args.layers:
        config["num_hidden_layers"] = args.layers
    cfg, params = llm.random_model(config)
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
    if args.census:
        census = kernel_census(compiled.as_text())
        print(f"{sum(census.values())} kernels a step, by kind:")
        for key, count in sorted(census.items(), key=lambda kv: (-kv[1], kv[0])):
            print(f"  {count:4d}  {key[:150]}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
