"""The routing benchmark (benchmarks/routing.py) end to end on tiny chains: its rows, JSON and
Markdown. Not a timed test."""

from __future__ import annotations

import json
import math

import routing as routing_bench

from jax_fp4 import dispatch


def test_quick_run_writes_rows_json_and_markdown(tmp_path, capsys):
    path = tmp_path / "routing.json"
    assert (
        routing_bench.main(["--quick", "--experts", "16", "--top-k", "4", "--json", str(path)]) == 0
    )
    results = json.loads(path.read_text())
    assert results["device"].startswith("cpu:")
    assert [r["tokens"] for r in results["rows"]] == [1, 4]
    for row in results["rows"]:
        assert (row["experts"], row["k"], row["pairs"]) == (16, 4, row["tokens"] * 4)
        assert math.isfinite(row["xla_us"]) and row["xla_us"] > 0
        assert "kernel_us" not in row  # no CUDA kernel on the CPU
        assert row["auto"] == (
            "kernel" if row["pairs"] <= dispatch.ROUTING_KERNEL_MAX_PAIRS else "xla"
        )
    capsys.readouterr()
    assert routing_bench.main(["--markdown-from", str(path)]) == 0
    table = capsys.readouterr().out
    assert "| tokens | experts | k | kernel us | xla us | kernel / xla | auto |" in table
    assert table.count("\n| 1 | 16 | 4 | - |") == 1 and "| 4 | 16 | 4 | - |" in table


def test_a_chain_runs_its_calls_in_order():
    """Each call's logits carry the previous call's weights: the chain computes the routing of the
    unchanged logits, and its order's first entries add up over the calls."""
    import jax.numpy as jnp
    import numpy as np

    logits = jnp.asarray(np.random.default_rng().standard_normal((3, 8)), jnp.float32)
    out, total = routing_bench.chain("xla", 5, 2)(logits)
    np.testing.assert_array_equal(np.asarray(out), np.asarray(logits))
    r = routing_bench.routing._composed(logits, k=2, renormalize=True)
    assert int(total) == 5 * (int(r[2][0]) + int(r[4][0]))
