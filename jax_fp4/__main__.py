"""`python -m jax_fp4 info`: what this installation of jax_fp4 can do."""

from __future__ import annotations

import argparse
import sys


def info() -> str:
    import jax
    import jaxlib

    import jax_fp4
    from jax_fp4 import _ffi

    lines = [
        f"jax_fp4 {jax_fp4.__version__}",
        f"jax {jax.__version__}, jaxlib {jaxlib.__version__}",
        f"python {sys.version.split()[0]}",
        f"devices: {', '.join(sorted({f'{d.platform}:{d.device_kind}' for d in jax.devices()}))}",
        f"CUDA kernels compiled in: {'yes, ' + _ffi.cuda_architectures() if _ffi.has_cuda_kernels() else 'no'}",
        f"backends: {', '.join(jax_fp4.BACKENDS)}",
        "FFI targets registered:",
    ]
    for platform, names in _ffi.REGISTERED_TARGETS.items():
        lines += [f"  {platform}: {name}" for name in names]
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m jax_fp4", description=__doc__)
    parser.add_argument("command", choices=["info"], nargs="?", default="info")
    parser.parse_args(argv)
    print(info())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
