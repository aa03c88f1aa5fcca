"""benchmarks/ab_compare.py on synthetic fused_timing.py JSON (no GPU)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from tests._helpers import load_repo_script

SHAPES = [(11008, 4096, 128), (4096, 11008, 256), (28672, 8192, 1024)]


@pytest.fixture(scope="module")
def ab():
    return load_repo_script("benchmarks/ab_compare.py")


def _write(path, fused_us, shapes=SHAPES):
    records = [
        {"n": n, "k": k, "m": m, "bf16_us": 1.0, "fused_us": float(t)}
        for (n, k, m), t in zip(shapes, fused_us)
    ]
    path.write_text(json.dumps({"records": records}))
    return str(path)


def test_verdicts_against_two_bases(ab, tmp_path, capsys):
    rng = np.random.default_rng()
    base1 = rng.uniform(30, 700, len(SHAPES))
    base2 = base1 * rng.uniform(1.05, 1.15, len(SHAPES))  # the second base drifted slower
    # Row 0 beats both bases, row 1 lies between them, row 2 loses to both.
    new = [base1[0] * 0.9, (base1[1] + base2[1]) / 2, base2[2] * 1.1]
    files = [
        _write(tmp_path / "fused_ab_1_base.json", base1),
        _write(tmp_path / "fused_ab_2_new.json", new),
        _write(tmp_path / "fused_ab_3_base.json", base2),
    ]
    assert ab.main(files) == 0
    out = capsys.readouterr().out
    table = out.splitlines()[2 : 2 + len(SHAPES)]  # below the header and separator lines
    rows = [[c.strip() for c in line.split("|")[1:-1]] for line in table]
    assert [cells[-1] for cells in rows] == ["faster", "within drift", "slower"]
    for cells, b1, b2, t in zip(rows, base1, base2, new):
        assert float(cells[2]) == pytest.approx(b1, abs=0.05)
        assert float(cells[3]) == pytest.approx(b2, abs=0.05)
        assert float(cells[4]) == pytest.approx(t, abs=0.05)
        assert float(cells[5].rstrip("%")) == pytest.approx(100 * (b2 / b1 - 1), abs=0.05)
        assert float(cells[6]) == pytest.approx((b1 + b2) / 2 / t, abs=5e-4)
    worst = 100 * max(base2 / base1 - 1)
    assert "1 faster, 1 slower, 1 within drift" in out
    assert f"base drift up to {worst:.1f}%" in out


def test_one_base_has_no_drift(ab, tmp_path, capsys):
    files = [
        _write(tmp_path / "a_base.json", [10, 20, 30]),
        _write(tmp_path / "b_new.json", [11, 19, 30]),
    ]
    assert ab.main(files) == 0
    out = capsys.readouterr().out
    assert "n/a" in out and "base drift unknown" in out
    assert "1 faster, 1 slower, 1 within drift" in out  # equal to the base: within


def test_sides_from_flag_and_bad_input(ab, tmp_path, capsys):
    a = _write(tmp_path / "run1.json", [10, 20, 30])
    b = _write(tmp_path / "run2.json", [5, 10, 15])
    assert ab.main([a, b, "--sides", "base,new"]) == 0
    assert "3 faster" in capsys.readouterr().out
    with pytest.raises(ValueError, match="cannot tell the side"):
        ab.side_of(a)
    with pytest.raises(SystemExit):
        ab.main([a, b, "--sides", "base"])
    assert "one of base/new per file" in capsys.readouterr().err
    # Two new sides, a shape missing from a side, a variant the JSON lacks: exit 2 with the reason.
    assert ab.main([a, b, "--sides", "new,new"]) == 2
    assert "exactly one new side" in capsys.readouterr().err
    short = _write(tmp_path / "short_new.json", [5, 10], SHAPES[:2])
    assert ab.main([a, short, "--sides", "base,new"]) == 2
    assert "missing" in capsys.readouterr().err
    assert ab.main([a, b, "--sides", "base,new", "--variant", "dequant"]) == 2
    assert "no 'dequant_us'" in capsys.readouterr().err


def test_bench_json_sides(ab, tmp_path, capsys):
    """`benchmarks/bench.py --json` files: jax_fp4's `us` per row."""
    rng = np.random.default_rng()
    times = rng.uniform(5, 500, (3, len(SHAPES)))
    paths = []
    for i, (side, us) in enumerate(zip(("base", "new", "base"), times)):
        rows = [
            {"n": n, "k": k, "m": m, "us": float(t), "bf16_us": 1.0}
            for (n, k, m), t in zip(SHAPES, us)
        ]
        path = tmp_path / f"pdl_ab_{i + 1}_{side}.json"
        path.write_text(json.dumps({"rows": rows, "decode_step": None}))
        paths.append(str(path))
    assert ab.load_side(paths[1], "ignored") == {
        s: pytest.approx(t) for s, t in zip(SHAPES, times[1])
    }
    assert ab.main(paths) == 0
    table = capsys.readouterr().out.splitlines()[2 : 2 + len(SHAPES)]
    for line, b1, t, b2 in zip(table, *times):
        cells = [c.strip() for c in line.split("|")[1:-1]]
        lo, hi = min(b1, b2), max(b1, b2)
        assert cells[-1] == ("faster" if t < lo else "slower" if t > hi else "within drift")
