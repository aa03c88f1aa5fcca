"""Smoke test of the benchmark machinery (bench) on tiny shapes: not a timed test."""

from __future__ import annotations

import json
import math
import statistics

import bench
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_fp4
from jax_fp4 import ffi as _ffi

ROW_FIELDS = (
    "path",
    "m",
    "n",
    "k",
    "dtype",
    "us",
    "tbps",
    "tflops",
    "speedup_vs_bf16",
    "speedup_vs_naive",
    "bf16_us",
    "naive_us",
    "read_bw_tbps",
    "fraction_of_read_bw",
    "floor_us",
)


def _positive_finite(x) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x) and x > 0


def test_bench_quick_run_writes_json(tmp_path, capsys):
    out = tmp_path / "results.json"
    rc = bench.main(
        [
            "--quick",
            "--shapes",
            "96x128",
            "--m",
            "2",
            "--repeats",
            "1",
            "--warmup",
            "0",
            "--decode-step",
            "--seed",
            "1",
            "--json",
            str(out),
        ]
    )
    assert rc == 0
    results = json.loads(out.read_text())

    assert results["device"] and results["jax_version"] == jax.__version__
    assert results["cpu_kernel_builds"] == _ffi.cpu_kernel_builds()
    assert results["complete"] is True
    assert _positive_finite(results["read_bw_tbps"])
    (row,) = results["rows"]
    for field in ROW_FIELDS:
        assert field in row, field
    assert (row["m"], row["n"], row["k"], row["dtype"]) == (2, 96, 128, "bf16")
    assert row["path"] == jax_fp4.dispatch_path(
        jax.ShapeDtypeStruct((2, 128), jnp.bfloat16), jax_fp4.quantize(jnp.ones((96, 128)))
    )
    for field in ROW_FIELDS[5:]:
        assert _positive_finite(row[field]), (field, row[field])
    assert row["bytes"] == 96 * 64 + 96 * 8 + 4 + 2 * (2 * 128 + 2 * 96)
    assert row["us_iqr"] == 0.0  # one timed pair: no spread to report
    assert row["layers"][0] < row["layers"][1]

    decode = results["decode_step"]
    assert decode["matmuls"] == 4 * decode["layers"] + 1
    for field in ("e2e_us", "step_us", "floor_us", "bf16_step_us", "naive_step_us"):
        assert _positive_finite(decode[field]), (field, decode[field])

    table = capsys.readouterr().out
    assert "96x128" in table and "decode step" in table


def test_a_run_cut_short_keeps_its_finished_shapes(tmp_path, monkeypatch):
    """The JSON is written after every shape: a device call's time limit does not lose the sweep."""

    def cut(self, model):
        raise KeyboardInterrupt

    monkeypatch.setattr(bench.Bench, "decode_step", cut)
    out = tmp_path / "results.json"
    with pytest.raises(KeyboardInterrupt):
        bench.main(
            [
                "--quick",
                "--shapes",
                "96x128,64x256",
                "--m",
                "2",
                "--repeats",
                "1",
                "--warmup",
                "0",
                "--decode-step",
                "--seed",
                "3",
                "--json",
                str(out),
            ]
        )
    results = json.loads(out.read_text())
    assert results["complete"] is False and results["decode_step"] is None
    assert [(r["n"], r["k"], r["m"]) for r in results["rows"]] == [(96, 128, 2), (64, 256, 2)]
    assert all(_positive_finite(r["us"]) for r in results["rows"])
    assert [f.name for f in tmp_path.iterdir()] == ["results.json"]  # written through a rename


def test_passes_keep_the_median_pass_and_report_each(tmp_path):
    out = tmp_path / "results.json"
    rc = bench.main(
        [
            "--quick",
            "--shapes",
            "96x128",
            "--m",
            "2",
            "--repeats",
            "1",
            "--warmup",
            "0",
            "--passes",
            "3",
            "--seed",
            "2",
            "--json",
            str(out),
        ]
    )
    assert rc == 0
    results = json.loads(out.read_text())
    (row,) = results["rows"]
    assert results["passes"] == 3
    assert len(row["us_passes"]) == 3 and all(_positive_finite(us) for us in row["us_passes"])
    assert row["us"] == sorted(row["us_passes"])[1]
    with pytest.raises(SystemExit, match="--passes must be >= 1, got 0"):
        bench.main(["--quick", "--passes", "0"])


def test_median_pass():
    timings = [
        bench.ChainTiming(us, 1, 2, 1.0, 2.0, noisy=us == 5.0) for us in (3.0, 1.0, 5.0, 2.0)
    ]
    chosen = bench.median_pass(timings)
    assert chosen.us == 2.0 and chosen.noisy  # the lower middle of four; one pass was noisy
    assert bench.median_pass(timings[:1]) == timings[0]
    assert bench.median_pass(timings[:3]).us == 3.0 and not bench.median_pass(timings[:2]).noisy


def test_pair_estimates_iqr():
    # Pairs (t1, t2) in seconds over 10 layers: per-layer estimates 1, 2, ..., 9 us.
    t1 = [0.001] * 9
    t2 = [0.001 + 10e-6 * i for i in range(1, 10)]
    q = statistics.quantiles([float(i) for i in range(1, 10)], n=4)
    assert bench.pair_estimates_iqr(t1, t2, 10) == pytest.approx(q[2] - q[0])
    assert bench.pair_estimates_iqr(t1[:1], t2[:1], 10) == 0.0
    assert bench.pair_estimates_iqr([0.001] * 4, [0.002] * 4, 10) == pytest.approx(0.0)


def test_chain_lengths_exceed_cache_and_respect_dense_cap():
    budget = bench.Budget(cache_bytes=60 * bench.MB, dense_cap_bytes=4 * bench.GB)
    for n, k in [(4096, 4096), (11008, 4096), (17408, 5120), (248320, 2048)]:
        layer = bench.nvfp4_weight_bytes(n, k)
        l1, l2 = bench.chain_lengths(layer, n * k * 2, budget)
        assert 1 <= l1 < l2
        assert l2 * n * k * 2 <= budget.dense_cap_bytes
        assert (l2 - l1) * layer > budget.cache_bytes
        assert l1 == 1 or l1 * layer >= 2 * budget.cache_bytes


def test_naive_dequantize_matches_dequantize():
    w = jax_fp4.quantize(jax.random.normal(jax.random.key(3), (32, 64)))
    naive = np.asarray(bench.naive_dequantize(w, jnp.float32))
    np.testing.assert_allclose(naive, np.asarray(jax_fp4.dequantize(w, jnp.float32)), rtol=1e-6)


@pytest.mark.parametrize("text", ["4096", "4096x", "0x128", "64x33"])
def test_parse_shape_rejects_bad_shapes(text):
    with pytest.raises(Exception):
        bench.parse_shape(text)


def _result_row(m: int, n: int, us: float, noisy: bool = False, us_passes=()) -> dict:
    return {
        "path": "gemv" if m <= 8 else "fused",
        "m": m,
        "n": n,
        "k": 256,
        "dtype": "bf16",
        "us": us,
        "tbps": 1.234,
        "tflops": 56.7,
        "speedup_vs_bf16": 1.5,
        "speedup_vs_naive": 4.25,
        "bf16_us": 2 * us,
        "naive_us": 4 * us,
        "read_bw_tbps": 3.0,
        "fraction_of_read_bw": 0.411,
        "floor_us": 0.75,
        "noisy": noisy,
        "us_passes": list(us_passes),
    }


def test_row_marks_noisy_and_unsteady_rows():
    assert bench.row_mark(False, ()) == "" and bench.row_mark(False, (5.0,)) == ""
    assert bench.row_mark(False, (5.0, 5.5)) == ""  # 10% apart: steady
    assert bench.row_mark(False, (5.6, 5.0)) == "~"  # 12%, in either order
    assert bench.row_mark(True, (5.6, 5.0)) == "?"  # noisy says more


def test_markdown_tables_split_decode_and_prefill_rows(tmp_path, capsys):
    results = {
        "rows": [
            _result_row(1, 96, 3.21),
            _result_row(64, 96, 12.34, noisy=True),
            _result_row(8, 128, 5.0, us_passes=(5.0, 6.0)),
        ]
    }
    decode, prefill = bench.markdown_tables(results).split("\n\n")
    decode_lines, prefill_lines = decode.splitlines(), prefill.splitlines()
    assert decode_lines[0].startswith("| N x K | M | path | us | TB/s | % of read BW |")
    assert decode_lines[1].startswith("|---|---:|---|---:|")
    # M <= 8 rows in JSON order, with bandwidth; the M = 64 row only in the second table.
    assert decode_lines[2:] == [
        "| 96x256 | 1 | gemv | 3.2 | 1.23 | 41% | 0.8 | 6.4 | 12.8 | 1.50 | 4.25 |",
        "| 128x256 | 8 | gemv | 5.0~ | 1.23 | 41% | 0.8 | 10.0 | 20.0 | 1.50 | 4.25 |",
    ]
    assert "TFLOP/s" in prefill_lines[0] and "TB/s" not in prefill_lines[0]
    assert prefill_lines[2:] == ["| 96x256 | 64 | fused | 12.3? | 57 | 24.7 | 49.4 | 1.50 | 4.25 |"]

    path = tmp_path / "results.json"
    path.write_text(json.dumps(results))
    assert bench.main(["--markdown-from", str(path)]) == 0
    assert capsys.readouterr().out.strip() == bench.markdown_tables(results)


def test_bench_tiled_layout_rows(tmp_path):
    """--layout tiled times prepacked weights where the shape allows and says so per row."""
    out = tmp_path / "tiled.json"
    assert (
        bench.main(
            [
                "--quick",
                "--shapes",
                "96x128,40x128",
                "--m",
                "1",
                "--repeats",
                "1",
                "--warmup",
                "0",
                "--layout",
                "tiled",
                "--seed",
                "2",
                "--json",
                str(out),
            ]
        )
        == 0
    )
    results = json.loads(out.read_text())
    assert results["layout"] == "tiled"
    assert [r["layout"] for r in results["rows"]] == ["tiled", "spec"]  # 40 rows: no 16-row tiles
    for row in results["rows"]:
        assert _positive_finite(row["us"]) and _positive_finite(row["naive_us"])
