"""`python -m jax_fp4 info` reports what this installation holds."""

import subprocess
import sys

from jax_fp4 import _ffi


def test_info_lists_versions_and_registered_targets():
    out = subprocess.run([sys.executable, "-m", "jax_fp4", "info"], check=True, capture_output=True,
                         text=True).stdout
    assert "jax_fp4 0.1.0" in out and "jaxlib" in out
    assert "cpu: jax_fp4_matmul_cpu" in out
    if _ffi.has_cuda_kernels():
        for target in ("jax_fp4_gemv_cuda", "jax_fp4_dequant_cuda", "jax_fp4_native_sm120_cuda",
                       "jax_fp4_fused_cuda"):
            assert f"CUDA: {target}" in out
        assert f"CUDA kernels compiled in: yes, {_ffi.cuda_architectures()}" in out
    else:
        assert "CUDA kernels compiled in: no" in out
