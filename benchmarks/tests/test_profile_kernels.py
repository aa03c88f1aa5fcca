"""benchmarks/profile_kernels.py: the cases it runs, each under each --tuning in turn."""

from __future__ import annotations

import sys

import profile_kernels
import pytest


def test_each_case_runs_under_each_tuning(monkeypatch, capsys):
    ran = []
    monkeypatch.setattr(
        profile_kernels, "run_case", lambda *args, **kw: ran.append((args, kw["tuning"]))
    )
    argv = ["profile_kernels.py", "--cases", "gemv:3:64x128,fused:32:256x256"]
    argv += ["--tuning", "", "--tuning", "fused_split=4"]
    monkeypatch.setattr(sys, "argv", argv)
    profile_kernels.main()
    assert [args for args, _ in ran] == [("gemv", 3, 64, 128)] * 2 + [("fused", 32, 256, 256)] * 2
    tunings = [tuning for _, tuning in ran]
    assert tunings[0] is None and tunings[2] is None
    assert tunings[1].fused_split == 4 and tunings[3].fused_split == 4
    printed = capsys.readouterr().out.splitlines()
    assert len(printed) == 4 and all(line.startswith("case ") for line in printed)


def test_no_tuning_runs_each_case_once_with_the_heuristics(monkeypatch):
    ran = []
    monkeypatch.setattr(profile_kernels, "run_case", lambda *a, **kw: ran.append(kw["tuning"]))
    monkeypatch.setattr(sys, "argv", ["profile_kernels.py", "--cases", "xla:1:32x128"])
    profile_kernels.main()
    assert ran == [None]


def test_a_bad_tuning_is_refused(monkeypatch):
    monkeypatch.setattr(sys, "argv", ["profile_kernels.py", "--tuning", "fused_split=99"])
    with pytest.raises(SystemExit):
        profile_kernels.main()
