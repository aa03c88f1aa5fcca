"""The MoE benchmark (benchmarks/moe.py) end to end on tiny shapes, and its parts: routing, byte
counts, the reading of XLA's compiled ragged_dot. Not a timed test."""

from __future__ import annotations

import json
import math

import jax
import jax.numpy as jnp
import moe
import numpy as np
import pytest

import jax_fp4
from tests._helpers import load_repo_package


def _positive_finite(x) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x) and x > 0


@pytest.mark.parametrize("kind", moe.ROUTINGS)
def test_routing_gives_distinct_experts_and_group_sizes(kind):
    rng = np.random.default_rng()
    experts, top_k, tokens = (
        int(rng.integers(8, 40)),
        int(rng.integers(1, 8)),
        int(rng.integers(1, 50)),
    )
    choice = moe.route(rng, kind, tokens, experts, top_k, 1.2)
    assert choice.shape == (tokens, top_k)
    assert all(len(set(row)) == top_k for row in choice.tolist())
    assert choice.min() >= 0 and choice.max() < experts
    sizes = moe.group_sizes(choice, experts)
    assert sizes.dtype == np.int32 and sizes.shape == (experts,) and sizes.sum() == tokens * top_k
    for e in range(experts):
        assert sizes[e] == np.count_nonzero(choice == e)
    with pytest.raises(ValueError, match="top_k must be in 1..4"):
        moe.route(rng, kind, 2, 4, 5, 1.2)


def test_zipf_routing_is_skewed_and_the_expected_active_count():
    rng = np.random.default_rng()
    # 32 tokens x top-8 of 128 experts: uniform visits ~112 experts (103-118 in 100 draws), at
    # most ~6 tokens each (5-9); Zipf 1.2 ~72 (62-82), its favourite ~30 tokens (27-32).
    sizes = {k: moe.group_sizes(moe.route(rng, k, 32, 128, 8, 1.2), 128) for k in moe.ROUTINGS}
    assert sizes["zipf"].max() > 2 * sizes["uniform"].max()
    assert np.count_nonzero(sizes["zipf"]) < np.count_nonzero(sizes["uniform"])
    # The example's expected active experts (the MoE model's byte floor in benchmarks/decode.py)
    # against uniform routing's draws (8 x top-8 of 128).
    llm = load_repo_package("examples/llm")
    cfg = llm.Config.from_json(llm.PRESETS["qwen3-30b-a3b"])
    active = [
        np.count_nonzero(moe.group_sizes(moe.route(rng, "uniform", 8, 128, 8, 1.2), 128))
        for _ in range(200)
    ]
    assert abs(np.mean(active) - llm.expected_active_experts(cfg, 8)) < 1.5


# The entry computation of jax.lax.ragged_dot(bf16 [32768, 2048], bf16 [128, 2048, 1536], sizes)
# as XLA compiled it for an H100 (jax 0.11.2), long attributes cut: every row copied once per
# expert with the other experts' rows zeroed ([M, G, K]), then one cuBLASLt GEMM over G*K.
H100_RAGGED_DOT = """\
ENTRY %main.1 (lhs.1: bf16[32768,2048], rhs.1: bf16[128,2048,1536], group_sizes.1: s32[128]) -> bf16[32768,1536] {
  %lhs.1 = bf16[32768,2048]{1,0} parameter(0), metadata={op_name="lhs"}
  %rhs.1 = bf16[128,2048,1536]{2,1,0} parameter(1), metadata={op_name="rhs"}
  %group_sizes.1 = s32[128]{0} parameter(2), metadata={op_name="group_sizes"}
  %bitcast.8.0 = bf16[262144,1536]{1,0} bitcast(%rhs.1), metadata={op_name="jit(ragged_dot)/ragged_dot_general"}
  %loop_add_fusion = s32[8,16]{1,0} fusion(%group_sizes.1), kind=kLoop, calls=%fused_add
  %input_concatenate_fusion = s32[128]{0} fusion(%loop_add_fusion), kind=kInput, calls=%fused_concatenate
  %loop_transpose_fusion = bf16[32768,128,2048]{2,1,0} fusion(%lhs.1, %loop_add_fusion, %input_concatenate_fusion), kind=kCustom, calls=%fused_transpose
  %bitcast.9.0 = bf16[32768,262144]{1,0} bitcast(%loop_transpose_fusion)
  %custom-call.1 = (bf16[32768,1536]{1,0}, s8[33554432]{0}) custom-call(%bitcast.9.0, %bitcast.8.0), custom_call_target="__cublas$lt$matmul", backend_config={"gemm_backend_config":{"alpha_real":1,"dot_dimension_numbers":{"lhs_contracting_dimensions":["1"],"rhs_contracting_dimensions":["0"],"lhs_batch_dimensions":[],"rhs_batch_dimensions":[]}}}
  ROOT %get-tuple-element = bf16[32768,1536]{1,0} get-tuple-element(%custom-call.1), index=0
}
"""


def test_hlo_summary_of_xla_ragged_dot_here_and_on_an_h100():
    m, g, k, n = 24, 4, 32, 16
    summary = moe.hlo_summary(moe.ragged_dot_hlo(m, g, k, n), m, g, k, n)
    # XLA's CPU program: one dense dot contracting over all G experts' K (G x the ragged FLOPs).
    assert summary["dense_over_all_experts"] and summary["largest_dot_work"] == pytest.approx(g)
    assert "a dense dot over all 4 experts" in moe.format_hlo_summary(summary)
    summary = moe.hlo_summary(H100_RAGGED_DOT, 32768, 128, 2048, 1536)
    assert summary["custom_calls"] == {"__cublas$lt$matmul": 1} and summary["fusions"] == 3
    assert summary["largest_dot"] == {
        "op": "custom-call",
        "lhs": [32768, 262144],
        "out": [32768, 1536],
        "flops": 2 * 32768 * 262144 * 1536,
    }
    assert summary["largest_dot_work"] == 128 and summary["dense_over_all_experts"]
    assert summary["largest_buffer"] == {
        "type": "bf16[32768,128,2048]",
        "bytes": 32768 * 128 * 2048 * 2,
    }
    assert moe.format_hlo_summary(summary).endswith(
        "128.0x the ragged product's FLOPs: a dense dot over all 128 experts; largest array made: "
        "bf16[32768,128,2048] (17.2 GB)"
    )
    # A GEMM of one expert's size is no dense dot over all of them.
    one = H100_RAGGED_DOT.replace(
        "bf16[32768,262144]{1,0} bitcast", "bf16[32768,2048]{1,0} bitcast"
    )
    summary = moe.hlo_summary(one, 32768, 128, 2048, 1536)
    assert summary["largest_dot_work"] == 1 and not summary["dense_over_all_experts"]


def test_quick_run_of_the_grouped_parts_writes_json_and_tables(tmp_path, capsys):
    out = tmp_path / "moe.json"
    hlo = tmp_path / "ragged_dot.txt"
    rc = moe.main(
        [
            "--quick",
            "--parts",
            "gemv,prefill",
            "--seed",
            "3",
            "--repeats",
            "1",
            "--warmup",
            "0",
            "--json",
            str(out),
            "--dump-hlo",
            str(hlo),
        ]
    )
    assert rc == 0
    results = json.loads(out.read_text())
    assert results["complete"] and results["device"].startswith("cpu")
    rows = results["rows"]
    plan = moe.QUICK_PLAN
    # Every shape in the gemv part; the plain ones (no activation) in the prefill part too.
    want = len(plan.routings) * sum(
        len(plan.gemv_tokens) + (s.activation is None) for s in plan.shapes
    )
    assert len(rows) == want
    for r in rows:
        assert r["m"] == r["tokens"] * r["top_k"] and 1 <= r["active_experts"] <= r["experts"]
        for field in (
            "us",
            "tbps",
            "read_bw_tbps",
            "fraction_of_read_bw",
            "floor_us",
            "bf16_floor_us",
        ):
            assert _positive_finite(r[field]), (field, r)
        assert (r["ragged_dot_us"] is None) == (r["part"] == "gemv")  # (a) with prefill
        shape = next(s for s in plan.shapes if s.name == r["shape"])
        io = r["m"] * (shape.k + shape.n_out) * 2
        assert (
            r["bytes"]
            == r["active_experts"] * (shape.n * shape.k // 2 + shape.n * shape.k // 16 + 4) + io
        )
        assert r["bf16_bytes"] == r["active_experts"] * shape.n * shape.k * 2 + io
        assert r["path"] == "cpu" and r["layout"] == (
            "tiled" if r["shape"].startswith("gate_up") else "spec"
        )
    assert {r["part"] for r in rows} == {"gemv", "prefill"}
    assert [s["dense_over_all_experts"] for s in results["ragged_dot_hlo"]] == [True, True]  # CPU
    assert (tmp_path / "ragged_dot_gate_up.txt").read_text().startswith("HloModule")
    printed = capsys.readouterr().out
    assert "| gate_up [8, 64, 128] | 2 x top-2 | uniform |" in printed
    assert "a dense dot over all 8 experts" in printed
    assert moe.main(["--markdown-from", str(out)]) == 0
    assert capsys.readouterr().out.strip() == printed.split("\n", 1)[1].strip()


def test_router_logits_route_to_the_drawn_experts():
    rng = np.random.default_rng()
    for kind in moe.ROUTINGS:
        choice = moe.route(rng, kind, 9, 128, 8, 1.2)
        r = jax_fp4.route_top_k(jnp.asarray(moe.router_logits(choice, 128, rng)), 8)
        np.testing.assert_array_equal(np.asarray(r.experts), choice)
        np.testing.assert_array_equal(np.asarray(r.group_sizes), moe.group_sizes(choice, 128))


def test_block_stage_bytes_count_the_experts_touched_and_the_activations():
    shape = moe.QWEN3_BLOCK
    got = moe.block_stage_bytes(shape, tokens=1, top_k=8, active=8, itemsize=2)
    expert = (1536 * 2048 + 2048 * 768) * 9 // 16  # codes and block scales
    assert (
        got["gate_up"] + got["down"] == 8 * (expert + 2 * 4) + (2048 + 2 * 8 * 768 + 2 * 2048) * 2
    )
    assert got["routing"] == 128 * 4 + 8 * 16 + 128 * 4
    assert got["block"] == got["routing"] + got["gate_up"] + got["down"]


def test_quick_run_of_the_block_part(tmp_path, capsys):
    out = tmp_path / "moe.json"
    rc = moe.main(
        ["--quick", "--parts", "block", "--repeats", "1", "--warmup", "0"]
        + [
            "--json",
            str(out),
        ]
    )
    assert rc == 0
    results = json.loads(out.read_text())
    rows = results["rows"]
    plan = moe.QUICK_PLAN
    # Off the kernels' path (the CPU): the routing and the block, per (tokens, routing).
    assert len(rows) == 2 * len(plan.block_tokens) * len(plan.routings)
    for r in rows:
        assert r["part"] == "block" and r["stage"] in ("routing", "block")
        assert r["path"] == "composed" and r["tokens"] in plan.block_tokens
        assert 1 <= r["active_experts"] <= plan.block.experts
        for field in ("us", "tbps", "read_bw_tbps", "fraction_of_read_bw", "floor_us"):
            assert _positive_finite(r[field]), (field, r)
        want = moe.block_stage_bytes(plan.block, r["tokens"], r["top_k"], r["active_experts"], 2)
        assert r["bytes"] == want[r["stage"]]
    printed = capsys.readouterr().out
    assert "The fused block, jax_fp4.moe with its routing" in printed
    assert "| block | 3 x top-2 | uniform |" in printed


def test_block_paths_times_the_kernels_where_they_serve(monkeypatch):
    """The block row runs once per path jax_fp4.moe can take: here (a CPU) the composition only;
    where its kernels serve, both, so one run compares them."""
    x = jax.ShapeDtypeStruct((3, 256), jnp.bfloat16)
    w_gu = jax_fp4.quantize(jnp.ones((4, 256, 256), jnp.float32))
    w_d = jax_fp4.quantize(jnp.ones((4, 256, 128), jnp.float32))
    assert moe.block_paths(x, 2, w_gu, w_d) == ["composed"]
    asked = []

    def serves(*args, backend=None, **kwargs):
        asked.append(backend)
        return "kernels"

    monkeypatch.setattr(jax_fp4, "moe_dispatch_path", serves)
    assert moe.block_paths(x, 2, w_gu, w_d) == ["composed", "kernels"]
    assert asked == ["kernels"]
