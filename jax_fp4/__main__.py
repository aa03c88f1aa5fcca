"""`python -m jax_fp4 info`: what this installation of jax_fp4 can do.
`python -m jax_fp4 paths NxK`: the path `auto` takes for that weight at every M."""

from __future__ import annotations

import argparse
import sys


def cuda_support(
    has_kernels: bool, cuda_version: str, plugin: str | None, has_gpu_devices: bool
) -> str:
    """info's line on JAX's CUDA support beside this build's CUDA kernels: whether the two can
    meet, and what to install where they cannot."""
    built = f" (built with CUDA {cuda_version})" if cuda_version else ""
    if plugin is None:
        line = "JAX's CUDA support: none, jaxlib runs on the CPU only"
        if has_kernels:
            line += (
                f"; the CUDA kernels{built} cannot run: install JAX for the GPU with "
                "`pip install 'jax_fp4[cuda]'` (jax[cuda13]; 'jax_fp4[cuda12]' for CUDA 12)"
            )
        return line
    line = f"JAX's CUDA support: {plugin}"
    if not has_gpu_devices:
        line += "; no CUDA device visible to JAX (driver, CUDA_VISIBLE_DEVICES?)"
    if not has_kernels:
        line += (
            "; this jax_fp4 has no CUDA kernels (built without nvcc): GPUs take the xla path; "
            "reinstall with nvcc on PATH (JAX_FP4_CUDA=ON makes its absence an error)"
        )
    return line


def info() -> str:
    import jax
    import jaxlib

    import jax_fp4
    from jax_fp4 import ffi as _ffi

    lines = [
        f"jax_fp4 {jax_fp4.__version__}",
        f"jax {jax.__version__}, jaxlib {jaxlib.__version__}",
        f"python {sys.version.split()[0]}",
        f"devices: {', '.join(sorted({f'{d.platform}:{d.device_kind}' for d in jax.devices()}))}",
        f"CPU kernel on this CPU: {_ffi.cpu_kernel_builds()}",
        f"CUDA kernels compiled in: {'yes, ' + _ffi.cuda_architectures() if _ffi.has_cuda_kernels() else 'no'}",
        cuda_support(
            _ffi.has_cuda_kernels(),
            _ffi.cuda_version(),
            _ffi.jax_cuda_plugin(),
            any(d.platform == "gpu" for d in jax.devices()),
        ),
        f"backends: {', '.join(jax_fp4.BACKENDS)}",
        "FFI targets registered:",
    ]
    for platform, names in _ffi.REGISTERED_TARGETS.items():
        lines += [f"  {platform}: {name}" for name in names]
    return "\n".join(lines)


def paths(
    n: int,
    k: int,
    *,
    layout: str,
    capability: tuple[int, int],
    dtype: str = "bfloat16",
    native: bool = False,
    max_m: int = 8192,
    device_kind: str | None = None,
) -> list[tuple[int, int, str]]:
    """The CUDA path `auto` picks for an N x K weight on a GPU of `capability` (and
    `device_kind`, the key of the dispatch's table; None: the capability's entry), as ranges of M:
    [(first M, last M, path), ...] for M = 1..max_m (the dispatch rules only, no device needed),
    with the CUDA architectures of this build (of a default build where this one has none)."""
    from jax_fp4 import dispatch as _dispatch

    target = _target(capability, device_kind, native)
    ranges: list[tuple[int, int, str]] = []
    for m in range(1, max_m + 1):
        path = _dispatch.plan(_problem(m, n, k, dtype, layout), target).path
        if ranges and ranges[-1][2] == path:
            ranges[-1] = (ranges[-1][0], m, path)
        else:
            ranges.append((m, m, path))
    return ranges


def _target(capability, device_kind, native):
    from jax_fp4 import config as _config
    from jax_fp4 import dispatch as _dispatch
    from jax_fp4 import ffi as _ffi

    return _dispatch.cuda_target(
        capability,
        device_kind=device_kind,
        architectures=_ffi.cuda_architectures() or _ffi.ALL_CUDA_ARCHITECTURES,
        native_enabled=native,
        gemv_mma=_config.gemv_tensor_cores(),
    )


def _problem(m, n, k, dtype, layout):
    import numpy as np

    from jax_fp4 import dispatch as _dispatch

    return _dispatch.Problem(
        m=m, n=n, k=k, block_size=16, dtype=np.dtype(dtype), tiled=layout == "tiled"
    )


def never_taken(n: int, k: int, *, taken=(), **where) -> dict[str, str]:
    """{path: why} for the CUDA kernel paths `auto` takes at no M (those not in `taken`): the
    reason a forced path gives at M = 1 (alignment, dtype, GPU), or that it loses on the
    crossovers. `where`: the keywords of `paths` but max_m (layout and capability required)."""
    from jax_fp4 import explain as _explain

    reasons = _explain.not_taken(
        _problem(1, n, k, where.get("dtype", "bfloat16"), where["layout"]),
        _target(where["capability"], where.get("device_kind"), where.get("native", False)),
        paths=("gemv", "fused", "native", "dequant"),
    )
    return {path: why for path, why in reasons.items() if path not in taken}


def _capability(text: str) -> tuple[int, int]:
    from jax_fp4 import config as _config

    try:
        return _config.parse_capability(text)
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from None


def paths_report(args) -> str:
    capability, source, device_kind = args.capability, "given", args.device_kind
    if capability is None:
        from jax_fp4 import config as _config
        from jax_fp4 import lowering as _lowering

        capability = _lowering.cuda_capability()
        device_kind = device_kind or _lowering.cuda_device_kind()
        source = (
            _config.CAPABILITY_ENV
            if _config.cuda_capability_override() is not None
            else device_kind or "this machine's GPU"
        )
        if capability is None:
            raise SystemExit(
                "paths: no CUDA device here; name the GPU with --capability "
                "(9.0: H100 / H200, 8.0: A100, 12.0: RTX 50xx)"
            )
    n, k = args.shape
    where = dict(
        layout=args.layout,
        capability=capability,
        dtype=args.dtype,
        native=args.native,
        device_kind=device_kind,
    )
    ranges = paths(n, k, max_m=args.max_m, **where)
    lines = [
        f"auto for N x K = {n}x{k}, {args.layout} layout, {args.dtype}, compute capability "
        f"{capability[0]}.{capability[1]} ({source}):"
    ]
    lines += [
        f"  M = {first}" + (f"-{last}" if last > first else "") + f": {path}"
        for first, last, path in ranges
    ]
    taken = {path for _, _, path in ranges}
    lines += [
        f"{path} is not taken: {reason}"
        for path, reason in never_taken(n, k, taken=taken, **where).items()
    ]
    return "\n".join(lines)


def _weight_shape(text: str) -> tuple[int, int]:
    """'4096x11008' -> (4096, 11008): a weight's N x K."""
    try:
        n, k = (int(part) for part in text.lower().split("x"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"a shape is NxK, e.g. 4096x11008; got {text!r}") from None
    if n <= 0 or k <= 0 or k % 2:
        raise argparse.ArgumentTypeError(f"N and K must be positive and K even; got {text!r}")
    return n, k


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m jax_fp4", description=__doc__)
    commands = parser.add_subparsers(dest="command")
    commands.add_parser("info", help="versions, CUDA architectures and FFI targets (the default)")
    p = commands.add_parser("paths", help="the path auto takes for an N x K weight at every M")
    p.add_argument("shape", type=_weight_shape, help="the weight's N x K, e.g. 4096x11008")
    p.add_argument(
        "--layout",
        choices=("spec", "tiled"),
        default="spec",
        help="tiled: a jax_fp4.prepack'ed weight (default spec)",
    )
    p.add_argument(
        "--capability",
        type=_capability,
        default=None,
        help="the GPU's compute capability, e.g. 9.0 (default: this machine's GPU)",
    )
    p.add_argument(
        "--device-kind",
        default=None,
        help="the GPU's name as JAX reports it, e.g. 'NVIDIA H200': the dispatch "
        "table's key (default: the capability's entry, or this machine's GPU)",
    )
    p.add_argument(
        "--dtype",
        choices=("bfloat16", "float16", "float32"),
        default="bfloat16",
        help="the activations' dtype (default bfloat16; float32 takes the reference path on a GPU)",
    )
    p.add_argument("--native", action="store_true", help="as with JAX_FP4_NATIVE_SM120=1")
    p.add_argument(
        "--max-m",
        type=int,
        default=8192,
        help="the largest M (rows of the activations, e.g. tokens) to report (default 8192)",
    )
    args = parser.parse_args(argv)
    print(paths_report(args) if args.command == "paths" else info())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
