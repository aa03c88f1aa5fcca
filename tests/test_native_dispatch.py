"""Dispatch decisions of the native SM120 NVFP4 x NVFP4 path: pure Python, no device.

Every combination of (device capability, JAX_FP4_NATIVE_SM120, backend, M, N, K, block_size,
dtype) is checked against the spec's rules (sections 3 and 6), restated here independently:
the path runs on compute capability 12.x only, for block_size 16, K % 32 == 0, N % 32 == 0 and
fp16/bf16 activations; under "auto" only when the environment enables it and M > 8 (the decode GEMV
keeps M <= 8); backend="native" forces it (any non-empty M) and fails loudly when it cannot run.
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from jax_fp4 import config as _config
from jax_fp4 import native as _native

CAPABILITIES = [
    None,
    (7, 5),
    (8, 0),
    (8, 9),
    (9, 0),
    (10, 0),
    (10, 3),
    (11, 0),
    (12, 0),
    (12, 1),
    (13, 0),
]
BACKENDS = [None, "auto", "native", "reference", "cpu", "gemv", "dequant"]
MS = [0, 1, 8, 9, 16, 127, 4096]
NS = [0, 16, 32, 48, 96, 11008]
KS = [0, 16, 32, 48, 64, 4096]
BLOCK_SIZES = [16, 32, 8]


def _dtypes():
    import ml_dtypes

    return [np.dtype("float16"), np.dtype(ml_dtypes.bfloat16), np.dtype("float32"), None]


def _device_ok(capability):
    return capability is not None and capability[0] == 12


def _shape_ok(n, k, block_size, dtype):
    half = dtype is None or dtype.name in ("float16", "bfloat16")
    return block_size == 16 and k % 32 == 0 and n % 32 == 0 and half


def test_every_combination():
    count = 0
    for cap, env, backend, m, n, k, bs, dtype in itertools.product(
        CAPABILITIES, (False, True), BACKENDS, MS, NS, KS, BLOCK_SIZES, _dtypes()
    ):
        count += 1
        ok = _device_ok(cap) and _shape_ok(n, k, bs, dtype)
        nonempty = m > 0 and n > 0 and k > 0
        args = (cap, env, backend, m, n, k, bs)
        if backend == "native":
            if not ok:
                with pytest.raises(ValueError, match="backend='native' cannot serve"):
                    _native.native_path_applies(*args, dtype=dtype)
                continue
            expected = nonempty
        elif backend in (None, "auto"):
            expected = env and ok and m > 8 and nonempty
        else:
            expected = False
        got = _native.native_path_applies(*args, dtype=dtype)
        assert got is expected or got == expected, (args, dtype, got, expected)
    assert count == (
        len(CAPABILITIES) * 2 * len(BACKENDS) * len(MS) * len(NS) * len(KS) * len(BLOCK_SIZES) * 4
    )


@pytest.mark.parametrize("m,expected", [(1, False), (8, False), (9, True), (4096, True)])
def test_decode_gemv_keeps_priority(m, expected):
    assert _native.native_path_applies((12, 0), True, None, m, 11008, 4096, 16) is expected


def test_env_disabled_means_off():
    assert not _native.native_path_applies((12, 0), False, "auto", 4096, 11008, 4096, 16)


@pytest.mark.parametrize("cap", [(8, 0), (9, 0), (10, 0), None])
def test_forced_native_on_other_devices_is_a_clear_error(cap):
    with pytest.raises(ValueError) as err:
        _native.native_path_applies(cap, False, "native", 64, 256, 256, 16)
    msg = str(err.value)
    assert "Blackwell SM120" in msg and "compute capability 12.x" in msg
    assert (f"{cap[0]}.{cap[1]}" if cap else "not a CUDA device") in msg


@pytest.mark.parametrize(
    "n,k,bs,dtype,what",
    [
        (256, 48, 16, "float16", "K must be a multiple of 32"),
        (48, 256, 16, "float16", "N must be a multiple of 32"),
        (256, 256, 32, "float16", "block_size must be 16"),
        (256, 256, 16, "float32", "float16 or bfloat16"),
    ],
)
def test_forced_native_shape_errors(n, k, bs, dtype, what):
    with pytest.raises(ValueError, match=what):
        _native.native_path_applies((12, 0), False, "native", 64, n, k, bs, dtype=np.dtype(dtype))


def test_forced_native_serves_small_m():
    assert _native.native_path_applies((12, 0), False, "native", 1, 256, 256, 16)


@pytest.mark.parametrize(
    "raw,expected",
    [("1", True), ("true", True), ("ON", True), ("0", False), ("", False), ("no", False)],
)
def test_env_flag(monkeypatch, raw, expected):
    monkeypatch.setenv(_native.NATIVE_ENV, raw)
    assert _config.env_flag(_native.NATIVE_ENV, False) is expected


def test_env_flag_default_and_garbage(monkeypatch):
    monkeypatch.delenv(_native.NATIVE_ENV, raising=False)
    assert _config.env_flag(_native.NATIVE_ENV, False) is False
    monkeypatch.setenv(_native.NATIVE_ENV, "maybe")
    with pytest.raises(ValueError, match="JAX_FP4_NATIVE_SM120"):
        _config.env_flag(_native.NATIVE_ENV, False)


def test_device_capability_parsing():
    class Fake:
        compute_capability = "12.0"

    class Cpu:
        platform = "cpu"

    assert _native.device_capability(Fake()) == (12, 0)
    assert _native.device_capability(Cpu()) is None
