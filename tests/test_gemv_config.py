"""The CUDA decode GEMV's launch heuristic (ffi/include/jax_fp4/gemv_config.h): pure C++, checked on
any machine by tests/cpp/gemv_config_check.cc (compile-time picks, invariants over a grid of shapes
and SM counts, the H200's measured picks, monotonicity in the SM count, degenerate inputs), built
and run here with each C++ compiler at hand."""

from __future__ import annotations

import subprocess

import pytest

from tests._helpers import COMPILERS, ROOT


@pytest.mark.parametrize("name", sorted(COMPILERS) or ["none"])
def test_launch_heuristic(name, tmp_path):
    if name == "none":
        pytest.skip("no C++ compiler found")
    exe = tmp_path / "gemv_config_check"
    cmd = [
        *COMPILERS[name],
        "-std=c++17",
        "-O2",
        "-Wall",
        "-I",
        str(ROOT / "ffi" / "include"),
        str(ROOT / "tests" / "cpp" / "gemv_config_check.cc"),
        "-o",
        str(exe),
    ]
    built = subprocess.run(cmd, capture_output=True, text=True)
    assert built.returncode == 0, f"{' '.join(cmd)}:\n{built.stderr[-3000:]}"
    out = subprocess.run([str(exe)], capture_output=True, text=True)
    assert out.returncode == 0 and out.stdout.strip() == "0", (
        f"{name}: {out.stdout}{out.stderr[-3000:]}"
    )
