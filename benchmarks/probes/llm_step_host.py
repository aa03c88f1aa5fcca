"""Is the LLM example's decode step bound by the host?

Builds the LLM example's (examples/llm) model of a preset's shapes with random weights (layers
unrolled), compiles its decode step (forward + argmax, caches donated), and prints per run
(NVFP4 through jax_fp4, then the same weights dequantized to bf16):
- the compiled program's kernel launches by kind: jax_fp4 custom calls, other custom calls and
  fusions (command buffers are formed after the HLO, so the profile below tells their effect);
- per step, over a run of steps launched back to back: the wall time, and from a profile
  (jax.profiler, read back with jax.profiler.ProfileData) the time the GPU's streams are busy
  and the host events that take longest. Busy well under wall: the GPU waits for the host.

    python benchmarks/probes/llm_step_host.py --random llama3-8b [--steps 32] [--json PATH]
"""

from __future__ import annotations

import argparse
import collections
import functools
import json
import re
import sys
import tempfile
import time
from pathlib import Path

import jax
import jax.numpy as jnp

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from tests._helpers import load_repo_package  # noqa: E402

llm = load_repo_package("examples/llm")


def thunk_counts(hlo_text: str) -> dict:
    """Counts of what the compiled program launches, from its optimized HLO text."""
    counts = collections.Counter()
    for line in hlo_text.splitlines():
        if " custom-call(" in line:
            target = re.search(r'custom_call_target="([^"]+)"', line)
            name = target.group(1) if target else "?"
            counts[
                "jax_fp4 custom calls" if name.startswith("jax_fp4") else f"custom call {name}"
            ] += 1
        elif re.search(r"= \S+ fusion\(", line):
            counts["fusions"] += 1
    return dict(counts)


def time_steps(cfg, params, batch: int, steps: int) -> dict:
    max_len = 8 + steps + 4

    k_cache, v_cache = llm.empty_cache(cfg, params, batch, max_len)
    token = jnp.ones((batch, 1), jnp.int32)
    step = jax.jit(functools.partial(llm.greedy_step, cfg), donate_argnums=(3, 4))
    compiled = step.lower(params, token, 0, k_cache, v_cache).compile()
    counts = thunk_counts(compiled.as_text())
    for i in range(3):  # warm-up
        token, k_cache, v_cache = compiled(params, token, i, k_cache, v_cache)
    token.block_until_ready()
    t0 = time.perf_counter()
    for i in range(3, 3 + steps):
        token, k_cache, v_cache = compiled(params, token, i, k_cache, v_cache)
    token.block_until_ready()
    wall = (time.perf_counter() - t0) / steps
    with tempfile.TemporaryDirectory() as trace_dir:
        jax.profiler.start_trace(trace_dir)
        for i in range(3 + steps, 3 + 2 * steps):
            token, k_cache, v_cache = compiled(params, token, i, k_cache, v_cache)
        token.block_until_ready()
        jax.profiler.stop_trace()
        profile = llm.profile_summary(next(Path(trace_dir).rglob("*.xplane.pb")), steps)
    return {"thunks": counts, "wall_ms_per_step": wall * 1e3, **profile}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--random", default="llama3-8b", help="a preset of the LLM example (examples/llm/config.py)"
    )
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--steps", type=int, default=32)
    parser.add_argument("--json", metavar="PATH")
    args = parser.parse_args(argv)
    cfg, params = llm.random_model(llm.PRESETS[args.random])
    record = {"device": jax.devices()[0].device_kind, "preset": args.random, "batch": args.batch}
    for name, model in (("nvfp4", params), ("bf16", llm.dense_twin(params))):
        record[name] = time_steps(cfg, model, args.batch, args.steps)
        r = record[name]
        print(
            f"{name}: {r['wall_ms_per_step']:.2f} ms a step; GPU busy {r['gpu_busy_ms_per_step']:.2f} ms "
            f"in {r['gpu_events_per_step']:.0f} events (window {r['gpu_window_ms_per_step']:.2f} ms); "
            f"thunks {r['thunks']}"
        )
        for event, ms in r["host_top_ms_per_step"].items():
            print(f"    host {ms:8.3f} ms  {event}")
    if args.json:
        Path(args.json).write_text(json.dumps(record, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
