"""Path selection (`_dispatch.select_path`): pure Python, every combination, no device needed.

The expected path is restated here from the rules in README/spec: empty first, then a forced
backend (or a clear ValueError), else on CUDA: the fused Hopper GEMM on compute capability 9.x
(block 16, K % 128 == 0) for 9 <= M <= 16 when N >= 8192 and K >= 8192 on prepacked weights
(not spec-layout ones), and past the GEMV's range up to M = 1024 (M = 2048 when N >= 8192 and
N * K >= 3 * 2^24); otherwise gemv for M <= 16, or M <= 64 with N <= 1024 and K <= 8192 (prepacked,
or where the GEMV runs on tensor cores), or M <= 32 on spec-layout weights with N * K <= 2^23
where the GEMV runs on tensor cores, or on prepacked weights M <= 32 with N <= 4096 and
K >= 8192, or M <= 64 where the fused GEMM cannot run
and the GEMV runs on tensor cores (sm_80+, K % 128 == 0 or prepacked) (block 16, K % 32 == 0,
fp16/bf16), native only when enabled on compute
capability 12.x, past M = 16 (block 16, K and N % 32 == 0), dequant for fp16/bf16,
reference otherwise; on CPU the fused C++ kernel; elsewhere (other platforms, CUDA without
jax_fp4's kernels) xla for fp16/bf16 and reference otherwise. reference and xla (fp16/bf16) can be
forced on any platform.
"""

import itertools

import ml_dtypes
import numpy as np
import pytest

from jax_fp4 import dispatch as _dispatch
from jax_fp4.dispatch import Problem, select_path

CAPABILITIES = [None, (7, 5), (8, 0), (9, 0), (10, 0), (12, 0)]
DTYPES = [np.dtype("float16"), np.dtype(ml_dtypes.bfloat16), np.dtype("float32")]
MS = [0, 1, 8, 9, 11, 12, 16, 17, 32, 33, 64, 65, 256, 257, 512, 1024, 1025, 2048, 2049, 4096]
NS = [0, 33, 1024, 1040, 2048, 4096, 4097, 8192, 12288]
KS, BLOCKS = [0, 48, 64, 4096, 5120, 8192, 16384], [16, 32, 7]


def _expected(platform, backend, cap, native_env, has_cuda, m, n, k, bs, dtype, tiled):
    half = dtype.name in ("float16", "bfloat16")
    gemv_ok = half and bs == 16 and k % 32 == 0
    native_ok = cap is not None and cap[0] == 12 and bs == 16 and k % 32 == 0 and n % 32 == 0 and half
    fused_ok = (cap is not None and cap[0] == 9 and half and bs == 16 and k > 0 and k % 128 == 0)
    shape_ok = {"gemv": gemv_ok, "dequant": half, "xla": half, "native": native_ok,
                "fused": fused_ok, "cpu": True, "reference": True, "auto": True}[backend]
    if backend in ("gemv", "dequant", "xla") and not shape_ok:
        return ValueError
    if m == 0 or n == 0 or k == 0:
        return "empty"
    if backend in ("reference", "xla"):
        return backend
    if backend != "auto":
        needed = "cpu" if backend == "cpu" else "cuda"
        if platform != needed or (needed == "cuda" and not has_cuda) or not shape_ok:
            return ValueError
        return backend
    if platform == "cpu":
        return "cpu"
    if platform == "cuda" and has_cuda:
        native = native_env and native_ok and m >= 9
        tensor_cores = cap is not None and cap >= (8, 0) and (tiled or k % 128 == 0)
        if native:
            gemv_max = 16
        elif not fused_ok and tensor_cores:
            gemv_max = 64
        elif n <= 1024 and k <= 8192 and (tiled or tensor_cores):
            gemv_max = 64
        elif not tiled and tensor_cores and n * k <= 2**23:
            gemv_max = 32
        else:
            gemv_max = 32 if tiled and n <= 4096 and k >= 8192 else 16
        fused_max = 2048 if n >= 8192 and n * k >= 3 * 2**24 else 1024
        if fused_ok and (9 <= m <= 16 and tiled and n >= 8192 and k >= 8192
                         or gemv_max < m <= fused_max):
            return "fused"
        if gemv_ok and m <= gemv_max:
            return "gemv"
        if native:
            return "native"
        if half:
            return "dequant"
    return "xla" if half else "reference"


def test_every_combination():
    count = 0
    for platform, backend, cap, env, has_cuda, m, n, k, bs, dtype, tiled in itertools.product(
            ("cpu", "cuda", "rocm"), _dispatch.BACKENDS, CAPABILITIES, (False, True), (False, True),
            MS, NS, KS, BLOCKS, DTYPES, (False, True)):
        if platform != "cuda" and (cap is not None or env):
            continue  # capability and the native switch only exist on CUDA
        problem = Problem(m=m, n=n, k=k, block_size=bs, dtype=dtype, tiled=tiled)
        want = _expected(platform, backend, cap, env, has_cuda, m, n, k, bs, dtype, tiled)
        kwargs = dict(has_cuda_kernels=has_cuda, capability=cap, native_enabled=env)
        if want is ValueError:
            with pytest.raises(ValueError, match=f"backend={backend!r}"):
                select_path(platform, backend, problem, **kwargs)
        else:
            assert select_path(platform, backend, problem, **kwargs) == want, (
                platform, backend, cap, env, has_cuda, m, n, k, bs, dtype, tiled)
        count += 1
    assert count > 100_000


DEFAULT_BUILD = "80-real;90a-real;120a-real;80-virtual"


@pytest.mark.parametrize("architectures, capability, runs", [
    (DEFAULT_BUILD, (7, 5), False),      # T4: older than every cubin and the PTX
    (DEFAULT_BUILD, (7, 0), False),
    (DEFAULT_BUILD, (8, 0), True),
    (DEFAULT_BUILD, (8, 6), True),       # the 8.0 cubin runs on later 8.x
    (DEFAULT_BUILD, (8, 9), True),
    (DEFAULT_BUILD, (9, 0), True),
    (DEFAULT_BUILD, (10, 0), True),      # through the 8.0 PTX
    (DEFAULT_BUILD, (12, 1), True),
    ("90a-real", (9, 0), True),          # the device build (benchmarks/device_run.sh)
    ("90a-real", (10, 0), False),        # arch-specific: 9.0 only
    ("90a-real", (8, 0), False),
    ("80-real", (9, 0), False),          # a cubin stays within its major version
    ("80-real", (8, 6), True),
    ("86-real", (8, 0), False),
    ("80-virtual", (12, 0), True),
    ("75", (7, 5), True),                # no suffix: cubin and PTX
    ("75", (9, 0), True),
    ("120a-real;80-real", (12, 0), True),
    ("120a-real;80-real", (12, 1), False),
    ("80-real,90a-real,120a-real,80-virtual", (7, 5), False),   # as the compiled module reports
    ("80-real,90a-real,120a-real,80-virtual", (8, 9), True),
    ("native", (7, 5), True),            # cannot tell: assume it runs
    (DEFAULT_BUILD, None, True),
    ("", (7, 5), True),
])
def test_cuda_kernels_run_on(architectures, capability, runs):
    assert _dispatch.cuda_kernels_run_on(architectures, capability) is runs


def test_auto_on_a_gpu_the_build_has_no_code_for():
    # jax_fp4's kernels compiled for sm_80+ on a T4: XLA alone (fp16/bf16), the reference (float32).
    kwargs = dict(tiled=False, capability=(7, 5), architectures=DEFAULT_BUILD)
    assert _dispatch.auto_cuda_path(1, 4096, 4096, dtype="bfloat16", **kwargs) == "xla"
    assert _dispatch.auto_cuda_path(4096, 4096, 4096, dtype="float16", **kwargs) == "xla"
    assert _dispatch.auto_cuda_path(1, 4096, 4096, dtype="float32", **kwargs) == "reference"
    assert _dispatch.auto_cuda_path(1, 4096, 4096, dtype="bfloat16", tiled=False,
                                    capability=(8, 0), architectures=DEFAULT_BUILD) == "gemv"


@pytest.mark.parametrize("raw, value", [("1", True), ("yes", True), ("TRUE", True), ("0", False),
                                        ("off", False), ("no", False), ("", True)])
def test_env_flag_parses_booleans(monkeypatch, raw, value):
    monkeypatch.setenv("JAX_FP4_GEMV_MMA", raw)
    assert _dispatch.env_flag("JAX_FP4_GEMV_MMA", True) is value


def test_env_flag_rejects_garbage(monkeypatch):
    monkeypatch.setenv("JAX_FP4_GEMV_ROW_TILING", "2")
    with pytest.raises(ValueError, match="JAX_FP4_GEMV_ROW_TILING must be a boolean"):
        _dispatch.env_flag("JAX_FP4_GEMV_ROW_TILING", True)
