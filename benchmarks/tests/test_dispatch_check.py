"""benchmarks/dispatch_check.py: the verdict logic on synthetic times, and a CPU smoke run of the
whole measurement (the CUDA backends are timed on the H200 only)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from tests._helpers import load_repo_script


@pytest.fixture(scope="module")
def dc():
    return load_repo_script("benchmarks/dispatch_check.py")


def test_judge_finds_the_fastest_and_the_ratio(dc):
    rng = np.random.default_rng()
    for _ in range(200):
        names = ["gemv", "fused", "dequant"][: rng.integers(1, 4)]
        us = {b: float(rng.uniform(5, 500)) for b in names}
        auto = str(rng.choice(names))
        tolerance = float(rng.uniform(1.0, 1.2))
        fastest, ratio, within = dc.judge(us, auto, tolerance)
        best = min(us.values())
        assert us[fastest] == best
        assert ratio == pytest.approx(us[auto] / best)
        assert within == (us[auto] <= tolerance * best * (1 + 1e-12))


def test_judge_at_the_tolerance_edge(dc):
    assert dc.judge({"gemv": 10.0, "fused": 10.4}, "fused", 1.05) == (
        "gemv",
        pytest.approx(1.04),
        True,
    )
    assert dc.judge({"gemv": 10.0, "fused": 10.6}, "fused", 1.05)[2] is False
    assert dc.judge({"gemv": 10.0, "fused": 10.6}, "gemv", 1.05) == ("gemv", 1.0, True)


def test_markdown_marks_misses_and_missing_backends(dc):
    rows = [
        dc.Verdict(
            4096,
            4096,
            16,
            "tiled",
            {"gemv": 7.0, "fused": 9.0},
            {},
            ["fused"],
            "fused",
            "gemv",
            9.0 / 7.0,
            False,
        ),
        dc.Verdict(
            4096,
            4096,
            64,
            "tiled",
            {"fused": 15.0, "dequant": 30.0},
            {},
            [],
            "fused",
            "fused",
            1.0,
            True,
        ),
    ]
    text = dc.markdown(rows, ["gemv", "fused", "dequant"])
    lines = text.splitlines()
    assert lines[0] == (
        "| N x K | M | gemv us | fused us | dequant us | fastest | auto | auto / fastest | within |"
    )
    assert lines[2] == "| 4096x4096 | 16 | 7.0 | 9.0? | - | gemv | fused | 1.29 | **no** |"
    assert lines[3] == "| 4096x4096 | 64 | - | 15.0 | 30.0 | fused | fused | 1.00 | yes |"
    assert dc.summary(rows, 1.05) == "auto within 5% of the fastest backend on 1 of 2 rows"


def test_cpu_smoke_run(dc, tmp_path, capsys):
    out = tmp_path / "dispatch.json"
    assert (
        dc.main(
            [
                "--shapes",
                "128x256",
                "--m",
                "1,5",
                "--backends",
                "reference,gemv",
                "--layout",
                "tiled",
                "--passes",
                "1",
                "--repeats",
                "2",
                "--warmup",
                "1",
                "--min-time",
                "0",
                "--cache-mb",
                "0.03",
                "--json",
                str(out),
            ]
        )
        == 0
    )
    results = json.loads(out.read_text())
    assert [r["m"] for r in results["rows"]] == [1, 5]
    for r in results["rows"]:
        assert (r["n"], r["k"], r["layout"], r["auto"]) == (128, 256, "tiled", "cpu")
        assert set(r["us"]) == {"reference", "cpu"}  # gemv cannot run on CPU; auto's pick is timed
        assert all(us > 0 for us in r["us"].values())
        fastest, ratio, within = dc.judge(r["us"], r["auto"], 1.05)
        assert (r["fastest"], r["within"]) == (fastest, within)
        assert r["auto_over_fastest"] == pytest.approx(ratio)
    assert (
        capsys.readouterr()
        .out.strip()
        .endswith(f"on {sum(r['within'] for r in results['rows'])} of 2 rows")
    )


def test_a_run_cut_short_keeps_the_rows_it_measured(dc, tmp_path, monkeypatch):
    """The JSON is written after every row: a device call's time limit loses one row at most."""
    timings, time_chain = [], dc.bench.time_chain

    def cut_after_the_first_row(*args, **kwargs):
        if len(timings) == 2:  # M = 1 timed (reference and auto's cpu): cut M = 5 short
            raise KeyboardInterrupt
        timings.append(time_chain(*args, **kwargs))
        return timings[-1]

    monkeypatch.setattr(dc.bench, "time_chain", cut_after_the_first_row)
    out = tmp_path / "dispatch.json"
    with pytest.raises(KeyboardInterrupt):
        dc.main(
            [
                "--shapes",
                "128x256",
                "--m",
                "1,5",
                "--backends",
                "reference",
                "--passes",
                "1",
                "--repeats",
                "2",
                "--warmup",
                "1",
                "--min-time",
                "0",
                "--cache-mb",
                "0.03",
                "--json",
                str(out),
            ]
        )
    rows = json.loads(out.read_text())["rows"]
    assert [(r["m"], sorted(r["us"])) for r in rows] == [(1, ["cpu", "reference"])]
    assert [rows[0]["us"][b] for b in ("reference", "cpu")] == [t.us for t in timings]
    assert [f.name for f in tmp_path.iterdir()] == ["dispatch.json"]  # written through a rename


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--backends", "gemv,bogus"], "unknown"),
        (["--backends", "auto"], "unknown"),
        (["--tolerance", "0.9"], "tolerance"),
        (["--passes", "0"], "passes"),
    ],
)
def test_bad_arguments(dc, argv, message):
    with pytest.raises(SystemExit, match=message):
        dc.main(argv)


def _row(n, k, m, layout, us, auto):
    fastest = min(us, key=us.get)
    return {
        "n": n,
        "k": k,
        "m": m,
        "layout": layout,
        "us": us,
        "us_passes": {b: [t] for b, t in us.items()},
        "noisy": [],
        "auto": auto,
        "fastest": fastest,
        "auto_over_fastest": us[auto] / us[fastest],
        "within": us[auto] <= 1.05 * us[fastest],
    }


def test_rejudge_applies_the_current_rules(dc, tmp_path, capsys):
    # Recorded under an older rule (auto took fused at M = 24 on a narrow long-K prepacked weight);
    # the current rules take the GEMV there, and the fused GEMM on the spec layout.
    times = {"gemv": 20.0, "fused": 22.0, "dequant": 67.0}
    run = {
        "device": "gpu:NVIDIA H200",
        "command": "python benchmarks/dispatch_check.py",
        "dtype": "bf16",
        "layout": "tiled",
        "tolerance": 1.05,
        "passes": 2,
        "seed": 1,
        "rows": [
            _row(4096, 11008, 24, "tiled", times, "fused"),
            _row(4096, 11008, 24, "spec", times, "fused"),
            _row(4096, 11008, 4096, "tiled", {"fused": 700.0, "dequant": 520.0}, "dequant"),
        ],
    }
    second = {
        **run,
        "rows": [_row(28672, 8192, 2048, "tiled", {"fused": 1326.0, "dequant": 1445.0}, "dequant")],
    }
    src, src2, out = tmp_path / "run.json", tmp_path / "run2.json", tmp_path / "rejudged.json"
    src.write_text(json.dumps(run))
    src2.write_text(json.dumps(second))
    assert not run["rows"][0]["within"]
    assert dc.main(["--rejudge", str(src), str(src2), "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    # One table, by layout, then shape in the runs' order, then M.
    assert [(r["layout"], r["n"], r["m"], r["auto"], r["within"]) for r in result["rows"]] == [
        ("spec", 4096, 24, "fused", False),
        ("tiled", 4096, 24, "gemv", True),
        ("tiled", 4096, 4096, "dequant", True),
        ("tiled", 28672, 2048, "fused", True),
    ]
    assert result["rows"][0]["auto_over_fastest"] == pytest.approx(22.0 / 20.0)
    assert [r["seed"] for r in result["runs"]] == [1, 1] and result["tolerance"] == 1.05
    assert capsys.readouterr().out.strip().endswith("on 3 of 4 rows")


def test_rejudge_refuses_a_pick_the_run_did_not_time(dc, tmp_path):
    run = {
        "dtype": "bf16",
        "tolerance": 1.05,
        "rows": [_row(4096, 11008, 24, "tiled", {"fused": 22.0, "dequant": 67.0}, "fused")],
    }
    src = tmp_path / "run.json"
    src.write_text(json.dumps(run))
    with pytest.raises(ValueError, match="did not time"):
        dc.main(["--rejudge", str(src)])


# ---- benchmarks/tune_dispatch.py: a table entry from timings ------------------------------------


@pytest.fixture(scope="module")
def tune():
    return load_repo_script("benchmarks/tune_dispatch.py")


def _timings(tune, n, k, us_by_m):
    return [tune.Timing(n, k, m, us) for m, us in us_by_m.items()]


def test_tune_derives_each_bound_from_where_its_backend_leads(tune):
    from jax_fp4 import dispatch as _dispatch

    template = _dispatch.HOPPER_SPEC
    plain = (template.small_n + 2048, template.long_k // 2)  # past both small rules
    small = (template.small_n, template.long_k)  # the small-N rule's
    large = (template.wide_n, template.long_k)  # wide, long and large

    def curve(gemv_to, fused_to):
        # the GEMV fastest up to gemv_to, the fused GEMM to fused_to, dequant after
        return {
            m: {
                "gemv": 1.0 if m <= gemv_to else 3.0,
                "fused": 2.0 if m <= fused_to else 4.0,
                "dequant": 2.5 + (m <= fused_to),
            }
            for m in (1, 8, 12, 16, 24, 32, 64, 128, 1024, 2048, 4096)
        }

    timings = (
        _timings(tune, *plain, curve(16, 1024))
        + _timings(tune, *small, curve(64, 1024))
        + _timings(tune, *large, curve(12, 2048))
    )
    findings = []
    c = tune.derive(timings, template, 1.0, findings, "spec")
    assert (c.gemv_max_m, c.gemv_max_m_small, c.fused_max_m, c.fused_max_m_large) == (
        16,
        64,
        1024,
        2048,
    )
    assert c.fused_min_m_wide_long == 16  # the fused GEMM leads from M = 16 on the wide shape
    assert c.gemv_max_m_without_fused == 1024  # the GEMV against dequant alone, on every shape
    assert c.small_n == template.small_n and c.long_k == template.long_k  # thresholds kept
    assert any(f.startswith("spec.gemv_max_m_small_weight: no timing") for f in findings)
    literal = tune.entry_literal("Test GPU", _dispatch.Entry(spec=c, tiled=c))
    ns = {"Entry": _dispatch.Entry, "Crossovers": _dispatch.Crossovers}
    assert eval("{" + literal + "}", ns) == {"Test GPU": _dispatch.Entry(spec=c, tiled=c)}


def test_tune_cpu_smoke_run(tune, tmp_path, capsys):
    """On a CPU none of gemv / fused / dequant runs: the entry keeps this device's current one."""
    out = tmp_path / "tune.json"
    assert (
        tune.main(
            [
                "--quick",
                "--shapes",
                "128x256",
                "--m",
                "1,17",
                "--passes",
                "1",
                "--repeats",
                "2",
                "--warmup",
                "1",
                "--json",
                str(out),
                "--device-kind",
                "Test CPU",
            ]
        )
        == 0
    )
    text = capsys.readouterr().out
    assert "'Test CPU': Entry(" in text and "gemv_max_m=" in text
    result = json.loads(out.read_text())
    assert result["device_kind"] == "Test CPU" and set(result["timings"]) == {"spec", "tiled"}
    assert [t["m"] for t in result["timings"]["spec"]] == [1, 17]
