"""benchmarks/targets.py on synthetic bench JSON (no GPU)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from tests.repo_scripts import load_repo_script

PREFILL = [(11008, 4096), (4096, 11008), (17408, 5120), (28672, 8192)]
DECODE = PREFILL + [(5120, 17408)]
PREFILL_MS = [16, 32, 64, 128, 256, 512, 1024, 4096]


@pytest.fixture(scope="module")
def targets():
    return load_repo_script("benchmarks/targets.py")


def _row(rng, n, k, m):
    floor = rng.uniform(3, 70)
    us = floor * rng.uniform(1.0, 2.0)
    bf16 = us * rng.uniform(0.6, 4.0)
    return {"n": n, "k": k, "m": m, "path": rng.choice(["gemv", "fused", "dequant"]), "us": us,
            "floor_us": floor, "fraction_of_read_bw": floor / us, "tbps": rng.uniform(1, 4),
            "bf16_us": bf16, "speedup_vs_bf16": bf16 / us}


def _results(rng, drop=()):
    keys = ([(n, k, m) for n, k in DECODE for m in (1, 2, 4, 8)]
            + [(4096, 4096, m) for m in (1, 2, 4, 8)] + [(248320, 2048, 4)]
            + [(n, k, m) for n, k in PREFILL for m in PREFILL_MS])
    rows = [_row(rng, *key) for key in dict.fromkeys(keys) if key not in drop]
    step = {"step_us": 1500.0, "speedup_vs_bf16": 2.1, "floor_us": 750.0}
    return {"rows": rows, "decode_step": step}


def test_every_target_judged_from_its_row(targets):
    rng = np.random.default_rng()
    results = _results(rng)
    rows = {(r["n"], r["k"], r["m"]): r for r in results["rows"]}
    found = targets.checks(results)
    by_target = {}
    for c in found:
        by_target.setdefault((c.issue, c.target), []).append(c)

    read = by_target[(4, "% of read BW")]
    assert len(read) == 5 * 4
    for c, (n, k, m) in zip(read, [(n, k, m) for n, k in DECODE for m in (1, 2, 4, 8)]):
        assert c.row == f"{n}x{k}, M = {m}"
        assert c.met == (rows[(n, k, m)]["floor_us"] / rows[(n, k, m)]["us"] >= 0.85)

    for c, (n, k) in zip(by_target[(4, "M = 8 against M = 1")], DECODE):
        assert c.met == (rows[(n, k, 8)]["us"] <= 1.10 * rows[(n, k, 1)]["us"])

    (lm,) = by_target[(4, "lm_head")]
    assert lm.met == (rows[(248320, 2048, 4)]["us"] <= 80.0)

    small = by_target[(4, "small weights near the floor")]
    assert [c.met for c in small] == [rows[(4096, 4096, m)]["us"] <= 1.5 * rows[(4096, 4096, m)]["floor_us"]
                                      for m in (1, 2, 4, 8)]

    (m1,) = by_target[(4, "x bf16 at M = 1")]
    assert m1.met == (rows[(11008, 4096, 1)]["bf16_us"] >= 5 * rows[(11008, 4096, 1)]["us"])
    assert by_target[(4, "decode step reported")][0].met

    goals = {"x bf16 at M = 16-64": (16, 64, 2.5), "x bf16 at M = 128": (128, 128, 1.5),
             "x bf16 at M = 256": (256, 256, 1.1), "x bf16 at M = 512-4096": (512, 4096, 0.95)}
    prefill = [c for c in found if c.issue == 7]
    assert len(prefill) == len(PREFILL) * len(PREFILL_MS)
    for c in prefill:
        first, last, goal = goals[c.target]
        shape, m = c.row.split(", M = ")
        n, k = map(int, shape.split("x"))
        assert first <= int(m) <= last
        r = rows[(n, k, int(m))]
        assert c.met == (r["bf16_us"] / r["us"] >= goal)


def test_missing_rows_are_not_measured_and_not_met(targets):
    rng = np.random.default_rng()
    drop = {(11008, 4096, 8), (248320, 2048, 4), (17408, 5120, 128)}
    results = _results(rng, drop=drop)
    del results["decode_step"]
    found = targets.checks(results)
    missing = {(c.target, c.row) for c in found if c.value == "not measured"}
    assert missing == {("% of read BW", "11008x4096, M = 8"),
                       ("M = 8 against M = 1", "11008x4096, M = 8 / M = 1"),
                       ("lm_head", "248320x2048, M = 4"),
                       ("decode step reported", "113 matmuls, M = 1"),
                       ("x bf16 at M = 128", "17408x5120")}
    assert not any(c.met for c in found if c.value == "not measured")


def test_speedup_bound_takes_the_larger_floor(targets):
    # Memory-bound: 10 us of reading beats 2*16*4096*4096 FLOPs at 989 TFLOP/s (0.54 us).
    r = {"m": 16, "n": 4096, "k": 4096, "floor_us": 10.0, "bf16_us": 30.0}
    assert targets.speedup_bound(r) == pytest.approx(3.0)
    # Compute-bound: 2*4096*11008*4096 FLOPs take 373.5 us at the peak, more than the 44 us floor.
    r = {"m": 4096, "n": 11008, "k": 4096, "floor_us": 44.0, "bf16_us": 517.0}
    compute_us = 2 * 4096 * 11008 * 4096 / 989e6
    assert targets.speedup_bound(r) == pytest.approx(517.0 / compute_us)


def test_main_prints_the_table_and_summary(targets, tmp_path, capsys):
    rng = np.random.default_rng()
    results = _results(rng)
    path = tmp_path / "h200.json"
    path.write_text(json.dumps(results))
    assert targets.main([str(path)]) == 0
    out = capsys.readouterr().out
    found = targets.checks(results)
    table = [line for line in out.splitlines() if line.startswith("| ")]
    assert len(table) == len(found) + 1  # the header, then a row per check
    met4 = sum(c.met for c in found if c.issue == 4)
    met7 = sum(c.met for c in found if c.issue == 7)
    assert out.strip().endswith(f"issue 4: {met4} of 32 met; issue 7: {met7} of 32 met")
    assert "cut short" not in out
    results["complete"] = False  # a bench run cut short by a time limit: said first
    path.write_text(json.dumps(results))
    assert targets.main([str(path)]) == 0
    assert capsys.readouterr().out.startswith(f"note: {path} is a run cut short")


def test_dispatch_rows_from_a_dispatch_check_run(targets, tmp_path, capsys):
    rng = np.random.default_rng()
    rows = []
    for m in (9, 16, 64, 2048):
        ratio = float(rng.uniform(1.0, 1.2))
        rows.append({"n": 11008, "k": 4096, "m": m, "auto": "fused", "fastest": "gemv",
                     "auto_over_fastest": ratio, "within": ratio <= 1.05})
    results = _results(rng)
    bench_path, dispatch_path = tmp_path / "h200.json", tmp_path / "dispatch.json"
    bench_path.write_text(json.dumps(results))
    dispatch_path.write_text(json.dumps({"tolerance": 1.05, "rows": rows}))
    found = targets.dispatch_checks(json.loads(dispatch_path.read_text()))
    assert [(c.issue, c.row, c.met) for c in found] == [
        (7, f"11008x4096, M = {r['m']}", r["within"]) for r in rows]
    assert targets.main([str(bench_path), "--dispatch", str(dispatch_path)]) == 0
    out = capsys.readouterr().out
    assert out.count("| auto within 5% of the fastest |") == len(rows)
    met7 = sum(c.met for c in targets.checks(results) if c.issue == 7) + sum(r["within"] for r in rows)
    assert out.strip().splitlines()[-1].endswith(f"issue 7: {met7} of {32 + len(rows)} met")
