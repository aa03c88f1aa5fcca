"""benchmarks/xla_fusion_check.py: its reading of compiled HLO, and a CPU run of the script."""

from __future__ import annotations

import json

import pytest

from tests._helpers import load_repo_script

CUBLAS_MODULE = """HloModule jit_f
%dequantize (p0: u8[8,8]) -> bf16[8,16] {
  %p0 = u8[8,8]{1,0} parameter(0)
  ROOT %w = bf16[8,16]{1,0} convert(%p0)
}
ENTRY %main (a: bf16[4,16], packed: u8[8,8]) -> bf16[4,8] {
  %a = bf16[4,16]{1,0} parameter(0)
  %packed = u8[8,8]{1,0} parameter(1)
  %fusion = bf16[8,16]{1,0} fusion(%packed), kind=kLoop, calls=%dequantize
  ROOT %gemm = bf16[4,8]{1,0} custom-call(%a, %fusion), custom_call_target="__cublas$gemm"
}
"""

TRITON_MODULE = """HloModule jit_f
%triton_gemm (p0: bf16[4,16], p1: u8[8,8]) -> bf16[4,8] {
  %p1 = u8[8,8]{1,0} parameter(1)
  %w = bf16[8,16]{1,0} convert(%p1)
  ROOT %dot = bf16[4,8]{1,0} dot(%p0, %w), lhs_contracting_dims={1}, rhs_contracting_dims={1}
}
ENTRY %main (a: bf16[4,16], packed: u8[8,8]) -> bf16[4,8] {
  %a = bf16[4,16]{1,0} parameter(0)
  %packed = u8[8,8]{1,0} parameter(1)
  ROOT %gemm = bf16[4,8]{1,0} fusion(%a, %packed), kind=kCustom, calls=%triton_gemm, backend_config={"fusion_backend_config":{"kind":"__triton_gemm"}}
}
"""


@pytest.fixture(scope="module")
def xfc():
    return load_repo_script("benchmarks/xla_fusion_check.py")


def test_a_dequantize_fusion_feeding_cublas_is_materialized(xfc):
    assert xfc.summarize(CUBLAS_MODULE, 8, 16) == {"gemm": "cublas", "weight_materialized": True}
    assert len(xfc.entry_lines(CUBLAS_MODULE)) == 4


def test_a_weight_decoded_inside_the_triton_gemm_is_not(xfc):
    # The [8, 16] weight exists only inside the fused computation, not in the entry computation.
    assert xfc.summarize(TRITON_MODULE, 8, 16) == {"gemm": "triton", "weight_materialized": False}
    # [K, N] counts too (a transposed copy); other shapes do not.
    transposed = CUBLAS_MODULE.replace("%fusion = bf16[8,16]", "%fusion = bf16[16,8]")
    assert xfc.summarize(transposed, 8, 16)["weight_materialized"]
    assert not xfc.summarize(CUBLAS_MODULE, 8, 32)["weight_materialized"]


def test_cpu_run_writes_a_row_per_shape_and_m(xfc, tmp_path, capsys):
    out = tmp_path / "fusion.json"
    assert xfc.main(["--shapes", "64x128,48x256", "--m", "1,33", "--json", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [(r["n"], r["k"], r["m"]) for r in rows] == [
        (64, 128, 1),
        (64, 128, 33),
        (48, 256, 1),
        (48, 256, 33),
    ]
    assert all(r["gemm"] == "dot" and isinstance(r["weight_materialized"], bool) for r in rows)
    assert [r["layout"] for r in rows] == ["tiled"] * 4  # both shapes take the tiled layout
    assert capsys.readouterr().out.count("| 64x128 |") == 2
