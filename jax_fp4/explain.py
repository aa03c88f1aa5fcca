"""Why `auto` did not take a path: for each path other than the one `jax_fp4/dispatch.py` picks,
the reason the dispatch gives when that path is forced (alignment, dtype, platform, GPU), or that
it could serve and loses on the measured crossovers. `python -m jax_fp4 paths` and
`jax_fp4.dispatch_reasons` print it; the decision itself stays in dispatch.py alone."""

from __future__ import annotations

import re

from jax_fp4 import dispatch as _dispatch

# The paths worth explaining per platform: the kernels, then XLA's fallback.
KERNEL_PATHS = {
    "cpu": ("cpu", "xla"),
    "cuda": ("gemv", "fused", "native", "dequant", "xla"),
}

_PREFIX = re.compile(r"^backend='\w+' (cannot serve this matmul: )?")


def not_taken(problem: _dispatch.Problem, target: _dispatch.Target, paths=None) -> dict[str, str]:
    """{path: why auto does not take it} for `paths` (default: the platform's KERNEL_PATHS, or
    every backend on another platform), the chosen path left out."""
    chosen = _dispatch.plan(problem, target).path
    if paths is None:
        paths = KERNEL_PATHS.get(target.platform, _dispatch.BACKENDS[1:])
    reasons = {}
    for path in paths:
        if path == chosen:
            continue
        try:
            _dispatch.plan(problem, target, path)
        except ValueError as err:
            reasons[path] = _PREFIX.sub("", str(err))
            continue
        if path == "native" and not target.native_enabled:
            reasons[path] = "opt-in: JAX_FP4_NATIVE_SM120=1 (or backend='native')"
        else:
            reasons[path] = (
                f"could serve it; auto prefers {chosen!r} for these shapes on this platform "
                "(the rules and measured crossovers of jax_fp4/dispatch.py)"
            )
    return reasons
