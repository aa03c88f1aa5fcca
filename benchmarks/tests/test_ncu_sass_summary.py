"""benchmarks/ncu_sass_summary.py on a small synthetic ncu source-page export (no GPU, no ncu)."""

from __future__ import annotations

import csv

import numpy as np
import pytest

from tests._helpers import load_repo_script

REASONS = ["barrier", "dispatch", "long_sb", "wait"]


@pytest.fixture(scope="module")
def summary():
    return load_repo_script("benchmarks/ncu_sass_summary.py")


def _write_export(path, rows, kernel="void Kernel<(int)256>(int)"):
    """rows: (source, executed, {reason: samples}, unlisted samples)."""
    header = (
        ["Address", "Source", "Warp Stall Sampling (All Samples)", "Instructions Executed"]
        + [f"stall_{r}" for r in REASONS]
        + [f"stall_{r} (Not Issued)" for r in REASONS]
    )
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        if kernel:
            w.writerow(["Kernel Name", kernel])
        w.writerow(header)
        for i, (source, executed, stalls, unlisted) in enumerate(rows):
            listed = [stalls.get(r, 0) for r in REASONS]
            w.writerow(
                [hex(16 * i), source, sum(listed) + unlisted, executed]
                + listed
                + [0] * len(REASONS)
            )


def _random_rows(rng, count, tensor_at):
    rows = []
    for i in range(count):
        source = "HGMMA.64x256x16.F32.BF16 R24, R168" if i in tensor_at else f"IADD3 R{i}, R1, 0x1"
        stalls = {r: int(rng.integers(0, 50)) for r in REASONS if rng.random() < 0.7}
        rows.append((source, int(rng.integers(0, 10**6)), stalls, int(rng.integers(0, 20))))
    return rows


def test_regions_add_up_to_the_rows(summary, tmp_path):
    rng = np.random.default_rng()
    count = int(rng.integers(40, 80))
    tensor_at = {int(rng.integers(5, 15)), int(rng.integers(20, 35))}
    rows = _random_rows(rng, count, tensor_at)
    path = tmp_path / "k.csv"
    _write_export(path, rows)
    kernel, instrs = summary.read_export(str(path))
    assert kernel == "void Kernel<(int)256>(int)"
    assert len(instrs) == count
    for ins, (source, executed, stalls, unlisted) in zip(instrs, rows):
        assert ins.source == source and ins.executed == executed
        assert ins.samples == sum(stalls.values()) + unlisted
        assert ins.stalls["unlisted"] == unlisted
        assert all(ins.stalls[r] == stalls.get(r, 0) for r in REASONS)
    assert summary.tensor_span(instrs) == (min(tensor_at), max(tensor_at) + 1)

    lo, hi = sorted(int(x) for x in rng.choice(count + 1, 2, replace=False))
    text = summary.summarise(instrs, [("part", lo, hi)], top_percent=2.0)
    total = sum(sum(s.values()) + u for _, _, s, u in rows)
    part = sum(sum(s.values()) + u for _, _, s, u in rows[lo:hi])
    executed = sum(e for _, e, _, _ in rows[lo:hi])
    line = next(x for x in text.splitlines() if x.startswith("part "))
    assert line.startswith(f"part [{lo}, {hi}): {part} samples ")
    assert f"{executed} instructions executed" in line
    assert text.splitlines()[0].startswith(f"{count} instructions, {total} stall samples")
    listed = [x for x in text.splitlines() if x.startswith("  ")]
    expected = [i for i, (_, _, s, u) in enumerate(rows) if sum(s.values()) + u >= 0.02 * total]
    assert [int(x.split()[0]) for x in listed] == expected


def test_export_without_kernel_row_or_tensor_ops(summary, tmp_path):
    path = tmp_path / "k.csv"
    _write_export(path, [("NOP", 3, {"wait": 4}, 0), ("EXIT", 1, {}, 2)], kernel="")
    kernel, instrs = summary.read_export(str(path))
    assert kernel == "" and summary.tensor_span(instrs) is None
    text = summary.summarise(instrs, [], top_percent=1.0)
    assert "tensor-core span" not in text
    assert "whole kernel [0, 2): 6 samples (100.0%), 4 instructions executed" in text


def test_bad_input_is_reported(summary, tmp_path, capsys):
    path = tmp_path / "k.csv"
    _write_export(path, [("NOP", 1, {"wait": 1}, 0)] * 3)
    with pytest.raises(SystemExit):
        summary.main([str(path), "--region", "loop:2:9"])
    assert "need 0 <= FIRST < END <= 3" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        summary.main([str(path), "--region", "loop:x:2"])
    assert "NAME:FIRST:END" in capsys.readouterr().err
    other = tmp_path / "other.csv"
    other.write_text("a,b\n1,2\n")
    with pytest.raises(ValueError, match="not an ncu source-page csv"):
        summary.read_export(str(other))
