"""The CPU kernel's vector E2M1 decode against nvfp4.h's scalar definition, and its fp16
activation conversion against every half's value, compiled (-O3, as the package) and run with each
C++ compiler at hand: GCC (which builds the package) takes the `__builtin_shuffle` table lookup,
Clang the lane-by-lane one that no other test runs (tests/cpp/cpu_decode_check.cc)."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import jax
import pytest

from tests._helpers import COMPILERS, ROOT


@pytest.mark.parametrize("name", sorted(COMPILERS) or ["none"])
@pytest.mark.parametrize("arch", ["", "-mavx2 -mfma"])
def test_vector_decode_matches_the_scalar_definition(name, arch, tmp_path):
    if name == "none":
        pytest.skip("no C++ compiler found")
    if arch and os.uname().machine != "x86_64":
        pytest.skip("x86-64 only")
    exe = tmp_path / "cpu_decode_check"
    cmd = [
        *COMPILERS[name],
        "-std=c++17",
        "-O3",
        *arch.split(),
        "-I",
        str(ROOT / "ffi" / "include"),
        "-I",
        str(ROOT / "ffi"),
        "-isystem",
        jax.ffi.include_dir(),
        str(ROOT / "tests" / "cpp" / "cpu_decode_check.cc"),
        "-o",
        str(exe),
    ]
    built = subprocess.run(cmd, capture_output=True, text=True)
    assert built.returncode == 0, f"{' '.join(cmd)}:\n{built.stderr[-3000:]}"
    cpuinfo = Path("/proc/cpuinfo")
    if arch and not (cpuinfo.exists() and "avx2" in cpuinfo.read_text()):
        pytest.skip("built; this CPU cannot run AVX2 code")
    out = subprocess.run([str(exe)], capture_output=True, text=True)
    assert out.returncode == 0 and out.stdout.strip() == "0", (
        f"{name} {arch}: {out.stdout}{out.stderr}"
    )
