"""`python -m jax_fp4 info` reports what this installation holds; `paths` what auto picks."""

import os
import platform
import subprocess
import sys

import pytest

from jax_fp4 import ffi as _ffi
from tests._helpers import cpu_flags, cpu_has_avx512


def test_info_lists_versions_and_registered_targets():
    out = subprocess.run(
        [sys.executable, "-m", "jax_fp4", "info"], check=True, capture_output=True, text=True
    ).stdout
    assert "jax_fp4 0.1.0" in out and "jaxlib" in out
    assert "cpu: jax_fp4_matmul_cpu" in out
    # _ffi.FFI_TARGETS (what export_disabled_checks waives) is what the built modules register.
    assert _ffi.REGISTERED_TARGETS["cpu"] == list(_ffi.FFI_TARGETS["cpu"])
    if _ffi.has_cuda_kernels():
        assert sorted(_ffi.REGISTERED_TARGETS["CUDA"]) == sorted(_ffi.FFI_TARGETS["CUDA"])
        for target in _ffi.FFI_TARGETS["CUDA"]:
            assert f"CUDA: {target}" in out
        assert f"CUDA kernels compiled in: yes, {_ffi.cuda_architectures()}" in out
    else:
        assert "CUDA kernels compiled in: no" in out


def _cpu_kernel_line(**env) -> str:
    out = subprocess.run(
        [sys.executable, "-m", "jax_fp4", "info"],
        check=True,
        capture_output=True,
        text=True,
        env=dict(os.environ, **env),
    ).stdout
    return next(line for line in out.splitlines() if line.startswith("CPU kernel on this CPU: "))


def test_info_names_the_cpu_kernels_instruction_sets():
    # Chosen at run time from the CPU's features; JAX_FP4_CPU_AVX512=0 turns the AVX-512 GEMM off.
    default, narrow = _cpu_kernel_line(), _cpu_kernel_line(JAX_FP4_CPU_AVX512="0")
    assert "x86-64-v4" not in narrow
    if "x86-64-v4" in default:
        assert cpu_has_avx512()
        assert default.endswith("x86-64-v4 (AVX-512) GEMM, x86-64-v3 (AVX2, FMA) decode")
    if (
        platform.machine() == "x86_64"
        and sys.platform == "linux"
        and {"avx2", "fma"} <= cpu_flags()
    ):
        assert narrow.endswith(": x86-64-v3 (AVX2, FMA)")
    elif "x86-64-v4" not in default:
        assert default == narrow and "plain C++" in narrow


def test_paths_reports_auto_as_ranges_of_m(capsys, monkeypatch):
    from jax_fp4 import __main__ as cli
    from jax_fp4 import ffi as _ffi

    # A build for sm_90a alone (as on the H200 for speed) leaves an A100 to XLA.
    monkeypatch.setattr(_ffi, "cuda_architectures", lambda: "90a-real")
    assert cli.paths(4096, 4096, layout="spec", capability=(8, 0), max_m=100) == [(1, 100, "xla")]
    # Below: a default build's architectures, whatever this build has.
    monkeypatch.setattr(_ffi, "cuda_architectures", lambda: "")

    assert cli.paths(4096, 11008, layout="tiled", capability=(9, 0), max_m=4096) == [
        (1, 32, "gemv"),
        (33, 1024, "fused"),
        (1025, 4096, "dequant"),
    ]
    assert cli.paths(4096, 11008, layout="spec", capability=(9, 0), max_m=2000) == [
        (1, 16, "gemv"),
        (17, 1024, "fused"),
        (1025, 2000, "dequant"),
    ]
    assert cli.paths(1024, 8192, layout="tiled", capability=(9, 0), max_m=2000) == [
        (1, 64, "gemv"),
        (65, 1024, "fused"),
        (1025, 2000, "dequant"),
    ]
    assert cli.paths(14336, 4096, layout="spec", capability=(9, 0), max_m=3000) == [
        (1, 16, "gemv"),
        (17, 2048, "fused"),
        (2049, 3000, "dequant"),
    ]
    assert cli.paths(28672, 8192, layout="tiled", capability=(9, 0), max_m=3000) == [
        (1, 8, "gemv"),
        (9, 2048, "fused"),
        (2049, 3000, "dequant"),
    ]
    assert cli.paths(4096, 4096, layout="spec", capability=(8, 0), max_m=100) == [
        (1, 64, "gemv"),
        (65, 100, "dequant"),
    ]
    assert cli.paths(4096, 4096, layout="spec", capability=(12, 0), native=True, max_m=100) == [
        (1, 16, "gemv"),
        (17, 100, "native"),
    ]
    # A GPU older than every architecture compiled in (a T4): XLA alone.
    assert cli.paths(4096, 4096, layout="spec", capability=(7, 5), max_m=100) == [(1, 100, "xla")]
    assert (
        cli.main(
            ["paths", "4096x11008", "--layout", "tiled", "--capability", "9.0", "--max-m", "64"]
        )
        == 0
    )
    assert capsys.readouterr().out.splitlines() == [
        "auto for N x K = 4096x11008, tiled layout, bfloat16, compute capability 9.0 (given):",
        "  M = 1-32: gemv",
        "  M = 33-64: fused",
        "native is not taken: it needs a Blackwell SM120 GPU (compute capability 12.x), and this "
        "device has compute capability 9.0",
        "dequant is not taken: could serve it; auto prefers 'gemv' for these shapes on this "
        "platform (the rules and measured crossovers of jax_fp4/dispatch.py)",
    ]


def test_paths_says_why_a_path_is_never_taken(capsys, monkeypatch):
    """K = 11000 is no multiple of 32: dequant at every M, and the report says why not the GEMV
    or the fused GEMM."""
    from jax_fp4 import __main__ as cli
    from jax_fp4 import ffi as _ffi

    monkeypatch.setattr(_ffi, "cuda_architectures", lambda: "")
    assert cli.main(["paths", "4096x11000", "--capability", "9.0", "--max-m", "64"]) == 0
    assert capsys.readouterr().out.splitlines() == [
        "auto for N x K = 4096x11000, spec layout, bfloat16, compute capability 9.0 (given):",
        "  M = 1-64: dequant",
        "gemv is not taken: K must be a multiple of 32, got 11000",
        "fused is not taken: K must be a positive multiple of 128, got 11000",
        "native is not taken: it needs a Blackwell SM120 GPU (compute capability 12.x), and this "
        "device has compute capability 9.0",
    ]
    # Opted out of on an SM120 GPU; float32 activations on a GPU: the reference path.
    assert cli.never_taken(4096, 4096, layout="spec", capability=(12, 0))["native"] == (
        "opt-in: JAX_FP4_NATIVE_SM120=1 (or backend='native')"
    )
    assert cli.paths(4096, 4096, layout="spec", capability=(9, 0), dtype="float32", max_m=64) == [
        (1, 64, "reference")
    ]


@pytest.mark.parametrize(
    "has_kernels, plugin, gpus, expected",
    [
        (
            True,
            None,
            False,
            "JAX's CUDA support: none, jaxlib runs on the CPU only; the CUDA kernels (built with "
            "CUDA 13.0.88) cannot run: install JAX for the GPU with `pip install "
            "'jax_fp4[cuda]'` (jax[cuda13]; 'jax_fp4[cuda12]' for CUDA 12)",
        ),
        (False, None, False, "JAX's CUDA support: none, jaxlib runs on the CPU only"),
        (True, "jax-cuda13-plugin 0.10.2", True, "JAX's CUDA support: jax-cuda13-plugin 0.10.2"),
        (
            True,
            "jax-cuda13-plugin 0.10.2",
            False,
            "JAX's CUDA support: jax-cuda13-plugin 0.10.2; no CUDA device visible to JAX "
            "(driver, CUDA_VISIBLE_DEVICES?)",
        ),
        (
            False,
            "jax-cuda12-plugin 0.10.2",
            True,
            "JAX's CUDA support: jax-cuda12-plugin 0.10.2; this jax_fp4 has no CUDA kernels "
            "(built without nvcc): GPUs take the xla path; reinstall with nvcc on PATH "
            "(JAX_FP4_CUDA=ON makes its absence an error)",
        ),
    ],
)
def test_info_says_whether_jax_can_run_the_cuda_kernels(has_kernels, plugin, gpus, expected):
    from jax_fp4 import __main__ as cli

    version = "13.0.88" if has_kernels else ""
    assert cli.cuda_support(has_kernels, version, plugin, gpus) == expected


def test_info_reports_this_installs_cuda_support():
    from jax_fp4 import __main__ as cli

    out = subprocess.run(
        [sys.executable, "-m", "jax_fp4", "info"], check=True, capture_output=True, text=True
    ).stdout
    import jax

    line = cli.cuda_support(
        _ffi.has_cuda_kernels(),
        _ffi.cuda_version(),
        _ffi.jax_cuda_plugin(),
        any(d.platform == "gpu" for d in jax.devices()),
    )
    assert line in out.splitlines()
    assert (_ffi.jax_cuda_plugin() is None) == ("CUDA support: none" in line)


@pytest.mark.parametrize(
    "argv, message",
    [
        (["paths", "4096"], "a shape is NxK"),
        (["paths", "0x64", "--capability", "9.0"], "must be positive"),
        (["paths", "64x64", "--capability", "9"], "expected MAJOR.MINOR"),
    ],
)
def test_paths_rejects_bad_arguments(argv, message, capsys):
    from jax_fp4 import __main__ as cli

    with pytest.raises(SystemExit):
        cli.main(argv)
    assert message in capsys.readouterr().err


def test_paths_without_a_gpu_asks_for_the_capability():
    from jax_fp4 import __main__ as cli
    from jax_fp4 import native as _native

    if _native.device_capability() is not None:
        pytest.skip("this machine has a CUDA device: paths reads its capability")
    with pytest.raises(SystemExit, match="no CUDA device here; name the GPU with --capability"):
        cli.main(["paths", "4096x4096"])


def test_paths_reads_the_capability_override(monkeypatch, capsys):
    """JAX_FP4_CUDA_CAPABILITY names the GPU the lowering picks for; `paths` shows the same."""
    from jax_fp4 import __main__ as cli

    monkeypatch.setenv("JAX_FP4_CUDA_CAPABILITY", "9.0")
    assert cli.main(["paths", "4096x11008", "--max-m", "20"]) == 0
    assert capsys.readouterr().out.splitlines()[:3] == [
        "auto for N x K = 4096x11008, spec layout, bfloat16, compute capability 9.0 "
        "(JAX_FP4_CUDA_CAPABILITY):",
        "  M = 1-16: gemv",
        "  M = 17-20: fused",
    ]


def test_all_cuda_architectures_are_the_builds():
    """_ffi.ALL_CUDA_ARCHITECTURES (what `paths` assumes on a build without CUDA kernels) is
    CMakeLists.txt's list for JAX_FP4_CUDA_ARCHITECTURES=all."""
    import pathlib
    import re

    cmake = (pathlib.Path(__file__).resolve().parents[1] / "CMakeLists.txt").read_text()
    every = re.search(r'set\(JAX_FP4_ALL_CUDA_ARCHITECTURES "([^"]+)"', cmake)[1]
    assert _ffi.ALL_CUDA_ARCHITECTURES == every == "80-real;90a-real;120a-real;80-virtual"


def test_the_compiled_architectures_are_read_by_the_dispatch():
    """The compiled module's list (',' for CMake's ';') is one the dispatch can read: every entry
    parses, and a default build runs on an H200 and has nothing for a T4."""
    import re

    from jax_fp4 import dispatch as _dispatch

    if not _ffi.has_cuda_kernels():
        pytest.skip("a build without CUDA kernels")
    built = _ffi.cuda_architectures()
    for entry in built.split(","):
        assert re.fullmatch(r"\d+[af]?(-real|-virtual)?", entry), built
    assert not _dispatch.cuda_kernels_run_on(built, (7, 0))  # no entry reaches below 7.5
    if built == _ffi.ALL_CUDA_ARCHITECTURES.replace(";", ","):
        assert _dispatch.cuda_kernels_run_on(built, (9, 0))
        assert not _dispatch.cuda_kernels_run_on(built, (7, 5))


# ---- the ImportError of a package without its compiled module --------------------------------------


def _package(root, *, pyproject: bool, module: str | None = None):
    package = root / "jax_fp4"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text("")
    if pyproject:
        (root / "pyproject.toml").write_text("[project]\nname = 'jax_fp4'\n")
    if module is not None:
        (package / module).write_text("")
    return package


def test_a_source_tree_import_says_so_and_what_to_do(tmp_path):
    package = _package(tmp_path / "src", pyproject=True)
    message = str(_ffi.missing_cpu_module_error(package, [str(tmp_path / "src")]))
    assert "source tree" in message and str(package.resolve()) in message
    assert "run from another directory" in message and "pip install -e ." in message


def test_a_source_tree_import_names_the_installed_copy(tmp_path):
    package = _package(tmp_path / "src", pyproject=True)
    installed = _package(tmp_path / "site", pyproject=False, module="_jax_fp4_cpu.abi3.so")
    message = str(
        _ffi.missing_cpu_module_error(package, [str(tmp_path / "src"), str(tmp_path / "site")])
    )
    assert str(installed.resolve()) in message


def test_an_install_without_its_module_is_called_broken(tmp_path):
    package = _package(tmp_path / "site", pyproject=False)
    message = str(_ffi.missing_cpu_module_error(package, [str(tmp_path / "site")]))
    assert "install is broken" in message and "reinstall" in message


def test_a_module_that_fails_to_load_is_named(tmp_path):
    package = _package(tmp_path / "site", pyproject=False, module="_jax_fp4_cpu.abi3.so")
    message = str(_ffi.missing_cpu_module_error(package, []))
    assert "failed to load" in message and "reinstall" in message
