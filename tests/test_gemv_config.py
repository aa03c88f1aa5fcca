"""The CUDA decode GEMV's launch heuristic (ffi/include/jax_fp4/gemv_config.h): pure C++, checked on
any machine by tests/cpp/gemv_config_check.cc (compile-time picks, invariants over a grid of shapes
and SM counts, the H200's measured picks, monotonicity in the SM count, degenerate inputs), built
and run here with each C++ compiler at hand."""

from __future__ import annotations

import importlib.util
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _compilers():
    found = {}
    if shutil.which("g++"):
        found["g++"] = ["g++"]
    if shutil.which("clang++"):
        found["clang++"] = ["clang++"]
    elif importlib.util.find_spec("ziglang") is not None:  # Zig's bundled Clang
        found["clang++ (zig)"] = [sys.executable, "-m", "ziglang", "c++"]
    return found


COMPILERS = _compilers()


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
