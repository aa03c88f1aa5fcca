"""The decode benchmark (benchmarks/decode.py) end to end on a tiny model and tiny shapes, its
dependent chains' values, and its tables: not a timed test."""

from __future__ import annotations

import json
import math

import bench
import decode
import jax
import jax.numpy as jnp
import numpy as np
import pytest

RUN_FIELDS = (
    "model",
    "layers",
    "batch",
    "context",
    "nvfp4_ms",
    "bf16_ms",
    "ratio",
    "gpu_busy_ms",
    "floor_ms",
)
GEMV_FIELDS = ("n", "k", "m", "us", "tbps", "fraction_of_read_bw")


def _positive(x) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x) and x > 0


def test_quick_run_writes_runs_and_gemv_rows(tmp_path, capsys):
    out = tmp_path / "decode.json"
    assert decode.main(["--quick", "--layers", "2", "--seed", "3", "--json", str(out)]) == 0
    results = json.loads(out.read_text())
    command = f"python benchmarks/decode.py --quick --layers 2 --seed 3 --json {out}"
    assert results["platform"] == "cpu"
    assert results["runs_setup"]["command"] == results["gemv_setup"]["command"] == command
    assert results["runs_setup"]["model"] == "quick" and results["gemv_setup"]["seed"] == 3
    assert results["runs_setup"]["config"]["layers"] == 2  # --layers over the config's 1
    assert results["runs_setup"]["attention"] == ["auto"]

    quick = decode.QUICK
    expected = [(b, quick["prompt_len"]) for b in quick["batches"]] + [(1, quick["long_prompt"])]
    runs = results["runs"]
    assert [(r["batch"], r["context"] - quick["new_tokens"]) for r in runs] == expected
    for r in runs:
        assert all(field in r for field in RUN_FIELDS), sorted(r)
        assert r["model"] == "quick" and r["layers"] == 2 and r["command"] == command
        assert r["attention"] == "xla"  # "auto" resolved: no cuDNN on a CPU
        assert _positive(r["nvfp4_ms"]) and _positive(r["bf16_ms"]) and _positive(r["floor_ms"])
        assert r["ratio"] == pytest.approx(r["bf16_ms"] / r["nvfp4_ms"])
        assert r["gpu_busy_ms"] is None  # no GPU in the trace
        assert r["non_matmul_ms"] is None and r["kernels_per_step"] is None

    rows = results["gemv"]
    assert [(r["n"], r["k"], r["m"]) for r in rows] == [
        (n, k, m) for n, k in quick["gemv_shapes"] for m in quick["gemv_m"]
    ]
    for r in rows:
        assert all(field in r for field in GEMV_FIELDS), sorted(r)
        assert _positive(r["us"]) and _positive(r["bf16_us"]) and _positive(r["glue_us"])
        nbytes = bench.nvfp4_weight_bytes(r["n"], r["k"]) + bench.io_bytes(
            r["m"], r["n"], r["k"], 2
        )
        assert r["bytes"] == nbytes
        assert r["tbps"] == pytest.approx(nbytes / (r["us"] * 1e-6) / 1e12)
        assert r["fraction_of_read_bw"] == pytest.approx(r["tbps"] / r["read_bw_tbps"])
        assert r["x_bf16"] == pytest.approx(r["bf16_us"] / r["us"])
        assert r["layout"] == "tiled" and r["path"] == "cpu" and r["command"] == command

    (pair,) = results["mlp"]  # the quick model's gate_up -> down pair, at its one M
    hidden, inter = decode.QUICK_MODEL["hidden_size"], decode.QUICK_MODEL["intermediate_size"]
    assert (pair["hidden"], pair["intermediate"], pair["m"]) == (hidden, inter, 1)
    weights = bench.nvfp4_weight_bytes(2 * inter, hidden) + bench.nvfp4_weight_bytes(hidden, inter)
    assert pair["bytes"] == weights + (3 * hidden + 2 * inter) * 2
    assert _positive(pair["us"]) and _positive(pair["bf16_us"]) and pair["path"] == "cpu"
    assert pair["tbps"] == pytest.approx(pair["bytes"] / (pair["us"] * 1e-6) / 1e12)
    assert pair["fraction_of_read_bw"] == pytest.approx(pair["tbps"] / pair["read_bw_tbps"])

    prefill = results["prefill"]
    assert [(r["batch"], r["prompt_len"]) for r in prefill] == [
        (b, n) for n in quick["prefill_lens"] for b in quick["prefill_batches"]
    ]
    assert results["prefill_setup"]["repeats"] == quick["prefill_repeats"]
    for r in prefill:
        assert r["model"] == "quick" and r["layers"] == 2 and r["command"] == command
        assert r["context"] == r["prompt_len"] + quick["new_tokens"]
        assert _positive(r["nvfp4_ms"]) and _positive(r["bf16_ms"]) and r["path"] == "cpu"
        assert r["nvfp4_min_ms"] <= r["nvfp4_ms"] and r["bf16_min_ms"] <= r["bf16_ms"]
        assert r["ratio"] == pytest.approx(r["bf16_ms"] / r["nvfp4_ms"])
        assert r["tokens_per_s"] == pytest.approx(
            r["batch"] * r["prompt_len"] / r["nvfp4_ms"] * 1e3
        )
        assert _positive(r["compile_s"]["nvfp4"]) and _positive(r["compile_s"]["bf16"])

    printed = capsys.readouterr().out
    assert "| model | layers | batch | prompt | NVFP4 ms | bf16 ms | x bf16 |" in printed
    assert "| model | layers | batch | context | attention | NVFP4 ms | bf16 ms |" in printed
    assert f"| {hidden}->{2 * inter}->{hidden} | 1 |" in printed
    assert "| N x K | M | us | TB/s | % of read BW |" in printed
    assert f"| {rows[0]['n']}x{rows[0]['k']} | 1 |" in printed


def test_moe_runs_give_each_row_its_own_prompt_and_count_the_active_experts(tmp_path, capsys):
    """A batch of distinct prompts activates more than one row's k experts a layer, and its
    floor reads what it activated; the expected count of random routing stays beside it."""
    out = tmp_path / "decode.json"
    argv = ["--quick", "--model", "qwen3-moe-tiny", "--batches", "1,4", "--no-long-prompt"]
    argv += ["--no-prefill", "--no-gemv", "--new-tokens", "5", "--json", str(out)]
    assert decode.main(argv) == 0
    one, four = json.loads(out.read_text())["runs"]
    assert one["active_experts"] == one["expected_active_experts"] == 2.0  # top 2 of 8
    assert 2.0 < four["active_experts"] <= 8.0
    assert four["expected_active_experts"] == pytest.approx(8 * (1 - (1 - 2 / 8) ** 4))
    assert four["nvfp4"]["active_experts"] == four["active_experts"]
    assert "| active experts | expected |" in capsys.readouterr().out
    llm = decode.load_example()
    prompts = llm.random_prompts(512, 4, 6)
    assert len({tuple(row) for row in prompts}) == 4  # each row its own
    np.testing.assert_array_equal(llm.random_prompts(512, 1, 6)[0], prompts[0])


def test_prefill_alone_at_chosen_lengths_and_batches(tmp_path):
    out = tmp_path / "decode.json"
    argv = ["--quick", "--no-runs", "--no-gemv", "--prefill-lens", "5,3", "--prefill-batches", "3"]
    assert decode.main(argv + ["--prefill-repeats", "1", "--json", str(out)]) == 0
    results = json.loads(out.read_text())
    assert results["runs"] == [] and results["gemv"] == [] and results["runs_setup"] is None
    assert [(r["batch"], r["prompt_len"]) for r in results["prefill"]] == [(3, 5), (3, 3)]
    assert results["prefill_setup"]["repeats"] == 1


def test_earlier_records_stay_unless_measured_again(tmp_path):
    path = tmp_path / "decode.json"
    current = {"device": "NVIDIA H200", "platform": "gpu"}
    assert decode.earlier_results(path, current) == {}  # no file yet
    earlier = dict(current, runs=[{"model": "m", "batch": 1, "context": 72, "nvfp4_ms": 2.0}])
    path.write_text(json.dumps(earlier))
    assert decode.earlier_results(path, current) == earlier
    other = {"device": "NVIDIA H100 80GB HBM3", "platform": "gpu"}
    assert decode.earlier_results(path, other) == {}

    runs = [
        {"model": "m", "batch": 1, "context": 72, "nvfp4_ms": 2.0},
        {"model": "m", "batch": 8, "context": 72, "nvfp4_ms": 3.0},
    ]
    new = [
        {"model": "m", "batch": 8, "context": 72, "nvfp4_ms": 2.5},
        {"model": "m", "batch": 1, "context": 2112, "nvfp4_ms": 4.0},
    ]
    assert decode.merged(runs, new, decode.RUN_KEY) == [runs[0], new[0], new[1]]
    shallower = [{"model": "m", "layers": 24, "batch": 1, "context": 72, "nvfp4_ms": 1.0}]
    assert decode.merged(runs, shallower, decode.RUN_KEY) == runs + shallower
    rows = [{"n": 8, "k": 8, "m": 1, "layout": "tiled", "us": 1.0}]
    spec = [{"n": 8, "k": 8, "m": 1, "layout": "spec", "us": 2.0}]
    assert decode.merged(rows, spec, decode.GEMV_KEY) == rows + spec


def test_help_documents_the_command_line(capsys):
    with pytest.raises(SystemExit) as exit_info:
        decode.main(["--help"])
    assert exit_info.value.code == 0
    text = capsys.readouterr().out
    assert "python benchmarks/decode.py" in text
    for flag in (
        "--batches",
        "--long-prompt",
        "--prefill-lens",
        "--prefill-batches",
        "--no-prefill",
        "--attention",
        "--gemv-m",
        "--gemv-shapes",
        "--json",
        "--quick",
    ):
        assert flag in text


def test_markdown_from_an_earlier_result(tmp_path, capsys):
    run = dict.fromkeys(RUN_FIELDS)
    run.update(model="llama3-8b", layers=32, batch=1, context=72, nvfp4_ms=1.5, bf16_ms=4.5)
    run.update(ratio=3.0)
    run.update(floor_ms=1.2, nvfp4_over_floor=1.25)  # gpu_busy_ms and loop_over_gpu_busy: none
    row = {"n": 4096, "k": 4096, "m": 1, "us": 5.0, "tbps": 1.7, "fraction_of_read_bw": 0.9}
    row.update(bf16_us=11.0, x_bf16=2.2, glue_us=0.0, noisy=True)
    path = tmp_path / "earlier.json"
    path.write_text(json.dumps({"runs": [run], "gemv": [row]}))
    assert decode.main(["--markdown-from", str(path)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert (
        "| llama3-8b | 32 | 1 | 72 | - | 1.50 | 4.50 | 3.00 | - | - | - | - | 1.20 | 1.25 | - | - |"
        in lines
    )
    # a record from before the floors and the M = 1 ratio: "-" in their columns
    assert "| 4096x4096 | 1 | 5.00? | 1.70 | 90% | 11.00 | 2.20 | - | - | 0.00 |" in lines


def test_floors_and_the_m1_ratio():
    """A row's time over the larger of its byte and compute floors, and over its weight's M = 1
    time in the same call (None where the call measured no M = 1)."""
    row = {"n": 64, "k": 32, "m": 8, "us": 6.0, "floor_us": 2.0}
    # 2 * 8 * 64 * 32 flops at 1 TFLOP/s: 0.032768 us, under the byte floor
    assert decode.with_floors(row, 2 * 8 * 64 * 32, 1.0)["over_floor"] == pytest.approx(3.0)
    slow = decode.with_floors(row, 2 * 8 * 64 * 32, 1e-5)  # 3276.8 us of compute
    assert slow["compute_floor_us"] == pytest.approx(3276.8)
    assert slow["over_floor"] == pytest.approx(6.0 / 3276.8)
    assert decode.with_floors(row, 1, None)["over_floor"] == pytest.approx(3.0)
    rows = [
        {"n": 64, "k": 32, "m": 1, "us": 4.0},
        {"n": 64, "k": 32, "m": 16, "us": 5.0},
        {"n": 32, "k": 64, "m": 16, "us": 7.0},
    ]
    assert [r["over_m1"] for r in decode.with_m1_ratio(rows)] == [1.0, 1.25, None]


def test_forced_variants_are_records_of_their_own():
    """Rows of a forced backend or tuning do not replace the default's (and vice versa)."""
    plain = [{"n": 8, "k": 8, "m": 16, "layout": "tiled", "backend": None, "tuning": None}]
    forced = [{**plain[0], "tuning": {"gemv_k_split": 4}}]
    assert decode.merged(plain, forced, decode.GEMV_KEY) == plain + forced
    again = [{**forced[0], "us": 1.0}]
    assert decode.merged(plain + forced, again, decode.GEMV_KEY) == plain + again


def test_gpu_tags_and_default_path():
    assert decode.gpu_tag("NVIDIA H200", "gpu") == "h200"
    assert decode.gpu_tag("NVIDIA H100 80GB HBM3", "gpu") == "h100"
    assert decode.gpu_tag("cpu", "cpu") == "cpu"
    path = decode.results_path("NVIDIA H200", "gpu")
    assert path.name == "decode_h200.json" and path.parent.name == "results"


def test_bad_arguments_are_refused():
    with pytest.raises(SystemExit):
        decode.main(["--batches", "0,8"])
    with pytest.raises(SystemExit):
        decode.main(["--gemv-shapes", "4096x"])
    with pytest.raises(SystemExit):
        decode.main(["--quick", "--new-tokens", "0"])
    with pytest.raises(SystemExit):
        decode.main(["--quick", "--layers", "0"])
    with pytest.raises(SystemExit):
        decode.main(["--quick", "--prefill-repeats", "0"])
    with pytest.raises(SystemExit):
        decode.main(["--prefill-lens", "512,0"])
    for attention in ("flash", "xla,xla", ""):
        with pytest.raises(SystemExit):
            decode.main(["--attention", attention])
    assert decode._attention_kinds("xla,cudnn") == ["xla", "cudnn"]
    assert decode._attention_kinds("auto") == ["auto"]


def test_fit_width_slices_or_repeats_columns():
    x = jnp.arange(6.0).reshape(2, 3)
    np.testing.assert_array_equal(bench.fit_width(x, 3), x)
    np.testing.assert_array_equal(bench.fit_width(x, 2), [[0, 1], [3, 4]])
    np.testing.assert_array_equal(
        bench.fit_width(x, 7), [[0, 1, 2, 0, 1, 2, 0], [3, 4, 5, 3, 4, 5, 3]]
    )


@pytest.mark.parametrize("n, k", [(6, 4), (4, 4), (3, 8)])
def test_dependent_chain_feeds_each_output_to_the_next(n, k):
    rng = np.random.default_rng()
    ws = [jnp.asarray(rng.standard_normal((n, k)), jnp.float32) for _ in range(3)]
    x = jnp.asarray(rng.standard_normal((2, k)), jnp.float32)
    expected = np.asarray(x, np.float64)
    for w in ws[:2]:
        y = expected @ np.asarray(w, np.float64).T
        expected = np.tile(y, (1, -(-k // n)))[:, :k]
    chain = jax.jit(bench.dependent_chain_of(bench.dense_layer)(2))
    np.testing.assert_allclose(np.asarray(chain(x, ws)), expected, rtol=1e-5, atol=1e-5)
    # The joints alone: the same arguments, x through [M, N] and back per layer.
    glue = jax.jit(bench.glue_chain(n)(2))
    z = np.tile(np.asarray(x), (1, -(-n // k)))[:, :n]
    np.testing.assert_array_equal(np.asarray(glue(x, ws)), bench.fit_width(jnp.asarray(z), k))


def test_gemv_row_subtracts_the_joint():
    def timing(us):
        return bench.ChainTiming(us, 2, 8, 0.0, 0.0)

    read = bench.ReadBandwidth(10**6, 1.0, 2.0, "sum", (2, 8), False)
    row = decode.gemv_row(256, 128, 4, 2, timing(12.0), timing(30.0), timing(2.0), read)
    assert row["us"] == 10.0 and row["bf16_us"] == 28.0 and row["x_bf16"] == 2.8
    assert row["chain_us"] == 12.0 and row["glue_us"] == 2.0
    nbytes = 256 * 64 + 256 * 8 + 4 + 4 * 128 * 2 + 4 * 256 * 2
    assert row["bytes"] == nbytes
    assert row["tbps"] == pytest.approx(nbytes / 10e-6 / 1e12)
    assert row["fraction_of_read_bw"] == pytest.approx(row["tbps"] / 2.0)
    # A joint slower than the whole chain time (CPU noise) is not subtracted.
    assert decode.gemv_row(256, 128, 4, 2, timing(1.0), timing(3.0), timing(2.0), read)["us"] == 1.0
